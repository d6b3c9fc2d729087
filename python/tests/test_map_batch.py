"""`map_batch=`: a per-batch function on a loader stage of its own, after collation. Image-text
shards whose captions name their key: the function tokenizes each batch's captions at once,
padded to the batch's longest, changes the images and labels and adds fields; every batch is
its function's output for its own rows, in order, across ranks and DataLoader workers,
resumed exactly; media it leaves alone are not copied, views it keeps stay valid; its
exceptions fail the batch's items, counted or fatal; what it cannot do is said."""

import json

import numpy as np
import pytest

import flowgate
from test_fields import ARGS, N, caption, write_shards
from test_audio_buckets import CAP, clips  # noqa: F401 (a fixture)


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("map_batch") / "shards")


def pad_captions(b):
    """Each batch's captions as word lengths padded to its longest (`input_ids`,
    `attention_mask`), the images negated, the labels plus 100, each row's word count as a
    field, and a draw seeded by the batch's first row and epoch."""
    words = [[len(w) for w in c.split()] for c in b["caption"]]
    longest = max(map(len, words))
    ids = np.zeros((len(words), longest), dtype=np.int64)
    mask = np.zeros_like(ids)
    for r, w in enumerate(words):
        ids[r, :len(w)] = w
        mask[r, :len(w)] = 1
    rng = np.random.default_rng([b["index"][0], b["epoch"]])
    return {**b, "input_ids": ids, "attention_mask": mask, "n_words": [len(w) for w in words],
            "image": 255 - np.asarray(b["image"]), "label": np.asarray(b["label"]) + 100,
            "draw": np.full(len(words), rng.integers(1 << 30), dtype=np.int64)}


def loader(src, **kw):
    return flowgate.ImageLoader(src, labels="cls", fields={"caption": "txt"},
                                **{"return_paths": True, **ARGS, **kw})


def rows(l):
    """(path, image, label, caption, input_ids row, n_words, draw) per row, in order."""
    out = []
    for b in l:
        n = len(b["path"])
        images, labels = np.asarray(b["image"]), np.asarray(b["label"])
        ids = np.asarray(b["input_ids"]) if "input_ids" in b else np.zeros((n, 0))
        for k, path in enumerate(b["path"]):
            out.append((path, images[k].copy(), int(labels[k]), b["caption"][k],
                        ids[k].tolist(), b.get("n_words", [None] * n)[k],
                        int(np.asarray(b["draw"])[k]) if "draw" in b else None))
    return out


def test_each_batch_is_its_functions_output_for_its_own_rows_across_ranks(shards):
    for rank, world in [(0, 1), (2, 3)]:
        plain = rows(loader(flowgate.Shards(shards), rank=rank, world_size=world))
        l = loader(flowgate.Shards(shards), rank=rank, world_size=world,
                   map_batch=pad_captions)
        mapped = rows(l)
        assert [r[0] for r in plain] == [r[0] for r in mapped], "the same rows, in order"
        for (path, image, label, cap, *_), (_, neg, label2, cap2, ids, n, _) in zip(plain,
                                                                                  mapped):
            key = path.rsplit(":", 1)[1].split(".")[0]
            assert cap == cap2 == caption(key), path
            words = [len(w) for w in cap.split()]
            assert ids[:len(words)] == words and not any(ids[len(words):]), (path, ids)
            assert n == len(words) and label2 == label + 100, path
            assert (image.astype(int) + neg == 255).all(), path
        stages = l.stats()["stages"]
        assert stages["map_batch"]["items_out"] == len(l) and stages["map_batch"]["workers"] >= 1
        assert set(l.stats()["gil"]) >= {"threads_busy", "cores_used", "bound"}
    # Every batch's keys, the function's added after the loader's.
    b = next(iter(loader(flowgate.Shards(shards), map_batch=pad_captions)))
    assert list(b) == ["image", "input_ids", "attention_mask", "draw", "label", "path",
                       "caption", "n_words"]


@pytest.mark.parametrize("stop", [1, 4])
def test_a_state_dict_resumes_to_exactly_the_same_batches(shards, stop):
    def make():
        return loader(flowgate.Shards(shards, buffer=5), map_batch=pad_captions)

    whole = [(p, ids, d) for p, _, _, _, ids, _, d in rows(make())]
    first = make()
    it = iter(first)
    got = []
    for _ in range(stop):
        got += [(p, ids, d) for p, _, _, _, ids, _, d in rows([next(it)])]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    again = make()
    again.load_state_dict(state)
    got += [(p, ids, d) for p, _, _, _, ids, _, d in rows(again)]
    assert got == whole


def test_dataloader_workers_give_the_same_batches(shards):
    torch = pytest.importorskip("torch")
    def make():
        return loader(flowgate.Shards(shards), map_batch=pad_captions, output="numpy")

    direct = rows(make())
    dl = torch.utils.data.DataLoader(make(), batch_size=None, num_workers=2)
    through = rows(dl)
    assert [r[0] for r in through] == [r[0] for r in direct]
    assert [r[4:] for r in through] == [r[4:] for r in direct]


