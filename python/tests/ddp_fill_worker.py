"""One rank of test_torchrun.py's skipped-files cases, all in one `torchrun` launch (each
launch costs seconds of process start, torch import and process-group setup): for each case
in ``--cases`` (a JSON list of ``{"name", "fill", "ddp", "drop_last"}``; ``fill`` null is the
loader's own default, what a user gets), a loader over files some of which are unreadable,
two epochs, and with ``ddp`` an all-reduce after every batch, as data-parallel training does
(a rank that ends its epoch early leaves the others waiting there forever). A barrier between
cases keeps the ranks on the same one. Writes ``report-RANK.json``: per case, the batches per
epoch, ``len(loader)``, items read again and failures."""

import argparse
import json

import torch
import torch.distributed as dist

import flowgate

ap = argparse.ArgumentParser()
ap.add_argument("files")
ap.add_argument("--cases", required=True)
ap.add_argument("--epochs", type=int, default=2)
a = ap.parse_args()

dist.init_process_group("gloo")
rank = dist.get_rank()
reports = {}
for case in json.loads(a.cases):
    fill = {} if case["fill"] is None else {"fill_skipped": case["fill"]}
    loader = flowgate.ImageLoader(a.files, batch_size=3, crop=16, resize=16, seed=2,
                                  drop_last=case["drop_last"], workers=1, **fill)
    report = {"len": len(loader), "batches": [], "filled": [], "failures": []}
    for epoch in range(a.epochs):
        n = 0
        for batch in loader:
            n += 1
            if case["ddp"]:
                t = torch.tensor([float(len(batch))])
                dist.all_reduce(t)
        report["batches"].append(n)
        report["filled"].append(loader.stats()["filled"])
        report["failures"].append(len(loader.failures()))
    loader.close()
    reports[case["name"]] = report
    dist.barrier()
dist.destroy_process_group()
with open(f"report-{rank}.json", "w") as f:
    json.dump(reports, f)
