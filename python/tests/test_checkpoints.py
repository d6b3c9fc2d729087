"""Checkpoints across ranks and world sizes, and a loader that stays responsive around its
training loop (stats from another thread, break releasing memory)."""

import gc
import json
import os
import threading
import time

import pytest

import flowgate
from conftest import with_unreadable


def paths_of(data):
    return [str(p) for p in sorted((data / "images").glob("*.jpg"))]


ARGS = dict(batch_size=3, crop=32, resize=32, seed=9, return_paths=True, workers=1)


def take(loader, n):
    """Paths of the first n batches of the loader's current (or next) epoch, and the
    loader's state_dict after them (taken inside the loop, as a training step would)."""
    got, it = [], iter(loader)
    for _ in range(n):
        try:
            _, paths = next(it)
        except StopIteration:
            break
        got.extend(paths)
    return got, loader.state_dict()


def test_merged_state_dicts_resume_at_other_world_sizes(data):
    files = paths_of(data)
    delivered = []
    state = None
    for world, batches in [(3, 2), (2, 1), (5, None)]:
        states, counts = [], []
        for rank in range(world):
            loader = flowgate.ImageLoader(files, rank=rank, world_size=world, **ARGS)
            if state is not None:
                loader.load_state_dict(state)
            got, state_dict = take(loader, batches if batches is not None else 10**6)
            delivered.extend(got)
            counts.append(len(got))
            states.append(state_dict)
            loader.close()
        if batches is None:
            # The rest, dealt out evenly: the shards are padded to the same length.
            assert max(counts) == min(counts), counts
            break
        # The ranks' states, saved and merged (in any order).
        state = flowgate.merge_state_dicts(states[::-1])
        assert state["epoch"] == 0 and state["shard"]["world_size"] == 1
        assert state["delivered_items"] == len(set(delivered))
    # Every file of the epoch, repeated only to pad uneven dealings (40 files at 3 ranks: 2
    # repeats; the rest at 2 and at 5 ranks: fewer than 2 and 5).
    assert set(delivered) == set(files), "every file of the epoch"
    assert len(delivered) - len(files) <= 2 + 1 + 4, len(delivered)

    # The merged state of a finished epoch names the next, whole.
    with pytest.raises(ValueError, match="no state of rank 1"):
        flowgate.merge_state_dicts(states[:1])


def test_a_state_dict_is_the_librarys_checkpoint_layout_and_reads_the_earlier_one(data):
    # One checkpoint format for every front end: the library's serde layout (flat shard keys).
    loader = flowgate.ImageLoader(data, batch_size=4, rank=1, world_size=3, seed=5)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert set(state["shard"]) >= {"rank", "world_size", "shard_lengths", "global_len", "base"}
    assert state["shard"]["shard_lengths"] == "pad"
    assert json.loads(json.dumps(state)) == state, "plain JSON values"
    rest = [b.tolist() for b in it]
    assert rest, "the rest of the epoch"
    # The nested layout Rust wrote before (world, lengths, split) still loads.
    old = dict(state, shard={k: v for k, v in state["shard"].items()
                             if k not in ("world_size", "shard_lengths")})
    old["shard"].update(world=3, lengths="Pad")
    again = flowgate.ImageLoader(data, batch_size=4, rank=1, world_size=3, seed=5)
    again.load_state_dict(old)
    assert [b.tolist() for b in again] == rest
    with pytest.raises(ValueError, match="state_dict: missing field `epoch`"):
        again.load_state_dict({k: v for k, v in state.items() if k != "epoch"})
    # A state that lost one key of a pair, or owes more than an epoch, is refused (it used to
    # resume as another share, or make up batches for ever).
    half = dict(state, shard=dict(state["shard"], worker=0))
    with pytest.raises(ValueError, match="`worker` and `workers` come together"):
        again.load_state_dict(half)
    with pytest.raises(flowgate.LoaderError, match="owes 9223372036854775808 batches"):
        again.load_state_dict(dict(state, owed_batches=2**63))


def test_a_dataloader_checkpoint_written_before_the_one_epoch_machine_still_resumes():
    """A `flowgate.DataLoader` checkpoint saved to disk by an earlier build (the state layout
    of version 2, from the DataLoader's own epoch machine) resumes to exactly the batches that
    loader delivered; a layout newer than this build's, or a loader of another batch size, is
    refused saying why."""
    import copy
    import pathlib
    saved = json.loads((pathlib.Path(__file__).parent / "data" / "dataloader_state_v2.json")
                       .read_text())

    def make(batch_size=4):
        return flowgate.DataLoader(list(range(23)), batch_size=batch_size, shuffle=True,
                                   seed=3, collate_fn=list)

    loader = make()
    loader.load_state_dict(copy.deepcopy(saved["state"]))
    assert list(loader) == saved["rest"]
    # The loader built today makes the same epoch: the two taken batches, then the rest.
    whole = make()
    whole.set_epoch(2)
    assert list(whole)[2:] == saved["rest"]
    with pytest.raises(flowgate.LoaderError, match="layout is version 99, this flowgate reads"):
        make().load_state_dict(dict(saved["state"], version=99))
    with pytest.raises(flowgate.LoaderError, match="taken with batch_size = 4, this pipeline has "
                                                   "batch_size = 8"):
        make(8).load_state_dict(copy.deepcopy(saved["state"]))


