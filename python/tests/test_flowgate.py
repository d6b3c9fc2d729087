"""The Python package: iteration, zero copy, errors, Python stages, interruption, resume."""

import gc
import hashlib
import importlib.util
import os
import pathlib
import time
import warnings

import numpy as np
import pytest

import flowgate
from flowgate import _native


def hashes(batches):
    return sorted(hashlib.sha1(np.asarray(b)[i].tobytes()).hexdigest()
                  for b in batches for i in range(len(b)))


def test_iterates_the_sample_images(data):
    loader = flowgate.ImageLoader(data / "images.txt", batch_size=8, shuffle=False)
    assert len(loader) == 5
    batches = list(loader)
    assert len(batches) == 5
    for b in batches:
        assert b.shape == (8, 3, 224, 224)
        assert b.dtype == "uint8"
        a = np.asarray(b)
        assert a.shape == (8, 3, 224, 224) and a.dtype == np.uint8
        assert a.std() > 0, "decoded pixels, not zeros"
    # A second epoch: the same images (in completion order: batches as decoders finish).
    assert hashes(list(loader)) == hashes(batches)
    stats = loader.stats()
    assert stats["failures"] == 0 and "decode" in stats["stages"]


def test_nhwc_and_a_directory(data):
    loader = flowgate.ImageLoader(data / "images", batch_size=16, layout="nhwc", crop=64,
                                  resize=80)
    shapes = [b.shape for b in loader]
    assert shapes == [(16, 64, 64, 3), (16, 64, 64, 3), (8, 64, 64, 3)]
    with pytest.raises(ValueError):
        flowgate.ImageLoader(data / "images", layout="chw")


def test_batches_are_zero_copy(data):
    loader = flowgate.ImageLoader(data / "images.txt", batch_size=4)
    b = next(iter(loader))
    a = np.asarray(b)
    assert a.ctypes.data == b.data_ptr
    d = np.from_dlpack(b)
    assert d.ctypes.data == b.data_ptr
    expected = int(a.sum())
    del b, loader
    gc.collect()
    # The arrays keep the memory alive.
    assert int(a.sum()) == expected == int(d.sum())


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch not installed")
def test_torch_from_dlpack_is_zero_copy(data):
    import torch

    b = next(iter(flowgate.ImageLoader(data / "images.txt", batch_size=4)))
    t = torch.from_dlpack(b)
    assert t.data_ptr() == b.data_ptr
    assert tuple(t.shape) == (4, 3, 224, 224) and t.dtype == torch.uint8


def test_audio(data):
    loader = flowgate.AudioLoader(data / "audio.txt", batch_size=4, seconds=1.0)
    batches = list(loader)
    assert [b.shape for b in batches] == [(4, 16000), (4, 16000)]
    assert batches[0].dtype == "float32"
    assert np.abs(np.asarray(batches[0])).max() > 0


def bad_list(data, tmp_path):
    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"\xff\xd8\xff\xe0 this is not a JPEG")
    lines = (data / "images.txt").read_text().split()[:6]
    lines = [str((data / l).resolve()) if not pathlib.Path(l).is_absolute() else l for l in lines]
    lst = tmp_path / "list.txt"
    lst.write_text("\n".join(lines[:3] + [str(bad), str(tmp_path / "missing.jpg")] + lines[3:]))
    return lst, bad


def test_errors_raise_with_stage_and_path(data, tmp_path):
    lst, bad = bad_list(data, tmp_path)
    loader = flowgate.ImageLoader(lst, batch_size=2, shuffle=False, skip_errors=False)
    with pytest.raises(flowgate.LoaderError) as e:
        list(loader)
    assert e.value.stage == "decode"
    assert e.value.item in (str(bad), str(tmp_path / "missing.jpg"))
    assert e.value.item in str(e.value)


