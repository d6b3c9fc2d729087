"""The Python half of scripts/gpu-check.sh: a PyTorch training step on the GPU (a small
convolutional model, mixed precision) fed two ways over the same images, one epoch each after
a warm-up, printing one JSON line per way:

  flowgate   ImageLoader(device="cuda", output="torch"): batches uploaded by flowgate's
             uploader, ready on the current stream
  baseline   ImageLoader(device="cpu", output="torch") and `.cuda(non_blocking=True)` in the
             loop, as most training code does

Each line has images/s, the GPU's idle fraction (1 - busy/wall, timed with CUDA events around
each step: time the stream waits for data counts as idle), H2D GB/s of the batches delivered
(bytes / wall) and torch's pinned-memory copy peak on the same machine for comparison.

    python scripts/gpu_train.py IMAGES_LIST [--batch 128] [--crop 112] [--width 32]
"""
import argparse
import json
import sys
import time

import torch
import torch.nn as nn

import flowgate


def model(width: int) -> nn.Module:
    c = width
    return nn.Sequential(
        nn.Conv2d(3, c, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(c, 2 * c, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(2 * c, 4 * c, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(4 * c, 4 * c, 3, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4 * c, 1000),
    ).cuda().to(memory_format=torch.channels_last)


def pinned_peak(nbytes: int = 64 << 20, reps: int = 20) -> float:
    """torch's host-to-device bandwidth from pinned memory, GB/s (the best of `reps`)."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        dst.copy_(src, non_blocking=True)
        b.record()
        b.synchronize()
        best = max(best, nbytes / (a.elapsed_time(b) / 1e3) / 1e9)
    return best


def run(way: str, list_path: str, args: argparse.Namespace, peak: float) -> dict:
    device = "cuda" if way == "flowgate" else "cpu"
    loader = flowgate.ImageLoader(list_path, batch_size=args.batch, resize=args.crop,
                                  crop=args.crop, labels=[0] * args.n, output="torch",
                                  device=device, shuffle=True, seed=1)
    net = model(args.width)
    opt = torch.optim.SGD(net.parameters(), lr=0.01)
    loss_fn = nn.CrossEntropyLoss()
    scaler = torch.amp.GradScaler("cuda")

    def step(x: torch.Tensor, y: torch.Tensor) -> None:
        with torch.autocast("cuda", dtype=torch.float16):
            out = net(x.float().div_(255).contiguous(memory_format=torch.channels_last))
            loss = loss_fn(out, y)
        opt.zero_grad(set_to_none=True)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()

    for epoch in range(2):  # the first warms up (cuDNN, the tuner, the pinned pool)
        events, images, nbytes = [], 0, 0
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for x, y in loader:
            if way == "baseline":
                x, y = x.cuda(non_blocking=True), y.cuda(non_blocking=True)
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step(x, y)
            b.record()
            events.append((a, b))
            images += x.shape[0]
            nbytes += x.numel() * x.element_size() + y.numel() * y.element_size()
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    busy = sum(a.elapsed_time(b) for a, b in events) / 1e3
    span = events[0][0].elapsed_time(events[-1][1]) / 1e3
    return {
        "way": way, "images": images, "seconds": round(wall, 3),
        "images_per_s": round(images / wall, 1),
        "gpu_idle_fraction": round(max(0.0, 1 - busy / span), 4),
        "h2d_gb_per_s_delivered": round(nbytes / wall / 1e9, 3),
        "torch_pinned_peak_gb_per_s": round(peak, 2),
        "batch": args.batch, "crop": args.crop,
    }


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("list")
    p.add_argument("--batch", type=int, default=128)
    p.add_argument("--crop", type=int, default=112)
    p.add_argument("--width", type=int, default=32)
    args = p.parse_args()
    args.n = len(open(args.list).read().split())
    if not torch.cuda.is_available():
        print(json.dumps({"skipped": "torch sees no CUDA device"}))
        return 1
    peak = pinned_peak()
    for way in ("flowgate", "baseline"):
        print(json.dumps(run(way, args.list, args, peak)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
