"""flowgate.DataLoader's failure policy: an item whose __getitem__ raises is named (fatal by
default) or, with skip_errors, left out of its batch and counted, the batch keeping its place;
a batch of only failures left out in one process (no item twice in an epoch) and made up of
the readable items after it in the rank's own share under a world size above 1, where every
rank still makes len() batches; a batch whose __getitems__ raises read item by item, one whose collate_fn raises cut
to the items that collate; a resume makes the same batches; the skips are said (a
SkippedItemsWarning at the first, and a count at the epoch's end)."""

import json
import os

import pytest

import flowgate
from conftest import run_clean

torch = pytest.importorskip("torch")
from torch.utils.data import Dataset  # noqa: E402

from test_dataloader import Numbered, ids  # noqa: E402


def test_a_failing_item_raises_naming_it_or_is_skipped_and_counted():
    ds = Numbered(12, bad={3, 7})
    with pytest.raises(flowgate.LoaderError, match="item 3 is unreadable") as e:
        list(flowgate.DataLoader(ds, batch_size=4))
    # The dataset's own exception is the cause, its traceback into __getitem__ kept.
    assert isinstance(e.value.__cause__, OSError) and e.value.item == "item 3"
    assert "__getitem__" in "".join(__import__("traceback").format_tb(
        e.value.__cause__.__traceback__))
    loader = flowgate.DataLoader(ds, batch_size=4, skip_errors=True)
    got = ids(loader)
    # Each batch keeps its place (its positions less the failed ones): a rank with unreadable
    # items makes len() batches, as DDP needs.
    assert got == [[0, 1, 2], [4, 5, 6], [8, 9, 10, 11]]
    assert len(got) == len(loader)
    assert loader.stats()["failures"] == 2
    # In one process a batch whose every item fails is left out: no item comes twice.
    loader = flowgate.DataLoader(Numbered(10, bad={4, 5, 6, 7, 8}), batch_size=4,
                                 skip_errors=True)
    assert ids(loader) == [[0, 1, 2, 3], [9]]
    assert loader.stats()["failures"] == 5 and loader.stats()["filled"] == 0
    # Under a world size above 1 it is made up of the readable items after it in the rank's
    # own share (its order of the epoch, wrapping), the same on every pass: the rank still
    # makes len() batches, and never reads another rank's items (rank 1 would deliver the
    # same ones in the same step). Rank 0 of 2 reads 0, 2, 4, ...
    bad = {4, 6, 10, 12, 14, 16, 18}
    loader = flowgate.DataLoader(Numbered(20, bad=bad), batch_size=2, skip_errors=True,
                                 rank=0, world_size=2)
    made_up = [[0, 2], [8, 0], [8], [0, 2], [0, 2]]
    assert ids(loader) == made_up and len(loader) == 5
    assert loader.stats()["failures"] == 7, "each unreadable item once, not its fillers'"
    assert loader.stats()["filled"] == 6
    assert ids(loader) == made_up
    with pytest.raises(flowgate.LoaderError, match="item 4 is unreadable"):
        list(flowgate.DataLoader(Numbered(8, bad={4, 5, 6, 7}), batch_size=4))


def test_a_waiting_dataset_with_more_workers_than_cores_skips_and_exits_cleanly():
    """num_workers above the cores (calls on blocking threads): a failed item is left out of
    its batch and counted, as on the tuned threads (it failed the whole batch before), and
    the process exits while calls are still asleep."""
    import os
    import time

    class Waits(Numbered):
        def __getitem__(self, i):
            time.sleep(0.01)
            return super().__getitem__(i)

    workers = len(os.sched_getaffinity(0)) + 3
    loader = flowgate.DataLoader(Waits(20, bad={3, 9, 10}), batch_size=4, num_workers=workers,
                                 skip_errors=True)
    assert ids(loader) == [[0, 1, 2], [4, 5, 6, 7], [8, 11], [12, 13, 14, 15],
                           [16, 17, 18, 19]]
    assert loader.stats()["failures"] == 3
    with pytest.raises(flowgate.LoaderError, match="item 9 is unreadable") as e:
        list(flowgate.DataLoader(Waits(20, bad={9}), batch_size=4, num_workers=workers))
    assert isinstance(e.value.__cause__, OSError)
    run_clean("import os, time, flowgate\n"
         "class DS:\n"
         "    def __len__(s): return 10**5\n"
         "    def __getitem__(s, i):\n"
         "        time.sleep(0.3)\n"
         "        return i\n"
         f"it = iter(flowgate.DataLoader(DS(), batch_size=2, num_workers={workers}))\n"
         "print(next(it))\n", times=3)


