"""One torchrun rank of test_dataloader.py's DDP test: a map-style dataset through
flowgate.DataLoader (ranks from the environment), an all_reduce after every batch as DDP's
backward does (a rank with fewer batches would hang the others), the ids each rank read."""

import json
import sys

import torch
import torch.distributed as dist
from torch.utils.data import Dataset

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
    bad = {int(i) for i in sys.argv[5].split(",") if i} if len(sys.argv) > 5 else set()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = flowgate.DataLoader(Numbered(n, bad), batch_size=batch, shuffle=True, seed=7,
                                 num_workers=2, skip_errors=bool(bad))
    read = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        ids = []
        for b in loader:
            dist.all_reduce(torch.ones(1))  # every rank steps together
            ids += b.flatten().tolist()
        read.append(ids)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, {"rank": rank, "len": len(loader), "read": read})
    if rank == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
