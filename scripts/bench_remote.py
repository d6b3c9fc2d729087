#!/usr/bin/env python3
"""The remote mode's cost per batch on one machine: the same ImageLoader (batches of 32,
resize 256, center crop 224, uint8) decoding in the training process, and decoding on one Ray
actor (`remote=flowgate.Ray(workers=1, local=False)`) holding the same cores, side by side in
one run, interleaved, repeated; plus Ray's object-store round trip for one batch alone.

    scripts/bench_remote.py --list target/sample-data/images.txt --epochs 3 --reps 3 \
        [--cores 2] [--json target/bench-remote.json]

Each run is a fresh process (a cold loader, as users see it); the Ray runtime is started by
the remote runs themselves (its start is not timed: the first epoch includes the actor's).
Needs `ray` in the running Python.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run(a):
    import flowgate

    paths = open(a.list).read().split()
    remote = None
    if a.mode == "remote":
        import ray
        ray.init(num_cpus=a.cores, object_store_memory=512 * 1024 * 1024,
                 include_dashboard=False, log_to_driver=False)
        remote = flowgate.Ray(workers=1, local=False, cpus_per_worker=a.cores,
                              batches_per_unit=a.unit)
    loader = flowgate.ImageLoader(paths, batch_size=32, resize=256, crop=224, shuffle=False,
                                  output="numpy", cpu_budget=a.cores, remote=remote)
    epochs = []
    for _ in range(a.epochs):
        t = time.perf_counter()
        n = 0
        for b in loader:
            n += 1
        epochs.append({"seconds": time.perf_counter() - t, "batches": n})
    loader.close()
    return {"epochs": epochs}


def object_store(a):
    """Seconds for one batch (32 x 3 x 224 x 224 uint8) through `ray.put` + `ray.get` from
    another process: an actor returning it, as a unit's result comes."""
    import numpy as np
    import ray
    ray.init(num_cpus=2, object_store_memory=512 * 1024 * 1024, include_dashboard=False,
             log_to_driver=False)

    @ray.remote
    class Echo:
        def batch(self):
            return np.ones((32, 3, 224, 224), np.uint8)

    e = Echo.remote()
    ray.get(e.batch.remote())
    times = []
    for _ in range(50):
        t = time.perf_counter()
        x = ray.get(e.batch.remote())
        times.append(time.perf_counter() - t)
        del x
    return {"round_trip_ms": statistics.median(times) * 1000}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--list", default="target/sample-data/images.txt")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--cores", type=int, default=2)
    p.add_argument("--unit", type=int, default=2, help="batches per unit")
    p.add_argument("--json")
    p.add_argument("--mode", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.mode == "store":
        print(json.dumps(object_store(a)))
        return
    if a.mode:
        print(json.dumps(run(a)))
        return
    results = {"local": [], "remote": []}
    for _ in range(a.reps):
        for mode in ("local", "remote"):
            out = subprocess.run(
                [sys.executable, __file__, "--mode", mode, "--list", a.list, "--epochs",
                 str(a.epochs), "--cores", str(a.cores), "--unit", str(a.unit)],
                capture_output=True, text=True, check=True)
            results[mode].append(json.loads(out.stdout.strip().splitlines()[-1]))
    store = json.loads(subprocess.run([sys.executable, __file__, "--mode", "store"],
                                      capture_output=True, text=True, check=True)
                       .stdout.strip().splitlines()[-1])

    def per_batch(runs, first):
        """Median ms per batch: of the first epoch (cold), or of the later ones."""
        vals = []
        for r in runs:
            eps = r["epochs"][:1] if first else r["epochs"][1:]
            vals.append(1000 * sum(e["seconds"] for e in eps) / sum(e["batches"] for e in eps))
        return statistics.median(vals)

    summary = {
        "cores": a.cores, "batches_per_unit": a.unit, "reps": a.reps, "epochs": a.epochs,
        "local_ms_per_batch": per_batch(results["local"], False),
        "remote_ms_per_batch": per_batch(results["remote"], False),
        "local_first_epoch_ms_per_batch": per_batch(results["local"], True),
        "remote_first_epoch_ms_per_batch": per_batch(results["remote"], True),
        "object_store_round_trip_ms": store["round_trip_ms"],
    }
    summary["remote_over_local"] = summary["remote_ms_per_batch"] / summary["local_ms_per_batch"]
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "runs": results}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    main()