@pytest.mark.parametrize("batch_size", [None, 1, 3])
def test_an_epoch_whose_every_item_fails_raises_with_skip_errors(batch_size):
    """Skipping unreadable items is not an empty epoch when none is readable (a wrong path,
    a broken decoder): the epoch's end raises, as a library loader's does."""
    loader = flowgate.DataLoader(Numbered(7, bad=range(7)), batch_size=batch_size,
                                 skip_errors=True)
    with pytest.raises(flowgate.LoaderError, match="delivered nothing: every item failed"):
        list(loader)
    # Not a resumed epoch's rest, which may be nothing.
    loader = flowgate.DataLoader(Numbered(6, bad={3, 4, 5}), batch_size=3, skip_errors=True)
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    again = flowgate.DataLoader(Numbered(6, bad={3, 4, 5}), batch_size=3, skip_errors=True)
    again.load_state_dict(state)
    assert ids(again) == [], "the failed batch left out in one process, and no error"
    again = flowgate.DataLoader(Numbered(12, bad={6, 8, 10}), batch_size=3, skip_errors=True,
                                rank=0, world_size=2)
    it = iter(again)
    assert ids([next(it)]) == [[0, 2, 4]]
    state = json.loads(json.dumps(again.state_dict()))
    del it
    rank0 = flowgate.DataLoader(Numbered(12, bad={6, 8, 10}), batch_size=3, skip_errors=True,
                                rank=0, world_size=2)
    rank0.load_state_dict(state)
    assert ids(rank0) == [[0, 2, 4]], "made up of the rank's own readable items, wrapping"


class Unbatchable(Numbered):
    """`__getitems__` raises for a batch holding one of `whole` (its items read alone are
    fine unless in `bad`)."""

    def __init__(self, n, bad=(), whole=()):
        super().__init__(n, bad)
        self.whole = set(whole)

    def __getitems__(self, indices):
        if self.whole & set(indices) or self.bad & set(indices):
            raise RuntimeError(f"a batch with {sorted(indices)} cannot be read at once")
        return [self[i] for i in indices]


def test_a_batch_whose_getitems_raises_is_read_item_by_item_with_skip_errors():
    # It was lost whole, not made up: under DDP that rank ran a batch short (a hang).
    loader = flowgate.DataLoader(Unbatchable(14, bad={5}), batch_size=4, skip_errors=True)
    assert ids(loader) == [[0, 1, 2, 3], [4, 6, 7], [8, 9, 10, 11], [12, 13]]
    assert len(loader) == 4 and loader.stats()["failures"] == 1, "the item, not the batch too"
    loader = flowgate.DataLoader(Unbatchable(14, whole={9}), batch_size=4, skip_errors=True)
    assert ids(loader) == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13]]
    assert loader.stats()["failures"] == 1, "the batch's own call failed: counted"
    # Every item of the batch fails alone: left out in one process.
    loader = flowgate.DataLoader(Unbatchable(14, bad={4, 5, 6, 7}), batch_size=4,
                                 skip_errors=True)
    assert ids(loader) == [[0, 1, 2, 3], [8, 9, 10, 11], [12, 13]]
    assert loader.stats()["failures"] == 4, "the items, not the batch's call too"
    with pytest.raises(flowgate.LoaderError, match="cannot be read at once") as e:
        list(flowgate.DataLoader(Unbatchable(14, whole={9}), batch_size=4))
    assert isinstance(e.value.__cause__, RuntimeError)


