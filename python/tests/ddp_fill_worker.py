"""One rank of test_torchrun.py's skipped-files cases: a loader over files some of which are
unreadable, and optionally (``--ddp``) an all-reduce after every batch, as data-parallel
training does (a rank that ends its epoch early leaves the others waiting there forever).
Writes ``report-RANK.json``: the batches per epoch, ``len(loader)``, items read again."""

import argparse
import json

import torch
import torch.distributed as dist

import flowgate

ap = argparse.ArgumentParser()
ap.add_argument("files")
ap.add_argument("--fill", action="store_true")
# The loader's own default (no fill_skipped argument), what a user gets.
ap.add_argument("--default-fill", action="store_true")
ap.add_argument("--ddp", action="store_true")
ap.add_argument("--drop-last", action="store_true")
ap.add_argument("--epochs", type=int, default=2)
a = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
fill = {} if a.default_fill else {"fill_skipped": a.fill}
loader = flowgate.ImageLoader(a.files, batch_size=3, crop=16, resize=16, seed=2,
                              drop_last=a.drop_last, workers=1, **fill)
report = {"len": len(loader), "batches": [], "filled": [], "failures": []}
for epoch in range(a.epochs):
    n = 0
    for batch in loader:
        n += 1
        if a.ddp:
            t = torch.tensor([float(len(batch))])
            dist.all_reduce(t)
    report["batches"].append(n)
    report["filled"].append(loader.stats()["filled"])
    report["failures"].append(len(loader.failures()))
if a.ddp:
    dist.barrier()
dist.destroy_process_group()
with open(f"report-{rank}.json", "w") as f:
    json.dump(report, f)
