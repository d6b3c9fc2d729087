"""The loader where PyTorch code expects things: fork, DataLoader workers, pickling, set_epoch,
per-epoch failures, tensors out (Ctrl-C in a Python pipeline: test_process.py)."""

import pickle
import subprocess
import sys

import numpy as np
import pytest

import flowgate
from conftest import unreadable, with_unreadable
from test_process import run

# One decode worker: batches are made of the items in the epoch's order (with several, of
# whichever finish first).
ARGS = dict(batch_size=4, crop=32, resize=32, seed=3, return_paths=True, workers=1)


def paths_of(data):
    return [str(p) for p in sorted((data / "images").glob("*.jpg"))]


def batches(loader):
    """An epoch's batches as sorted tuples of paths (the shuffle decides what each batch
    holds; collate on two workers may swap whole batches)."""
    return sorted(tuple(ps) for _, ps in loader)


def test_a_fork_after_iterating_gives_the_child_its_own_batches(data, tmp_path):
    """The parent is mid-epoch (its threads busy, buffers pooled) when it forks: the child
    builds its own pipeline and reads the epoch the parent was in, within seconds."""
    r = run(f"""
        import os, signal, flowgate
        loader = flowgate.ImageLoader({str(data / "images.txt")!r}, batch_size=4, crop=32,
                                      resize=32, return_paths=True, seed=1)
        it = iter(loader)
        first = next(it)
        pid = os.fork()
        if pid == 0:
            signal.alarm(30)   # a hang ends the child with SIGALRM, not the test's timeout
            paths = [p for _, ps in loader for p in ps]
            print("child", len(paths), len(set(paths)), loader.epoch, flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        rest = [p for _, ps in it for p in ps]
        print("parent", len(first[1]) + len(rest), "status", status, flush=True)
    """, tmp_path, timeout=90)
    assert "child 40 40 1" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "parent 40 status 0" in r.stdout, r.stdout + r.stderr[-3000:]


def test_a_forked_child_frees_the_loader_it_inherited_without_waiting(data, tmp_path):
    """The parent's pipeline threads are running when it forks; the child frees its copy of
    the loader (``del``, or a name rebound to a new loader, as a DataLoader worker's dataset
    that builds its own loader does) and reads a loader of its own. Freeing the copy used to
    wait forever for the parent's threads."""
    r = run(f"""
        import gc, os, signal, flowgate
        def make():
            return flowgate.ImageLoader({str(data / "images.txt")!r}, batch_size=4, crop=32,
                                        resize=32, return_paths=True, seed=1)
        loader = make()
        it = iter(loader)
        first = next(it)
        for how in ("del", "rebind"):
            pid = os.fork()
            if pid == 0:
                signal.alarm(30)   # a hang ends the child with SIGALRM, not the test's timeout
                if how == "del":
                    del it, loader
                    gc.collect()
                    loader = make()
                else:
                    loader = make()   # the inherited loader freed here
                    del it
                    gc.collect()
                paths = [p for _, ps in loader for p in ps]
                print("child", how, len(paths), flush=True)
                os._exit(0)
            _, status = os.waitpid(pid, 0)
            print("status", how, status, flush=True)
        rest = [p for _, ps in it for p in ps]
        print("parent", len(first[1]) + len(rest), flush=True)
    """, tmp_path, timeout=90)
    for how in ("del", "rebind"):
        assert f"child {how} 40" in r.stdout, r.stdout + r.stderr[-3000:]
        assert f"status {how} 0" in r.stdout, r.stdout + r.stderr[-3000:]
    assert "parent 40" in r.stdout, r.stdout + r.stderr[-3000:]


