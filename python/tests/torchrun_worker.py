"""One rank of test_torchrun.py: a flowgate loader sharded by torchrun's RANK/WORLD_SIZE."""

import argparse
import json
import os

import torch.distributed as dist

import flowgate

ap = argparse.ArgumentParser()
ap.add_argument("files")
ap.add_argument("--load")
ap.add_argument("--then", type=float)
ap.add_argument("--save")
ap.add_argument("--whole-before", type=int, default=0)
ap.add_argument("--whole-after", type=int, default=0)
ap.add_argument("--trace", action="store_true")
a = ap.parse_args()

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
loader = flowgate.ImageLoader(a.files, batch_size=2, crop=32, resize=32, seed=11,
                              return_paths=True, workers=1)


def gather(x):
    out = [None] * world
    dist.all_gather_object(out, x)
    return out


report = {"epochs": [], "epoch_numbers": []}


def whole_epochs(n):
    for _ in range(n):
        report["epoch_numbers"].append(loader.epoch)
        paths = [p for _, ps in loader for p in ps]
        report["epochs"].append(gather(paths))


if a.trace:
    # One tuned epoch over the list repeated: the decode workers the tuner chose, per tick.
    paths = [p for p in open(a.files).read().split()] * 30
    tuned = flowgate.ImageLoader(paths, batch_size=16, resize=256, crop=224)
    for _ in tuned:
        pass
    ticks = [(r["t"], dict(zip(r["stages"], r["workers"]))["decode"]) for r in tuned.tuner_trace()]
    report["traces"] = gather(ticks)
    report["local_world_size"] = gather(os.environ.get("LOCAL_WORLD_SIZE"))

if a.load:
    with open(a.load) as f:
        loader.load_state_dict(json.load(f))
whole_epochs(a.whole_before)
if a.then is not None:
    # Part of the current epoch (a fraction of a full share's batches, or all that is
    # left), then a checkpoint of every rank, merged.
    n = 10**9 if a.then >= 1.0 else int(len(loader) * a.then + 0.5)
    got, batches, state = [], 0, None
    for _, paths in loader:
        got.extend(paths)
        batches += 1
        if batches == n:
            state = loader.state_dict()  # the checkpoint of a training step
            break
    if state is None:
        state = loader.state_dict()
    report["partial"] = gather(got)
    report["batches"] = gather(batches)
    states = gather(state)
    if a.save and rank == 0:
        with open(a.save, "w") as f:
            json.dump(flowgate.merge_state_dicts(states), f)
whole_epochs(a.whole_after)

if rank == 0:
    with open("report.json", "w") as f:
        json.dump(report, f)
dist.barrier()
dist.destroy_process_group()