def test_errors_are_skipped_and_counted(data, tmp_path):
    lst, bad = bad_list(data, tmp_path)
    loader = flowgate.ImageLoader(lst, batch_size=2, shuffle=False)
    n = sum(len(b) for b in loader)
    assert n == 6
    failed = sorted(item for _, item, _ in loader.failures())
    assert failed == sorted([str(bad), str(tmp_path / "missing.jpg")])
    assert loader.stats()["failures"] == 2


def test_python_callable_stages():
    p = flowgate.Pipeline(lambda epoch: range(100)).map(lambda x: x * x, workers=2).batch(10)
    assert p.tuner_trace() == [], "nothing runs before the first iter()"
    for _ in range(2):
        batches = list(p)
        assert all(isinstance(b, list) for b in batches)
        assert sorted(x for b in batches for x in b) == [x * x for x in range(100)]
    # What the loaders say of themselves, it says too.
    assert p.stats()["stages"]["map1"]["items_out"] == 200, "both epochs"
    assert all({"t", "workers", "decisions"} <= set(r) for r in p.tuner_trace())

    def boom(x):
        if x == 7:
            raise KeyError("seven")
        return x

    with pytest.raises(flowgate.LoaderError) as e:
        list(flowgate.Pipeline(range(20)).map(boom, name="explode"))
    assert e.value.stage == "explode" and e.value.item == "7"
    assert "KeyError" in str(e.value)
    got = sorted(flowgate.Pipeline(range(20), skip_errors=True).map(boom))
    assert got == [x for x in range(20) if x != 7]


def test_a_stages_workers_and_a_batchs_size_are_refused_at_once_in_the_librarys_words():
    # Unbounded before: 10**6 workers took 4 GiB, 2**40 aborted, 2**63 panicked mid-epoch.
    for bad in (1025, 2**40, 2**63, 2**200, -1, 2.0, True):
        with pytest.raises(ValueError, match=r"^workers: must be in 0\.\.=1024, not "):
            flowgate.Pipeline(range(3)).map(str, workers=bad)
        with pytest.raises(ValueError, match=r"^size: must be in 1\.\.=65536, not "):
            flowgate.Pipeline(range(3)).batch(bad if bad != 1025 else 0)
    assert list(flowgate.Pipeline(range(3)).map(str, workers=1024)) == ["0", "1", "2"]


def test_a_part_left_out_of_a_result_is_a_failure():
    """skip_part in a stage: a counted failure naming the part, raised unless skip_errors;
    outside a stage, the exception itself is raised."""
    def parts(x):
        kept = []
        for part in range(3 * x, 3 * x + 3):
            if part == 13:
                flowgate.skip_part(f"part {part}", ValueError("unreadable"))
            else:
                kept.append(part)
        return kept

    with pytest.raises(flowgate.LoaderError) as e:
        list(flowgate.Pipeline(range(10)).map(parts, name="assemble"))
    assert e.value.stage == "assemble" and e.value.item == "part 13"
    assert "ValueError: unreadable" in str(e.value)
    got = sorted(p for r in flowgate.Pipeline(range(10), skip_errors=True).map(parts) for p in r)
    assert got == [p for p in range(30) if p != 13]
    with pytest.raises(ValueError, match="unreadable"):
        flowgate.skip_part("alone", ValueError("unreadable"))
    with pytest.raises(TypeError, match="exception"):
        flowgate.skip_part("alone", "not an exception")


def test_a_failing_source_raises():
    def source(epoch):
        yield 1
        raise ValueError("source broke")

    with pytest.raises(ValueError, match="source broke"):
        list(flowgate.Pipeline(source))


def wait_for_threads(base, timeout=5.0):
    deadline = time.monotonic() + timeout
    while _native._thread_count() > base and time.monotonic() < deadline:
        time.sleep(0.02)
    return _native._thread_count()


