"""The fault harness: ranks under torchrun read data on a real local S3 server behind a fault
proxy (bursts of 503 SlowDown, connection resets, bodies cut in half, stalls), an object is
rewritten on the store while the ranks read it, one rank is killed with SIGKILL mid-epoch,
the last merged checkpoint is resumed at another world size through DataLoader workers, and
every item of the epoch is checked: delivered in a committed step or after the resume, each
once (repeats only where ranks pad to equal counts), nothing lost; the accounted memory
within the budget at every tuner tick; the disk cache within its limit after the epoch.

Two datasets: tar shards on S3 (through the disk cache), and a mixture of local tar shards
and Parquet on S3. ``FLOWGATE_SOAK_SAMPLES`` makes the data larger (the long run in
docs/reliability.md)."""

import collections
import io
import json
import os
import pathlib
import random
import subprocess
import sys
import tarfile
import threading
import time

import pytest

import flowgate
from faults import s3_store

torch = pytest.importorskip("torch")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

WORKER = pathlib.Path(__file__).with_name("fault_worker.py")
SAMPLES = int(os.environ.get("FLOWGATE_SOAK_SAMPLES", "97"))  # divides by no world or batch
PER_SHARD = 9
BATCH = 4
FIRST_WORLD, RESUMED_WORLD, WORKERS = 3, 2, 2
#: Steps between checkpoints in the first run: the kill lands one, two or three steps after
#: the last one (at a checkpoint's step, just before it is taken).
EVERY = 3


def kill_step(seed, steps_per_rank):
    """The step rank 1 is killed at, drawn from ``seed`` (``FLOWGATE_FAULT_SEED`` overrides
    it: scripts/soak-faults.sh draws one per round): after the first checkpoint and early
    enough that a rank whose reads fail (the rewritten object) still gets there."""
    seed = int(os.environ.get("FLOWGATE_FAULT_SEED", seed))
    return random.Random(seed).randint(EVERY + 1, max(EVERY + 1, steps_per_rank - 2))


def write_tar(path, items, mtime):
    """KEY.jpg for each (key, jpeg file); written beside and renamed into place (a reader
    of the old file keeps it)."""
    tmp = path.with_suffix(".tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for key, image in items:
            raw = pathlib.Path(image).read_bytes()
            info = tarfile.TarInfo(f"{key}.jpg")
            info.size, info.mtime = len(raw), mtime
            tar.addfile(info, io.BytesIO(raw))
    os.replace(tmp, path)


def write_parquet(path, images, compression):
    rows = [{"bytes": pathlib.Path(p).read_bytes(), "path": f"row{i}.jpg"}
            for i, p in enumerate(images)]
    tmp = path.with_suffix(".tmp")
    pq.write_table(pa.table({"image": rows}), tmp, row_group_size=8, compression=compression)
    os.replace(tmp, path)


def shards_of(images, n, folder, mtime=1):
    """``n`` samples in shards of PER_SHARD, sample k's image images[k % len(images)]."""
    folder.mkdir(parents=True, exist_ok=True)
    count = (n + PER_SHARD - 1) // PER_SHARD
    for s in range(count):
        keys = range(s * PER_SHARD, min(n, (s + 1) * PER_SHARD))
        write_tar(folder / f"shard-{s:06d}.tar",
                  [(f"s{k:05d}", images[k % len(images)]) for k in keys], mtime)
    return count


def torchrun(n, out, *args, check=True):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
         "--master_port", str(29000 + os.getpid() % 1000 + n), str(WORKER),
         str(out / "spec.json"), str(out), *map(str, args)],
        env=env, capture_output=True, text=True, timeout=300, cwd=out)
    # The whole output beside the run (an assertion shows its end).
    (out / f"torchrun-{n}.log").write_text(r.stdout + r.stderr)
    if check:
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-6000:]
    return r


@pytest.fixture
def store(tmp_path, monkeypatch):
    """The server over ``tmp_path/s3`` (bucket ``data``) and the fault proxy before it; the
    environment points clients at the proxy."""
    for root, proxy in s3_store(tmp_path, monkeypatch, faults=True):
        yield root / "data", proxy


