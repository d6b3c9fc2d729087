"""flowgate.DataLoader against torch.utils.data.DataLoader: the same batches, len(), exact
resume, ranks with equal counts, and a torchvision-style dataset of JPEGs decoded with PIL
(each thread's copy of the dataset: test_dataloader_copies.py; the failure policy:
test_dataloader_failures.py; passes and the process's exit: test_dataloader_lifecycle.py)."""

import json
import os

import pytest
from test_fields import jpeg

import flowgate

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402


class Numbered(Dataset):
    """Item i: a tensor, an int and a string, all naming i; `bad` indices raise."""

    def __init__(self, n, bad=()):
        self.n, self.bad = n, set(bad)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        if i in self.bad:
            raise OSError(f"item {i} is unreadable")
        return {"x": torch.tensor([i, 2 * i]), "label": i % 3, "name": f"item{i}"}


class Batched(Numbered):
    """With __getitems__ (a batch's indices at once), as torch's newer datasets have."""

    def __init__(self, n):
        super().__init__(n)
        self.calls = [0]  # shared by the threads' copies of the dataset

    def __getitems__(self, indices):
        self.calls[0] += 1
        return [self[i] for i in indices]


def ids(batches):
    return [b["x"][:, 0].tolist() for b in batches]


def same(a, b):
    return (len(a) == len(b) and all(
        torch.equal(x["x"], y["x"]) and torch.equal(x["label"], y["label"])
        and x["name"] == y["name"] for x, y in zip(a, b)))


@pytest.mark.parametrize("batch_size", [1, 4, 5, 23, 30])
@pytest.mark.parametrize("drop_last", [False, True])
def test_the_same_batches_and_len_as_torch(batch_size, drop_last):
    ds = Numbered(23)
    want = list(TorchLoader(ds, batch_size=batch_size, drop_last=drop_last))
    loader = flowgate.DataLoader(ds, batch_size=batch_size, drop_last=drop_last, num_workers=3)
    got = list(loader)
    assert len(loader) == len(TorchLoader(ds, batch_size=batch_size, drop_last=drop_last))
    assert len(got) == len(loader)
    assert same(want, got)
    assert same(got, list(loader)), "a second pass, unshuffled, is the same"


def test_batch_size_none_converts_items_as_torch_does():
    ds = Numbered(7)
    want = list(TorchLoader(ds, batch_size=None))
    loader = flowgate.DataLoader(ds, batch_size=None)
    got = list(loader)
    assert len(loader) == 7 and len(got) == 7
    assert all(torch.equal(a["x"], b["x"]) and a["name"] == b["name"] for a, b in zip(want, got))


def test_getitems_fetches_a_batch_at_once_with_the_same_batches():
    ds = Batched(23)
    got = list(flowgate.DataLoader(ds, batch_size=4))
    assert same(list(TorchLoader(Numbered(23), batch_size=4)), got)
    assert ds.calls == [6]


def test_a_users_collate_fn_makes_the_batches():
    def collate(items):
        return sorted(it["name"] for it in items)

    got = list(flowgate.DataLoader(Numbered(10), batch_size=3, collate_fn=collate))
    assert got == list(TorchLoader(Numbered(10), batch_size=3, collate_fn=collate))


def test_shuffled_epochs_are_permutations_fixed_by_seed_and_epoch():
    ds = Numbered(23)
    loader = flowgate.DataLoader(ds, batch_size=4, shuffle=True, seed=5)
    epochs = [sum(ids(loader), []) for _ in range(3)]
    for e in epochs:
        assert sorted(e) == list(range(23)), "every item once"
    assert epochs[0] != epochs[1] != epochs[2], "each pass a new order"
    again = flowgate.DataLoader(ds, batch_size=4, shuffle=True, seed=5)
    again.set_epoch(1)
    assert sum(ids(again), []) == epochs[1], "set_epoch names the order"
    other = flowgate.DataLoader(ds, batch_size=4, shuffle=True, seed=6)
    assert sum(ids(other), []) != epochs[0]
    gen = torch.Generator().manual_seed(5)
    assert sum(ids(flowgate.DataLoader(ds, batch_size=4, shuffle=True, generator=gen)), []) \
        == epochs[0], "a generator's seed is the seed"


