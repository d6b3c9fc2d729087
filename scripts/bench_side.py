"""Side-by-side benchmark runs shared by scripts/bench_image_text.py and scripts/bench_speech.py:
each run in a cold process of its own (the script called again with `--one RUN`), runs
interleaved over repetitions, ratios per repetition against the best peer setting of that
repetition, a Markdown table on stdout."""
import io
import json
import os
import statistics
import subprocess
import sys
import tarfile


def write_shards(paths, out, ext, sidecars, per_shard):
    """Tar shards of `paths` (each as `KEY.ext`, KEY its number) with the members
    `sidecars(i, key)` gives (`[(ext, text or bytes), ...]`) beside each; returns the brace
    pattern."""
    os.makedirs(out, exist_ok=True)
    n = (len(paths) + per_shard - 1) // per_shard
    for s in range(n):
        with tarfile.open(os.path.join(out, f"{s:05d}.tar"), "w") as tar:
            for i in range(s * per_shard, min(len(paths), (s + 1) * per_shard)):
                key = f"{i:09d}"
                tar.add(paths[i], arcname=f"{key}.{ext}")
                for side, body in sidecars(i, key):
                    raw = body if isinstance(body, bytes) else body.encode()
                    info = tarfile.TarInfo(f"{key}.{side}")
                    info.size = len(raw)
                    tar.addfile(info, io.BytesIO(raw))
    return os.path.join(out, f"{{00000..{n - 1:05d}}}.tar")


def one(script, args, what):
    """`script --one WHAT ARGS...` in a fresh interpreter: its last stdout line, as JSON."""
    out = subprocess.run([sys.executable, script, *args, "--one", what], capture_output=True,
                         text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def compare(script, args, runs, ours, peer_prefix, reps, extra=()):
    """Runs each of `runs` `reps` times (interleaved) and prints the table: items/s, CPU
    seconds per 1,000 items, `extra` columns (a result key each, medians), and `ours` over
    each run and over the best `peer_prefix` run of each repetition."""
    results = {r: [] for r in runs}
    for rep in range(reps):
        for r in runs:
            results[r].append(one(script, args, r))
            print(rep, r, results[r][-1], file=sys.stderr)

    def rate(x):
        return x["items"] / x["seconds"]

    def cpu(x):
        return 1000 * x["epoch_cpu_s"] / x["items"]

    best = [max(rate(results[r][k]) for r in runs if r.startswith(peer_prefix))
            for k in range(reps)]
    head = "".join(f" {e} |" for e in extra)
    print(f"| loader | items/s | CPU s / 1,000 items |{head} {ours} over it (median, range) |")
    print("|---|---|---|" + "---|" * len(extra) + "---|")
    for r in runs:
        rates = [rate(x) for x in results[r]]
        ratios = [rate(f) / rate(x) for f, x in zip(results[ours], results[r])]
        cell = "" if r == ours else (
            f"{statistics.median(ratios):.2f}× ({min(ratios):.2f}–{max(ratios):.2f})")
        cols = "".join(f" {statistics.median(x[e] for x in results[r]):.3g} |" for e in extra)
        print(f"| {r} | {statistics.median(rates):.0f} | "
              f"{statistics.median(cpu(x) for x in results[r]):.2f} |{cols} {cell} |")
    over_best = [rate(f) / b for f, b in zip(results[ours], best)]
    print(f"\n{ours} over the best {peer_prefix} setting per repetition: median "
          f"{statistics.median(over_best):.2f}× ({min(over_best):.2f}–{max(over_best):.2f})")