def rewrite_when_opened(out, rewrite):
    """Waits for the ranks to open the data, rewrites an object, lets them go on."""
    def run():
        while not (out / "opened").exists():
            if done.is_set():
                return
            time.sleep(0.05)
        rewrite()
        (out / "rewritten").touch()
    done = threading.Event()
    threading.Thread(target=run, daemon=True).start()
    return done


def reference(spec, tmp_path):
    """The epoch in one process, without faults: each item as often as the order holds it."""
    if spec["kind"] == "shards":
        source = flowgate.Shards(spec["url"], cache_dir=tmp_path / "ref-cache", cache_mb=1)
    else:
        source = flowgate.Mix([flowgate.Shards(spec["shards"]),
                               flowgate.Parquet(spec["parquet"], column="image")],
                              weights=[0.6, 0.4], stop="all")
    loader = flowgate.ImageLoader(source, batch_size=BATCH, resize=32, crop=32,
                                  seed=spec["seed"], return_paths=True, rank=0, world_size=1)
    return collections.Counter(p for _, paths in loader for p in paths)


def run_harness(spec, out, proxy, rewrite, tmp_path, shard_bytes, context="fork"):
    out.mkdir(exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    done = rewrite_when_opened(out, rewrite)
    steps_per_rank = -(-SAMPLES // FIRST_WORLD) // BATCH
    kill = kill_step(spec["seed"], steps_per_rank)
    first = torchrun(FIRST_WORLD, out, "--phase", "first", "--kill-rank", 1, "--kill-step",
                     kill, "--every", EVERY, "--gate", check=False)
    done.set()
    assert (out / "rewritten").exists(), first.stderr[-3000:]
    # The job ended when rank 1 killed itself (its last report is from that step).
    assert first.returncode != 0, "the killed rank ended the job"
    firsts = [json.loads((out / f"report-first-{r}.json").read_text())
              for r in range(FIRST_WORLD)]
    assert firsts[1]["steps"] == kill, (firsts[1], first.stderr[-3000:])
    ckpt = json.loads((out / "checkpoint.json").read_text())
    # The last checkpoint before the kill: the kill's step's own is never taken.
    assert ckpt["step"] == (kill - 1) // EVERY * EVERY, (ckpt["step"], kill)
    torchrun(RESUMED_WORLD, out, "--phase", "resume", "--workers", WORKERS, "--context", context)
    resumed = json.loads((out / "resumed.json").read_text())
    rest = [json.loads((out / f"report-resume-{r}.json").read_text())
            for r in range(RESUMED_WORLD)]
    proxy.faults = False
    want = reference(spec, tmp_path)
    got = collections.Counter(ckpt["committed"]) + collections.Counter(resumed)
    missing = {p: n - got[p] for p, n in want.items() if got[p] < n}
    extra = {p: got[p] - want[p] for p in got if got[p] > want[p]}
    strangers = [p for p in got if p not in want]
    # Each dealing pads fewer positions than it has ranks.
    padding = (FIRST_WORLD - 1) + (RESUMED_WORLD - 1)
    figures = dict(items=sum(want.values()), committed=len(ckpt["committed"]),
                   resumed=len(resumed), lost=sum(missing.values()), kill_step=kill,
                   steps_after_checkpoint=kill - ckpt["step"],
                   repeated=sum(extra.values()), padding_allows=padding,
                   faults={k: v for k, v in proxy.counts.items()},
                   failed_before_the_kill=sum(len(r["failures"]) for r in firsts))
    print(json.dumps(figures))
    assert not strangers, strangers[:5]
    assert not missing, f"lost: {list(missing)[:5]} {figures}"
    assert sum(extra.values()) <= padding, f"repeated beyond padding: {extra} {figures}"
    assert len(ckpt["committed"]) > 0 and len(resumed) > 0
    # Faults of every kind were injected (and absorbed by retries).
    for k in ("slow_down", "reset", "truncated", "stalled"):
        assert proxy.counts[k] > 0, (k, proxy.counts)
    # The rewritten object: only its reads failed, each saying so.
    for r in firsts:
        for stage, path, message in r["failures"]:
            assert "changed on the store" in message, (stage, path, message)
    # Memory: the accounted bytes within the budget at every tick (each rank waits for its
    # tuner's first tick after its first batch).
    for r in firsts:
        assert r["ticks"] > 0 and r["over_budget_ticks"] == 0, r
        assert r["max_bytes"] <= r["memory_budget"], r
        assert r["rss_growth_mb"] < spec["memory_mb"] + 150, r
    # The training process refuses a state its DataLoader workers make wrong.
    for r in rest:
        assert "DataLoader worker processes" in r["parent_state"], r
    return figures, firsts, rest


def test_shards_on_s3_under_faults_a_killed_rank_and_a_resume_with_workers(
        data, tmp_path, store):
    bucket, proxy = store
    images = sorted(str(p) for p in (data / "images").glob("*.jpg"))
    count = shards_of(images, SAMPLES, bucket / "train")
    shard_bytes = max(p.stat().st_size for p in (bucket / "train").glob("*.tar"))
    cache_mb = 2.5 * shard_bytes / 2**20
    spec = dict(kind="shards", url=f"s3://data/train/shard-{{000000..{count - 1:06d}}}.tar",
                cache_mb=cache_mb, batch=BATCH, seed=7, memory_mb=64)

    def rewrite():
        # The same samples in other bytes (another mtime): another version on the store.
        keys = range(0, PER_SHARD)
        write_tar(bucket / "train" / "shard-000000.tar",
                  [(f"s{k:05d}", images[k % len(images)]) for k in keys], mtime=2)

    # Forked DataLoader workers (the default on Linux), from a training process whose loader
    # and S3 client have threads parked: see vendor/README.md.
    figures, firsts, rest = run_harness(spec, tmp_path / "run", proxy, rewrite, tmp_path,
                                        shard_bytes, context="fork")
    # The disk cache while the ranks read (sampled every 5 ms): within its limit, or no more
    # than its working set (shards with samples still to read, the most recently used).
    for r in firsts:
        assert r["cache_samples"] > 0 and not r["cache_over"], r
        assert r["cache_max"] > 0, r
    # The disk cache after the epoch: each resumed rank's workers hold at most the limit
    # and the two shards each keeps as its working set.
    for r in rest:
        limit = WORKERS * (cache_mb * 2**20 + 2 * shard_bytes)
        assert r["cache_bytes"][-1] <= limit, (r["cache_bytes"], limit)
    assert proxy.counts["precondition_failed"] > 0, proxy.counts


def test_a_mixture_of_shards_and_parquet_on_s3_under_faults_a_killed_rank_and_a_resume(
        data, tmp_path, store):
    bucket, proxy = store
    images = sorted(str(p) for p in (data / "images").glob("*.jpg"))
    local = tmp_path / "local"
    count = shards_of(images, SAMPLES * 3 // 5, local)
    rows = [images[(i * 7) % len(images)] for i in range(SAMPLES - SAMPLES * 3 // 5)]
    write_parquet(bucket / "rows.parquet", rows, "snappy")
    spec = dict(kind="mix", shards=f"{local}/shard-{{000000..{count - 1:06d}}}.tar",
                parquet="s3://data/rows.parquet", batch=BATCH, seed=3, memory_mb=64)

    def rewrite():
        # The same rows and row groups in other bytes: another version on the store.
        write_parquet(bucket / "rows.parquet", rows, "gzip")

    # Spawned workers (the other start method; the shards' harness forks them).
    figures, firsts, _ = run_harness(spec, tmp_path / "run", proxy, rewrite, tmp_path, 0,
                                     context="spawn")
    # The rewritten Parquet object was read at the version the ranks opened: its later range
    # reads named that version (If-Match) and the store refused them, each read's rows failed
    # saying so (and were read again, at the new version, after the resume: none lost).
    assert proxy.counts["precondition_failed"] > 0, proxy.counts
    changed = [f for r in firsts for f in r["failures"] if "changed on the store" in f[2]]
    assert changed and all(path.startswith("s3://data/rows.parquet") for _, path, _ in changed), \
        changed[:3]
