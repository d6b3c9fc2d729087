"""A node CPU budget shared by torchrun ranks: three ranks (one with clips six times longer)
on a budget of two cores, every tick's figures checked from the ranks' traces."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import flowgate
from conftest import ROOT, gen_data

pytest.importorskip("torch")

WORKER = pathlib.Path(__file__).with_name("cpu_budget_worker.py")


@pytest.fixture(scope="session")
def clips() -> pathlib.Path:
    """48 light (2 s) and 48 heavy (12 s) FLAC clips."""
    d = ROOT / "target" / "pytest-cpu-budget"
    for name, seconds, seed in (("light", "2,2", "0"), ("heavy", "12,12", "1")):
        if not (d / name / "audio.txt").exists():
            gen_data(d / name, "--images", "0", "--audio", "48", "--audio-seconds", seconds,
                     "--seed", seed)
    return d


def run_ranks(tmp_path, clips, budget, key):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "FLOWGATE_NODE_KEY": key}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=3",
         "--master_port", str(29500 + (os.getpid() + 7) % 1000), str(WORKER),
         "--heavy", str(clips / "heavy" / "audio.txt"),
         "--light", str(clips / "light" / "audio.txt"),
         "--budget", budget, "--step-ms", "10", "--epochs", "2", "--repeat", "10"],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return [json.loads((tmp_path / f"report-{k}.json").read_text()) for k in range(3)]


def test_three_ranks_never_decode_on_more_cores_than_the_budget(tmp_path, clips):
    key = f"pytest-{os.getpid()}-{tmp_path.name}"
    reports = run_ranks(tmp_path, clips, "2", key)
    for rep in reports:
        assert rep["local_world_size"] == "3"
        assert [e["batches"] for e in rep["epochs"]] == [60, 60], "every clip, every epoch"
        cpu = [t["cpu"] for t in rep["ticks"] if t["cpu"]]
        assert len(cpu) >= 10, f"rank {rep['rank']}: {len(cpu)} ticks with the budget"
        for c in cpu:
            # The node's holds at the tick: every rank's decoding items at that instant.
            assert c["budget"] == 2 and c["node_busy"] <= 2 and c["held"] <= 2, c
            assert c["share"] <= 2.2, c
    heavy = reports[0]
    # The heavy rank's consumer waits: it grew past its static share of one worker
    # (2 cores / 3 ranks) into the cores the step-bound light ranks leave idle.
    assert max(t["decode"] for t in heavy["ticks"]) >= 2, heavy["ticks"]
    assert max(c["share"] for c in (t["cpu"] for t in heavy["ticks"] if t["cpu"])) > 1.0
    # Every rank gone: the ledger holds nothing.
    ledger = pathlib.Path("/dev/shm") / f"flowgate-cpu-{key}-2"
    assert ledger.exists(), "the ledger lives in /dev/shm, named by the key and the budget"
    ledger.unlink()


@pytest.mark.parametrize("bad", [True, 0, -1, 1.5, "x", "0%", "101%", float("nan"), [2]])
def test_a_bad_cpu_budget_is_refused_naming_it(data, bad):
    with pytest.raises((ValueError, TypeError), match="cpu_budget"):
        flowgate.ImageLoader(data / "images.txt", cpu_budget=bad)


def test_a_cpu_budget_takes_cores_fractions_and_percentages(data, monkeypatch):
    monkeypatch.setenv("FLOWGATE_NODE_KEY", f"pytest-forms-{os.getpid()}")
    paths = (data / "images.txt").read_text().split() * 15
    for budget in (1, 0.5, "50%", "1"):
        loader = flowgate.ImageLoader(paths, batch_size=8, crop=32, resize=32,
                                      cpu_budget=budget)
        assert sum(len(b) for b in loader) == 600
        cpu = [r["cpu"] for r in loader.tuner_trace() if r.get("cpu")]
        assert cpu and all(c["budget"] >= 1 and c["node_busy"] <= c["budget"] for c in cpu)
        loader.close()
    for ledger in pathlib.Path("/dev/shm").glob(f"flowgate-cpu-pytest-forms-{os.getpid()}-*"):
        ledger.unlink()
