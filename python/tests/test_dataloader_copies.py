"""flowgate.DataLoader's copies of the dataset: each thread calls its own (`copy.copy`, the
torch datasets it wraps too, as each torch worker has its own), made afresh each pass or kept
with `persistent_workers`, dropped or handed on when their thread ends; one that cannot be
copied is shared and said so."""

import os

import pytest

import flowgate

torch = pytest.importorskip("torch")
from torch.utils.data import DataLoader as TorchLoader  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from test_dataloader import Numbered, ids, same  # noqa: E402


class Records(Dataset):
    """The idiom for torch's workers: a file opened lazily by the first call, then `seek` and
    `read` of an item's record (not thread-safe on one handle)."""

    def __init__(self, path, n):
        self.path, self.n, self.f, self.opened = path, n, None, [0]

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        import time
        if self.f is None:
            self.f, self.opened[0] = open(self.path, "rb", buffering=0), self.opened[0] + 1
        self.f.seek(i * 64)
        time.sleep(0.0005)  # where another thread's seek lands
        return int.from_bytes(self.f.read(64)[:4], "little")


@pytest.mark.parametrize("wrap", ["subset", "random_split", "concat", "nested"])
def test_the_datasets_a_wrapper_holds_are_each_threads_own_too(wrap, tmp_path):
    """torch's wrappers (`Subset`, `random_split`, `ConcatDataset`) hold the dataset that
    opens its file: each thread has its own copy of it too, as each torch worker has, and a
    `collate_fn` that is the dataset's method runs on the thread's copy (a shallow
    copy of the wrapper shared the inner dataset's handle, 1,640 of 2,000 items another
    record's; 92 calls of one `collate` at once on 4 threads)."""
    import time
    from torch.utils.data import ConcatDataset, Subset, random_split

    path = tmp_path / "records.bin"
    n = 1001
    path.write_bytes(b"".join(i.to_bytes(4, "little") * 16 for i in range(n)))
    records = Records(path, n)
    if wrap == "subset":
        ds, want = Subset(records, range(3, n)), list(range(3, n))
    elif wrap == "random_split":
        ds = random_split(records, [0.7, 0.3], generator=torch.Generator().manual_seed(1))[0]
        want = list(ds.indices)
    elif wrap == "concat":
        half = Records(path, 500)
        ds, want = ConcatDataset([records, half]), list(range(n)) + list(range(500))
    else:
        ds = ConcatDataset([Subset(records, range(0, 400)), Subset(records, range(600, n))])
        want = list(range(0, 400)) + list(range(600, n))

    class Collating(Dataset):
        def __init__(self, inner):
            self.inner, self.busy, self.overlaps = inner, False, [0]

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner[i]

        def collate(self, items):
            self.overlaps[0] += self.busy
            self.busy = True
            time.sleep(0.001)
            self.busy = False
            return items

    outer = Collating(ds)
    loader = flowgate.DataLoader(outer, batch_size=7, num_workers=4, collate_fn=outer.collate)
    got = [i for b in loader for i in b]
    assert got == want, f"{sum(a != b for a, b in zip(got, want))} items another's"
    assert records.f is None, "the loader's own dataset is not called"
    assert outer.overlaps[0] == 0, "a thread's collate_fn runs on its own copy"


@pytest.mark.parametrize("workers", [0, 2, 8])
def test_each_thread_calls_its_own_copy_of_the_dataset_as_each_torch_worker(workers, tmp_path):
    # On one shared handle, 35 to 373 of 2,000 items held another record's bytes.
    path = tmp_path / "records.bin"
    # 603 records: not a multiple of the batch, the last batch short.
    path.write_bytes(b"".join(i.to_bytes(4, "little") * 16 for i in range(603)))
    ds = Records(path, 603)
    loader = flowgate.DataLoader(ds, batch_size=8, num_workers=workers)
    assert [i for b in loader for i in b.tolist()] == list(range(603))
    assert ds.f is None, "the loader's own dataset is not called"
    opened = ds.opened[0]
    # A copy a thread, not a call (76 batches): num_workers above the cores run on a pool
    # whose threads come and go (12 seen for 8 workers).
    assert 1 <= opened <= 3 * max(workers, len(os.sched_getaffinity(0))), opened
    # Copies are made afresh each pass (what the loop set on the dataset is seen), and kept
    # across passes with persistent_workers.
    ds.offset = 1

    class Shifted(Records):
        def __getitem__(self, i):
            return super().__getitem__(i) + getattr(self, "offset", 0)

    shifted = Shifted(path, 603)
    loader = flowgate.DataLoader(shifted, batch_size=8, num_workers=workers)
    assert next(iter(loader)).tolist()[0] == 0
    shifted.offset = 100
    assert next(iter(loader)).tolist()[0] == 100, "a new pass copies the dataset again"
    kept = Shifted(path, 603)
    loader = flowgate.DataLoader(kept, batch_size=8, num_workers=workers,
                                 persistent_workers=True)
    list(loader)
    kept.offset = 100
    # (A thread the tuner adds makes its copy now.)
    assert any(b.tolist()[0] < 100 for b in loader), "persistent: the threads' copies kept"


