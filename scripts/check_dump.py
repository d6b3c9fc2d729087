#!/usr/bin/env python3
"""Compares a `bench images --dump` batch with torchvision's geometry computed by Pillow, or a
`bench audio --dump` batch with soundfile's samples (mixed to mono, cropped or zero-padded).

torchvision's Resize(256) + CenterCrop(224) on a PIL image is PIL's antialiased bilinear resize
to (short 256, long int(256 * long / short)) followed by a crop at round((size - 224) / 2).
This recomputes that with Pillow for the list's first images and prints the mean absolute
difference in grey levels (the contract: at most 2).

    .peers-venv/bin/pip install pillow   # numpy comes with the peers
    cargo run --release -p flowgate-tools --bin bench -- images --list L --dump /tmp/first.npy
    .peers-venv/bin/python scripts/check_dump.py --list L --dump /tmp/first.npy
    .peers-venv/bin/python scripts/check_dump.py --audio --list A --dump /tmp/audio.npy
"""
import argparse, json
import numpy as np
from PIL import Image

ap = argparse.ArgumentParser()
ap.add_argument("--list", required=True)
ap.add_argument("--dump", required=True)
ap.add_argument("--resize", type=int, default=256)
ap.add_argument("--crop", type=int, default=224)
ap.add_argument("--audio", action="store_true", help="an audio dump (same rate as the files)")
a = ap.parse_args()

batch = np.load(a.dump)
n = batch.shape[0]
paths = [l.strip() for l in open(a.list) if l.strip()][:n]
if a.audio:
    import soundfile as sf
    worst = 0.0
    for i, p in enumerate(paths):
        x, _ = sf.read(p, dtype="float32", always_2d=True)
        x = x.mean(axis=1, dtype=np.float32)[: batch.shape[1]]
        ref = np.zeros(batch.shape[1], np.float32)
        ref[: len(x)] = x
        worst = max(worst, float(np.abs(batch[i] - ref).max()))
    print(json.dumps({"clips": n, "max_abs_diff": worst, "ok": worst <= 1e-6}))
    raise SystemExit(0)
ref = []
for p in paths:
    im = Image.open(p).convert("RGB")
    w, h = im.size
    if w <= h:
        nw, nh = a.resize, int(a.resize * h / w)
    else:
        nw, nh = int(a.resize * w / h), a.resize
    im = im.resize((nw, nh), Image.BILINEAR)
    left, top = int(round((nw - a.crop) / 2.0)), int(round((nh - a.crop) / 2.0))
    im = im.crop((left, top, left + a.crop, top + a.crop))
    ref.append(np.asarray(im).transpose(2, 0, 1))  # CHW
ref = np.stack(ref)
if batch.shape != ref.shape:
    batch = batch.transpose(0, 3, 1, 2)  # an NHWC dump
diff = np.abs(batch.astype(np.int16) - ref.astype(np.int16))
print(json.dumps({"images": n, "mean_abs_diff": float(diff.mean()), "max_abs_diff": int(diff.max()),
                  "ok": bool(diff.mean() <= 2.0)}))