def test_a_damaged_state_dict_is_refused_in_the_librarys_words(data):
    # Resumed as another set of items before; the library's check, once.
    loader = flowgate.ImageLoader(data, batch_size=4, rank=1, world_size=3, seed=5)
    it = iter(loader)
    next(it)
    state = json.loads(json.dumps(loader.state_dict()))
    del it
    share = len(flowgate.ImageLoader(data, batch_size=1, rank=1, world_size=3, seed=5))
    shard = {k: v for k, v in state["shard"].items()}
    for damaged, says in [
        (dict(state, delivered=[[0, share + 1]], delivered_items=share + 1), "past the"),
        (dict(state, delivered=[[3, 1]]), "empty or reversed"),
        (dict(state, delivered_items=state["delivered_items"] + 1), "`delivered_items` is"),
        (dict(state, shard=dict(shard, base=[[0, 10**6]])), "`base` range"),
        ({k: v for k, v in state.items() if k != "shard"}, "names no rank"),
    ]:
        l = flowgate.ImageLoader(data, batch_size=4, rank=1, world_size=3, seed=5)
        with pytest.raises(flowgate.LoaderError, match=says):
            l.load_state_dict(damaged)
            next(iter(l))
        l.close()
    with pytest.raises(ValueError, match="rank 1's state: the checkpoint is damaged"):
        flowgate.merge_state_dicts([dict(state, shard=dict(shard, rank=r)) if r != 1 else
                                    dict(state, delivered=[[3, 1]]) for r in range(3)])


def test_an_older_iterator_ends_once_a_newer_one_takes_the_epoch(data):
    # It took the newer one's batches before: that one then missed them.
    loader = flowgate.ImageLoader(data, batch_size=4, shuffle=False, output="numpy")
    a = iter(loader)
    next(a), next(a)
    b = iter(loader)                   # the epoch again, from its start
    first = next(b)
    assert next(a, None) is None, "the older iterator has ended"
    got = [first] + list(b)
    assert len(got) == len(loader)
    assert loader.state_dict()["epoch"] == 1


def test_a_rank_state_does_not_load_at_another_rank(data):
    files = paths_of(data)
    a = flowgate.ImageLoader(files, rank=0, world_size=2, **ARGS)
    _, state = take(a, 1)
    a.close()
    b = flowgate.ImageLoader(files, rank=1, world_size=2, **ARGS)
    with pytest.raises(flowgate.LoaderError, match="merge every rank"):
        b.load_state_dict(state)


def fifo_dataset(tmp_path, data):
    """A list whose first file is a named pipe: reading it blocks until someone writes."""
    fifo = tmp_path / "slow.jpg"
    os.mkfifo(fifo)
    return fifo, [str(fifo)] + paths_of(data)[:4]


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes")
def test_stats_and_epoch_answer_while_next_waits(data, tmp_path):
    fifo, files = fifo_dataset(tmp_path, data)
    loader = flowgate.ImageLoader(files, batch_size=1, shuffle=False, crop=32, resize=32,
                                  workers=1)
    it = iter(loader)
    waiting = threading.Thread(target=lambda: next(it))
    waiting.start()
    time.sleep(0.3)
    assert waiting.is_alive(), "next() waits for the blocked read"
    t0 = time.monotonic()
    stats = loader.stats()
    epoch = loader.epoch
    took = time.monotonic() - t0
    assert stats["delivered"] == 0 and epoch == 0
    assert took < 0.5, f"stats() took {took:.2f}s while next() waited"
    # A monitoring thread runs Python meanwhile: the GIL is not held by the waiting call.
    ticks = []
    ticker = threading.Thread(target=lambda: [ticks.append(time.sleep(0.01)) for _ in range(10)])
    ticker.start()
    ticker.join(timeout=2)
    assert len(ticks) == 10
    # Unblock the read (a valid JPEG) and finish.
    with open(fifo, "wb") as f:
        f.write(open(files[1], "rb").read())
    waiting.join(timeout=10)
    assert not waiting.is_alive()
    loader.close()


def rss_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs /proc")
def test_break_releases_the_epochs_buffers(data):
    """Leaving an epoch with `break` stops its pipeline at once and gives its buffers back:
    RSS falls by most of what the buffers held (measured, not only the ledger)."""
    files = paths_of(data) * 4  # 160 items of 1024x1024x3 = 3 MiB each
    loader = flowgate.ImageLoader(files, batch_size=8, resize=1024, crop=1024, shuffle=False,
                                  workers=2, memory_mb=400)
    gc.collect()
    before = rss_mb()
    it = iter(loader)
    b = next(it)
    del b
    # Let the prefetch fill its buffers.
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and rss_mb() - before < 100:
        time.sleep(0.05)
    time.sleep(0.2)
    filled, held = rss_mb(), loader.stats()["bytes"] / 2**20
    assert filled - before > 100, f"RSS grew only {filled - before:.0f} MiB ({held:.0f} held)"
    del it  # the loop's iterator is freed: the epoch is abandoned
    gc.collect()
    after = rss_mb()
    assert after - before < 0.3 * (filled - before), (
        f"RSS {before:.0f} -> {filled:.0f} MiB with {held:.0f} MiB buffered, "
        f"{after:.0f} MiB after the break")
    assert loader.epoch == 0, "the abandoned epoch starts again from its beginning"
    loader.close()