@pytest.mark.parametrize("batch_size", [None, 4])
def test_a_batch_whose_collate_fn_raises_keeps_the_items_that_collate_with_skip_errors(
        batch_size):
    # It was lost whole (a rank a batch short under DDP), then made up of the items after it,
    # themselves often as bad.
    def collate(items):
        if batch_size and len({int(x["x"][0]) == 5 for x in items}) > 1:
            raise ValueError("item 5 does not stack with the others")
        if not batch_size and int(items["x"][0]) == 5:
            raise ValueError("item 5 does not convert")
        return (torch.utils.data.default_collate(items) if batch_size
                else torch.utils.data.default_convert(items))

    loader = flowgate.DataLoader(Numbered(14), batch_size=batch_size, collate_fn=collate,
                                 skip_errors=True)
    got = list(loader)
    if batch_size:
        assert ids(got) == [[0, 1, 2, 3], [4, 6, 7], [8, 9, 10, 11], [12, 13]]
        assert len(got) == len(loader), "the batch keeps its place"
    else:
        firsts = [int(b["x"][0]) for b in got]
        assert firsts == [0, 1, 2, 3, 4, 6, 7, 8, 9, 10, 11, 12, 13], "left out alone"
        assert len(loader) == 14
    assert loader.stats()["failures"] == 1
    with pytest.raises(flowgate.LoaderError, match="item 5 does not") as e:
        list(flowgate.DataLoader(Numbered(14), batch_size=batch_size, collate_fn=collate))
    assert isinstance(e.value.__cause__, ValueError)
    # A collate_fn that fails every batch: the epoch raises, it neither hangs nor ends quietly.
    with pytest.raises(flowgate.LoaderError, match="delivered nothing"):
        list(flowgate.DataLoader(Numbered(6), batch_size=batch_size, skip_errors=True,
                                 collate_fn=lambda items: 1 / 0))


class Gray(Dataset):
    """Images, those in `gray` of one channel: torch's collate cannot stack them with the
    others (a real dataset's odd images)."""

    def __init__(self, n, gray):
        self.n, self.gray = n, set(gray)

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        return torch.full((1 if i in self.gray else 3, 2, 2), i)