def test_the_dataloader_route_reads_each_image_once(data, tmp_path):
    """DataLoader(loader, batch_size=None, num_workers=2): the workers split the files (with
    fork, and with spawn, which pickles the loader), each image once per epoch, batches of the
    type a loop without workers gets (a Batch)."""
    r = run(f"""
        import collections, torch, flowgate
        from torch.utils.data import DataLoader

        def epoch(loader, context):
            dl = DataLoader(loader, batch_size=None, num_workers=2,
                            multiprocessing_context=context)
            got = []
            for x, paths in dl:
                assert isinstance(x, flowgate.Batch) and x.shape[1:] == (3, 32, 32), x.shape
                assert x.shape[0] == len(paths)
                got += paths
            return got

        if __name__ == "__main__":
            files = sorted(open({str(data / "images.txt")!r}).read().split())
            loader = flowgate.ImageLoader(files, batch_size=4, crop=32, resize=32,
                                          return_paths=True, seed=2)
            assert isinstance(loader, torch.utils.data.IterableDataset)
            for context in ["fork", "spawn"]:
                for e in range(2):
                    loader.set_epoch(e)
                    got = epoch(loader, context)
                    twice = [p for p, n in collections.Counter(got).items() if n > 1]
                    print(context, e, len(got), sorted(got) == files, twice[:3], flush=True)
    """, tmp_path, timeout=240)
    for line in ["fork 0 40 True []", "fork 1 40 True []", "spawn 0 40 True []",
                 "spawn 1 40 True []"]:
        assert line in r.stdout, r.stdout + r.stderr[-3000:]


def test_dataloader_workers_split_a_rank_share_exactly_and_resume_a_rank_state(data, tmp_path):
    """41 files, 2 ranks, 3 DataLoader workers each, batches of 4 (nothing divides): each
    rank's workers deliver its share once (the one padded item is the ranks' padding, as
    DistributedSampler's, never a worker's); the training process refuses a state_dict it
    cannot know; a rank's own mid-epoch state, loaded before the workers start, gives them
    exactly the rest."""
    import shutil
    files = sorted(open(data / "images.txt").read().split())
    extra = tmp_path / "extra.jpg"
    shutil.copy(files[0], extra)
    files.append(str(extra))
    listing = tmp_path / "files.txt"
    listing.write_text("\n".join(files))
    r = run(f"""
        import collections, json, torch, flowgate
        from torch.utils.data import DataLoader

        def make(rank):
            return flowgate.ImageLoader({str(listing)!r}, batch_size=4, crop=32, resize=32,
                                        return_paths=True, seed=5, rank=rank, world_size=2)

        def through_workers(loader, context):
            dl = DataLoader(loader, batch_size=None, num_workers=3,
                            multiprocessing_context=context)
            return [p for _, paths in dl for p in paths]

        if __name__ == "__main__":
            for context in ["fork", "spawn"]:
                both = []
                for rank in range(2):
                    loader = make(rank)
                    got = through_workers(loader, context)
                    alone = [p for _, ps in make(rank) for p in ps]
                    twice = [p for p, n in collections.Counter(got).items() if n > 1]
                    print(context, "rank", rank, len(got), sorted(got) == sorted(alone),
                          twice, flush=True)
                    both += got
                    try:
                        loader.state_dict()
                        print(context, "state taken", flush=True)
                    except RuntimeError as e:
                        print(context, "refused", "num_workers=0" in str(e), flush=True)
                print(context, "world", len(both), len(set(both)), flush=True)
            # A rank's own state after 3 batches, resumed by workers.
            first = make(1)
            it = iter(first)
            seen = [p for _ in range(3) for p in next(it)[1]]
            state = json.loads(json.dumps(first.state_dict()))
            del it
            share = [p for _, ps in make(1) for p in ps]
            resumed = make(1)
            resumed.load_state_dict(state)
            rest = through_workers(resumed, "fork")
            print("resume", len(seen), len(rest), sorted(seen + rest) == sorted(share),
                  flush=True)
    """, tmp_path, timeout=300)
    out = r.stdout + r.stderr[-3000:]
    for context in ["fork", "spawn"]:
        for rank in range(2):
            assert f"{context} rank {rank} 21 True []" in r.stdout, out
        assert f"{context} refused True" in r.stdout, out
        assert f"{context} state taken" not in r.stdout, out
        assert f"{context} world 42 41" in r.stdout, out
    assert "resume 12 9 True" in r.stdout, out


