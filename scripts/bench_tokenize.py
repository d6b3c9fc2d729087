#!/usr/bin/env python3
"""What `map_batch=` gains for a tokenizer: Hugging Face's `tokenizers` (Rust, releases the GIL,
parallel inside `encode_batch`) on each batch's captions, in the training loop against on the
loader's `map_batch` stage, with a simulated training step of `--step-ms` per batch (a sleep,
as a GPU step leaves the CPU to the loader while the loop waits for it).

The data: image-text shards of small photos (64×48, cheap to decode) with long captions
(`--words` words each, from a fixed vocabulary), so the tokenizer is the work that counts; the
tokenizer a word-level one over that vocabulary (`WordLevel` + whitespace), each batch padded
to its longest caption. One cold process per run, interleaved repetitions; Markdown on stdout.

    PYTHONPATH=/tmp/tokpkgs scripts/bench_tokenize.py --reps 3
"""
import argparse
import io
import json
import os
import random
import statistics
import subprocess
import sys
import tarfile
import time

HERE = os.path.abspath(__file__)
VOCAB = [f"w{i}" for i in range(5000)]


def make_shards(out, n, words, per_shard=64):
    """`n` samples of a 64×48 JPEG and a caption of `words` words; returns the pattern."""
    from PIL import Image
    os.makedirs(out, exist_ok=True)
    rng = random.Random(0)
    shards = (n + per_shard - 1) // per_shard
    for s in range(shards):
        with tarfile.open(os.path.join(out, f"{s:05d}.tar"), "w") as tar:
            for i in range(s * per_shard, min(n, (s + 1) * per_shard)):
                im = io.BytesIO()
                Image.new("RGB", (64, 48), (i % 256, 40, 90)).save(im, format="JPEG")
                text = " ".join(rng.choice(VOCAB) for _ in range(words))
                for ext, body in (("jpg", im.getvalue()), ("txt", text.encode())):
                    info = tarfile.TarInfo(f"{i:09d}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
    return os.path.join(out, f"{{00000..{shards - 1:05d}}}.tar")


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {"[PAD]": 0, "[UNK]": 1, **{w: i + 2 for i, w in enumerate(VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.enable_padding(pad_id=0, pad_token="[PAD]")
    return tok


def run(pattern, where, step_ms):
    import numpy as np

    import flowgate
    tok = tokenizer()

    def tokenize(b):
        ids = np.array([e.ids for e in tok.encode_batch(b["caption"])], dtype=np.int64)
        return {"tokens": ids}

    args = dict(batch_size=32, resize=48, crop=48, shuffle=False, fields={"caption": "txt"})
    if where == "map_batch":
        args["map_batch"] = tokenize
    loader = flowgate.ImageLoader(flowgate.Shards(pattern), **args)
    n, tokens = 0, 0
    t = time.perf_counter()
    for b in loader:
        ids = b["tokens"] if where == "map_batch" else tokenize(b)["tokens"]
        tokens += int(np.asarray(ids).size)
        time.sleep(step_ms / 1000)  # the training step
        n += len(b["caption"])
    seconds = time.perf_counter() - t
    out = {"samples": n, "tokens": tokens, "seconds": seconds}
    if where == "map_batch":
        out["gil"] = loader.stats()["gil"]
        out["workers"] = loader.stats()["stages"]["map_batch"]["workers"]
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="/tmp/flowgate-tokenize")
    ap.add_argument("--samples", type=int, default=3200)
    ap.add_argument("--words", type=int, default=400)
    ap.add_argument("--step-ms", type=float, default=30.0)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--one")
    ap.add_argument("--pattern")
    args = ap.parse_args()
    if args.one:
        return run(args.pattern, args.one, args.step_ms)
    pattern = make_shards(args.out, args.samples, args.words)
    runs = ["loop", "map_batch"]
    res = {r: [] for r in runs}
    for rep in range(args.reps):
        for r in runs:
            out = subprocess.run([sys.executable, HERE, "--one", r, "--pattern", pattern,
                                  "--step-ms", str(args.step_ms)],
                                 capture_output=True, text=True, check=True).stdout
            res[r].append(json.loads(out.strip().splitlines()[-1]))
            print(rep, r, res[r][-1], file=sys.stderr)
    rate = lambda x: x["samples"] / x["seconds"]  # noqa: E731
    ratios = [rate(m) / rate(lp) for m, lp in zip(res["map_batch"], res["loop"])]
    m = res["map_batch"]
    print(f"| where the captions are tokenized | samples/s (median) |\n|---|---|\n"
          f"| in the loop, then the {args.step_ms:.0f} ms step | "
          f"{statistics.median(map(rate, res['loop'])):.0f} |\n"
          f"| `map_batch=` (the loop only steps) | {statistics.median(map(rate, m)):.0f} |\n\n"
          f"map_batch= over the loop: median {statistics.median(ratios):.2f}× "
          f"({min(ratios):.2f}–{max(ratios):.2f}); its threads busy / cores used "
          f"{statistics.median(x['gil']['threads_busy'] for x in m):.2f} / "
          f"{statistics.median(x['gil']['cores_used'] for x in m):.2f}, stage workers "
          f"{statistics.median(x['workers'] for x in m):.0f}")


if __name__ == "__main__":
    main()