def test_arguments_are_checked_with_clear_errors(data, tmp_path):
    images = data / "images.txt"
    for kw, says in [(dict(batch_size=-1), "batch_size: must be in 1..=65536, not -1"),
                     (dict(crop=-1), "crop: invalid value: integer `-1`, expected a whole number"),
                     (dict(seed=1.5), "seed: invalid type: floating point `1.5`, expected a whole number"),
                     (dict(workers=0), "workers: must be in 1..=1024, not 0"),
                     (dict(crop=300, resize=256), "300")]:
        with pytest.raises(ValueError, match=says):
            flowgate.ImageLoader(images, **kw)
    with pytest.raises(FileNotFoundError):
        flowgate.ImageLoader(tmp_path / "missing")
    with pytest.raises(ValueError, match="no files to load"):
        flowgate.ImageLoader([])
    # One image file is a dataset of one image, not a list file.
    one = paths_of(data)[0]
    (batch,) = list(flowgate.ImageLoader(one, batch_size=4, crop=32, resize=32))
    assert len(batch) == 1


def test_a_state_dict_taken_after_a_break_resumes_the_rest_of_that_epoch(data):
    files = paths_of(data)[:20]
    loader = flowgate.ImageLoader(files, **ARGS)
    got = []
    for i, (_, paths) in enumerate(loader):
        got.extend(paths)
        if i == 2:
            break
    state = loader.state_dict()  # after the loop: the abandoned epoch's progress
    assert (state["epoch"], state["delivered_items"]) == (0, 9)
    resumed = flowgate.ImageLoader(files, **ARGS)
    resumed.load_state_dict(json.loads(json.dumps(state)))
    rest = [p for _, paths in resumed for p in paths]
    assert sorted(got + rest) == sorted(files), "the rest of epoch 0, each once"


def test_fill_skipped_state_dicts_resume_to_the_uninterrupted_batches(data, tmp_path):
    """With ``fill_skipped``, a state_dict taken after any batch (before, at and after the
    rank's own items run out, while batches are made up) resumes through JSON to the rest of
    the uninterrupted epoch: the same batches, ``len(loader)`` in all."""
    files = with_unreadable(data, tmp_path)
    args = dict(ARGS, seed=2, fill_skipped=True, world_size=3)
    made_up = 0
    for rank in range(3):
        whole = flowgate.ImageLoader(files, rank=rank, **args)
        every = [list(p) for _, p in whole]
        assert len(every) == len(whole), f"rank {rank}"
        made_up += whole.stats()["filled"]
        for k in range(len(every)):
            loader = flowgate.ImageLoader(files, rank=rank, **args)
            got, state = take(loader, k)
            resumed = flowgate.ImageLoader(files, rank=rank, **args)
            resumed.load_state_dict(json.loads(json.dumps(state)))
            rest = [list(p) for _, p in resumed]
            assert k + len(rest) == len(every), f"rank {rank}, after {k} batches"
            assert got + [p for b in rest for p in b] == [p for b in every for p in b], \
                f"rank {rank}, after {k} batches"
    assert made_up > 0, "some rank made up batches (else this proves nothing)"


def test_load_state_dict_during_a_loop_makes_that_loop_raise(data):
    # The roll-back pattern (a loss spike: load the last checkpoint, go on): the running loop
    # ended quietly, as if its epoch were over, losing the rest unnoticed.
    images = data / "images.txt"
    loader = flowgate.ImageLoader(images, shuffle=False, **ARGS)
    whole = [p for _, ps in loader for p in ps]
    it = iter(loader)
    first = [p for _ in range(2) for p in next(it)[1]]
    state = loader.state_dict()
    next(it)
    loader.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) during this loop ended it"):
        next(it)
    rest = [p for _, ps in loader for p in ps]
    assert first + rest == whole
    # A state loaded between loops is a resume as before, nothing raised.
    loader.load_state_dict(state)
    assert [p for _, ps in loader for p in ps] == rest


def test_load_state_dict_from_another_thread_while_the_loop_waits_makes_it_raise(data):
    import time
    images = data / "images.txt"

    def slow(s):
        time.sleep(0.3)
        return s

    whole = [p for _, ps in flowgate.ImageLoader(images, shuffle=False, **ARGS) for p in ps]
    loader = flowgate.ImageLoader(images, shuffle=False, map=slow, **ARGS)
    it = iter(loader)
    first = [p for p in next(it)[1]]
    state = loader.state_dict()
    timer = threading.Timer(0.1, loader.load_state_dict, (state,))
    timer.start()
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) during this loop ended it"):
        for _ in range(len(whole)):
            next(it)
    timer.join()
    assert first + [p for _, ps in loader for p in ps] == whole