@pytest.mark.parametrize("drop_last", [False, True])
def test_a_checkpoint_at_every_batch_resumes_exactly(drop_last):
    ds = Numbered(23)
    args = dict(batch_size=4, shuffle=True, seed=3, drop_last=drop_last)
    whole = flowgate.DataLoader(ds, **args)
    whole.set_epoch(2)
    want = ids(whole)
    for k in range(len(want) + 1):
        loader = flowgate.DataLoader(ds, **args)
        loader.set_epoch(2)
        it = iter(loader)
        head = [next(it)["x"][:, 0].tolist() for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        resumed = flowgate.DataLoader(ds, **args)
        resumed.load_state_dict(state)
        resumed.set_epoch(2)  # at each epoch's start, as with DistributedSampler: kept
        assert head + ids(resumed) == want, f"resumed after {k} batches"
    # After the epoch's end the checkpoint names the next epoch, from its start.
    done = flowgate.DataLoader(ds, **args)
    done.set_epoch(2)
    list(done)
    resumed = flowgate.DataLoader(ds, **args)
    resumed.load_state_dict(done.state_dict())
    nxt = flowgate.DataLoader(ds, **args)
    nxt.set_epoch(3)
    assert ids(resumed) == ids(nxt)


def test_a_checkpoint_of_another_loader_is_refused():
    state = flowgate.DataLoader(Numbered(23), batch_size=4, shuffle=True, seed=3).state_dict()
    with pytest.raises(flowgate.LoaderError, match="shuffle_seed"):
        flowgate.DataLoader(Numbered(23), batch_size=4, shuffle=True, seed=4).load_state_dict(state)
    # Batches of another size, or drop_last changed, as a loader's (they were taken, and len()
    # then said 8 where 6 came).
    with pytest.raises(flowgate.LoaderError, match="batch_size = 4, this pipeline has "
                                                   "batch_size = 5"):
        flowgate.DataLoader(Numbered(23), batch_size=5, shuffle=True, seed=3).load_state_dict(
            json.loads(json.dumps(state)))
    with pytest.raises(flowgate.LoaderError, match="drop_last = false"):
        flowgate.DataLoader(Numbered(23), batch_size=4, shuffle=True, seed=3,
                            drop_last=True).load_state_dict(state)
    # A state without batching (from before it was recorded): taken.
    old = json.loads(json.dumps(state))
    del old["fingerprint"]["batch_size"], old["fingerprint"]["drop_last"]
    loader = flowgate.DataLoader(Numbered(23), batch_size=4, shuffle=True, seed=3)
    loader.load_state_dict(old)
    assert len(list(loader)) == 6


@pytest.mark.parametrize("n,world,batch", [(10, 3, 2), (23, 4, 5), (2, 3, 1)])
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_read_equal_shares_of_the_epoch(n, world, batch, drop_last):
    seen, lens = [], []
    for rank in range(world):
        loader = flowgate.DataLoader(Numbered(n), batch_size=batch, shuffle=True, seed=1,
                                     rank=rank, world_size=world, drop_last=drop_last)
        got = sum(ids(loader), [])
        assert len(list(loader)) == len(loader)
        lens.append(len(loader))
        seen += got
    assert len(set(lens)) == 1, f"every rank as many batches: {lens}"
    if drop_last:
        assert len(seen) == len(set(seen)), "nothing read twice"
        assert len(seen) >= (n // world) * world - (batch - 1) * world
    else:
        assert set(seen) == set(range(n)), "every item read"
        share = -(-n // world)
        assert lens[0] == -(-share // batch)


def test_ranks_come_from_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    loader = flowgate.DataLoader(Numbered(9), batch_size=2)
    mine = sum(ids(loader), [])
    monkeypatch.setenv("RANK", "0")
    other = sum(ids(flowgate.DataLoader(Numbered(9), batch_size=2)), [])
    assert len(mine) == len(other) == 5 and set(mine) | set(other) == set(range(9))
    # Out of range: refused when built, as the loaders refuse it (a ValueError, same words).
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="RANK=2 with WORLD_SIZE=2: RANK must be in") as e:
        flowgate.DataLoader(Numbered(9), batch_size=2)
    (tmp_path / "a.jpg").write_bytes(jpeg(1))
    with pytest.raises(ValueError) as l:
        flowgate.ImageLoader(str(tmp_path), batch_size=2)
    assert str(l.value) == str(e.value)


def test_what_it_cannot_do_is_refused_at_once():
    ds = Numbered(4)
    for kw in (dict(sampler=range(4)), dict(batch_sampler=[[0, 1]]),
               dict(worker_init_fn=lambda i: None), dict(timeout=5)):
        with pytest.raises(ValueError, match=f"takes no {next(iter(kw))}"):
            flowgate.DataLoader(ds, **kw)
    with pytest.raises(TypeError, match="map-style"):
        flowgate.DataLoader(iter(range(3)))

    # One with a __len__ was built (torch's Dataset has a __getitem__ that raises).
    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

        def __len__(self):
            return 3

    with pytest.raises(TypeError, match="map-style dataset .__getitem__ and __len__., not Stream"):
        flowgate.DataLoader(Stream())
    # As torch (it was accepted and drop_last ignored).
    with pytest.raises(ValueError, match="mutually exclusive with drop_last"):
        TorchLoader(ds, batch_size=None, drop_last=True)
    with pytest.raises(ValueError, match="mutually exclusive with drop_last"):
        flowgate.DataLoader(ds, batch_size=None, drop_last=True)
    with pytest.raises(ValueError, match="batch_size"):
        flowgate.DataLoader(ds, batch_size=0)
    for bad in (-1, 1025, 2**63, True, 2.0):
        with pytest.raises(ValueError, match=r"^num_workers: must be in 0\.\.=1024, not "):
            flowgate.DataLoader(ds, num_workers=bad)


def test_stats_say_whether_the_gil_holds_the_threads_back():
    class Busy(Numbered):
        def __getitem__(self, i):
            x = 0
            for k in range(20000):  # pure Python: holds the GIL throughout
                x += k
            return super().__getitem__(i)

    loader = flowgate.DataLoader(Busy(64), batch_size=8, num_workers=4)
    assert len(list(loader)) == 8
    s = loader.stats()
    gil = s["gil"]
    assert gil["call_s"] > 0 and 0 <= gil["wait_fraction"] <= 1
    assert gil["cpu_s"] <= gil["call_s"] * 1.05 + 0.01
    # Pure Python holds the GIL: however many threads are busy, about one core is used.
    assert gil["cores_used"] <= 1.15, gil
    assert s["gil_bound"] == (gil["threads_busy"] >= 1.5 and gil["cores_used"] < 1.25)
    assert "fetch" in s["stages"]


def test_a_torchvision_dataset_of_jpegs_gives_torchs_tensors(data):
    pytest.importorskip("torchvision")
    from PIL import Image
    from torchvision import transforms

    paths = sorted((data / "images").glob("*.jpg"))

    class Photos(Dataset):
        tf = transforms.Compose([transforms.Resize(72), transforms.CenterCrop(64),
                                 transforms.ToTensor(),
                                 transforms.Normalize([0.5] * 3, [0.25] * 3)])

        def __len__(self):
            return len(paths)

        def __getitem__(self, i):
            with Image.open(paths[i]) as im:
                return self.tf(im.convert("RGB")), i % 5

    want = list(TorchLoader(Photos(), batch_size=6))
    loader = flowgate.DataLoader(Photos(), batch_size=6, num_workers=2)
    got = list(loader)
    assert len(got) == len(loader) == len(want) == 7
    for (wx, wy), (gx, gy) in zip(want, got):
        assert torch.equal(wx, gx) and torch.equal(wy, gy)


@pytest.mark.parametrize("n,world,batch,bad,unbatchable", [
    (10, 3, 2, "", ""), (7, 2, 3, "", ""), (13, 3, 2, "1,2,8", ""), (13, 3, 2, "", "5")])
def test_under_torchrun_every_rank_steps_as_often_and_the_epoch_is_covered(
        n, world, batch, bad, unbatchable, tmp_path):
    """With unreadable items skipped (`bad`), ranks still step together: a batch keeps its
    place less its failed items, so no rank runs short and hangs the others' all-reduce. A
    batch `collate_fn` fails (`unbatchable`) is made up (it was lost: that rank ran short)."""
    import os
    import pathlib
    import subprocess
    import sys
    worker = pathlib.Path(__file__).with_name("dataloader_ddp_worker.py")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        env.pop(k, None)
    out = tmp_path / "report.json"
    r = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={world}",
         "--master_port", str(30500 + (os.getpid() + n) % 1000), str(worker), str(n),
         str(batch), "2", str(out), bad, unbatchable],
        env=env, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    ranks = json.loads(out.read_text())
    share = -(-n // world)
    for rep in ranks:
        assert rep["len"] == -(-share // batch) and rep["steps"] == [rep["len"]] * 2
    skipped = {int(i) for i in bad.split(",") if i}
    if unbatchable:
        assert all(int(unbatchable) not in rep["read"][e] for rep in ranks for e in range(2))
        return
    for epoch in range(2):
        read = [i for rep in ranks for i in rep["read"][epoch]]
        assert set(read) == set(range(n)) - skipped, f"epoch {epoch}: every readable item"
        if not skipped:
            assert len(read) == share * world, "shares padded to equal lengths"
    assert ranks[0]["read"][0] != ranks[0]["read"][1], "a new order each epoch"


def test_none_is_an_item_or_a_batch_like_any_other():
    class Holes(Numbered):
        def __getitem__(self, i):
            return None if i == 2 else i

    assert list(flowgate.DataLoader(Holes(5), batch_size=None)) == \
        list(TorchLoader(Holes(5), batch_size=None))
    drop = flowgate.DataLoader(list(range(10)), batch_size=2,
                               collate_fn=lambda b: None if 4 in b else b)
    assert list(drop) == [[0, 1], [2, 3], None, [6, 7], [8, 9]]
    assert list(flowgate.Pipeline(lambda epoch: [1, None, 3])) == [1, None, 3]


def test_a_dataset_past_the_epoch_limit_is_refused_not_an_abort():
    class Huge:
        def __len__(self):
            return 10**12

        def __getitem__(self, i):
            return i

    with pytest.raises(ValueError, match="at most"):
        flowgate.DataLoader(Huge(), batch_size=4)


def test_torchs_attributes_and_the_samplers_set_epoch():
    loader = flowgate.DataLoader(Numbered(10), batch_size=3, shuffle=True, num_workers=2,
                                 rank=0, world_size=2)
    assert loader.num_workers == 2 and loader.batch_size == 3 and loader.batch_sampler is None
    assert len(loader.sampler) == 5
    loader.sampler.set_epoch(3)
    same = flowgate.DataLoader(Numbered(10), batch_size=3, shuffle=True, rank=0, world_size=2)
    same.set_epoch(3)
    assert ids(loader) == ids(same)
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-1)
    # What it was built from, as torch's (a dataset set anew was read at the old
    # length); copies refused (a copy shared the pipeline of a loader that may be freed).
    for name in ("dataset", "batch_size", "drop_last", "persistent_workers"):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
            setattr(loader, name, None)
    assert loader.dataset.n == 10
    loader.collate_fn = torch.utils.data.default_collate  # as torch's: taken
    import copy
    for f in (copy.copy, copy.deepcopy):
        with pytest.raises(TypeError, match="does not copy"):
            f(loader)


@pytest.mark.skipif(torch.cuda.is_available(), reason="batches are pinned with CUDA")
def test_pin_memory_without_cuda_says_so_once():
    """pin_memory=True where there is no CUDA device: the batches come as without it, and the
    loader says so at its first iter(), once (it was silent before)."""
    import warnings
    loader = flowgate.DataLoader(Numbered(10), batch_size=4, pin_memory=True)
    with pytest.warns(UserWarning, match="pin_memory=True, but no CUDA device"):
        first = ids(loader)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert ids(loader) == first == ids(flowgate.DataLoader(Numbered(10), batch_size=4))
    assert loader.pin_memory is True


@pytest.mark.parametrize("ranks", [None, "cores"])
def test_more_workers_than_cores_make_that_many_batches_at_once(ranks, monkeypatch):
    """A dataset that waits (a network read) with num_workers above the cores: batches are
    made that many at once, as by torch's workers, not held to the cores. The cores are the
    process's share of the node (`LOCAL_WORLD_SIZE` ranks: the affinity mask was read)."""
    import os
    import threading
    import time

    class Waits(Numbered):
        def __init__(self, n):
            super().__init__(n)
            # Shared by the threads' copies of the dataset.
            self.lock, self.count = threading.Lock(), {"now": 0, "most": 0}

        def __getitem__(self, i):
            with self.lock:
                self.count["now"] += 1
                self.count["most"] = max(self.count["most"], self.count["now"])
            time.sleep(0.05)
            with self.lock:
                self.count["now"] -= 1
            return super().__getitem__(i)

    cores = len(os.sched_getaffinity(0))
    workers = cores + 4
    if ranks:
        # As many ranks on the node as cores: one core each.
        monkeypatch.setenv("LOCAL_WORLD_SIZE", str(cores))
        workers = max(2, cores)
    ds = Waits(96)
    loader = flowgate.DataLoader(ds, batch_size=2, num_workers=workers)
    assert same(list(TorchLoader(Numbered(96), batch_size=2)), list(loader))
    most = ds.count["most"]
    assert most >= workers - 2, f"at most {most} calls at once of {workers} workers"
    assert loader.stats()["stages"]["fetch"]["workers"] == workers


@pytest.mark.parametrize("factor", [None, 1, 3])
def test_batches_made_ahead_of_a_slow_loop_are_bounded_by_prefetch_factor(factor):
    # 256 batches were made ahead whatever their size (1 GiB of 4 MiB items); as
    # torch's, the bound is prefetch_factor (default 2) per worker: that many waiting in the
    # stage and for the loop, besides one in each worker's hand.
    import time
    made = [0]

    class Counted(Numbered):
        def __getitem__(self, i):
            made[0] += 1
            return super().__getitem__(i)

    workers = 2
    loader = flowgate.DataLoader(Counted(400), batch_size=1, num_workers=workers,
                                 prefetch_factor=factor)
    ahead = 0
    for k, _ in enumerate(loader):
        time.sleep(0.01)
        ahead = max(ahead, made[0] - (k + 1))
        if k == 60:
            break
    most = 2 * (factor or 2) * workers + workers
    assert 0 < ahead <= most, (ahead, most)
    with pytest.raises(ValueError, match=r"^prefetch_factor: must be in 1\.\.=1024, not 0$"):
        flowgate.DataLoader(Counted(4), num_workers=2, prefetch_factor=0)


def test_ranks_come_from_a_process_group_started_by_spawn(data, tmp_path):
    # torch.multiprocessing.spawn sets no RANK/WORLD_SIZE: every rank read the whole dataset
    # (three times the epoch across 3 ranks, silently). Now the initialized
    # process group's rank and world size, for DataLoader, the loaders and their workers.
    import pathlib
    import subprocess
    import sys
    worker = pathlib.Path(__file__).with_name("spawn_ddp_worker.py")
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    env["OMP_NUM_THREADS"] = "1"
    init = f"file://{tmp_path / 'rendezvous'}"
    r = subprocess.run([sys.executable, str(worker), "3", init, str(data / "images.txt"),
                        str(tmp_path)], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-5000:]
    reps = [json.loads((tmp_path / f"rank{k}.json").read_text()) for k in range(3)]
    # 11 items over 3 ranks: shares of 4, padded by the epoch's start as DistributedSampler.
    items = [i for rep in reps for i in rep["items"]]
    assert set(items) == set(range(11)) and all(len(rep["items"]) == 4 for rep in reps)
    assert len(items) - len(set(items)) == 1 and all(rep["len"] == 2 for rep in reps)
    n = len((data / "images.txt").read_text().split())
    paths = [p for rep in reps for p in rep["paths"]]
    assert len(set(paths)) == n and len(paths) == 3 * -(-n // 3), "shares of the images"
    assert all(rep["worker_paths"] == rep["paths"] for rep in reps)