def test_the_copies_of_threads_that_ended_are_dropped_during_the_pass(monkeypatch):
    """More workers than cores run on a pool whose threads end after 10 s idle (a training
    step slower than that, the batches ahead already made): the threads that take over make
    copies of their own, and those of the threads gone are dropped, not kept to the pass's
    end (one more set of copies, each with its open files, every long step)."""
    import gc
    import time
    import weakref

    copies, late = weakref.WeakSet(), [False]

    class Tracked(Numbered):
        def __copy__(self):
            c = Tracked.__new__(Tracked)
            c.__dict__.update(self.__dict__, late=late[0])
            copies.add(c)
            return c

    # The blocking pool's idle threads end after 1 s here, not tokio's 10 s.
    monkeypatch.setenv("FLOWGATE_BLOCKING_KEEP_ALIVE_MS", "1000")
    workers = len(os.sched_getaffinity(0)) + 2
    # 401 items, batches of 2: the last one short.
    loader = flowgate.DataLoader(Tracked(401), batch_size=2, num_workers=workers,
                                 prefetch_factor=1)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    gc.collect()
    assert len(copies) >= 1
    late[0] = True
    time.sleep(3)  # the pool's threads end after 1 s idle (10 s by default)
    got += list(it)
    assert [i for b in ids(got) for i in b] == list(range(401))
    gc.collect()
    early = [c for c in copies if not c.late]
    assert not early, f"{len(early)} copies of threads that ended are kept"
    assert len(copies) >= 1, "the threads that took over have their copies"


@pytest.mark.parametrize("more", [False, True])
def test_persistent_workers_keep_their_copies_across_passes_left_early(more):
    """With persistent_workers a pass left early (a peek, a `break`) starts new threads, as
    do the pool's idle ends: each new thread takes a copy an ended one left, as torch's
    persistent workers keep their datasets (a file opened once stays open), so copies are
    made for the threads alive at once, not for every pass; a copy still serves one thread
    at a time."""
    import threading
    import time

    made, shared, lock = [], [], threading.Lock()

    class Counted(Numbered):
        def __copy__(self):
            c = Counted.__new__(Counted)
            c.__dict__.update(self.__dict__, busy=False)
            with lock:
                made.append(c)
            return c

        def __getitem__(self, i):
            if self.busy:
                shared.append(i)
            self.busy = True
            time.sleep(0.005)  # the GIL let go: another thread on this copy would see busy
            self.busy = False
            return super().__getitem__(i)

    cores = len(os.sched_getaffinity(0))
    workers = cores + 2 if more else cores
    # 103 items, batches of 4: the last one short.
    loader = flowgate.DataLoader(Counted(103), batch_size=4, num_workers=workers,
                                 persistent_workers=True)
    passes = 12
    for _ in range(passes):
        for _batch in loader:
            break
    assert [i for b in ids(loader) for i in b] == list(range(103))
    assert not shared, f"items {shared} ran on a copy another thread was in"
    # Threads alive at once: a pass's, and the last pass's still ending. (Each pass made
    # copies anew before: 21 for 2 workers, 31 for 4.)
    bound = 2 * workers + 2
    assert 1 <= len(made) <= bound, f"{len(made)} copies for {passes} passes of {workers}"


def test_a_dataset_that_cannot_be_copied_is_shared_by_the_threads_and_said_so():
    # A wrapper forwarding attributes with __getattr__ (copy.copy recurses) was
    # refused, where torch takes it.
    class Wrapper(Dataset):
        def __init__(self, inner):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def __len__(self):
            return len(self.inner)

        def __getitem__(self, i):
            return self.inner[i]

    with pytest.warns(UserWarning, match="cannot be copied for each thread .copy.copy raised "
                                         "RecursionError.*share it.*__copy__"):
        loader = flowgate.DataLoader(Wrapper(Numbered(10)), batch_size=4)
    assert same(list(loader), list(TorchLoader(Numbered(10), batch_size=4)))
    # Held by a Subset: the Subset is copied, the wrapper inside shared, and said so by name.
    from torch.utils.data import Subset
    with pytest.warns(UserWarning, match=r"dataset\.dataset cannot be copied for each thread"):
        loader = flowgate.DataLoader(Subset(Wrapper(Numbered(10)), range(10)), batch_size=4)
    assert same(list(loader), list(TorchLoader(Numbered(10), batch_size=4)))
