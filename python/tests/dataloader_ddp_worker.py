"""One torchrun rank of test_dataloader.py's DDP test: a map-style dataset through
flowgate.DataLoader (ranks from the environment), an all_reduce after every batch as DDP's
backward does (a rank with fewer batches would hang the others), the ids each rank read.
Items named in `bad` raise; a batch holding one named in `unbatchable` fails `collate_fn`."""

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset, default_collate

import flowgate


class Numbered(Dataset):
    def __init__(self, n, bad):
        self.n, self.bad = n, bad

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise OSError(f"item {i} is unreadable")
        return torch.tensor([i])


def main() -> None:
    n, batch, epochs, out = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    bad, unbatchable = ({int(i) for i in a.split(",") if i} for a in (sys.argv[5:] + ["", ""])[:2])

    def collate(items):
        if any(int(x) in unbatchable for x in items):
            raise ValueError("these items do not stack")
        return default_collate(items)

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = flowgate.DataLoader(Numbered(n, bad), batch_size=batch, shuffle=True, seed=7,
                                 num_workers=2, collate_fn=collate,
                                 skip_errors=bool(bad or unbatchable))
    read, steps = [], []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        ids = []
        steps.append(0)
        for b in loader:
            steps[-1] += 1
            dist.all_reduce(torch.ones(1))  # every rank steps together
            ids += b.flatten().tolist()
        read.append(ids)
    gathered = [None] * dist.get_world_size()
    report = {"rank": rank, "len": len(loader), "read": read, "steps": steps}
    dist.all_gather_object(gathered, report)
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