def test_break_and_del_stop_without_hanging_or_leaking_threads(data):
    gc.collect()
    base = wait_for_threads(0, timeout=2.0)
    loader = flowgate.ImageLoader(data / "images.txt", batch_size=4)
    for _ in range(3):
        for b in loader:
            break  # abandon the epoch: its pipeline stops now, not at the next iter()
        assert wait_for_threads(base) <= base, "an abandoned epoch's threads keep running"
    it = iter(loader)
    next(it)
    assert _native._thread_count() > base
    del it
    t0 = time.monotonic()
    del loader, b
    gc.collect()
    assert wait_for_threads(base) <= base, "pipeline threads left behind"
    assert time.monotonic() - t0 < 5

    p = flowgate.Pipeline(lambda e: iter(range(10**9))).map(lambda x: x + 1, workers=2)
    it = iter(p)
    next(it)
    del it, p
    gc.collect()
    assert wait_for_threads(base) <= base


def test_state_dict_resumes_exactly(data):
    args = dict(batch_size=8, shuffle=True, seed=3)
    whole = hashes(list(flowgate.ImageLoader(data / "images.txt", **args)))
    a = flowgate.ImageLoader(data / "images.txt", **args)
    it = iter(a)
    first = [next(it), next(it)]
    state = a.state_dict()
    assert state["epoch"] == 0 and state["delivered_items"] == 16
    a.close()
    b = flowgate.ImageLoader(data / "images.txt", **args)
    b.load_state_dict(state)
    rest = list(b)
    assert sum(len(x) for x in rest) == 24
    assert hashes(first + rest) == whole
    assert b.epoch == 1


def image_folder(data, root):
    """root/{cat,dog,zebra}/*.jpg from the sample images, and a corrupt file in cat/."""
    sources = sorted((data / "images").glob("*.jpg"))[:12]
    for i, src in enumerate(sources):
        d = root / ("dog", "cat", "zebra")[i % 3]
        d.mkdir(parents=True, exist_ok=True)
        (d / src.name).write_bytes(src.read_bytes())
    (root / "cat" / "broken.jpg").write_bytes(b"\xff\xd8\xff\xe0 not a JPEG")
    return root


def one_image(path):
    (b,) = list(flowgate.ImageLoader([path], batch_size=1, shuffle=False))
    return np.asarray(b)[0].tobytes()


def test_folder_labels_and_paths_stay_aligned_with_their_images(data, tmp_path):
    root = image_folder(data, tmp_path / "train")
    loader = flowgate.ImageLoader(root, batch_size=5, seed=1, labels="folder", return_paths=True)
    assert loader.classes == ["cat", "dog", "zebra"]
    seen = []
    for x, y, paths in loader:
        assert len(x) == len(y) == len(paths)
        assert y.dtype == "int64" and y.shape == (len(x),)
        labels = np.asarray(y)
        for i, p in enumerate(paths):
            assert labels[i] == loader.classes.index(pathlib.Path(p).parent.name)
            assert np.asarray(x)[i].tobytes() == one_image(p), "image and path disagree"
        seen += paths
    assert sorted(seen) == sorted(str(p) for p in root.glob("*/*.jpg") if p.name != "broken.jpg")
    assert [item for _, item, _ in loader.failures()] == [str(root / "cat" / "broken.jpg")]
    # Every rank numbers the classes alike.
    ranks = [flowgate.ImageLoader(root, labels="folder", rank=r, world_size=2) for r in (0, 1)]
    assert [r.classes for r in ranks] == [loader.classes] * 2


def test_labels_from_a_sequence_or_a_mapping(data, tmp_path):
    paths = [str(p) for p in sorted((data / "images").glob("*.jpg"))[:6]]
    by_seq = flowgate.ImageLoader(paths, batch_size=6, labels=[10, 11, 12, 13, 14, 15],
                                  return_paths=True, crop=32, resize=40)
    ((_, y, got),) = list(by_seq)
    assert dict(zip(got, np.asarray(y).tolist())) == {p: 10 + i for i, p in enumerate(paths)}
    assert by_seq.classes is None
    mapping = {pathlib.Path(p): 7 * i for i, p in enumerate(paths)}
    # Rows come in completion order (several decode workers): labels are checked by path.
    ((x, y, got),) = list(flowgate.ImageLoader(paths, batch_size=6, shuffle=False,
                                               labels=mapping, return_paths=True))
    assert dict(zip(got, np.asarray(y).tolist())) == {p: 7 * i for i, p in enumerate(paths)}
    assert len(x) == 6
    ((_, only_paths),) = list(flowgate.ImageLoader(paths, batch_size=6, shuffle=False,
                                                   return_paths=True))
    assert sorted(only_paths) == sorted(paths)
    with pytest.raises(ValueError, match="5 labels for 6 files"):
        flowgate.ImageLoader(paths, labels=[0] * 5)
    with pytest.raises(ValueError, match="no entry for"):
        flowgate.ImageLoader(paths, labels={paths[0]: 1})
    with pytest.raises(ValueError, match="folder"):
        flowgate.ImageLoader(paths, labels="folders")


