"""One rank of test_torchrun.py's straggler case: two epochs over the sample images, rank 1
reading the same pictures saved 16 times larger (its decoding slowed on purpose: the only
difference between the ranks), then ``flowgate.report_ranks``; rank 0 writes the line it
returned to ``report.txt``. Arguments: the list of sample images, the list of large ones."""

import sys

import torch.distributed as dist

import flowgate

dist.init_process_group("gloo")
rank = dist.get_rank()
listed = sys.argv[2] if rank == 1 else sys.argv[1]
# The list 20 times over: enough decoding (~270 items a rank) for the slowed rank to show.
paths = [line.strip() for line in open(listed) if line.strip()] * 20
loader = flowgate.ImageLoader(paths, batch_size=4, resize=64, crop=64, workers=1,
                              shuffle=False)
for _ in range(2):
    for _batch in loader:
        pass
line = flowgate.report_ranks(loader, log=None)
if rank == 0:
    with open("report.txt", "w") as f:
        f.write(line)
else:
    assert line is None
dist.destroy_process_group()
