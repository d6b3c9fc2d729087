"""One rank of test_cpu_budget.py and scripts/bench-cpu-budget.sh, under torchrun.

Rank 0 decodes the heavy clips, the other ranks the light ones (each rank its whole list: the
work differs per rank, as with ranks whose clips differ in length); every rank takes a training
step (a sleep) per batch; with `--lockstep` the ranks also all-reduce a number after each step
(gloo), as data-parallel training does, so no rank runs ahead of the slowest. Writes `report-RANK.json`: the epochs' times and the tuner's ticks
(decode workers, and the node CPU budget's figures when there is one)."""

import argparse
import json
import os
import time

import flowgate

ap = argparse.ArgumentParser()
ap.add_argument("--heavy", required=True)
ap.add_argument("--light", required=True)
ap.add_argument("--budget", default="none")
ap.add_argument("--step-ms", type=float, default=10.0)
ap.add_argument("--epochs", type=int, default=2)
ap.add_argument("--repeat", type=int, default=1)
ap.add_argument("--seconds", type=float, default=12.0)
ap.add_argument("--train", action="store_true", help="a random window in each clip (decoded up to it)")
ap.add_argument("--batch-size", type=int, default=8)
ap.add_argument("--drop", type=int, default=0, help="leave out the list's last N clips")
ap.add_argument("--heavy-workers", type=int, help="pin the heavy rank's decode workers")
ap.add_argument("--lockstep", action="store_true", help="all-reduce after each step (DDP)")
a = ap.parse_args()

if a.lockstep:
    import torch
    import torch.distributed as dist
    dist.init_process_group("gloo")
    one = torch.ones(1)

rank = int(os.environ["RANK"])
listing = a.heavy if rank == 0 else a.light
paths = open(listing).read().split() * a.repeat
paths = paths[:len(paths) - a.drop]
loader = flowgate.AudioLoader(
    paths, batch_size=a.batch_size, seconds=a.seconds, train=a.train, rank=0, world_size=1,
    seed=rank, workers=a.heavy_workers if rank == 0 else None,
    cpu_budget=None if a.budget == "none" else a.budget)
epochs = []
started = time.time()
for epoch in range(a.epochs):
    t = time.time()
    n = items = 0
    for audio in loader:
        n += 1
        items += len(audio)
        time.sleep(a.step_ms / 1000)
        if a.lockstep:
            dist.all_reduce(one)
    epochs.append({"seconds": time.time() - t, "batches": n, "items": items})
ticks = []
for r in loader.tuner_trace():
    workers = dict(zip(r["stages"], r["workers"]))
    ticks.append({"t": r["t"], "decode": workers.get("decode"), "wait": r["wait"], "workers": workers, "decisions": r["decisions"],
                  "cpu": r.get("cpu")})
if a.lockstep:
    dist.destroy_process_group()
with open(f"report-{rank}.json", "w") as f:
    json.dump({"rank": rank, "heavy": rank == 0, "epochs": epochs, "ticks": ticks,
               "started": started, "local_world_size": os.environ.get("LOCAL_WORLD_SIZE")}, f)
