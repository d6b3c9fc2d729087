"""The few lines a training loop needs: a flowgate loader feeding a PyTorch-style loop.

    pip install ./python            # once (builds the Rust extension with maturin)
    python examples/python/train_loop.py target/sample-data/images.txt

Uses PyTorch when it is installed (torch.from_dlpack: the batch is not copied), NumPy
otherwise. Checkpoints the loader with the model, so a preempted run resumes exactly.
"""

import sys
import time

import numpy as np

import flowgate

try:
    import torch
except ImportError:  # NumPy stands in for the model
    torch = None

images = sys.argv[1] if len(sys.argv) > 1 else "target/sample-data/images.txt"
# fill_skipped: under torchrun (DDP), a rank whose files were skipped as unreadable still makes
# len(loader) batches, so no rank waits at the last step for one that ended early.
loader = flowgate.ImageLoader(images, batch_size=32, resize=256, crop=224, shuffle=True, seed=0,
                              fill_skipped=True)

mean = np.array([0.485, 0.456, 0.406], dtype=np.float32).reshape(1, 3, 1, 1) * 255
for epoch in range(2):
    t0, seen = time.perf_counter(), 0
    for step, batch in enumerate(loader):
        if torch is not None:
            x = torch.from_dlpack(batch).float() - torch.from_numpy(mean)   # zero-copy in
            loss = x.mean()                                                  # model(x) here
        else:
            x = np.asarray(batch, dtype=np.float32) - mean                   # zero-copy view
            loss = float(x.mean())
        seen += len(batch)
        if step == 5 and epoch == 0:
            checkpoint = {"loader": loader.state_dict()}                     # with the model's
    rate = seen / (time.perf_counter() - t0)
    print(f"epoch {epoch}: {seen} images, {rate:.0f} images/s, loss {float(loss):.3f}")

# After a preemption: a new process builds the same loader and continues where it stopped.
resumed = flowgate.ImageLoader(images, batch_size=32, resize=256, crop=224, shuffle=True, seed=0,
                               fill_skipped=True)
resumed.load_state_dict(checkpoint["loader"])
rest = sum(len(b) for b in resumed)
print(f"resumed epoch 0: {rest} images left after the checkpoint at 6 batches")
print("stats:", {k: v for k, v in loader.stats().items() if k != "stages"})