def by_path(loader):
    """{path: image bytes} over one epoch."""
    return {p: np.asarray(x)[i].tobytes() for x, paths in loader for i, p in enumerate(paths)}


def test_train_augmentation_is_new_each_epoch_reproducible_and_resumable(data):
    paths = [str(p) for p in sorted((data / "images").glob("*.jpg"))[:12]]
    args = dict(batch_size=4, crop=64, train=True, seed=5, return_paths=True)
    a = flowgate.ImageLoader(paths, **args)
    e0, e1 = by_path(a), by_path(a)
    assert sorted(e0) == sorted(paths) and len(next(iter(e0.values()))) == 3 * 64 * 64
    assert sum(e0[p] != e1[p] for p in paths) >= 10, "a new crop/flip every epoch"
    eval_crops = by_path(flowgate.ImageLoader(paths, batch_size=4, resize=64, crop=64,
                                              return_paths=True))
    assert sum(e0[p] != eval_crops[p] for p in paths) >= 10, "not the center crop"
    b = flowgate.ImageLoader(paths, **args)
    assert by_path(b) == e0, "same seed and epoch: same augmentation"
    # An exact resume mid-epoch 1 redraws epoch 1's crops.
    c = flowgate.ImageLoader(paths, **args)
    list(c)
    it = iter(c)
    first = next(it)
    state = c.state_dict()
    c.close()
    d = flowgate.ImageLoader(paths, **args)
    d.load_state_dict(state)
    got = {p: np.asarray(first[0])[i].tobytes() for i, p in enumerate(first[1])}
    got.update(by_path(d))
    assert got == e1
    other = by_path(flowgate.ImageLoader(paths, **{**args, "seed": 6}))
    assert sum(e0[p] != other[p] for p in paths) >= 10, "another seed, other crops"
    with pytest.raises(ValueError, match="scale"):
        flowgate.ImageLoader(paths, train=True, scale=(0.5, 0.2))


def test_normalize_gives_float32_of_the_uint8_pixels(data):
    paths = [str(p) for p in sorted((data / "images").glob("*.jpg"))[:4]]
    # Rows in completion order (decode runs on several workers): compared by path.
    def rows(**kw):
        b, names = next(iter(flowgate.ImageLoader(paths, batch_size=4, shuffle=False,
                                                  return_paths=True, **kw)))
        order = np.argsort(names)
        return b, np.asarray(b)[order]

    _, raw = rows()
    mean, std = (0.5, 0.4, 0.3), (0.2, 0.25, 0.3)
    for norm, (m, s) in [(True, (flowgate.IMAGENET_MEAN, flowgate.IMAGENET_STD)),
                         ((mean, std), (mean, std))]:
        b, got = rows(normalize=norm)
        assert b.dtype == "float32" and b.shape == (4, 3, 224, 224)
        m = np.array(m, np.float32).reshape(1, 3, 1, 1)
        s = np.array(s, np.float32).reshape(1, 3, 1, 1)
        np.testing.assert_allclose(got, (raw / 255.0 - m) / s, rtol=0, atol=1e-5)
    with pytest.raises(ValueError, match="normalize must have finite standard deviations above 0"):
        flowgate.ImageLoader(paths, normalize=(mean, (0.2, 0.0, 0.3)))


