"""flowgate.DataLoader's passes and its process: a pass taken over by a newer iter(), ended
by close() or by load_state_dict() (from the loop's thread or another), the loader freed by the
garbage collector on its own thread, and the process's exit with iterators, threads still in
Python and calls that never return (a bounded wait, Ctrl-C)."""

import json
import os

import pytest

import flowgate
from conftest import run_clean

torch = pytest.importorskip("torch")
from test_dataloader import Numbered, ids  # noqa: E402


def test_a_newer_iterator_takes_over_and_the_older_one_says_so():
    loader = flowgate.DataLoader(list(range(6)), batch_size=2)
    a = iter(loader)
    assert next(a).tolist() == [0, 1]
    b = iter(loader)
    assert next(b).tolist() == [0, 1]
    with pytest.raises(RuntimeError, match="newer iter"):
        next(a)
    assert [x.tolist() for x in b] == [[2, 3], [4, 5]], "the newer one reads its pass whole"


def test_exit_with_an_iterator_alive_is_clean(tmp_path):
    code = ("import flowgate\n"
            "class DS:\n"
            "    def __len__(s): return 10**6\n"
            "    def __getitem__(s, i): return i\n"
            "it = iter(flowgate.DataLoader(DS(), batch_size=4, num_workers=2))\n"
            "print(next(it))\n")
    run_clean(code, times=5)


def test_a_loader_is_freed_by_its_count_and_one_in_a_cycle_on_its_own_thread_cleanly():
    """The loader's sampler does not hold the loader (a cycle made the garbage collector free
    it later, on whichever thread allocated, which could join a thread from itself and
    abort); a user's cycle freed during a stage's call stops the threads from another."""
    import gc
    import weakref
    gc.disable()
    try:
        loader = flowgate.DataLoader(Numbered(8), batch_size=2)
        next(iter(loader))
        ref = weakref.ref(loader)
        del loader
        assert ref() is None, "freed when its last reference goes, without the collector"
    finally:
        gc.enable()
    out = run_clean("import gc, flowgate\n"
               "class DS:\n"
               "    def __len__(s): return 400\n"
               "    def __getitem__(s, i):\n"
               "        gc.collect()\n"
               "        return i\n"
               "for k in range(4):\n"
               "    loader = flowgate.DataLoader(DS(), batch_size=4, num_workers=2)\n"
               "    loader.me = loader\n"
               "    print(next(iter(loader)))\n"
               "    del loader\n"
               "print('done')\n", times=2)
    assert out.strip().endswith("done")


def test_close_during_iteration_raises_and_a_new_pass_starts_again():
    import threading
    import time

    class Slow(Numbered):
        def __getitem__(self, i):
            time.sleep(0.02)
            return super().__getitem__(i)

    loader = flowgate.DataLoader(Slow(200), batch_size=2)
    it = iter(loader)
    next(it)
    threading.Timer(0.1, loader.close).start()
    with pytest.raises(flowgate.LoaderError, match="stopped before the epoch ended"):
        for _ in it:
            pass
    with pytest.raises(flowgate.LoaderError, match="stopped"):
        next(it)
    loader.close()
    assert len(list(loader)) == len(loader) == 100


