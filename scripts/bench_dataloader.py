#!/usr/bin/env python3
"""flowgate.DataLoader beside the loaders a map-style Dataset would otherwise run on, on the
peers' image recipe (PIL decode, Resize(256), CenterCrop(224), PILToTensor, batches of 32 by
default_collate: `torch_images.py`'s Dataset class itself, imported from the peers' folder):

- PyTorch's DataLoader (`torch_images.py --num-workers W`, worker processes), each W given;
- dataloader-rs 0.2 (`dlrs_images.py --num-workers W --decode pil`, threads) when its CPython
  3.13 virtualenv exists (DLRS_PY, see that script);
- flowgate.DataLoader (this script with --flowgate: threads the tuner sizes from a cold
  process, num_workers=0), and with --busy a pure-Python __getitem__ (the GIL's case).

Interleaved repetitions, one process per run (timed by the peers' EpochMeter: the epoch only,
CPU seconds of the process and its children). Ratios are per repetition: flowgate over the
best peer setting of that repetition; the median and range are printed as Markdown.

    scripts/bench_dataloader.py --peers ../shared/peers --list IMAGES.txt --reps 3 \
        --torch-workers 1,2,3 [--dlrs-workers 2,3] [--peers-py PY]
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def flowgate_run(peers: str, list_file: str, batch_size: int, busy: int) -> None:
    """One cold-process epoch of flowgate.DataLoader over the peers' Dataset."""
    sys.path.insert(0, peers)
    from _common import EpochMeter, emit, read_list
    from torch_images import ImageFiles
    from torchvision import transforms

    import flowgate

    transform = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                    transforms.PILToTensor()])
    dataset = ImageFiles(read_list(list_file), transform)
    if busy:
        images = dataset

        class Busy:
            def __len__(self):
                return len(images)

            def __getitem__(self, i):
                x = 0
                for k in range(busy):  # pure Python: holds the GIL
                    x += k
                return images[i]
        dataset = Busy()
    loader = flowgate.DataLoader(dataset, batch_size=batch_size)
    m = EpochMeter()
    n = 0
    m.start()
    for batch in loader:
        m.first_batch()
        n += batch.shape[0]
    m.stop()
    s = loader.stats()
    threads = s["stages"].get("fetch", {}).get("workers")
    emit(m.result(f"flowgate.DataLoader{'(busy)' if busy else ''}", n, threads=threads,
                  threads_busy=round(s["gil"]["threads_busy"], 2),
                  cores_used=round(s["gil"]["cores_used"], 2), gil_bound=s["gil"]["bound"]))
    loader.close()


def run(cmd: list, env: dict) -> dict:
    r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=1800)
    if r.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default=os.environ.get("FLOWGATE_PEERS", "../shared/peers"))
    ap.add_argument("--list", required=True)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--torch-workers", default="1,2,3")
    ap.add_argument("--dlrs-workers", default="2,3")
    ap.add_argument("--busy", type=int, default=0,
                    help="also a run whose __getitem__ first counts to this in Python")
    ap.add_argument("--peers-py", default=sys.executable,
                    help="the Python with torch and torchvision for torch_images.py")
    ap.add_argument("--flowgate", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--json")
    a = ap.parse_args()
    peers = os.path.abspath(a.peers)
    if a.flowgate:
        flowgate_run(peers, a.list, a.batch_size, a.busy)
        return
    env = {**os.environ, "PYTHONPATH": peers}
    me = [sys.executable, os.path.abspath(__file__), "--flowgate", "--peers", peers, "--list",
          a.list, "--batch-size", str(a.batch_size)]
    cases = {"flowgate": me}
    if a.busy:
        cases["flowgate(busy)"] = me + ["--busy", str(a.busy)]
    for w in filter(None, a.torch_workers.split(",")):
        cases[f"torch(workers={w})"] = [a.peers_py, os.path.join(peers, "torch_images.py"),
                                        "--num-workers", w, "--list", a.list,
                                        "--batch-size", str(a.batch_size)]
    dlrs_py = os.environ.get("DLRS_PY", os.path.join(peers, ".venv-dlrs", "bin", "python"))
    if os.path.exists(dlrs_py):
        for w in filter(None, a.dlrs_workers.split(",")):
            cases[f"dataloader-rs(workers={w})"] = [
                dlrs_py, os.path.join(peers, "dlrs_images.py"), "--num-workers", w,
                "--decode", "pil", "--list", a.list]
    runs = {k: [] for k in cases}
    for rep in range(a.reps):
        for name, cmd in cases.items():
            r = run(cmd, {**env, "DLRS_PY": dlrs_py})
            runs[name].append(r)
            print(f"rep {rep} {name}: {r['items_per_s']} items/s, "
                  f"{r['epoch_cpu_s']} CPU s", file=sys.stderr)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(runs, f, indent=1)
    print("| loader | items/s (median) | CPU s / 1,000 items | flowgate over it (median, range) |")
    print("|---|---|---|---|")
    fg = [r["items_per_s"] for r in runs["flowgate"]]
    for name, rs in runs.items():
        rate = statistics.median(r["items_per_s"] for r in rs)
        cpu = statistics.median(1000 * r["epoch_cpu_s"] / r["items"] for r in rs)
        ratios = [f / r["items_per_s"] for f, r in zip(fg, rs)]
        extra = ""
        if "cores_used" in rs[0]:
            busy = statistics.median(r["threads_busy"] for r in rs)
            cores = statistics.median(r["cores_used"] for r in rs)
            extra = f" ({busy:.1f} threads busy on {cores:.1f} cores)"
        print(f"| {name}{extra} | {rate:.0f} | {cpu:.2f} | {statistics.median(ratios):.2f}x "
              f"({min(ratios):.2f}-{max(ratios):.2f}) |")


if __name__ == "__main__":
    main()
