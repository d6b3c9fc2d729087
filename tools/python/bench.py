"""The images/audio benchmark driven from Python, same file list and JSON as the Rust one
(`cargo run --release -p flowgate-tools --bin bench`), for side-by-side runs with the peer loaders (scripts/peers.py):

    python tools/python/bench.py images --list FILE [--batch 32] [--workers N]
    python tools/python/bench.py audio --list FILE [--batch 32] [--seconds 4]

Prints one JSON line: workload, items, seconds, items_per_s, cpu_seconds, peak_rss_mb,
batch_shape, dtype. Each batch is viewed as a NumPy array (no copy), as a training loop would.
"""

import argparse
import json
import resource
import time

import numpy as np

import flowgate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("workload", choices=["images", "audio"])
    ap.add_argument("--list", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--workers", type=int, default=None)
    ap.add_argument("--resize", type=int, default=256)
    ap.add_argument("--crop", type=int, default=224)
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    if a.workload == "images":
        loader = flowgate.ImageLoader(a.list, batch_size=a.batch, resize=a.resize, crop=a.crop,
                                      shuffle=False, workers=a.workers)
    else:
        loader = flowgate.AudioLoader(a.list, batch_size=a.batch, seconds=a.seconds,
                                      shuffle=False, workers=a.workers)
    cpu0 = time.process_time()
    t0 = time.perf_counter()
    items, shape, dtype = 0, None, None
    for batch in loader:
        x = np.asarray(batch)
        if shape is None:
            shape, dtype = list(x.shape), str(x.dtype)
        items += x.shape[0]
    secs = time.perf_counter() - t0
    cpu = time.process_time() - cpu0
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({
        "workload": a.workload, "items": items, "seconds": round(secs, 4),
        "items_per_s": round(items / secs, 1), "cpu_seconds": round(cpu, 3),
        "peak_rss_mb": round(rss, 1), "batch_shape": shape, "dtype": dtype,
        "driver": "python",
    }))


if __name__ == "__main__":
    main()