def test_close_keeps_the_checkpoint_and_the_epoch_and_set_epoch_keeps_the_loop():
    """close() mid-epoch then state_dict() said epoch 0 with nothing
    delivered (a checkpoint that restarts training), the next iter() repeated epoch 0, a
    loaded state was dropped by close(), and set_epoch() mid-epoch then state_dict() ended the
    loop after one batch."""
    def make():
        return flowgate.DataLoader(Numbered(20), batch_size=3, shuffle=True, seed=7)

    whole = {e: ids(make_epoch(make(), e)) for e in (2, 3)}
    loader = make()
    loader.set_epoch(2)
    it = iter(loader)
    got = ids([next(it), next(it)])
    loader.close()
    state = loader.state_dict()
    assert (state["epoch"], state["delivered_items"]) == (2, 6)
    with pytest.raises(flowgate.LoaderError, match="stopped"):
        next(it)
    assert ids(loader) == whole[3], "the next pass is the next epoch, as after a break"
    again = make()
    again.load_state_dict(json.loads(json.dumps(state)))
    again.close()
    assert got + ids(again) == whole[2], "a loaded state survives close()"
    loader = make()
    loader.set_epoch(2)
    it = iter(loader)
    first = ids([next(it)])
    loader.set_epoch(9)
    mid = loader.state_dict()
    assert (mid["epoch"], mid["delivered_items"]) == (2, 3)
    assert first + ids(it) == whole[2], "the loop goes on to its end"


def make_epoch(loader, epoch):
    loader.set_epoch(epoch)
    return list(loader)


def test_exit_with_threads_still_in_python_is_clean():
    """Each of these aborted the interpreter at exit (SIGABRT): a daemon thread
    iterating a loader, one that iterates again after exit's close, and a call of the
    dataset that outlives exit's close by seconds."""
    import time
    for code in (
            "import threading, time, flowgate\n"
            "class DS:\n"
            "    def __len__(s): return 4\n"
            "    def __getitem__(s, i): return i\n"
            "L = flowgate.DataLoader(DS(), batch_size=4, collate_fn=list)\n"
            "def producer():\n"
            "    while True:\n"
            "        try:\n"
            "            for b in L: pass\n"
            "        except Exception: pass\n"
            "threading.Thread(target=producer, daemon=True).start()\n"
            "time.sleep(0.3)\n",
            "import time, flowgate\n"
            "class DS:\n"
            "    def __len__(s): return 64\n"
            "    def __getitem__(s, i):\n"
            "        if i >= 8:\n"
            "            t = time.time()\n"
            "            while time.time() - t < 2: time.sleep(0.005)\n"
            "        return i\n"
            "it = iter(flowgate.DataLoader(DS(), batch_size=2, num_workers=8, collate_fn=list))\n"
            "print(next(it))\n"):
        start = time.monotonic()
        for _ in range(3):
            run_clean(code)
        assert time.monotonic() - start < 90


def test_load_state_dict_during_a_loop_makes_the_loop_raise_and_iter_resumes_it():
    # The loop ended quietly after 2 of 6 batches: a roll-back lost the epoch.
    loader = flowgate.DataLoader(Numbered(12), batch_size=2)
    it = iter(loader)
    first = ids([next(it) for _ in range(2)])
    state = loader.state_dict()
    next(it)
    loader.load_state_dict(state)
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) during this loop ended it"):
        next(it)
    rest = ids(loader)
    assert first + rest == [[2 * k, 2 * k + 1] for k in range(6)]


NEVER_RETURNS = """
import threading, time, flowgate
class DS:
    def __len__(s): return 100
    def __getitem__(s, i):
        if i >= 2 and {looping}:
            while True:   # never returns, running Python now and then (a retried read)
                time.sleep(0.05)
        if i >= 2: threading.Event().wait()   # never returns
        return i
L = flowgate.DataLoader(DS(), batch_size=2, collate_fn=list, num_workers={workers})
it = iter(L)
print(next(it), flush=True)
time.sleep(1)   # the next batch's calls are under way
"""


