#!/usr/bin/env python3
"""Two installs of the Python package side by side: the same loader-bound ImageLoader run
(batches of 32, resize 256, center crop 224, tuned, `output="torch"`, no training step) from
the installed package and from another one (a wheel of another commit unpacked into a folder:
`pip install --no-deps --target DIR WHEEL`), each run a fresh process, interleaved.

    scripts/ab_python.py --other /tmp/old-site --list target/sample-data/images.txt \
        --epochs 4 --reps 5 [--json target/ab-python.json]

Prints the median images/s of the first epoch (cold) and of the later ones for each, and
their ratio (installed / other).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def run(a):
    import torch  # noqa: F401  (as a training process has it)

    import flowgate

    paths = open(a.list).read().split()
    loader = flowgate.ImageLoader(paths, batch_size=32, resize=256, crop=224, shuffle=False,
                                  output="torch")
    epochs = []
    for _ in range(a.epochs):
        t = time.perf_counter()
        n = sum(len(b) for b in loader)
        epochs.append(n / (time.perf_counter() - t))
    return {"file": flowgate.__file__, "images_per_s": epochs}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--other", required=True, help="a folder holding another flowgate package")
    p.add_argument("--list", default="target/sample-data/images.txt")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json")
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        print(json.dumps(run(a)))
        return
    runs = {"installed": [], "other": []}
    for _ in range(a.reps):
        for name in ("installed", "other"):
            env = dict(os.environ)
            env.pop("PYTHONPATH", None)
            if name == "other":
                env["PYTHONPATH"] = a.other
            out = subprocess.run([sys.executable, __file__, "--child", "--list", a.list,
                                  "--epochs", str(a.epochs), "--other", a.other],
                                 capture_output=True, text=True, check=True, env=env,
                                 cwd="/")
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))

    def med(name, first):
        return statistics.median(
            r["images_per_s"][0] if first else statistics.mean(r["images_per_s"][1:])
            for r in runs[name])

    summary = {
        "installed_file": runs["installed"][0]["file"], "other_file": runs["other"][0]["file"],
        "installed_images_per_s": med("installed", False), "other_images_per_s": med("other", False),
        "installed_first_epoch": med("installed", True), "other_first_epoch": med("other", True),
    }
    summary["ratio"] = summary["installed_images_per_s"] / summary["other_images_per_s"]
    summary["ratio_first_epoch"] = summary["installed_first_epoch"] / summary["other_first_epoch"]
    print(json.dumps(summary, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"summary": summary, "runs": runs}, f, indent=1)


if __name__ == "__main__":
    main()
