#!/usr/bin/env python3
"""Side by side with the peers, every figure the issue asks for: items/s, CPU seconds per 1,000
items and peak RSS, for flowgate's `bench` tool and the peers' scripts (SPDL, PyTorch
DataLoader, in a folder given by --peers or $FLOWGATE_PEERS) at their best settings, interleaved
(flowgate, SPDL settings, PyTorch; repeated), same file list.

    scripts/peers.py --peers DIR --reps 5 --case images:/tmp/ds/images.txt \
        --case audio:/tmp/ds/audio.txt [--torch] [--json target/peers.json]
    scripts/peers.py --peers DIR --reps 5 --torch \
        --case "shards:/tmp/ds/images.txt:/tmp/ds/shards/shard-{000000..000029}.tar"

A `video:LIST` case (with --torch) compares `bench video --batch 8` with PyTorch DataLoader +
torchcodec (`torchcodec_video.py`, batches of 8) at 2 and 3 workers.

`--variant NAME=ARGS` adds a row of flowgate run tuned with extra `bench` arguments (e.g.
`--variant "draft=--draft true"`), compared with the peers like the default row.

`--pinned 1,2,3` also runs flowgate with its decode workers pinned at each count (`bench
--workers N`) in every repetition, and reports the tuned run (from a cold process) over the
best pinned one of the same repetition: the cost of the tuner's cold start. Without --peers
(and $FLOWGATE_PEERS) only flowgate runs.

A `shards:LIST:PATTERN` case (tar shards of LIST's images, e.g. from `flowgate gen-data
--shards 100`) runs `bench images --shards PATTERN` beside `bench images --list LIST` (the same
images as loose files) and, with --torch, webdataset + DataLoader (`wds_images.py`) at 1 to 4
workers, its best of each repetition.

Needs `cargo build --release -p flowgate-tools --bin bench` and the peers' virtualenv (their
`setup.sh`; `--torch` for PyTorch; PEERS_PY overrides its path). Peak RSS comes from GNU time (`%M`, the
largest process: a PyTorch DataLoader's worker processes are not summed, so its RSS is not
compared). Ratios are per repetition (flowgate over the best SPDL setting of that repetition),
reported as the median and the range. Prints a Markdown table and writes every run as JSON.
"""
import argparse
import glob
import json
import os
import statistics
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
PY = os.environ.get("PEERS_PY", os.path.join(ROOT, ".peers-venv", "bin", "python"))

SETTINGS = {
    "images": {
        "spdl": [["spdl_images.py", "--mode", "batch", "--concurrency", "2"],
                 ["spdl_images.py", "--mode", "batch", "--concurrency", "4"]],
        "torch": [["torch_images.py", "--num-workers", "2"]],
    },
    "audio": {
        "spdl": [["spdl_audio.py", "--concurrency", "2"],
                 ["spdl_audio.py", "--mode", "batch", "--concurrency", "2"]],
        "torch": [["torch_audio.py", "--num-workers", "4", "--backend", "soundfile"]],
    },
    # PyTorch DataLoader + torchcodec (`--torch`); no SPDL script for video.
    "video": {
        "spdl": [],
        "torch": [["torchcodec_video.py", "--num-workers", "2"],
                  ["torchcodec_video.py", "--num-workers", "3"]],
    },
}

# Extra `bench` arguments per workload, so flowgate does the peers' work: torchcodec_video.py
# delivers batches of 8 clips.
BENCH_ARGS = {"video": ["--batch", "8"]}


def timed(cmd, cwd=None):
    """Runs cmd under GNU time; returns its last JSON line plus peak RSS (MB)."""
    with tempfile.NamedTemporaryFile("r", suffix=".time") as t:
        p = subprocess.run(["/usr/bin/time", "-f", "%M", "-o", t.name, *cmd], cwd=cwd,
                           capture_output=True, text=True, timeout=900)
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[:3])} exited {p.returncode}: {p.stderr[-400:]}")
        rss_kb = int(t.read().split()[-1])
    line = next(l for l in reversed(p.stdout.splitlines()) if l.strip().startswith("{"))
    r = json.loads(line)
    cpu = r.get("cpu_seconds", r.get("epoch_cpu_s"))
    return {"items_per_s": r["items_per_s"], "cpu_per_1000": 1000 * cpu / r["items"],
            "rss_mb": rss_kb / 1024, "items": r["items"], "shape": r.get("batch_shape")}