@pytest.mark.parametrize("workers", [0, 4])
def test_exit_waits_a_bounded_time_for_a_call_that_never_returns_and_ctrl_c_ends_it(workers):
    # On the tuned threads (num_workers=0) exit joined a __getitem__ that never returns, for
    # good; Ctrl-C there was swallowed by the atexit hook.
    import signal
    import subprocess
    import sys
    import time
    env = dict(os.environ, FLOWGATE_EXIT_WAIT="3")
    for looping in (False, True):
        code = NEVER_RETURNS.format(workers=workers, looping=looping)
        start = time.monotonic()
        r = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                           text=True, timeout=120)
        took = time.monotonic() - start
        # It waited (FLOWGATE_EXIT_WAIT: 3 s for the calls under way), then ended the process
        # as a run that did not end cleanly: a call running Python when the interpreter
        # stopped aborted it (SIGABRT, "FATAL: exception not rethrown").
        assert r.stdout.strip() == "[0, 1]" and 3.5 <= took < 60, (took, r.stderr[-2000:])
        assert r.returncode == 1 and "still under way 3 s into exit" in r.stderr, (
            looping, r.returncode, r.stderr[-2000:])
    code = NEVER_RETURNS.format(workers=workers, looping=False)
    # A minute's wait, ended by Ctrl-C at once (SIGINT as a terminal sends it).
    p = subprocess.Popen([sys.executable, "-c", code],
                         env=dict(os.environ, FLOWGATE_EXIT_WAIT="60"),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "[0, 1]"
    time.sleep(1.5)
    p.send_signal(signal.SIGINT)
    try:
        _, err = p.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        p.kill()
        pytest.fail("Ctrl-C did not end the exit's wait")
    assert p.returncode == 130 and "interrupted at exit" in err, (p.returncode, err[-2000:])


def test_load_state_dict_from_another_thread_while_the_loop_waits_makes_it_raise():
    # The waiting next() ended the epoch quietly, and the usual set_epoch loop then moved on
    # without the loaded state.
    import threading
    import time

    class Slow(Numbered):
        def __getitem__(self, i):
            if i >= 4:
                time.sleep(0.5)
            return super().__getitem__(i)

    loader = flowgate.DataLoader(Slow(12), batch_size=2)
    it = iter(loader)
    first = ids([next(it), next(it)])
    state = loader.state_dict()
    timer = threading.Timer(0.2, loader.load_state_dict, (state,))
    timer.start()
    got = []
    with pytest.raises(RuntimeError, match=r"load_state_dict\(\) during this loop ended it"):
        for _ in range(4):
            got.append(next(it))  # waits for a slow batch meanwhile
    timer.join()
    # Batches taken before the load got the pipeline are the old pass's (they come again
    # after the loaded state); then the loop raised, and iter() resumes the state exactly.
    assert ids(got) == [[4, 5], [6, 7]][:len(got)]
    assert first + ids(loader) == [[2 * k, 2 * k + 1] for k in range(6)]


def test_a_peek_costs_no_epoch_so_ranks_keep_one_shuffle():
    # Rank 0 peeked at a batch after set_epoch(0) (to log it) and its loop read
    # epoch 1's shuffle while rank 1 read epoch 0's: 29 of 40 items read that epoch.
    def make(rank, world=2):
        # 41 items: shares padded to 21, batches of 4 with a short last one.
        return flowgate.DataLoader(list(range(41)), batch_size=4, shuffle=True, seed=0,
                                   rank=rank, world_size=world)

    # With set_epoch each epoch, and without (rank 0 ran an epoch ahead: 29 of 40).
    for named in (True, False):
        seen = []
        for rank in (0, 1):
            loader = make(rank)
            if named:
                loader.set_epoch(0)
            if rank == 0:
                next(iter(loader))
            seen += [i for b in loader for i in b.tolist()]
        assert set(seen) == set(range(41)) and len(seen) == 42, "the ranks' shares of one epoch"
    # A peek at a resumed epoch starts again at the resumed position, not its beginning; also
    # one process's, and with set_epoch of that epoch after the peek (it restarted
    # the epoch, 10 batches where 4 were left, the other ranks' all-reduces unanswered).
    for world, set_again in ((2, False), (1, False), (2, True), (1, True)):
        whole = [b.tolist() for b in make_epoch(make(0, world), 3)]
        loader = make(0, world)
        loader.set_epoch(3)
        it = iter(loader)
        next(it), next(it)
        state = json.loads(json.dumps(loader.state_dict()))
        del it
        again = make(0, world)
        again.load_state_dict(state)
        next(iter(again))
        if set_again:
            again.set_epoch(3)
        assert whole[:2] + [b.tolist() for b in again] == whole, (world, set_again)
    whole = [b.tolist() for b in make_epoch(make(0), 3)]
    # A loop left after a few batches: one process's goes on with the next epoch, as torch's
    # next pass is new; a rank's starts the epoch again, as `DistributedSampler`'s, so the
    # ranks keep one shuffle without set_epoch (when rank 0 broke after 2 batches to
    # log them, and the ranks read 46 of 61 items an epoch from then on).
    for world, epoch in ((1, 1), (2, 0)):
        loader = make(0, world)
        it = iter(loader)
        next(it), next(it), next(it)
        del it
        assert ([b.tolist() for b in loader]
                == [b.tolist() for b in make_epoch(make(0, world), epoch)]), world
    for rank_breaks in (0, 1):
        seen = []
        for rank in (0, 1):
            loader = make(rank)
            if rank == rank_breaks:
                it = iter(loader)
                next(it), next(it)
                del it
            for _ in range(2):  # two whole epochs, no set_epoch
                seen.append([i for b in loader for i in b.tolist()])
        for epoch in (0, 1):
            got = seen[epoch] + seen[2 + epoch]
            assert set(got) == set(range(41)) and len(got) == 42, (rank_breaks, epoch)
    # One process's passes are one more epoch each (torch's RandomSampler draws anew): a
    # `next(iter(loader))` each step is not one batch for ever, set_epoch or not.
    for named in (False, True):
        loader = make(0, 1)
        if named:
            loader.set_epoch(0)
        firsts = [next(iter(loader)).tolist() for _ in range(6)]
        assert firsts == [make_epoch(make(0, 1), e)[0].tolist() for e in range(6)]
    # close() after a peek at an epoch of several ranks: the next pass starts it again; the
    # checkpoint is what the consumer received, as every loader's after a pass left (the
    # library's epoch machine), so a loader that resumes it delivers the rest.
    loader = make(0)
    loader.set_epoch(3)
    next(iter(loader))
    assert loader.state_dict()["delivered_items"] == 4
    loader.close()
    state = json.loads(json.dumps(loader.state_dict()))
    assert (state["epoch"], state["delivered_items"]) == (3, 4)
    assert [b.tolist() for b in loader] == whole
    again = make(0)
    again.load_state_dict(state)
    assert whole[:1] + [b.tolist() for b in again] == whole


def test_a_pass_that_took_every_batch_ended_its_epoch_under_either_rule():
    # `zip(range(len(loader)), loader)` never asks for the epoch's end: under ranks (and in
    # the media loaders) the next pass read the same epoch again, every item twice, while the
    # checkpoint taken then resumed to an empty pass and the next epoch.
    def make(world):
        return flowgate.DataLoader(list(range(23)), batch_size=4, shuffle=True, seed=5,
                                   rank=0, world_size=world, collate_fn=list)

    for world in (1, 2):
        epochs = [make_epoch(make(world), e) for e in (0, 1)]
        loader = make(world)
        first = [b for _, b in zip(range(len(loader)), loader)]
        state = json.loads(json.dumps(loader.state_dict()))
        second = [b for _, b in zip(range(len(loader)), loader)]
        assert [first, second] == epochs, world
        # The checkpoint taken before the loop asked for the end: the epoch, read through (a
        # restart that calls set_epoch(0) again resumes its empty rest); after the pass, the
        # next epoch's start.
        resumed = make(world)
        resumed.load_state_dict(state)
        assert list(resumed) == [] and list(resumed) == epochs[1], world
        loader.close()
        after = loader.state_dict()
        assert (after["epoch"], after["delivered_items"]) == (2, 0), world


def test_a_loader_in_a_cycle_through_its_dataset_or_collate_fn_is_freed_with_its_threads():
    # A data module's `collate_fn=self.collate` (and a dataset holding its loader)
    # kept every loader and its threads alive: 190 MB and 6 threads a fold.
    import gc
    import time
    import weakref

    def threads():
        return len(os.listdir("/proc/self/task"))

    class Module:
        def __init__(self):
            self.ds = Numbered(64)
            self.loader = flowgate.DataLoader(self.ds, batch_size=4, num_workers=2,
                                              collate_fn=self.collate)

        def collate(self, items):
            return torch.utils.data.default_collate(items)

    def through_dataset():
        ds = Numbered(64)
        ds.loader = flowgate.DataLoader(ds, batch_size=4, num_workers=2)
        return ds.loader

    gc.collect()
    before = threads()
    for make in (lambda: Module().loader, through_dataset):
        refs = []
        for _ in range(5):
            loader = make()
            it = iter(loader)
            next(it), next(it)
            refs.append(weakref.ref(loader))
            del loader, it
        # (A call under way holds its copy of the dataset, and so the loader, until it ends:
        # a later collection frees that one.)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            gc.collect()
            if threads() <= before and all(r() is None for r in refs):
                break
            time.sleep(0.05)
        assert not [r for r in refs if r() is not None], "every loader freed"
        assert threads() <= before, "and its threads"


def test_an_idle_loaders_threads_go_to_the_loader_being_read():
    """A validation loader whose iterator is made and left unread (or read, then left alive
    between evaluations) holds no more than one thread while another loader of the process is
    read: the process's threads beyond one a stage go to the loader being read. A
    training loader ran 1 thread of its 2 beside an idle validation iterator, for good (137
    against 217 img/s); tests/isolated/idle_tokens.rs has the rule, this its DataLoader translation."""
    code = (
        "import hashlib, json, os, time\n"
        "import flowgate\n"
        "class Hashes:\n"
        "    buf = bytes(1 << 20)\n"
        "    def __len__(self):\n"
        "        return 10 ** 6\n"
        "    def __getitem__(self, i):\n"
        "        return hashlib.sha256(self.buf + i.to_bytes(8, 'little')).digest()\n"
        "cores = len(os.sched_getaffinity(0))\n"
        "def threads(dl):\n"
        "    return dl.stats()['stages']['fetch']['workers']\n"
        "val = flowgate.DataLoader(Hashes(), batch_size=8, num_workers=cores,\n"
        "                          collate_fn=lambda b: b)\n"
        "train = flowgate.DataLoader(Hashes(), batch_size=8, num_workers=cores,\n"
        "                            collate_fn=lambda b: b)\n"
        "it = iter(val)\n"
        "first = threads(val)\n"
        "t0, took = time.monotonic(), None\n"
        "for k, _ in enumerate(train):\n"
        "    if k % 10 == 0 and threads(train) == cores:\n"
        "        took = time.monotonic() - t0\n"
        "        break\n"
        "    if time.monotonic() - t0 > 30:\n"
        "        break\n"
        "parks = [d for r in val.tuner_trace() for d in r['decisions'] if 'park:' in d]\n"
        "print(json.dumps(dict(cores=cores, first=first, took=took, val=threads(val),\n"
        "                      train=threads(train), parks=parks)))\n"
        "next(it)  # the validation loop is back: it reads\n"
    )
    r = json.loads(run_clean(code))
    assert r["first"] == r["cores"], r
    if r["cores"] == 1:
        return  # one core: no thread beyond a stage's first to hand over
    assert r["took"] is not None, f"the loader being read never got the idle one's threads: {r}"
    assert r["val"] == 1, r
    # Said in its trace, once: parked, and not woken while unread.
    assert len(r["parks"]) == 1 and "took nothing" in r["parks"][0], r
    # In words, as the command says a decision: the stage, its workers, why.
    assert r["parks"][0].startswith("fetch → 1 worker: park:"), r