@pytest.mark.parametrize("world", [1, 2, 3])
def test_odd_images_collate_fails_on_leave_every_rank_len_batches_without_them(world):
    # 3% grayscale, batches of 16: ranks made 56 and 54 of 63 batches before.
    import random
    gray = set(random.Random(0).sample(range(2000), 60))
    seen, failures = set(), 0
    for rank in range(world):
        loader = flowgate.DataLoader(Gray(2000, gray), batch_size=16, shuffle=True, seed=0,
                                     skip_errors=True, rank=rank, world_size=world)
        got = list(loader)
        assert len(got) == len(loader), f"rank {rank} of {world}"
        assert all(b.shape[1] == 3 for b in got)
        seen |= {int(b[k, 0, 0, 0]) for b in got for k in range(len(b))}
        failures += loader.stats()["failures"]
    assert not gray & seen and seen | gray == set(range(2000)), "every other image, once"
    padded = -(-2000 // world) * world - 2000
    assert len(gray) <= failures <= len(gray) + padded, "each odd image counted"


@pytest.mark.parametrize("batch_size", [1, 2, 7])
def test_items_collate_fn_refuses_alone_are_made_up_until_a_batch_collates(batch_size):
    # A pad-to-max-length collate refusing 1 sequence in 10; a batch of 1 made up
    # of one refused item was lost (ranks made 200 and 198 of 200).
    import random
    rng = random.Random(0)
    lengths = [rng.choice([5] * 9 + [15]) for _ in range(400)]

    def pad(items):
        if any(len(x) > 10 for x in items):
            raise ValueError("longer than 10")
        return torch.stack([torch.nn.functional.pad(x, (0, 10 - len(x))) for x in items])

    for rank in (0, 1):
        loader = flowgate.DataLoader([torch.ones(n) for n in lengths], batch_size=batch_size,
                                     shuffle=True, seed=0, collate_fn=pad, skip_errors=True,
                                     rank=rank, world_size=2)
        assert sum(1 for _ in loader) == len(loader), f"rank {rank}"


def test_a_resume_after_a_batch_collate_fn_failed_is_exact():
    # The checkpoint did not know the failed batch's items, so the resumed epoch
    # made a later batch up of them, collate_fn failed again and the batch was lost.
    def collate(b):
        if 1 in b or 21 in b:
            raise ValueError(f"cannot collate {b}")
        return torch.utils.data.default_collate(b)

    def make():
        return flowgate.DataLoader(list(range(24)), batch_size=4, collate_fn=collate,
                                   skip_errors=True)

    full = [b.tolist() for b in make()]
    assert full == [[0, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15],
                    [16, 17, 18, 19], [20, 22, 23]]
    for k in range(len(full) + 1):
        loader = make()
        it = iter(loader)
        got = [next(it).tolist() for _ in range(k)]
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        again = make()
        again.load_state_dict(state)
        assert got + [b.tolist() for b in again] == full, f"resumed after {k}"


def test_a_batch_of_only_failures_names_its_first_item_by_default():
    with pytest.raises(flowgate.LoaderError) as e:
        list(flowgate.DataLoader(Numbered(8, bad={4, 5, 6, 7}), batch_size=4))
    assert e.value.item == "item 4" and isinstance(e.value.__cause__, OSError)
    assert "item 4 is unreadable" in str(e.value.__cause__)


def test_unbatched_items_that_fail_are_left_out_alone_and_made_up_across_ranks():
    loader = flowgate.DataLoader(Numbered(6, bad={1, 2}), batch_size=None, skip_errors=True)
    got = [int(x["x"][0]) for x in loader]
    assert got == [0, 3, 4, 5] and len(loader) == 6
    assert loader.stats()["failures"] == 2
    # Rank 0 of 2 reads 0, 2, 4, ...: each failed item made up of the next readable one of
    # its own share.
    loader = flowgate.DataLoader(Numbered(12, bad={2, 4}), batch_size=None, skip_errors=True,
                                 rank=0, world_size=2)
    got = [int(x["x"][0]) for x in loader]
    assert got == [0, 6, 6, 6, 8, 10] and len(got) == len(loader)
    with pytest.raises(flowgate.LoaderError, match="item 1 is unreadable"):
        list(flowgate.DataLoader(Numbered(6, bad={1}), batch_size=None))


def test_any_exception_of_an_item_is_its_own_failure_and_the_epoch_names_itself():
    class Raises(Numbered):
        def __getitem__(self, i):
            if i == 4:
                raise KeyboardInterrupt("the dataset's own")
            return super().__getitem__(i)

    loader = flowgate.DataLoader(Raises(9), batch_size=3, skip_errors=True)
    assert ids(loader) == [[0, 1, 2], [3, 5], [6, 7, 8]] and len(loader) == 3
    loader = flowgate.DataLoader(Numbered(6, bad=range(6)), batch_size=2, skip_errors=True)
    loader.set_epoch(5)
    with pytest.raises(flowgate.LoaderError, match="epoch 5 delivered nothing") as e:
        list(loader)
    assert isinstance(e.value.__cause__, OSError), "the dataset's error, not a make-up's"


def test_one_process_delivers_no_item_twice_and_says_what_it_skipped():
    """41 items, batches of 8, the last item missing: its batch of one is left out, not made
    up of item 0 again. The first skip is said once with its reason, and the epoch's end says
    how many batches came against len()."""
    import warnings
    loader = flowgate.DataLoader(Numbered(41, bad={40}), batch_size=8, skip_errors=True)
    for epoch in range(2):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            got = [int(i) for b in loader for i in b["x"][:, 0]]
        assert sorted(got) == list(range(40)), f"epoch {epoch}: every readable item once"
        said = [str(x.message) for x in w if x.category is flowgate.SkippedItemsWarning]
        first = [m for m in said if "said once a loader" in m]
        ends = [m for m in said if f"epoch {epoch} skipped 1 unreadable item" in m]
        assert len(first) == (1 if epoch == 0 else 0), said
        assert "item 40 is unreadable" in first[0] if first else True
        assert len(ends) == 1 and "delivered 5 batches where len() counts 6" in ends[0], said
        assert all(x.filename == __file__ for x in w if x.category is
                   flowgate.SkippedItemsWarning), "said at the user's loop"
        assert loader.failures()[0][1] == "item 40"
    assert issubclass(flowgate.SkippedItemsWarning, UserWarning)
    # Resumed after two batches: the rest was due 4 batches and made 3, said against those.
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    del it
    again = flowgate.DataLoader(Numbered(41, bad={40}), batch_size=8, skip_errors=True)
    again.load_state_dict(state)
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        assert len(list(again)) == 3
    said = [str(x.message) for x in w if x.category is flowgate.SkippedItemsWarning]
    assert any("delivered 3 batches where 4 were due (the rest of a resumed epoch; len() "
               "counts 6)" in m for m in said), said
    # Silenced the usual way.
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        warnings.filterwarnings("ignore", category=flowgate.SkippedItemsWarning)
        assert len(list(flowgate.DataLoader(Numbered(41, bad={40}), batch_size=8,
                                            skip_errors=True))) == 5
    assert not [x for x in w if x.category is flowgate.SkippedItemsWarning]


def test_an_image_loader_in_one_process_says_what_it_skipped(data, tmp_path):
    """41 files, one corrupt and the last missing, batches of 8: len() counts 6 and 5 come.
    No file comes twice, and the loader says so at the epoch's end (and the first skip once),
    not only when failures() is asked."""
    import warnings
    good = sorted(str(p) for p in (data / "images").glob("*.jpg"))[:39]
    corrupt = tmp_path / "corrupt.jpg"
    corrupt.write_bytes(b"not a jpeg")
    paths = good[:10] + [str(corrupt)] + good[10:] + [str(tmp_path / "missing.jpg")]
    loader = flowgate.ImageLoader(paths, batch_size=8, shuffle=False, crop=32, resize=32,
                                  return_paths=True)
    assert len(loader) == 6
    for epoch in range(2):
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            seen = [p for _, batch_paths in loader for p in batch_paths]
        assert sorted(seen) == sorted(good), "every readable file once"
        said = [str(x.message) for x in w if x.category is flowgate.SkippedItemsWarning]
        first = [m for m in said if "said once a loader" in m]
        assert len(first) == (1 if epoch == 0 else 0), said
        assert not first or "corrupt.jpg" in first[0], first
        ends = [m for m in said if f"epoch {epoch} skipped 2 unreadable items" in m]
        assert len(ends) == 1 and "delivered 5 batches where len() counts 6" in ends[0], said
        assert all(x.filename == __file__ for x in w
                   if x.category is flowgate.SkippedItemsWarning)
        assert len(loader.failures()) == 2


@pytest.mark.parametrize("batch_size", [None, 2])
def test_a_failure_that_ends_the_epoch_is_not_said_to_be_skipped(batch_size, data, tmp_path):
    """By default an unreadable item ends the epoch with LoaderError: it was not skipped, so
    no SkippedItemsWarning says it was (under `simplefilter("error")` that warning was raised
    in place of the LoaderError, the dataset's own exception lost)."""
    import warnings
    for build in (lambda: flowgate.DataLoader(Numbered(10, bad={3}), batch_size=batch_size),
                  lambda: flowgate.ImageLoader(
                      [str(p) for p in sorted((data / "images").glob("*.jpg"))][:3]
                      + [str(tmp_path / "missing.jpg")], batch_size=batch_size or 1,
                      shuffle=False, crop=32, resize=32, skip_errors=False)):
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            with pytest.raises(flowgate.LoaderError):
                list(build())
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            loader = build()
            with pytest.raises(flowgate.LoaderError):
                list(loader)
        assert not [x for x in w if x.category is flowgate.SkippedItemsWarning], \
            [str(x.message) for x in w]
