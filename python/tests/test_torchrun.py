"""Multi-rank behaviour under the real launcher: `torchrun --nproc_per_node=N` on CPU (gloo),
one flowgate loader per rank, batches all-gathered."""

import json
import os
import pathlib
import subprocess
import sys

import pytest

import flowgate
from conftest import with_unreadable

torch = pytest.importorskip("torch")

WORKER = pathlib.Path(__file__).with_name("torchrun_worker.py")


def torchrun(n, tmp_path, *args):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
         "--master_port", str(29500 + os.getpid() % 1000), str(WORKER), *map(str, args)],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    return json.loads((tmp_path / "report.json").read_text())


def test_ranks_cover_the_epoch_and_merged_checkpoints_resume_at_other_world_sizes(
        data, tmp_path):
    files = tmp_path / "files.txt"
    paths = sorted(str(p) for p in (data / "images").glob("*.jpg"))
    files.write_text("\n".join(paths) + "\n")
    # 4 ranks: epoch 0 whole, then 40% of epoch 1 and a merged checkpoint.
    rep = torchrun(4, tmp_path, files, "--whole-before", 1, "--then", 0.4, "--save", "s1.json")
    whole = rep["epochs"][0]
    assert sorted(p for rank in whole for p in rank) == paths, "epoch 0: every file once"
    assert len({len(rank) for rank in whole}) == 1, "equal batch counts per rank"
    first = [p for rank in rep["partial"] for p in rank]
    # 2 ranks: part of the rest, merged again.
    rep = torchrun(2, tmp_path, files, "--load", "s1.json", "--then", 0.5, "--save", "s2.json")
    second = [p for rank in rep["partial"] for p in rank]
    # 5 ranks: the rest of epoch 1, then epoch 2 whole.
    rep = torchrun(5, tmp_path, files, "--load", "s2.json", "--then", 1.0, "--whole-after", 1)
    third_by_rank = rep["partial"]
    counts = rep["batches"]
    assert max(counts) == min(counts), f"batches per rank {counts}"
    third = [p for rank in third_by_rank for p in rank]
    epoch1 = first + second + third
    # Every file of epoch 1 across 4, 2 and 5 ranks; the shards are padded to equal lengths
    # (as DistributedSampler does), so a dealing that does not divide repeats fewer files than
    # it has ranks.
    assert set(epoch1) == set(paths), "epoch 1 across 4, 2 and 5 ranks: every file"
    assert len(epoch1) - len(paths) <= 1 + 4, f"{len(epoch1) - len(paths)} repeats"
    assert len(first) > 0 and len(second) > 0 and len(third) > 0
    assert sorted(p for rank in rep["epochs"][0] for p in rank) == paths, "epoch 2 whole"
    assert rep["epoch_numbers"] == [2]


def test_ranks_on_one_node_share_its_cores(data, tmp_path):
    """torchrun sets LOCAL_WORLD_SIZE: each rank's tuner sizes for its share of the node's
    cores, so the ranks' decode workers together never exceed the cores."""
    cores = os.cpu_count()
    files = tmp_path / "files.txt"
    files.write_text("\n".join(str(p) for p in sorted((data / "images").glob("*.jpg"))) + "\n")
    rep = torchrun(2, tmp_path, files, "--trace")
    assert rep["local_world_size"] == ["2", "2"]
    traces = rep["traces"]
    assert all(len(t) >= 3 for t in traces), f"too few tuner ticks: {traces}"
    share = max(1, cores // 2)
    for rank, ticks in enumerate(traces):
        most = max(w for _, w in ticks)
        assert most <= share, f"rank {rank} ran {most} decode workers, its share is {share}"
    # The bound binds: alone on the node (a fresh process: this one's earlier loaders may
    # still hold worker tokens), the same loader runs decode past the share.
    code = (
        "import flowgate\n"
        f"paths = open({str(files)!r}).read().split() * 30\n"
        "alone = flowgate.ImageLoader(paths, batch_size=16, resize=256, crop=224)\n"
        "for _ in alone:\n"
        "    pass\n"
        "print(max(dict(zip(r['stages'], r['workers']))['decode'] for r in alone.tuner_trace()))\n")
    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_WORLD_SIZE", "RANK",
                                                           "WORLD_SIZE", "LOCAL_RANK")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    most = int(out.stdout.split()[-1])
    assert most > share, f"alone, decode reached only {most} workers"