def test_draft_mode_is_close_to_the_exact_pixels_on_large_photos(data, tmp_path):
    import subprocess
    big = []
    for i, src in enumerate(sorted((data / "images").glob("*.jpg"))[:4]):
        out = tmp_path / f"big{i}.jpg"
        # 1200 px wide: the center crop's window (about 680 px) is over twice the 224 output.
        subprocess.run(["ffmpeg", "-loglevel", "error", "-y", "-i", str(src), "-vf",
                        "scale=1200:-2", "-q:v", "2", str(out)], check=True)
        big.append(str(out))

    def rows(paths, **kw):
        b, names = next(iter(flowgate.ImageLoader(paths, batch_size=4, shuffle=False,
                                                  return_paths=True, **kw)))
        return np.asarray(b)[np.argsort(names)].astype(np.int16)

    exact, draft = rows(big), rows(big, draft=True)
    diff = np.abs(exact - draft)
    assert 0 < diff.mean() < 2.5, diff.mean()
    assert np.percentile(diff, 99) <= 16
    # Photos whose window is under twice the output decode exactly as without draft mode.
    small = [str(p) for p in sorted((data / "images").glob("*.jpg"))[:4]]
    np.testing.assert_array_equal(rows(small), rows(small, draft=True))


def test_audio_random_crops_and_lengths(data):
    clips = (data / "audio.txt").read_text().split()
    args = dict(batch_size=len(clips), seconds=1.0, train=True, seed=2, return_paths=True,
                return_lengths=True)
    a = flowgate.AudioLoader(clips, **args)

    def epoch(loader):
        ((x, lengths, paths),) = list(loader)
        assert np.asarray(lengths).tolist() == [16000] * len(clips), "every clip is >= 1 s"
        return {p: np.asarray(x)[i].tobytes() for i, p in enumerate(paths)}

    e0, e1 = epoch(a), epoch(a)
    assert sum(e0[p] != e1[p] for p in clips) >= len(clips) - 1, "a new window every epoch"
    assert epoch(flowgate.AudioLoader(clips, **args)) == e0, "reproducible"
    start = epoch(flowgate.AudioLoader(clips, **{**args, "train": False}))
    assert sum(e0[p] != start[p] for p in clips) >= len(clips) - 1, "not the clip's start"
    # Longer than the clips (3-10 s): padded, and the lengths say how much is real.
    ((x, lengths),) = list(flowgate.AudioLoader(clips, batch_size=len(clips), seconds=12.0,
                                                return_lengths=True, shuffle=False))
    x, lengths = np.asarray(x), np.asarray(lengths)
    assert lengths.dtype == np.int64 and 3 * 16000 <= lengths.min() < lengths.max() <= 10 * 16000
    for row, n in zip(x, lengths):
        assert not row[n:].any() and row[n - 1600:n].any(), "zeros exactly past the length"


def test_the_python_loader_and_a_pipeline_file_give_the_same_batches(data, tmp_path):
    """One recipe rule on every path: for the same seed and epoch, `ImageLoader` and a pipeline
    file run by `flowgate run --dump` (the Rust side) deliver the same augmented images."""
    import subprocess

    root = pathlib.Path(__file__).resolve().parents[2]

    listing = data / "images.txt"
    paths = listing.read_text().split()
    seed, batch = 11, 16
    cfg = tmp_path / "p.toml"
    cfg.write_text(
        f'[source]\nkind = "list"\npath = "{listing}"\n'
        f'[loader]\nshuffle = false\nseed = {seed}\nworkers = 1\nbatch_size = {batch}\n'
        f'[decode]\nkind = "image"\nresize = 72\ncrop = 64\ntrain = true\n'
        f'[run]\nepochs = 2\n[tuner]\nenabled = false\n')
    dump = tmp_path / "dump"
    from conftest import flowgate_command
    subprocess.run([*flowgate_command(), "run", "--quiet", str(cfg), "--dump", str(dump)],
                   cwd=root, check=True, stdout=subprocess.DEVNULL)
    loader = flowgate.ImageLoader(str(listing), batch_size=batch, resize=72, crop=64,
                                  train=True, seed=seed, shuffle=False, return_paths=True)
    epochs = []
    for epoch in range(2):
        # The file's batches come in list order (one worker, no shuffle, tuner off).
        files = sorted(dump.glob(f"epoch{epoch}-batch*.npy"))
        rows = [row for f in files for row in np.load(f)]
        want = {p: row.tobytes() for p, row in zip(paths, rows)}
        got = by_path(loader)
        assert len(want) == len(paths) == len(got)
        assert got == want, f"epoch {epoch}"
        epochs.append(got)
    assert sum(epochs[0][p] != epochs[1][p] for p in paths) >= len(paths) // 2, "new per epoch"