def shards_case(lst, pattern, reps, bench, torch):
    """Tar shards vs loose files vs webdataset's best worker count, interleaved."""
    for path in open(lst).read().split() + glob.glob(os.path.join(os.path.dirname(pattern.split("{")[0]), "*.tar")):
        with open(path, "rb") as f:
            f.read()
    runs = {"flowgate shards": [], "flowgate files": [], "webdataset": []}
    for rep in range(reps):
        runs["flowgate shards"].append(timed([bench, "images", "--shards", pattern]))
        runs["flowgate files"].append(timed([bench, "images", "--list", lst]))
        if torch:
            runs["webdataset"].append(max(
                (dict(timed([PY, "wds_images.py", "--num-workers", str(w), "--shards", pattern],
                            cwd=PEERS_DIR), workers=w) for w in (1, 2, 3, 4)),
                key=lambda r: r["items_per_s"]))
        print(f"shards rep {rep + 1}: " + ", ".join(
            f"{k} {v[-1]['items_per_s']:.0f}/s" for k, v in runs.items() if v), file=sys.stderr)
    f = runs["flowgate shards"]
    ratio = lambda key, other: [a[key] / b[key] for a, b in zip(f, runs[other])]
    print(f"\nimages from tar shards ({pattern}, {f[0]['items']} items, {reps} interleaved "
          "repetitions; median (min–max))\n")
    print("| loader | items/s | CPU s per 1000 items | peak RSS MB |\n|---|---|---|---|")
    for name, r in runs.items():
        if r:
            rss = span([x["rss_mb"] for x in r]) if name != "webdataset" else "(not summed)"
            label = name if name != "webdataset" else \
                f"webdataset + DataLoader (best of 1–4 workers: {sorted({x['workers'] for x in r})})"
            print(f"| {label} | {span([x['items_per_s'] for x in r])} | "
                  f"{span([x['cpu_per_1000'] for x in r], '{:.2f}')} | {rss} |")
    print(f"| **shards / files** | **{span(ratio('items_per_s', 'flowgate files'), '{:.2f}')}×** | "
          f"{span(ratio('cpu_per_1000', 'flowgate files'), '{:.2f}')}× | |")
    if runs["webdataset"]:
        print(f"| **flowgate shards / webdataset** | **{span(ratio('items_per_s', 'webdataset'), '{:.2f}')}×** | "
              f"{span(ratio('cpu_per_1000', 'webdataset'), '{:.2f}')}× | |")
    return runs


def best_of(workload, peer, lst):
    """Every setting of a peer runs; its best of this repetition counts."""
    return max((timed([PY, c[0], *c[1:], "--list", lst], cwd=PEERS_DIR)
                for c in SETTINGS[workload][peer]), key=lambda r: r["items_per_s"])