def test_indexing_says_how_to_use_a_dataloader(data):
    loader = flowgate.ImageLoader(data / "images.txt", batch_size=4)
    with pytest.raises(TypeError, match=r"DataLoader\(loader, batch_size=None\)"):
        loader[0]


def test_errors_batches_and_loaders_pickle(data, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    with pytest.raises(flowgate.LoaderError) as e:
        list(flowgate.ImageLoader([str(bad)], skip_errors=False, crop=32, resize=32))
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is flowgate.LoaderError
    assert (back.stage, back.item, str(back)) == (e.value.stage, e.value.item, str(e.value))
    assert back.item == str(bad)

    loader = flowgate.ImageLoader(paths_of(data), **ARGS)
    batch, _ = next(iter(loader))
    again = pickle.loads(pickle.dumps(batch))
    assert np.array_equal(np.asarray(again), np.asarray(batch))

    epochs = [batches(loader) for _ in range(2)]  # epoch 0 (the peek cost none) and 1
    copy = pickle.loads(pickle.dumps(loader))
    assert copy.epoch == loader.epoch == 2
    assert batches(copy) == batches(loader)
    assert epochs[0] != epochs[1]


def test_set_epoch_gives_that_epochs_order_and_keeps_a_loaded_position(data):
    files = paths_of(data)
    reference = flowgate.ImageLoader(files, **ARGS)
    orders = [batches(reference) for _ in range(3)]

    loader = flowgate.ImageLoader(files, **ARGS)
    loader.set_epoch(2)
    assert loader.epoch == 2
    assert batches(loader) == orders[2]
    loader.set_epoch(1)  # back to an earlier epoch
    assert batches(loader) == orders[1]

    # A loop calling set_epoch(epoch) after load_state_dict keeps the loaded position.
    it = iter(loader)
    seen = [tuple(next(it)[1]) for _ in range(3)]
    state = loader.state_dict()
    resumed = flowgate.ImageLoader(files, **ARGS)
    resumed.load_state_dict(state)
    resumed.set_epoch(state["epoch"])
    rest = batches(resumed)
    assert sorted(seen + rest) == sorted(orders[2])
    assert len(rest) == len(orders[2]) - 3

    # Mid-epoch, set_epoch abandons the epoch being iterated.
    it = iter(loader)
    next(it)
    loader.set_epoch(0)
    assert batches(loader) == orders[0]
    with pytest.raises(ValueError, match="epoch"):
        loader.set_epoch(-1)
    # The last epoch the library takes, and past it (2**64 - 1 wrapped to epoch 0 before;
    # 2**64 was an OverflowError): the same words for both.
    loader.set_epoch(2**32)
    for bad in (2**32 + 1, 2**64 - 1, 2**64, 1.0):
        with pytest.raises(ValueError, match=r"^epoch: must be in 0\.\.=4294967296, not "):
            loader.set_epoch(bad)


def test_failures_are_per_epoch(data, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    loader = flowgate.ImageLoader(paths_of(data)[:7] + [str(bad)], batch_size=4, crop=32,
                                  resize=32)
    for _ in range(3):
        assert sum(len(b) for b in loader) == 7
        assert [item for _, item, _ in loader.failures()] == [str(bad)]
    assert [len(loader.failures(e)) for e in range(4)] == [1, 1, 1, 0]


def test_output_torch_and_numpy_and_the_attributes(data):
    torch = pytest.importorskip("torch")
    files = paths_of(data)
    x, _ = next(iter(flowgate.ImageLoader(files, output="torch", **ARGS)))
    assert isinstance(x, torch.Tensor) and tuple(x.shape) == (4, 3, 32, 32)
    y = next(iter(flowgate.ImageLoader(files, output="numpy", batch_size=4, crop=32,
                                       resize=32)))
    assert isinstance(y, np.ndarray) and y.shape == (4, 3, 32, 32) and y.dtype == np.uint8
    with pytest.raises(ValueError, match="output"):
        flowgate.ImageLoader(files, output="tensor")
    loader = flowgate.ImageLoader(files, batch_size=8)
    assert loader.batch_size == 8 and loader.dataset == files
    for bad in [((0.5, 0.5), (0.5, 0.5)), (0.5, 0.5), "imagenet"]:
        with pytest.raises(ValueError, match="normalize"):
            flowgate.ImageLoader(files, normalize=bad)
    with pytest.raises(ValueError, match="scale"):
        flowgate.ImageLoader(files, train=True, scale=0.5)


def test_worker_checkpoints_are_refused_in_the_process_whose_workers_read(data, tmp_path):
    """Whose DataLoader workers read a loader decides whose ``state_dict()`` is refused: a
    child process that trains through workers is refused, the parent that built the loader
    (and never used workers) is not; a copy is its own loader. ``drop_last=True`` through
    workers drops only the rank's last partial batch (13 items: 12 delivered); a loaded state no
    longer applies once ``set_epoch`` names another epoch, for workers as for the loader."""
    r = run(f"""
        import copy, glob, multiprocessing as mp, torch, flowgate
        from torch.utils.data import DataLoader
        paths = sorted(glob.glob({str(data / "images")!r} + "/*.jpg"))

        def mk(**kw):
            return flowgate.ImageLoader(paths, batch_size=4, resize=16, crop=16,
                                        return_paths=True, seed=7, **kw)

        def refused(loader):
            try:
                loader.state_dict()
                return False
            except RuntimeError:
                return True

        def train(loader, q):
            n = sum(len(b[-1]) for b in DataLoader(loader, batch_size=None, num_workers=2))
            q.put((n, refused(loader)))

        if __name__ == "__main__":
            loader = mk()
            for ctx in ("spawn", "fork"):
                q = mp.get_context(ctx).Queue()
                p = mp.get_context(ctx).Process(target=train, args=(loader, q))
                p.start(); n, r = q.get(timeout=120); p.join()
                print(ctx, "child", n, "refused" if r else "taken", flush=True)
            print("builder", "refused" if refused(loader) else "taken", flush=True)
            a = mk(); b = copy.deepcopy(a)
            for _ in DataLoader(a, batch_size=None, num_workers=2): pass
            for _ in b: pass
            print("copies", refused(a), refused(b), flush=True)
            got = list(DataLoader(mk(drop_last=True, rank=0, world_size=3), batch_size=None,
                                  num_workers=2))
            print("drop_last taken", sum(len(b[-1]) for b in got), flush=True)
            p = mk(); p.set_epoch(3); it = iter(p); next(it); next(it); st = p.state_dict()
            del it; p.close()
            w = mk(); w.load_state_dict(st); w.set_epoch(4); w.set_epoch(3)
            n = sum(len(x[-1]) for x in DataLoader(w, batch_size=None, num_workers=2))
            print("away and back", n, flush=True)
    """, tmp_path, timeout=300)
    out = r.stdout + r.stderr[-3000:]
    assert "spawn child 40 refused" in r.stdout, out
    assert "fork child 40 refused" in r.stdout, out
    assert "builder taken" in r.stdout, out
    assert "copies True False" in r.stdout, out
    assert "drop_last taken 12" in r.stdout, out
    assert "away and back 40" in r.stdout, out


def test_drop_last_through_dataloader_workers_gives_the_local_loaders_batches(data, tmp_path):
    """drop_last=True through DataLoader workers: each worker decodes whole batches (w, w+W,
    ...) of the rank's epoch, so the DataLoader yields the local loader's batches in its order,
    only the last partial batch dropped; with fork and spawn, 3 workers, 2 epochs, ranks whose
    shares do not divide by the batch size, and a state loaded in the parent."""
    r = run(f"""
        import numpy as np, torch, flowgate
        from torch.utils.data import DataLoader

        def mk(**kw):
            return flowgate.ImageLoader({str(data / "images.txt")!r}, batch_size=3, resize=16,
                                        crop=16, train=True, seed=5, return_paths=True,
                                        drop_last=True, **kw)

        def via(loader, ctx, persistent):
            dl = DataLoader(loader, batch_size=None, num_workers=3, multiprocessing_context=ctx,
                            persistent_workers=persistent)
            out = []
            for e in range(2):
                if not persistent:
                    loader.set_epoch(e)
                out.append([(np.asarray(x).tobytes(), tuple(p)) for x, p in dl])
            return out

        def local(loader):
            return [[(np.asarray(x).tobytes(), tuple(p)) for x, p in loader] for _ in range(2)]

        if __name__ == "__main__":
            for ctx in ("fork", "spawn"):
                for rank, world in ((0, 1), (1, 3)):
                    want = local(mk(rank=rank, world_size=world, output="torch"))
                    got = via(mk(rank=rank, world_size=world), ctx, False)
                    sizes = [len(b[1]) for b in got[0]]
                    print(ctx, rank, world, got == want, sizes, flush=True)
                got = via(mk(rank=0, world_size=1), ctx, True)
                same = got == local(mk(rank=0, world_size=1, output="torch"))
                print(ctx, "persistent", same, flush=True)
                l = mk(rank=0, world_size=1, output="torch")
                it = iter(l); head = [next(it) for _ in range(4)]; state = l.state_dict(); del it
                w = mk(rank=0, world_size=1); w.load_state_dict(state)
                rest = [tuple(p) for _, p in DataLoader(w, batch_size=None, num_workers=3,
                                                          multiprocessing_context=ctx)]
                full = [p for _, p in local(mk(rank=0, world_size=1, output="torch"))[0]]
                print(ctx, "resumed", [tuple(p) for _, p in head] + rest == full, flush=True)
    """, tmp_path, timeout=400)
    out = r.stdout + r.stderr[-3000:]
    for ctx in ("fork", "spawn"):
        assert f"{ctx} 0 1 True [3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3, 3]" in r.stdout, out
        assert f"{ctx} 1 3 True [3, 3, 3, 3]" in r.stdout, out
        assert f"{ctx} persistent True" in r.stdout, out
        assert f"{ctx} resumed True" in r.stdout, out


def test_fill_skipped_through_dataloader_workers_keeps_the_ranks_counts_equal(data, tmp_path):
    """Through ``DataLoader`` workers each worker makes up what its skips cost in its part of
    the rank's share, so the ranks' batch counts stay equal (they differ without it); with
    ``drop_last`` (workers decode whole batches of the rank's plan) a batch of only unreadable
    files is made up from one the worker delivered: every rank makes ``len(loader)``."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader
    files = with_unreadable(data, tmp_path)
    counts = {}
    for fill in (False, True):
        counts[fill] = []
        for rank in range(3):
            loader = flowgate.ImageLoader(files, batch_size=3, crop=16, resize=16, seed=2,
                                          rank=rank, world_size=3, fill_skipped=fill)
            dl = DataLoader(loader, batch_size=None, num_workers=2)
            counts[fill].append(sum(1 for _ in dl))
    assert len(set(counts[False])) > 1, counts   # the case binds
    assert len(set(counts[True])) == 1, counts
    # drop_last: the workers decode whole batches of the rank's plan, so a skipped item
    # leaves its batch short; a batch of only unreadable files is made up (25 files, 10
    # unreadable, 2 ranks).
    good, bad = paths_of(data), iter(unreadable(tmp_path / "more", 10))
    files = [next(bad) if i in {1, 4, 5, 9, 14, 18, 19, 22, 23, 24} else good[i]
             for i in range(25)]
    for fill in (False, True):
        counts[fill] = []
        for rank in range(2):
            loader = flowgate.ImageLoader(files, batch_size=3, crop=16, resize=16, seed=1,
                                          rank=rank, world_size=2, drop_last=True,
                                          fill_skipped=fill)
            dl = DataLoader(loader, batch_size=None, num_workers=2)
            counts[fill].append((sum(1 for _ in dl), len(loader)))
    assert all(n <= m for n, m in counts[False]), counts
    assert all(n == m for n, m in counts[True]), counts
    # Each worker's part holds fewer readable files than a batch while the
    # rank has plenty (with drop_last a worker used to drop its short batch: 0 batches).
    files = list(paths_of(data)[:32])
    bad = iter(unreadable(tmp_path / "few", 2))
    files[1], files[17] = next(bad), next(bad)
    for workers in (2, 3):
        loader = flowgate.ImageLoader(files, batch_size=8, crop=16, resize=16, shuffle=False,
                                      drop_last=True, rank=1, world_size=2)
        got = sum(1 for _ in DataLoader(loader, batch_size=None, num_workers=workers))
        assert got == len(loader) == 2, (workers, got)


def test_a_fill_skipped_state_resumed_through_dataloader_workers_owes_the_ranks_rest(
        data, tmp_path):
    """Each rank's state after k batches (of a loop without workers), loaded into a loader read
    through 3 ``DataLoader`` workers: every rank makes ``len(loader) - k`` batches, the local
    loader's own (with ``drop_last`` up to a short batch the rank would drop and make up;
    the counts used to differ across ranks)."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader
    good, bad = paths_of(data), iter(unreadable(tmp_path, 10))
    files = [next(bad) if i in {1, 4, 5, 9, 14, 18, 19, 22, 23, 24} else good[i]
             for i in range(27)]
    for drop_last in (False, True):
        args = dict(batch_size=3, crop=16, resize=16, seed=3, world_size=2, drop_last=drop_last,
                    fill_skipped=True, return_paths=True)
        n = len(flowgate.ImageLoader(files, rank=0, **args))
        for k in range(1, n + 1):
            counts = []
            for rank in range(2):
                local = flowgate.ImageLoader(files, rank=rank, **args)
                whole = [list(p) for _, p in local]
                local = flowgate.ImageLoader(files, rank=rank, **args)
                it = iter(local)
                for _ in range(k):
                    next(it)
                state = local.state_dict()
                del it
                resumed = flowgate.ImageLoader(files, rank=rank, **args)
                resumed.load_state_dict(state)
                got = [list(p) for _, p in DataLoader(resumed, batch_size=None, num_workers=3)]
                counts.append(len(got))
                # The local loader's rest; with drop_last up to its first short batch (a
                # worker keeps a short batch where the rank drops it and makes a whole one up).
                whole_ones = next((i for i, b in enumerate(got) if len(b) < 3), len(got))
                upto = len(got) if not drop_last else whole_ones
                assert got[:upto] == whole[k:k + upto], f"rank {rank}, k {k}"
            assert counts == [n - k] * 2, f"drop_last {drop_last}, k {k}: {counts}"


def test_merged_states_whose_rest_is_unreadable_resume_to_no_batches(data, tmp_path):
    """States taken at each rank's last batch, merged (as a job saves them) and resumed: the
    epoch's rest holds only unreadable files, so no batches and no error (the epoch delivered
    before the checkpoint), as each rank's own state resumes; then the next epoch whole."""
    files = paths_of(data)[:10] + unreadable(tmp_path, 2)
    for fill in (False, True):
        args = dict(batch_size=2, shuffle=False, crop=16, resize=16, world_size=2,
                    fill_skipped=fill)
        states = []
        for rank in range(2):
            loader = flowgate.ImageLoader(files, rank=rank, **args)
            for k, _ in enumerate(loader, 1):
                if k == len(loader):
                    states.append(loader.state_dict())
        merged = flowgate.merge_state_dicts(states)
        for rank in range(2):
            loader = flowgate.ImageLoader(files, rank=rank, **args)
            loader.load_state_dict(merged)
            assert sum(1 for _ in loader) == 0, f"fill {fill}, rank {rank}"
            assert sum(1 for _ in loader) == len(loader)


def test_dataloader_workers_deliver_len_batches_of_the_same_type(data):
    """Through DataLoader workers the batches are the local loader's (in order, the same type
    as without workers) and as many as len(): workers read whole batches of the rank's epoch,
    for counts no worker count divides, both drop_last settings."""
    torch = pytest.importorskip("torch")
    from torch.utils.data import DataLoader
    files = paths_of(data)[:37]
    for drop_last in (False, True):
        for workers in (2, 3, 5):
            args = dict(batch_size=4, crop=16, resize=16, seed=2, drop_last=drop_last,
                        return_paths=True)
            local = [(type(b), list(p)) for b, p in flowgate.ImageLoader(files, **args)]
            loader = flowgate.ImageLoader(files, **args)
            got = [(type(b), list(p)) for b, p in
                   DataLoader(loader, batch_size=None, num_workers=workers)]
            what = f"drop_last {drop_last}, {workers} workers"
            assert len(got) == len(loader) == len(local), what
            assert got == local, what
            assert all(t is flowgate.Batch for t, _ in got), what
            torch_loader = flowgate.ImageLoader(files, output="torch", **args)
            assert all(isinstance(b, torch.Tensor) for b, _ in
                       DataLoader(torch_loader, batch_size=None, num_workers=workers))


def test_a_worker_that_cannot_write_its_marker_makes_the_training_process_refuse_state(data):
    """The marker tells the training process that workers read the loader (so its own
    state_dict would lose their progress). A worker that cannot write it fails the loop, and
    the training process then refuses state_dict() as if the marker were there."""
    pytest.importorskip("torch")
    from torch.utils.data import DataLoader
    loader = flowgate.ImageLoader(paths_of(data)[:8], batch_size=4, crop=16, resize=16)
    loader._marker.path = "/nonexistent-flowgate-dir/marker"  # unwritable, even for root
    assert loader.state_dict() is not None  # nothing read by workers yet
    with pytest.raises(Exception, match="cannot write its marker file"):
        list(DataLoader(loader, batch_size=None, num_workers=2,
                        multiprocessing_context="fork"))
    with pytest.raises(RuntimeError, match="DataLoader worker processes"):
        loader.state_dict()


def test_stats_from_another_thread_while_the_first_iter_imports_torch(data):
    """``output="torch"`` with torch not imported yet: the first ``iter()`` imports it while
    another thread polls ``stats()``, which asks whether this process is a DataLoader worker.
    A half-imported ``torch.utils.data`` must read as "no worker", not raise (it raised
    AttributeError on its ``get_worker_info``, 3 runs of 3). In a fresh interpreter."""
    code = f"""
import threading, time, flowgate
paths = open({str(data / "images.txt")!r}).read().split()
loader = flowgate.ImageLoader(paths, batch_size=2, resize=32, crop=32, workers=2, output="torch")
errors, stop = [], False
def poll():
    while not stop:
        try:
            loader.stats()
        except Exception as e:
            errors.append(repr(e))
            return
threading.Thread(target=poll, daemon=True).start()
time.sleep(0.05)
n = sum(1 for _ in loader)
stop = True
print("batches", n, "errors", errors[:1] or "none")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "batches 20 errors none" in r.stdout, r.stdout + r.stderr[-2000:]