def peak_rss_mb(reset=False):
    """This process's peak resident set (VmHWM), in MiB; ``reset`` sets it to the current
    RSS first (``/proc/self/clear_refs``)."""
    if reset:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    with open("/proc/self/status") as f:
        kb = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    return kb / 1024


#: What a loader holds beside its budget, named: the batch the loop holds, each decode
#: worker's source image at full size (500×375×3, two workers), thread stacks and allocator
#: arenas (the Rust test, tests/isolated/bounds.rs, measures its own).
RSS_OVERHEAD_MB = 24


def test_memory_mb_binds_with_items_large_against_it(data):
    """432 KiB items in batches of 4 (1.7 MiB) over 160 items (68 MiB), behind a slow loop.
    The stages hold four batches, an item per decode worker and one waiting whatever their
    byte budgets (8.0 MiB with two workers): a 4 MiB budget is refused, naming that (before, it was taken,
    reserving two batches, and the stages held 7.2 MiB). A 9 MiB budget reserves it: the
    bytes the stages hold stay within it at every batch, and the process's peak RSS grows by
    at most the budget and a named overhead."""
    paths = [p for p in (data / "images.txt").read_text().split() if p] * 4
    args = dict(batch_size=4, crop=384, resize=384, shuffle=False, workers=2)
    item = 384 * 384 * 3
    with pytest.raises(ValueError, match=r"4\.0 MiB cannot hold a batch in flight.*"
                                                   r"\(8\.0 MiB at once\)"):
        flowgate.ImageLoader(paths, **args, memory_mb=4)
    loader = flowgate.ImageLoader(paths, **args, memory_mb=9)
    held, n = [], 0
    gc.collect()
    before = peak_rss_mb(reset=True)
    for b in loader:
        n += len(b)
        time.sleep(0.04)  # a slow loop: the stages run ahead until the budget stops them
        held.append(loader.stats()["bytes"])
        del b
    grew = peak_rss_mb() - before
    loader.close()
    assert n == len(paths)
    assert max(held) <= 9 * 2**20 + 2 * item, max(held)
    assert max(held) >= 2 * 4 * item, ("the stages ran ahead of the loop", max(held))
    assert grew <= 9 + RSS_OVERHEAD_MB, f"peak RSS grew {grew:.1f} MiB under a 9 MiB budget"
    with pytest.raises(ValueError, match="memory_mb"):
        flowgate.ImageLoader(str(data / "images.txt"), memory_mb=0)


def test_a_misconfigured_rank_is_an_error_not_a_duplicated_shard(data):
    with pytest.raises(ValueError, match=r"^rank: must be in 0\.\.2 \(below world_size=2\), not 2$"):
        flowgate.ImageLoader(str(data / "images.txt"), rank=2, world_size=2)
    with pytest.raises(ValueError, match="world_size: must be at least 1, not 0"):
        flowgate.ImageLoader(str(data / "images.txt"), rank=0, world_size=0)