def span(xs, fmt="{:.0f}"):
    return f"{fmt.format(statistics.median(xs))} ({fmt.format(min(xs))}–{fmt.format(max(xs))})"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default=os.environ.get("FLOWGATE_PEERS"),
                    help="the folder of the peers' scripts (or $FLOWGATE_PEERS); none: flowgate only")
    ap.add_argument("--pinned", default="",
                    help="comma list of decode worker counts to run pinned beside the tuned run")
    ap.add_argument("--variant", action="append", default=[],
                    help="NAME=ARGS: also flowgate tuned with these extra bench arguments")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--case", action="append", required=True, help="WORKLOAD:LIST")
    ap.add_argument("--torch", action="store_true", help="also PyTorch DataLoader")
    ap.add_argument("--json", default=os.path.join(ROOT, "target", "peers.json"))
    args = ap.parse_args()
    global PEERS_DIR
    PEERS_DIR = args.peers
    bench = os.environ.get("FLOWGATE_BENCH", os.path.join(ROOT, "target", "release", "bench"))
    results = {}
    for case in args.case:
        workload, lst = case.split(":", 1)
        if workload == "shards":
            lst, pattern = lst.split(":", 1)
            results["shards"] = shards_case(lst, pattern, args.reps, bench, args.torch)
            continue
        for path in open(lst).read().split():  # a warm page cache for everyone
            with open(path, "rb") as f:
                f.read()
        pinned = [int(w) for w in args.pinned.split(",") if w]
        variants = dict(v.split("=", 1) for v in args.variant)
        runs = {"flowgate": [], "spdl": [], "torch": []}
        runs.update({f"flowgate {v}": [] for v in variants})
        runs.update({f"pinned {w}": [] for w in pinned})
        peers = (("spdl", "torch") if args.torch else ("spdl",)) if PEERS_DIR else ()
        peers = [p for p in peers if SETTINGS.get(workload, {}).get(p)]
        cmd = [bench, workload, "--list", lst, *BENCH_ARGS.get(workload, [])]
        for rep in range(args.reps):
            runs["flowgate"].append(timed(cmd))
            for v, extra in variants.items():
                runs[f"flowgate {v}"].append(timed([*cmd, *extra.split()]))
            for w in pinned:
                runs[f"pinned {w}"].append(timed([*cmd, "--workers", str(w)]))
            for peer in peers:
                runs[peer].append(best_of(workload, peer, lst))
            print(f"{workload} rep {rep + 1}: " + ", ".join(
                f"{k} {v[-1]['items_per_s']:.0f}/s" for k, v in runs.items() if v), file=sys.stderr)
        results[workload] = runs
        f = runs["flowgate"]
        ratio = lambda key, peer, mine="flowgate": [a[key] / b[key]
                                                   for a, b in zip(runs[mine], runs[peer])]
        print(f"\n{workload} ({lst}, {f[0]['items']} items, {args.reps} interleaved repetitions;"
              " median (min–max))\n")
        print("| loader | items/s | CPU s per 1000 items | peak RSS MB |\n|---|---|---|---|")
        for name in runs:
            r = runs[name]
            if r:
                rss = span([x["rss_mb"] for x in r]) if name != "torch" else "(not summed)"
                label = "flowgate (tuned, cold process)" if name == "flowgate" else name
                print(f"| {label} | {span([x['items_per_s'] for x in r])} | "
                      f"{span([x['cpu_per_1000'] for x in r], '{:.2f}')} | {rss} |")
        if pinned:
            best = [max(runs[f"pinned {w}"][k]["items_per_s"] for w in pinned)
                    for k in range(args.reps)]
            tuned = [x["items_per_s"] / b for x, b in zip(f, best)]
            print(f"| **tuned / best pinned** | **{span(tuned, '{:.3f}')}×** | | |")
        if runs["spdl"]:
            print(f"| **flowgate / SPDL** | **{span(ratio('items_per_s', 'spdl'), '{:.2f}')}×** | "
                  f"**{span(ratio('cpu_per_1000', 'spdl'), '{:.2f}')}×** | "
                  f"**{span(ratio('rss_mb', 'spdl'), '{:.2f}')}×** |")
        if runs["torch"]:
            print(f"| **flowgate / PyTorch** | **{span(ratio('items_per_s', 'torch'), '{:.2f}')}×** | "
                  f"{span(ratio('cpu_per_1000', 'torch'), '{:.2f}')}× | |")
        for v in variants:
            for peer, label in (("spdl", "SPDL"), ("torch", "PyTorch")):
                if runs[peer]:
                    mine = f"flowgate {v}"
                    print(f"| **flowgate {v} / {label}** | "
                          f"**{span(ratio('items_per_s', peer, mine), '{:.2f}')}×** | "
                          f"{span(ratio('cpu_per_1000', peer, mine), '{:.2f}')}× | "
                          f"{span(ratio('rss_mb', peer, mine), '{:.2f}') + '×' if peer == 'spdl' else ''} |")
    os.makedirs(os.path.dirname(args.json), exist_ok=True)
    with open(args.json, "w") as out:
        json.dump(results, out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