SEEN = {}


def note_pointer(b):
    """Records where the image's memory is, keeping no reference to it."""
    SEEN[b["index"][0]] = b["image"].data_ptr
    return {"first": [b["index"][0]] * len(b["index"])}


KEPT = []


def keep_view(b):
    KEPT.append((b["index"][0], np.asarray(b["image"])))
    return {"n": [1] * len(b["index"])}


def test_media_left_alone_are_not_copied_and_kept_views_stay_valid(shards):
    SEEN.clear()
    n = 0
    for b in loader(flowgate.Shards(shards), map_batch=note_pointer):
        assert b["image"].data_ptr == SEEN[b["first"][0]], "the batch's own memory"
        n += 1
    assert n == len(SEEN) == -(-N // ARGS["batch_size"])
    # A view the function keeps: the batch's media copied for the loop, the view intact.
    KEPT.clear()
    delivered = {}
    for b in loader(flowgate.Shards(shards), map_batch=keep_view, return_paths=False):
        delivered[int(np.asarray(b["label"])[0])] = np.asarray(b["image"]).copy()
        del b
    assert len(KEPT) == len(delivered) == -(-N // ARGS["batch_size"])
    import gc
    gc.collect()
    by_label = {}
    for b in loader(flowgate.Shards(shards), return_paths=False):
        by_label[int(np.asarray(b["label"])[0])] = np.asarray(b["image"]).copy()
    for label, image in delivered.items():
        assert (image == by_label[label]).all()
    kept = sorted(view.sum() for _, view in KEPT)
    assert kept == sorted(image.sum() for image in by_label.values()), "views intact"
    # A function that writes into the media in place and returns the batch: its writes stay.
    def zero(b):
        np.asarray(b["image"])[:] = 0
        return b
    for b in loader(flowgate.Shards(shards), map_batch=zero):
        assert not np.asarray(b["image"]).any()


def test_exceptions_fail_the_batches_items_counted_or_fatal(shards):
    def flaky(b):
        if 1 in np.asarray(b["label"]) % 9:
            raise ValueError(f"cannot pad the batch from {b['index'][0]}")
        return b

    plain = [np.asarray(b["label"]).tolist() for b in loader(flowgate.Shards(shards))]
    doomed = [b for b in plain if 1 in np.array(b) % 9]
    assert 0 < len(doomed) < len(plain)
    l = loader(flowgate.Shards(shards), map_batch=flaky)
    got = [np.asarray(b["label"]).tolist() for b in l]
    assert got == [b for b in plain if b not in doomed]
    failures = l.failures()
    assert len(failures) == len(doomed), failures
    assert all(stage == "map_batch" and item.startswith("the batch of ")
               and "ValueError: cannot pad" in why for stage, item, why in failures), failures
    with pytest.raises(flowgate.LoaderError, match="cannot pad"):
        rows(loader(flowgate.Shards(shards), map_batch=flaky, skip_errors=False))


@pytest.mark.parametrize("f, said", [
    (lambda b: None, "must return the batch's dict"),
    (lambda b: {"x": [1, 2]}, "2 values for a batch of 4 rows"),
    (lambda b: {"x": np.zeros((2, 3), np.uint8)}, "first dimension"),
    (lambda b: {"image": np.asarray(b["image"]) / 2.0}, "float64"),
    (lambda b: {"path": ["x"] * 4}, "path"),
    (lambda b: {"label": np.zeros(4, np.float32)}, "int64"),
    (lambda b: {1: 2}, "not a str"),
])
def test_what_map_batch_cannot_do_is_said(shards, f, said):
    with pytest.raises(flowgate.LoaderError, match=said):
        rows(loader(flowgate.Shards(shards), map_batch=f, skip_errors=False))


def test_what_map_batch_cannot_take_is_refused_at_once(shards):
    with pytest.raises(ValueError, match="remote decoding"):
        loader(flowgate.Shards(shards), map_batch=pad_captions, remote=flowgate.Ray(workers=1))
    with pytest.raises(ValueError, match="function of a batch"):
        loader(flowgate.Shards(shards), map_batch=3)


def test_length_aware_batches_map_whole_batches(clips):  # noqa: F811
    """Each length-aware batch reaches the function whole: its transcripts' lengths beside
    its lengths, in order."""
    def lengths_of(b):
        return {"twice": np.asarray(b["lengths"]) * 2,
                "rows": [len(b["index"])] * len(b["index"])}

    l = flowgate.AudioLoader(clips, max_batch_seconds=CAP, buckets=4, return_paths=True,
                             map_batch=lengths_of)
    n = 0
    for b in l:
        assert (np.asarray(b["twice"]) == 2 * np.asarray(b["lengths"])).all()
        assert b["rows"] == [len(b["path"])] * len(b["path"])
        n += len(b["path"])
    assert n == len(open(clips).read().split())


def test_the_image_text_example_runs(tmp_path):
    """`examples/python/image_text.py`: captions tokenized by `map_batch=`, each batch's tokens
    checked against its captions, resumed half way."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    from conftest import ROOT
    from test_fields import jpeg
    files = []
    for i in range(70):
        path = tmp_path / f"{i:03d}.jpg"
        path.write_bytes(jpeg(i))
        files.append(str(path))
    (tmp_path / "images.txt").write_text("\n".join(files))
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/image_text.py"),
                          str(tmp_path / "images.txt")], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr
    assert "70 samples in the epoch, resumed after 1 batches" in out.stdout, out.stdout


def test_the_asr_example_runs(clips):  # noqa: F811
    """`examples/python/asr.py`: CTC targets made by `map_batch=` on length-aware batches,
    each row's checked against its transcript, resumed half way."""
    pytest.importorskip("torch")
    import subprocess
    import sys
    from conftest import ROOT
    out = subprocess.run([sys.executable, str(ROOT / "examples/python/asr.py"), str(clips)],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert "30 clips in the epoch" in out.stdout, out.stdout


def test_a_function_reading_its_loader_while_the_loop_stops_the_epoch_does_not_hang(shards):
    """A function calling `stats()` (or `state_dict()`) on its own loader
    while the loop left the epoch (`break`, `close()`, `set_epoch()`) waited for the loop,
    which held the loader while it joined the function's thread: a hang even Ctrl-C could
    not end. Now `stats()` answers or says the pipeline is stopping, and `state_dict()` is
    refused from inside (a checkpoint is the loop's position)."""
    from conftest import run_clean
    code = ("import flowgate, faulthandler, sys\n"
            "faulthandler.dump_traceback_later(60, exit=True)\n"
            "H = {}\n"
            "def f(b):\n"
            "    H['l'].stats()\n"
            "    return {}\n"
            "def g(s):\n"
            "    H['l'].stats()\n"
            "    return s\n"
            "for kw in ({'map_batch': f}, {'map': g}):\n"
            "    for how in ('break', 'close', 'set_epoch'):\n"
            "        for _ in range(3):\n"
            f"            l = H['l'] = flowgate.ImageLoader(flowgate.Shards({shards!r}),"
            " batch_size=2, resize=16, crop=16, fields={'c': 'txt'}, workers=2, **kw)\n"
            "            for k, b in enumerate(l):\n"
            "                if k == 2:\n"
            "                    if how == 'close': l.close()\n"
            "                    if how == 'set_epoch': l.set_epoch(3)\n"
            "                    break\n"
            "            l.close()\n"
            "print('ok')\n")
    assert run_clean(code).strip() == "ok"
    holder = {}

    def checkpoint(b):
        holder["l"].state_dict()
        return b

    l = holder["l"] = loader(flowgate.Shards(shards), map_batch=checkpoint)
    with pytest.raises(flowgate.LoaderError, match="state_dict: not from inside the loader's"):
        rows(l)
    assert l.failures() and all("state_dict: not from inside" in why
                                for _, _, why in l.failures()), l.failures()
    holder.clear()


def test_a_dict_changed_and_returned_gives_its_changes(shards):
    """A function that set keys of the dict it was given and returned it
    had its changes dropped (the test for 'returned as given' looked at the changed dict)."""
    def mutate(b):
        b["image"] = np.zeros_like(np.asarray(b["image"]))
        b["caption"][0] = "NEW"
        b["label"] = np.asarray(b["label"]) + 100
        return b

    plain = rows(loader(flowgate.Shards(shards)))
    got = rows(loader(flowgate.Shards(shards), map_batch=mutate))
    assert [r[0] for r in got] == [r[0] for r in plain]
    assert all(not image.any() for _, image, *_ in got)
    assert [label for _, _, label, *_ in got] == [label + 100 for _, _, label, *_ in plain]
    captions = [cap for _, _, _, cap, *_ in got]
    assert captions.count("NEW") == len(loader(flowgate.Shards(shards)))
    # The same for map=: the item's dict changed and returned.
    def zero(s):
        s["image"] = np.zeros_like(np.asarray(s["image"]))
        return s
    for b in loader(flowgate.Shards(shards), map=zero):
        assert not np.asarray(b["image"]).any()


def test_fields_named_as_the_functions_own_keys_are_refused(shards):
    for name in ("index", "epoch"):
        with pytest.raises(ValueError, match="already has"):
            flowgate.ImageLoader(flowgate.Shards(shards), fields={name: "txt"},
                                 map_batch=pad_captions, **ARGS)


def test_a_field_named_label_without_labels_passes_through_the_function(shards):
    # The library's one rule for a batch's keys: without labels, `label` is a field's name
    # (a shard's `.cls` read as one), at build and in the function's output alike.
    l = flowgate.ImageLoader(flowgate.Shards(shards), fields={"label": "cls"},
                             map_batch=lambda b: b, skip_errors=False, **ARGS)
    got = sorted(int(v) for b in l for v in b["label"])
    assert got == list(range(N)) and not l.failures()
    with pytest.raises(ValueError, match='fields: "label" is a key the batch already has'):
        flowgate.ImageLoader(flowgate.Shards(shards), labels="cls", fields={"label": "txt"},
                             map_batch=lambda b: b, **ARGS)