def test_a_state_dict_loads_only_into_a_loader_it_fits(data):
    args = dict(batch_size=4, crop=64, resize=64, seed=3)
    a = flowgate.ImageLoader(str(data / "images.txt"), **args)
    it = iter(a)
    next(it)
    state = a.state_dict()
    a.close()
    assert state["fingerprint"]["shuffle_seed"] == "3" and state["version"] >= 1
    flowgate.ImageLoader(str(data / "images.txt"), **args).load_state_dict(state)
    for change, field in [({"seed": 4}, "shuffle_seed"), ({"batch_size": 8}, "batch_size"),
                          ({"drop_last": True}, "drop_last")]:
        b = flowgate.ImageLoader(str(data / "images.txt"), **{**args, **change})
        with pytest.raises(flowgate.LoaderError, match=field):
            b.load_state_dict(state)


def test_an_abandoned_epoch_starts_again_until_set_epoch_and_an_error_ends_it(data, tmp_path):
    """An epoch left mid-way (a peek with next(iter(loader)), close(), a break) starts again
    from its beginning at the next iter(), in the same order (as DistributedSampler until
    set_epoch): a peek costs no epoch, silently; a loop left after more than one batch warns.
    set_epoch moves on; an error ends the epoch (the next follows, with its own shuffle)."""
    good = [str(p) for p in sorted((data / "images").glob("*.jpg"))[:12]]
    args = dict(batch_size=4, crop=32, resize=32, seed=5, return_paths=True, workers=1)

    def order(loader):
        # The epoch's batches (their make-up is the shuffle's; the tuner may give collate a
        # second worker, which can swap whole batches).
        return sorted(tuple(paths) for _, paths in loader)

    reference = flowgate.ImageLoader(good, **args)
    epochs = [order(reference) for _ in range(4)]
    assert epochs[0] != epochs[1]

    loader = flowgate.ImageLoader(good, **args)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a peek is silent
        _, peeked = next(iter(loader))
        assert loader.epoch == 0, "a peek costs no epoch"
        assert order(loader) == epochs[0]
        it = iter(loader)
        next(it)
        loader.close()  # mid-epoch 1
        assert loader.epoch == 1
        assert order(loader) == epochs[1]
    assert tuple(peeked) in epochs[0]
    it = iter(loader)
    next(it), next(it)
    del it  # a break after two batches: epoch 2 abandoned
    with pytest.warns(UserWarning, match="epoch 2 starts again from its beginning.*after 2 "
                                         "batches.*set_epoch"):
        assert order(loader) == epochs[2]
    it = iter(loader)
    next(it), next(it)
    del it  # epoch 3 left: set_epoch moves on
    loader.set_epoch(0)
    assert order(loader) == epochs[0]
    it = iter(loader)
    next(it), next(it)
    del it  # epoch 1 left, then named again: started again by choice, silently
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loader.set_epoch(1)
        assert order(loader) == epochs[1]

    bad = tmp_path / "bad.jpg"
    bad.write_bytes(b"not a jpeg")
    failing = flowgate.ImageLoader(good + [str(bad)], **{**args, "skip_errors": False,
                                                        "shuffle": False})
    with pytest.raises(flowgate.LoaderError):
        order(failing)
    assert failing.epoch == 1, "the failed epoch is over; the next is epoch 1"


def test_a_rebuilt_pipeline_starts_with_the_workers_the_last_one_had(data):
    """An epoch cut short (a `break`, e.g. a fixed number of steps per epoch) rebuilds the
    pipeline: the new one starts its decode stage where the tuner had left the old one, not
    at a cold start."""
    paths = [str(p) for p in sorted((data / "images").glob("*.jpg"))]
    loader = flowgate.ImageLoader(paths, batch_size=4, crop=32, resize=32)
    assert loader._native._learned_workers() is None
    it = iter(loader)
    next(it)
    had = loader.stats()["stages"]["decode"]["workers"]
    del it  # a break: the next iter() rebuilds the pipeline
    it = iter(loader)
    next(it)
    learned = loader._native._learned_workers()
    assert learned is not None and 1 <= learned <= max(had, os.cpu_count())
    del it
    # A pinned count stays pinned.
    pinned = flowgate.ImageLoader(paths, batch_size=4, crop=32, resize=32, workers=1)
    it = iter(pinned)
    next(it)
    del it
    next(iter(pinned))
    assert pinned.stats()["stages"]["decode"]["workers"] == 1


