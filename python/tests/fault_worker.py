"""One rank of the fault harness (test_faults.py), under torchrun: a loader over data on the
local S3 server behind the fault proxy (``AWS_ENDPOINT_URL`` points at the proxy).

``first``: reads epoch 0; every ``--every`` steps the ranks all-gather their states and the
paths delivered since, and rank 0 saves the merged state and the committed paths (the
checkpoint a training job keeps); rank ``--kill-rank`` kills itself with SIGKILL at step
``--kill-step`` (torchrun then stops the others). ``resume``: loads the checkpoint and reads
the rest of the epoch through ``DataLoader(loader, batch_size=None, num_workers=W)``.
Each rank writes ``report-PHASE-RANK.json``: failures, the tuner's accounted bytes against
the budget, RSS growth, the cache folder's bytes."""

import argparse
import json
import os
import resource
import signal
import threading
import time

import torch
import torch.distributed as dist

import flowgate

# Spawned DataLoader workers import this file again: only the launched process runs it.
if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("spec")
    ap.add_argument("out")
    ap.add_argument("--phase", choices=["first", "resume"], required=True)
    ap.add_argument("--every", type=int, default=2)
    ap.add_argument("--kill-rank", type=int, default=-1)
    ap.add_argument("--kill-step", type=int, default=0)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--context", default="fork", help="the DataLoader workers' start method")
    ap.add_argument("--gate", action="store_true")
    a = ap.parse_args()
    spec = json.loads(open(a.spec).read())

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    cache_dir = os.path.join(a.out, f"cache-{a.phase}-rank{rank}")


    def gather(x):
        out = [None] * world
        dist.all_gather_object(out, x)
        return out


    def rss_mb():
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


    def folder_bytes(d):
        total = 0
        for root, _, files in os.walk(d):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except OSError:
                    pass
        return total


    def make():
        if spec["kind"] == "shards":
            source = flowgate.Shards(spec["url"], cache_dir=cache_dir, cache_mb=spec["cache_mb"],
                                     prefetch=2)
        else:
            source = flowgate.Mix([flowgate.Shards(spec["shards"]),
                                   flowgate.Parquet(spec["parquet"], column="image")],
                                  weights=[0.6, 0.4], stop="all")
        # Exactly once is what the harness checks: no batch made up from items read again
        # (fill_skipped is on by default under torchrun's world size).
        return flowgate.ImageLoader(source, batch_size=spec["batch"], resize=32, crop=32,
                                    seed=spec["seed"], return_paths=True,
                                    memory_mb=spec["memory_mb"], fill_skipped=False)


    def write_json(name, value):
        tmp = os.path.join(a.out, f".{name}.tmp-{rank}")
        with open(tmp, "w") as f:
            json.dump(value, f)
        os.replace(tmp, os.path.join(a.out, name))


    rss_before = rss_mb()
    loader = make()
    report = {"rank": rank, "world": world, "steps": 0, "failures": [], "cache_bytes": [],
              "over_budget_ticks": 0, "ticks": 0, "cache_samples": 0, "cache_over": [],
              "cache_max": 0}


    def watch_cache(stop):
        """The disk cache against its limit and working set, every 5 ms all run long: each
        cache's bytes within max(limit, pinned) (the shards it may not evict now)."""
        while not stop.is_set():
            for c in loader.stats().get("shard_caches", []):
                report["cache_samples"] += 1
                report["cache_max"] = max(report["cache_max"], c["bytes"])
                if c["bytes"] > max(c["limit"], c["pinned"]) and len(report["cache_over"]) < 5:
                    report["cache_over"].append(c)
            time.sleep(0.005)


    def note_progress():
        trace = loader.tuner_trace()
        report["ticks"] = len(trace)
        report["over_budget_ticks"] = sum(
            1 for t in trace if t.get("memory_budget") and t["bytes"] > t["memory_budget"])
        report["max_bytes"] = max((t["bytes"] for t in trace), default=0)
        report["memory_budget"] = max((t.get("memory_budget") or 0 for t in trace), default=0)
        report["rss_growth_mb"] = rss_mb() - rss_before
        report["cache_bytes"].append(folder_bytes(cache_dir))
        write_json(f"report-{a.phase}-{rank}.json", report)


    if a.phase == "first":
        stop_watching = threading.Event()
        threading.Thread(target=watch_cache, args=(stop_watching,), daemon=True).start()
        if a.gate:
            # The shards are opened (indexed); the test rewrites one on the store now.
            dist.barrier()
            if rank == 0:
                open(os.path.join(a.out, "opened"), "w").close()
                deadline = time.monotonic() + 120
                while not os.path.exists(os.path.join(a.out, "rewritten")):
                    assert time.monotonic() < deadline, "the test did not rewrite the object"
                    time.sleep(0.05)
            dist.barrier()
        committed, pending, step = [], [], 0
        for _, paths in loader:
            step += 1
            pending += paths
            report["steps"] = step
            if step == 1:
                # The memory check reads the tuner's ticks: let it tick once before the
                # first checkpoint (a fast rank may otherwise reach it first).
                deadline = time.monotonic() + 5
                while not loader.tuner_trace() and time.monotonic() < deadline:
                    time.sleep(0.02)
            if rank == a.kill_rank and step == a.kill_step:
                note_progress()
                os.kill(os.getpid(), signal.SIGKILL)
            if step % a.every == 0:
                states, delivered = gather(loader.state_dict()), gather(pending)
                pending = []
                report["failures"] = [list(f) for f in loader.failures()]
                note_progress()
                if rank == 0:
                    committed += [p for ps in delivered for p in ps]
                    write_json("checkpoint.json", {"state": flowgate.merge_state_dicts(states),
                                                   "committed": committed, "step": step})
        note_progress()
    else:
        ckpt = json.loads(open(os.path.join(a.out, "checkpoint.json")).read())
        loader.load_state_dict(ckpt["state"])
        dl = torch.utils.data.DataLoader(loader, batch_size=None, num_workers=a.workers,
                                         multiprocessing_context=a.context)
        got = []
        for x, paths in dl:
            assert x.shape[0] == len(paths)
            got += paths
            report["steps"] += 1
        try:
            loader.state_dict()
            report["parent_state"] = "taken"
        except RuntimeError as e:
            report["parent_state"] = str(e)
        note_progress()
        everything = gather(got)
        if rank == 0:
            write_json("resumed.json", [p for ps in everything for p in ps])
    dist.destroy_process_group()