def run_ranks(n, script, args, cwd, port_offset, timeout=300):
    """`torchrun --nproc_per_node=n` of the test script `script` with `args`, in `cwd`."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={n}",
         "--master_port", str(29500 + (os.getpid() + port_offset) % 1000),
         str(WORKER.with_name(script)), *map(str, args)],
        env=env, capture_output=True, text=True, timeout=timeout, cwd=cwd)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]


#: The skipped-files cases, run in one `torchrun` launch (see `ddp_fill_worker.py`).
SKIPPED_CASES = [
    {"name": f"{kind}-{drop_last}", "fill": fill, "ddp": ddp, "drop_last": drop_last}
    for kind, fill, ddp in (("plain", False, False), ("filled", True, True))
    for drop_last in (False, True)
] + [{"name": "default", "fill": None, "ddp": True, "drop_last": False}]


@pytest.fixture(scope="module")
def skipped_runs(data, tmp_path_factory):
    """Three ranks over 40 JPEGs and 9 unreadable files, every case of `SKIPPED_CASES` in one
    launch: each case's reports, one a rank."""
    tmp_path = tmp_path_factory.mktemp("skipped")
    files = tmp_path / "files.txt"
    files.write_text("\n".join(with_unreadable(data, tmp_path)) + "\n")
    run_ranks(3, "ddp_fill_worker.py", [files, "--cases", json.dumps(SKIPPED_CASES)], tmp_path,
              port_offset=7, timeout=300)
    ranks = [json.loads((tmp_path / f"report-{k}.json").read_text()) for k in range(3)]
    return {c["name"]: [r[c["name"]] for r in ranks] for c in SKIPPED_CASES}


@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_with_skipped_files_keep_in_step_with_fill_skipped(skipped_runs, drop_last):
    """Without ``fill_skipped`` the ranks end their epochs at different batch counts (what
    hangs DDP at the last step); with it, three ranks with an all-reduce after every batch
    all make ``len(loader)`` batches in each of two epochs and finish."""
    plain = skipped_runs[f"plain-{drop_last}"]
    counts = [r["batches"] for r in plain]
    assert len({tuple(c) for c in counts}) > 1, f"the case binds: batches per rank {counts}"
    # 9 or more: padding the shares to equal length may repeat an unreadable file.
    failed = [r["failures"] for r in plain]
    assert sum(f[0] for f in failed) >= 9, failed
    filled = skipped_runs[f"filled-{drop_last}"]
    for r in filled:
        assert r["batches"] == [r["len"]] * 2, filled
    assert len({r["len"] for r in filled}) == 1
    assert [r["failures"] for r in filled] == failed, "each skip counted once, none added"
    assert any(f > 0 for r in filled for f in r["filled"]), filled
    for r, p in zip(filled, plain):
        if p["batches"] == [p["len"]] * 2:
            assert r["filled"] == [0, 0], "a rank its skips did not cut short reads nothing again"


def test_ranks_with_skipped_files_keep_in_step_by_default(skipped_runs):
    """The loader's defaults under torchrun (world size 3): one unreadable file cannot leave
    the ranks at different step counts (an all-reduce after every batch; the plain run's
    ranks differ, see above), two epochs, items read again to make up the skips."""
    default = skipped_runs["default"]
    for r in default:
        assert r["batches"] == [r["len"]] * 2, default
    assert any(f > 0 for r in default for f in r["filled"]), default


def test_an_epochs_end_names_the_slowest_rank_and_its_bottleneck(data, tmp_path):
    """flowgate.report_ranks under torchrun (3 ranks, gloo): one all-gather of each rank's
    pace, and on rank 0 one line naming the rank slowed on purpose (its pictures saved 16 times
    larger, so each decode costs ~16 times more: a gap no scheduling noise on a 2-core machine
    running 3 ranks closes) and its decode stage."""
    from PIL import Image

    images = sorted((data / "images").glob("*.jpg"))
    (tmp_path / "large").mkdir()
    for p in images:
        with Image.open(p) as im:
            im.resize((im.width * 4, im.height * 4)).save(tmp_path / "large" / p.name, quality=90)
    files, large = tmp_path / "files.txt", tmp_path / "large.txt"
    files.write_text("\n".join(str(p) for p in images) + "\n")
    large.write_text("\n".join(str(tmp_path / "large" / p.name) for p in images) + "\n")
    run_ranks(3, "rank_report_worker.py", [files, large], tmp_path, port_offset=11)
    line = (tmp_path / "report.txt").read_text()
    assert "slowest rank 1 of 3" in line and "held back by the decode stage" in line, line
    # Without a process group it is a no-op.
    assert flowgate.report_ranks(flowgate.ImageLoader(str(files), batch_size=4)) is None
