"""DDP launched by ``torch.multiprocessing.spawn``, as PyTorch's DDP tutorial does: no
``RANK``/``WORLD_SIZE`` in the environment, the process group initialized with the rank and
world size. Each rank's ``flowgate.DataLoader`` and ``ImageLoader`` (built after
``init_process_group``) report what they read; a DataLoader worker process too."""

import json
import os
import sys

import torch.distributed as dist
import torch.multiprocessing as mp
import torch.utils.data

import flowgate


def run(rank: int, world: int, init: str, images: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    loader = flowgate.DataLoader(list(range(11)), batch_size=2, shuffle=False)
    items = [int(x) for b in loader for x in b]
    images_loader = flowgate.ImageLoader(images, batch_size=2, resize=16, crop=16,
                                         shuffle=False, return_paths=True)
    paths = [p for _, batch_paths in images_loader for p in batch_paths]
    # Through a torch DataLoader worker (a process without the group): the same share.
    workers = torch.utils.data.DataLoader(images_loader, batch_size=None, num_workers=1)
    worker_paths = [p for _, batch_paths in workers for p in batch_paths]
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump({"items": items, "len": len(loader), "paths": paths,
                   "worker_paths": worker_paths}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    world, init, images, out = int(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    mp.spawn(run, args=(world, init, images, out), nprocs=world)
