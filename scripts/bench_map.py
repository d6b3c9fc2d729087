#!/usr/bin/env python3
"""What `map=` and `map_batch=` gain: a per-item Python function on the loader's own stage
(threads the tuner sizes), or the same function over each batch's images on the per-batch
stage, against the function applied in the training loop, item by item, for
three kinds of work, each a few milliseconds per image (more than its decoding, so that the
function is what bounds the loop): pure Python (holds the GIL), NumPy (float32 matrix
products: BLAS releases the GIL; one BLAS thread) and PIL (Gaussian blurs of each 224x224
crop: PIL releases the GIL). Each run in a cold process, interleaved repetitions; the table gives
images/s, map= and map_batch= over the loop, and their `stats()["gil"]` (threads busy in
calls, cores they used). Markdown on stdout.

    scripts/bench_map.py --list IMAGES.txt --reps 3
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time

HERE = os.path.abspath(__file__)
WORKS = ("python", "numpy", "pil")


def work(kind):
    import numpy as np
    if kind == "python":
        def f(image):
            a = np.asarray(image)
            s = 0
            for v in a[:100, :100, 0].ravel().tolist() * 8:  # ~80k Python steps
                s += v
            return image
    elif kind == "numpy":
        def f(image):
            a = np.asarray(image, dtype=np.float32).reshape(224, 672)
            for _ in range(6):
                b = a @ a.T
            return b[:, :224, None].repeat(3, axis=2).clip(0, 255).astype(np.uint8)
    else:
        from PIL import Image, ImageFilter

        def f(image):
            im = Image.fromarray(np.asarray(image))
            for _ in range(3):
                im = im.filter(ImageFilter.GaussianBlur(4))
            return np.asarray(im)
    return f


def run(files, kind, where):
    import flowgate
    f = work(kind)
    args = dict(batch_size=32, resize=256, crop=224, shuffle=False, layout="nhwc")
    t = time.perf_counter()
    if where == "map":
        loader = flowgate.ImageLoader(files, map=lambda s: {**s, "image": f(s["image"])},
                                      **args)
        n = sum(b.shape[0] for b in loader)
    elif where == "map_batch":
        import numpy as np
        loader = flowgate.ImageLoader(
            files, map_batch=lambda b: {"image": np.stack([f(x) for x in np.asarray(b["image"])])},
            **args)
        n = sum(b["image"].shape[0] for b in loader)
    else:
        loader = flowgate.ImageLoader(files, **args)
        n = 0
        import numpy as np
        for b in loader:
            for image in np.asarray(b):
                f(image)
                n += 1
    seconds = time.perf_counter() - t
    out = {"images": n, "seconds": seconds}
    if where != "loop":
        out["gil"] = loader.stats()["gil"]
        out["map_workers"] = loader.stats()["stages"][where]["workers"]
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--one")
    args = ap.parse_args()
    files = [line.strip() for line in open(args.list) if line.strip()]
    if args.one:
        kind, where = args.one.split("/")
        return run(files, kind, where)
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
    runs = [f"{k}/{w}" for k in WORKS for w in ("loop", "map", "map_batch")]
    res = {r: [] for r in runs}
    for rep in range(args.reps):
        for r in runs:
            out = subprocess.run([sys.executable, HERE, "--list", args.list, "--one", r],
                                 capture_output=True, text=True, check=True, env=env).stdout
            res[r].append(json.loads(out.strip().splitlines()[-1]))
            print(rep, r, res[r][-1], file=sys.stderr)
    print("| work | stage | in the loop, images/s | on the stage, images/s | stage over the loop "
          "(median, range) | threads busy / cores used | stage workers |")
    print("|---|---|---|---|---|---|---|")
    rate = lambda x: x["images"] / x["seconds"]  # noqa: E731
    for k in WORKS:
        loop = res[f"{k}/loop"]
        for where in ("map", "map_batch"):
            mapped = res[f"{k}/{where}"]
            ratios = [rate(m) / rate(lp) for m, lp in zip(mapped, loop)]
            busy = statistics.median(m["gil"]["threads_busy"] for m in mapped)
            cores = statistics.median(m["gil"]["cores_used"] for m in mapped)
            workers = statistics.median(m["map_workers"] for m in mapped)
            print(f"| {k} | `{where}=` | {statistics.median(map(rate, loop)):.0f} | "
                  f"{statistics.median(map(rate, mapped)):.0f} | "
                  f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f}) | "
                  f"{busy:.2f} / {cores:.2f} | {workers:.0f} |")


if __name__ == "__main__":
    main()
