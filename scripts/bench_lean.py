#!/usr/bin/env python3
"""Memory with a training step in the loop: flowgate's ImageLoader (tuned) against PyTorch's
DataLoader (PIL decode, resize 256, center crop 224, batches of 32) with the same step, each in
a fresh process, interleaved, repeated. Figures: wall time, the process's peak RSS (for the
DataLoader, its main process: the training process; its workers are other processes), and for
flowgate what it buffered at the end of each epoch and at its peak.

    scripts/bench_lean.py --list target/sample-data/images.txt --step-ms 100 --epochs 4 \
        --reps 3 [--workers 2] [--json target/bench-lean.json]

The step is a sleep (a GPU step leaves the host's cores free) after converting the batch to a
torch tensor. Needs torch and Pillow in the running Python (`pip install pillow`).
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time


def run_flowgate(a):
    import torch  # noqa: F401  (the training process has torch loaded, as the DataLoader's)

    import flowgate

    paths = open(a.list).read().split()
    loader = flowgate.ImageLoader(paths, batch_size=32, resize=256, crop=224, shuffle=False,
                                  output="torch")
    t0 = time.perf_counter()
    buffered, peak = [], 0
    for _ in range(a.epochs):
        for batch in loader:
            batch.float().mean()  # touch the batch as a training step would
            time.sleep(a.step_ms / 1000)
            peak = max(peak, loader.stats()["bytes"])
        buffered.append(loader.stats()["bytes"])
    return {"wall": time.perf_counter() - t0, "buffered_mb": [b / 1e6 for b in buffered],
            "buffered_peak_mb": peak / 1e6}


def run_torch(a):
    import numpy as np
    import torch
    from PIL import Image
    from torch.utils.data import DataLoader, Dataset

    class Files(Dataset):
        def __init__(self, paths):
            self.paths = paths

        def __len__(self):
            return len(self.paths)

        def __getitem__(self, i):
            im = Image.open(self.paths[i]).convert("RGB")
            w, h = im.size
            s = 256 / min(w, h)
            im = im.resize((max(256, round(w * s)), max(256, round(h * s))), Image.BILINEAR)
            w, h = im.size
            left, top = (w - 224) // 2, (h - 224) // 2
            im = im.crop((left, top, left + 224, top + 224))
            return torch.from_numpy(np.asarray(im).copy()).permute(2, 0, 1)

    paths = open(a.list).read().split()
    loader = DataLoader(Files(paths), batch_size=32, num_workers=a.workers,
                        persistent_workers=a.workers > 0)
    t0 = time.perf_counter()
    for _ in range(a.epochs):
        for batch in loader:
            batch.float().mean()
            time.sleep(a.step_ms / 1000)
    return {"wall": time.perf_counter() - t0}


def one(a):
    out = run_flowgate(a) if a.one == "flowgate" else run_torch(a)
    out["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    out["loader"] = a.one
    print(json.dumps(out))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--list", default="target/sample-data/images.txt")
    ap.add_argument("--step-ms", type=float, default=100)
    ap.add_argument("--epochs", type=int, default=4)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--workers", type=int, default=2, help="DataLoader workers")
    ap.add_argument("--json")
    ap.add_argument("--one", choices=["flowgate", "torch"], help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.one:
        return one(a)
    runs = []
    for rep in range(a.reps):
        for which in ("flowgate", "torch"):
            cmd = [sys.executable, __file__, "--one", which, "--list", a.list,
                   "--step-ms", str(a.step_ms), "--epochs", str(a.epochs),
                   "--workers", str(a.workers)]
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
            run = json.loads(r.stdout.strip().splitlines()[-1])
            run["rep"] = rep
            runs.append(run)
            print(json.dumps(run), file=sys.stderr)
    fg = [r for r in runs if r["loader"] == "flowgate"]
    pt = [r for r in runs if r["loader"] == "torch"]
    med = lambda rs, k: statistics.median(r[k] for r in rs)  # noqa: E731
    print("| loader | wall s | peak RSS MB | buffered at epoch ends MB |")
    print("|---|---|---|---|")
    ends = [b for r in fg for b in r["buffered_mb"][1:]]
    print(f"| flowgate (tuned) | {med(fg, 'wall'):.2f} | {med(fg, 'peak_rss_mb'):.0f} | "
          f"median {statistics.median(ends):.0f}, peak {max(r['buffered_peak_mb'] for r in fg):.0f} |")
    print(f"| DataLoader, {a.workers} workers (main process) | {med(pt, 'wall'):.2f} | "
          f"{med(pt, 'peak_rss_mb'):.0f} | - |")
    diffs = [f["peak_rss_mb"] - t["peak_rss_mb"] for f, t in zip(fg, pt)]
    walls = [f["wall"] / t["wall"] for f, t in zip(fg, pt)]
    print(f"\nflowgate peak RSS minus DataLoader main's, per repetition: "
          f"{', '.join(f'{d:+.0f}' for d in diffs)} MB; wall time ratio "
          f"{', '.join(f'{w:.3f}' for w in walls)}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)


if __name__ == "__main__":
    main()