def test_folder_labels_are_torchvisions_image_folder(data, tmp_path):
    """Nested class folders, a file at the root, upper-case and hidden names: the classes and
    every file's label are ImageFolder's; an empty class folder is refused, as ImageFolder
    refuses it."""
    datasets = pytest.importorskip("torchvision.datasets")
    sources = sorted((data / "images").glob("*.jpg"))
    root = tmp_path / "tree"
    layout = ["cat/sub1/a.jpg", "cat/sub2/deeper/b.jpg", "cat/c.jpg", "dog/d.jpg",
              "Zebra/e.jpg", ".hidden/f.jpg", "nested/x/y/z/g.jpg", "root.jpg"]
    for src, rel in zip(sources, layout):
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_bytes(src.read_bytes())
    tv = datasets.ImageFolder(str(root))
    loader = flowgate.ImageLoader(str(root), labels="folder", batch_size=3, crop=16, resize=16,
                                  return_paths=True)
    assert loader.classes == tv.classes
    want = {path: label for path, label in tv.samples}
    got = {p: int(y) for _, labels, paths in loader for p, y in zip(paths, labels)}
    assert got == want
    # An empty class folder: torchvision raises, and so does flowgate, naming it.
    (root / "ant").mkdir()
    with pytest.raises(FileNotFoundError):
        datasets.ImageFolder(str(root))
    with pytest.raises(FileNotFoundError, match="Found no valid file for the classes ant"):
        flowgate.ImageLoader(str(root), labels="folder")


def test_first_hour_conveniences(data):
    """A version, a readable repr, label batches that index, iterate and turn into lists."""
    assert flowgate.__version__ and flowgate.__version__[0].isdigit()
    paths = [str(p) for p in sorted((data / "images").glob("*.jpg"))[:5]]
    loader = flowgate.ImageLoader(paths, batch_size=5, labels=[3, 1, 4, 1, 5], shuffle=False,
                                  crop=16, resize=16)
    assert repr(loader) == "ImageLoader([5 paths], batch_size=5, len=1, epoch=0)"
    ((x, y),) = list(loader)
    assert y.tolist() == [3, 1, 4, 1, 5] and list(y) == [3, 1, 4, 1, 5]
    assert int(y[2]) == 4 and list(y[1:3]) == [1, 4] and x[0].shape == (3, 16, 16)
    # Fail-fast says so, not that a budget was exceeded.
    bad = paths[:2] + [str(data / "audio.txt")]
    with pytest.raises(flowgate.LoaderError, match="first failed item") as e:
        list(flowgate.ImageLoader(bad, batch_size=1, skip_errors=False, crop=16, resize=16))
    assert "budget" not in str(e.value)


def test_an_epoch_of_only_failures_names_its_last_failure_in_every_front_end(data, tmp_path):
    """"delivered nothing" says the count and the last failure alike for a loader and a
    `Pipeline` (the Pipeline used to name its first under "last:")."""
    def bad(x):
        raise ValueError(f"bad {x}")

    with pytest.raises(flowgate.LoaderError,
                       match=r"^epoch 0 delivered nothing: every item failed \(50 failed "
                             r"items\); last: .* on 49"):
        list(flowgate.Pipeline(range(50), skip_errors=True).map(bad, workers=1))
    missing = tmp_path / "missing.txt"
    missing.write_text("".join(f"{tmp_path}/gone{i}.jpg\n" for i in range(30)))
    loader = flowgate.ImageLoader(str(missing), shuffle=False, workers=1, skip_errors=True)
    with pytest.raises(flowgate.LoaderError,
                       match=r"^epoch 0 delivered nothing: every item failed \(30 failed "
                             r"items\); last: .*gone29\.jpg"):
        list(loader)
    loader.close()
