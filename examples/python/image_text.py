"""CLIP-style training input from image-text tar shards: images and token ids, aligned.

    pip install ./python torch
    python examples/python/image_text.py target/sample-data/images.txt
    torchrun --nproc_per_node=2 examples/python/image_text.py target/sample-data/images.txt

The shards are LAION's layout (`KEY.jpg`, `KEY.txt` the caption, `KEY.json` a record); the
script writes a few from the listed images (each caption and record naming its key) unless
`--shards PATTERN` names existing ones. flowgate decodes and crops the images on its tuned
threads and reads each sample's caption and record beside them: a batch is a dict whose
`caption` list is in the images' order. Each batch's captions are tokenized at once on the
loader's threads too (`map_batch=`: a toy hashing vocabulary here, padded to the batch's
longest caption; a real tokenizer's batch call in training), so the loop gets `tokens` beside
`image`. Under torchrun each rank reads an equal share; the script checks that every caption
belongs to its image and its tokens, and stops half way through to resume from
`state_dict()`.
"""

import argparse
import io
import json
import os
import tarfile
import tempfile
import zlib

import numpy as np
import torch

import flowgate


def write_shards(images, out, per_shard=16):
    """LAION-style shards of the listed images, with captions and records naming each key."""
    os.makedirs(out, exist_ok=True)
    n = (len(images) + per_shard - 1) // per_shard
    for s in range(n):
        with tarfile.open(os.path.join(out, f"{s:05d}.tar"), "w") as tar:
            for i in range(s * per_shard, min(len(images), (s + 1) * per_shard)):
                key = f"{i:09d}"
                tar.add(images[i], arcname=f"{key}.jpg")
                for ext, body in (("txt", f"a synthetic photo, sample {key}"),
                                  ("json", json.dumps({"key": key, "source": images[i]}))):
                    raw = body.encode()
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(raw)
                    tar.addfile(info, io.BytesIO(raw))
    return os.path.join(out, f"{{00000..{n - 1:05d}}}.tar")


def word_ids(caption):
    """A toy tokenizer: each word's id from its hash (a pure function: a resumed epoch, any
    thread, tokenizes alike)."""
    return [zlib.crc32(w.encode()) % 30000 + 1 for w in caption.split()]


def tokenize(batch):
    """A batch's captions as token ids padded to its longest (0 after each caption), on the
    loader's threads: with a real tokenizer, ``tokenizer(batch["caption"], padding=True,
    return_tensors="np")["input_ids"]``."""
    rows = [word_ids(c) for c in batch["caption"]]
    tokens = np.zeros((len(rows), max(map(len, rows))), dtype=np.int64)
    for r, ids in enumerate(rows):
        tokens[r, :len(ids)] = ids
    return {"tokens": tokens}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("images", nargs="?", default="target/sample-data/images.txt")
    p.add_argument("--shards", help="existing image-text shards (a brace pattern)")
    a = p.parse_args()
    pattern = a.shards
    if pattern is None:
        with open(a.images) as f:
            images = [line.strip() for line in f if line.strip()]
        pattern = write_shards(images, tempfile.mkdtemp(prefix="image-text-"))
    make = lambda: flowgate.ImageLoader(  # noqa: E731 - built twice: before and after resume
        flowgate.Shards(pattern, buffer=256), batch_size=32, resize=256, crop=224, train=True,
        seed=0, output="torch", return_paths=True, fields={"caption": "txt", "meta": "json"},
        map_batch=tokenize)
    loader = make()
    print(f"rank {os.environ.get('RANK', 0)}: {len(loader)} batches an epoch")
    half, state, seen = max(1, len(loader) // 2), None, 0
    for step, batch in enumerate(loader):
        images, tokens = batch["image"], batch["tokens"]
        for k, (path, caption, meta) in enumerate(zip(batch["path"], batch["caption"],
                                                      batch["meta"])):
            key = path.rsplit(":", 1)[1].split(".")[0]
            assert caption.endswith(key) and meta["key"] == key, (path, caption, meta)
            ids = word_ids(caption)
            assert tokens[k, :len(ids)].tolist() == ids, (path, caption)
        seen += images.shape[0]
        if step + 1 == half:
            state = loader.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    for batch in resumed:
        seen += batch["image"].shape[0]
    print(f"images {tuple(images.shape)} {images.dtype}, tokens {tuple(tokens.shape)}; "
          f"{seen} samples in the epoch, resumed after {half} batches; stats: "
          f"{ {k: resumed.stats()[k] for k in ('delivered', 'failures')} }")


if __name__ == "__main__":
    main()
