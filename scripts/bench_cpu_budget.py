#!/usr/bin/env python3
"""Ranks under torchrun on one node (3 by default), one with clips longer than the others' (rank 0;
`--heavy-seconds`, `--light-seconds`), each with a training step (a sleep) per batch and, with
`--lockstep` (as data-parallel training: an all-reduce after each step), no rank running ahead
of the slowest: the static split (each rank within its share of the node's cores,
`LOCAL_WORLD_SIZE`) against a shared `cpu_budget`, interleaved, repeated.

    scripts/bench_cpu_budget.py [--ranks 3] [--budget 2] [--reps 3] [--step-ms 10] [--epochs 3]
        [--lockstep] [--heavy-seconds 12] [--light-seconds 2]

Per mode: the heavy rank's epoch time and the light ranks' (median of the epochs after the
first, over the repetitions), the sum of the ranks' decode workers over time (0.5-s buckets of
their tuner traces: mean and most), and on the budget the most cores the node's ranks held at
any tick. Needs torch (the launcher) and a built wheel in the running Python.
"""
import argparse
import json
import os
import pathlib
import statistics
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
WORKER = ROOT / "python" / "tests" / "cpu_budget_worker.py"


def clips(out: pathlib.Path, heavy: float, light: float) -> dict:
    """48 FLAC clips of each length (generated once per length): the listings by role."""
    listings = {}
    for name, secs, seed in (("light", light, "0"), ("heavy", heavy, "1")):
        d = out / f"{secs:g}s-seed{seed}"
        if not (d / "audio.txt").exists():
            subprocess.run(["cargo", "run", "--quiet", "-p", "flowgate-cli", "--bin",
                            "flowgate", "--", "gen-data", "--out", str(d), "--images",
                            "0", "--audio", "48", "--audio-seconds", f"{secs:g},{secs:g}",
                            "--seed", seed],
                           cwd=ROOT, check=True)
        listings[name] = d / "audio.txt"
    return listings


def run(mode, a, data, port):
    with tempfile.TemporaryDirectory() as tmp:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWGATE_NODE_KEY": f"bench-{os.getpid()}"}
        for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
            env.pop(k, None)
        subprocess.run(
            [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={a.ranks}",
             "--master_port", str(port), str(WORKER),
             "--heavy", str(data["heavy"]), "--light", str(data["light"]),
             "--budget", a.budget if mode == "shared" else "none",
             "--step-ms", str(a.step_ms), "--epochs", str(a.epochs), "--repeat", str(a.repeat),
             "--seconds", f"{a.window or max(a.heavy_seconds, a.light_seconds):g}",
             "--batch-size", str(a.batch_size), *(["--train"] if a.window else []),
             *(["--lockstep"] if a.lockstep else [])],
            env=env, cwd=tmp, check=True, capture_output=True, text=True)
        return [json.loads((pathlib.Path(tmp) / f"report-{k}.json").read_text())
                for k in range(a.ranks)]


def workers_over_time(reports, ranks):
    """Sum of the ranks' decode workers per 0.5-s bucket (wall-clock aligned)."""
    buckets = {}
    for rep in reports:
        per = {}
        for t in rep["ticks"]:
            b = int((rep["started"] + t["t"]) * 2)
            per[b] = t["decode"] or 0
        for b, w in per.items():
            buckets.setdefault(b, []).append(w)
    sums = [sum(ws) for ws in buckets.values() if len(ws) == ranks]
    return sums


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--budget", default="2")
    ap.add_argument("--ranks", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--step-ms", type=float, default=10)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--data", default=str(ROOT / "target" / "pytest-cpu-budget"))
    ap.add_argument("--heavy-seconds", type=float, default=12)
    ap.add_argument("--light-seconds", type=float, default=2)
    ap.add_argument("--window", type=float,
                    help="a random window of this many seconds in each clip (decoded up to its "
                         "end, so decode stays proportional to the clip, collation small)")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lockstep", action="store_true",
                    help="all-reduce after each step, as data-parallel training does")
    ap.add_argument("--json")
    a = ap.parse_args()
    data = clips(pathlib.Path(a.data), a.heavy_seconds, a.light_seconds)
    rows = {"static": [], "shared": []}
    for rep in range(a.reps):
        for mode in ("static", "shared"):
            reports = run(mode, a, data, 29400 + rep)
            heavy = [e["seconds"] for e in reports[0]["epochs"][1:]]
            light = [e["seconds"] for r in reports[1:] for e in r["epochs"][1:]]
            sums = workers_over_time(reports, a.ranks)
            busy = [t["cpu"]["node_busy"] for r in reports for t in r["ticks"] if t["cpu"]]
            row = {"rep": rep, "mode": mode, "heavy_s": statistics.median(heavy),
                   "light_s": statistics.median(light),
                   "workers_mean": statistics.mean(sums) if sums else None,
                   "workers_max": max(sums) if sums else None,
                   "node_busy_max": max(busy) if busy else None,
                   "rank_workers_mean": [
                       round(statistics.mean(t["decode"] or 0 for t in r["ticks"]), 2)
                       if r["ticks"] else None for r in reports],
                   "heavy_worker_moves": [f"{t['t']:.1f}s {d}" for t in reports[0]["ticks"]
                                          for d in t["decisions"] if "SetWorkers { stage: 0" in d]}
            rows[mode].append(row)
            print(json.dumps(row), file=sys.stderr, flush=True)
    step = "lockstep" if a.lockstep else "independent"
    print(f"| split ({a.ranks} ranks {step}, budget {a.budget}) | heavy rank epoch s | light ranks epoch s | "
          "sum of decode workers, mean / most | most cores held at a tick |")
    print("|---|---|---|---|---|")
    for mode, rs in rows.items():
        med = lambda k: statistics.median(r[k] for r in rs)  # noqa: E731
        busy = max((r["node_busy_max"] or 0) for r in rs) if mode == "shared" else "-"
        print(f"| {mode} | {med('heavy_s'):.2f} | {med('light_s'):.2f} | "
              f"{med('workers_mean'):.2f} / {max(r['workers_max'] for r in rs)} | {busy} |")
    ratios = [s["heavy_s"] / t["heavy_s"] for s, t in zip(rows["shared"], rows["static"])]
    print(f"\nheavy rank's epoch, shared over static, per repetition: "
          f"{', '.join(f'{r:.2f}' for r in ratios)}")
    if a.json:
        pathlib.Path(a.json).write_text(json.dumps(rows, indent=1))
    for ledger in pathlib.Path("/dev/shm").glob(f"flowgate-cpu-u*-bench-{os.getpid()}-*"):
        ledger.unlink()


if __name__ == "__main__":
    main()
