"""Samples with fields besides their media (`fields=`): image-text tar shards (KEY.jpg,
KEY.txt, KEY.json) and Parquet rows (image beside caption), each caption and record naming
its sample's key: every batch's fields belong to its images, in order, every sample once
across ranks, resumed exactly from a mid-epoch state_dict; a missing field skipped and
counted, fatal, or None when optional; what cannot carry fields refused at once."""

import io
import json
import tarfile

import numpy as np
import pytest

import flowgate
from conftest import run_clean

N = 43  # samples: divisible by no batch size, rank count or shard size used here
ARGS = dict(batch_size=4, resize=16, crop=16, seed=3, workers=2)


def jpeg(i):
    from PIL import Image
    pixels = np.full((16, 16, 3), (i * 5) % 256, dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="JPEG", quality=95)
    return out.getvalue()


def caption(key):
    return f"a photo of {key}, café"


def write_shards(out, gap=None, bad_json=None, per_shard=10):
    """KEY.jpg, KEY.cls (the sample's number), KEY.txt (a caption naming KEY) and KEY.json
    (a record naming KEY); sample `gap` without its caption, `bad_json`'s record broken."""
    out.mkdir(parents=True, exist_ok=True)
    shards = 0
    for s in range(0, N, per_shard):
        with tarfile.open(out / f"s-{s // per_shard:03d}.tar", "w") as tar:
            for i in range(s, min(N, s + per_shard)):
                key = f"k{i:05d}"
                members = [("jpg", jpeg(i)), ("cls", str(i).encode())]
                if i != gap:
                    members.append(("txt", caption(key).encode()))
                record = {"key": key, "n": i, "tags": ["x", i % 3], "score": i / 4}
                members.append(("json", b"{oops" if i == bad_json
                                else json.dumps(record).encode()))
                for ext, body in members:
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        shards += 1
    return f"{out}/s-{{000..{shards - 1:03d}}}.tar"


@pytest.fixture(scope="module")
def shards(tmp_path_factory):
    return write_shards(tmp_path_factory.mktemp("fields") / "shards")


FIELDS = {"caption": "txt", "meta": "json"}


def rows(batch):
    """(key, caption, record) per item, checking each belongs to the item's image: the
    caption and record name the key of the tar member the image was decoded from."""
    assert set(batch) == {"image", "label", "path", "caption", "meta"}
    n = len(batch["path"])
    assert np.asarray(batch["image"]).shape[0] == n == len(batch["caption"]) == len(
        batch["meta"]) == len(np.asarray(batch["label"]))
    out = []
    for path, label, cap, meta in zip(batch["path"], np.asarray(batch["label"]),
                                      batch["caption"], batch["meta"]):
        key = path.rsplit(":", 1)[1].split(".")[0]
        assert cap == caption(key), (path, cap)
        assert meta["key"] == key and meta["n"] == int(label), (path, meta)
        assert meta["tags"] == ["x", int(label) % 3] and meta["score"] == int(label) / 4
        out.append((key, cap, meta["n"]))
    return out


def loader(source, **kw):
    args = dict(ARGS, labels="cls", return_paths=True, fields=FIELDS)
    args.update(kw)
    return flowgate.ImageLoader(source, **args)


def test_image_text_shards_keep_captions_and_records_with_their_images_across_ranks(shards):
    for epoch in range(2):
        seen = {}
        for rank in range(3):
            l = loader(flowgate.Shards(shards, buffer=7), rank=rank, world_size=3)
            l.set_epoch(epoch)
            batches = list(l)
            assert len(batches) == len(l)
            for b in batches:
                for key, _, _ in rows(b):
                    seen[key] = seen.get(key, 0) + 1
        assert len(seen) == N, f"every sample in epoch {epoch}"
        assert sum(seen.values()) == 45, "two padded (43 over 3 ranks)"


@pytest.mark.parametrize("stop", [1, 5, 10])
def test_a_mid_epoch_state_dict_resumes_to_exactly_the_rest_with_its_fields(shards, stop):
    whole = [r for b in loader(flowgate.Shards(shards, buffer=7)) for r in rows(b)]
    assert len(whole) == N
    first = loader(flowgate.Shards(shards, buffer=7))
    it = iter(first)
    got = [r for _ in range(stop) for r in rows(next(it))]
    state = json.loads(json.dumps(first.state_dict()))
    del it
    again = loader(flowgate.Shards(shards, buffer=7))
    again.load_state_dict(state)
    got += [r for b in again for r in rows(b)]
    assert got == whole


def test_parquet_rows_give_their_caption_column_with_each_image(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    keys = [f"row{i:03d}" for i in range(N)]
    table = pa.table({"image": [jpeg(i) for i in range(N)],
                      "caption": [caption(k) for k in keys],
                      "id": list(range(N))})
    path = tmp_path / "rows.parquet"
    pq.write_table(table, path, row_group_size=6)
    src = flowgate.Parquet(str(path), column="image")
    l = flowgate.ImageLoader(src, labels="id", fields={"caption": "caption"}, **ARGS)
    got = []
    for b in l:
        assert set(b) == {"image", "label", "caption"}
        for i, cap in zip(np.asarray(b["label"]), b["caption"]):
            assert cap == caption(keys[int(i)])
            got.append(int(i))
    assert sorted(got) == list(range(N))
    # Resumed after two batches: the same rows, captions and all.
    whole = [(int(i), c) for b in flowgate.ImageLoader(src, labels="id", fields={
        "caption": "caption"}, **ARGS) for i, c in zip(np.asarray(b["label"]), b["caption"])]
    first = flowgate.ImageLoader(src, labels="id", fields={"caption": "caption"}, **ARGS)
    it = iter(first)
    part = [(int(i), c) for _ in range(2) for b in [next(it)]
            for i, c in zip(np.asarray(b["label"]), b["caption"])]
    state = first.state_dict()
    del it
    again = flowgate.ImageLoader(src, labels="id", fields={"caption": "caption"}, **ARGS)
    again.load_state_dict(state)
    part += [(int(i), c) for b in again for i, c in zip(np.asarray(b["label"]), b["caption"])]
    assert part == whole
    with pytest.raises(ValueError, match='no column "text"'):
        flowgate.ImageLoader(src, fields={"caption": "text"}, **ARGS)


def test_a_missing_or_unreadable_field_follows_the_failure_policy_or_is_none(tmp_path):
    pattern = write_shards(tmp_path / "gaps", gap=7, bad_json=12)
    l = loader(flowgate.Shards(pattern))
    got = [r for b in l for r in rows(b)]
    assert sorted(k for k, _, _ in got) == [f"k{i:05d}" for i in range(N) if i not in (7, 12)]
    failures = l.stats()["recent_failures"] if "recent_failures" in l.stats() else None
    assert l.stats()["failures"] == 2, failures
    with pytest.raises(flowgate.LoaderError, match='field "caption"|field "meta"'):
        list(loader(flowgate.Shards(pattern), skip_errors=False))
    optional = loader(flowgate.Shards(pattern), fields={
        "caption": {"from": "txt", "optional": True}, "raw": {"from": "json", "kind": "bytes"}})
    n = 0
    for b in optional:
        for path, cap, raw in zip(b["path"], b["caption"], b["raw"]):
            key = path.rsplit(":", 1)[1].split(".")[0]
            assert cap == (None if key == "k00007" else caption(key))
            assert isinstance(raw, bytes) and (raw == b"{oops") == (key == "k00012")
            n += 1
    assert n == N


def test_fields_as_torch_and_what_cannot_carry_them_is_refused(shards, tmp_path):
    torch = pytest.importorskip("torch")
    b = next(iter(loader(flowgate.Shards(shards), output="torch")))
    assert isinstance(b["image"], torch.Tensor) and isinstance(b["label"], torch.Tensor)
    rows({**b, "image": b["image"].numpy(), "label": b["label"].numpy()})
    with pytest.raises(ValueError, match="is a key the batch already has"):
        loader(flowgate.Shards(shards), fields={"label": "txt"})
    with pytest.raises(ValueError, match="kind must be"):
        loader(flowgate.Shards(shards), fields={"c": {"from": "txt", "kind": "str"}})
    with pytest.raises(ValueError, match=r"remote decoding: .*not a sample's other fields \(fields\)"):
        loader(flowgate.Shards(shards), remote=flowgate.Ray(workers=1))


def test_a_daemon_thread_iterating_a_loader_at_exit_is_clean(shards):
    """A daemon thread waiting for a batch when the interpreter stopped
    aborted the process ("FATAL: exception not rethrown")."""
    code = ("import queue, threading, flowgate\n"
            f"L = flowgate.ImageLoader(flowgate.Shards({shards!r}), batch_size=2, resize=16,"
            " crop=16, fields={'c': 'txt'})\n"
            "q = queue.Queue(maxsize=1000)\n"
            "def prefetch():\n"
            "    while True:\n"
            "        for b in L: q.put(b)\n"
            "threading.Thread(target=prefetch, daemon=True).start()\n"
            "for _ in range(3): q.get()\n")
    run_clean(code, times=4)


def test_a_field_named_as_a_mixtures_label_is_refused(shards, tmp_path):
    with pytest.raises(ValueError, match="is a key the batch already has"):
        flowgate.ImageLoader(flowgate.Mix([flowgate.Shards(shards)], weights=[1.0], draws=8,
                                          labels=["cls"]), fields={"label": "txt"}, **ARGS)


def test_loose_files_read_their_fields_from_the_files_beside_them(tmp_path):
    """A folder of a.jpg + a.txt + a.json (the media's extension replaced by the field's):
    each image's caption and record are its own, across two ranks; one without its caption
    is a failed item naming the file looked for, or None when optional."""
    n = 23
    for i in range(n):
        (tmp_path / f"p{i:03d}.jpg").write_bytes(jpeg(i))
        if i != 4:
            (tmp_path / f"p{i:03d}.txt").write_text(caption(f"p{i:03d}"))
        (tmp_path / f"p{i:03d}.json").write_text(json.dumps({"key": f"p{i:03d}"}))
    seen, failed = [], []
    for rank in range(2):
        l = flowgate.ImageLoader(str(tmp_path), fields=FIELDS, return_paths=True, rank=rank,
                                 world_size=2, **ARGS)
        for b in l:
            assert set(b) == {"image", "path", "caption", "meta"}
            for path, cap, meta in zip(b["path"], b["caption"], b["meta"]):
                key = path.rsplit("/", 1)[1].split(".")[0]
                assert cap == caption(key) and meta["key"] == key, (path, cap, meta)
                seen.append(key)
        failed += l.failures()
    assert len(failed) == 1 and "p004.txt" in failed[0][2], failed
    assert sorted(set(seen)) == [f"p{i:03d}" for i in range(n) if i != 4]
    optional = flowgate.ImageLoader(str(tmp_path), return_paths=True, fields={
        "caption": {"from": "txt", "optional": True}}, **ARGS)
    none = [p for b in optional for p, c in zip(b["path"], b["caption"]) if c is None]
    assert [p.rsplit("/", 1)[1] for p in none] == ["p004.jpg"]


def shade(n):
    """The value of every pixel of `jpeg(n)`."""
    return (n * 5) % 256


def write_pairs(out):
    """Shards of KEY.jpg (sample i's shade), KEY.depth.jpg (sample i + 20's), KEY.cls and
    KEY.txt."""
    out.mkdir(parents=True, exist_ok=True)
    for s in range(0, N, 10):
        with tarfile.open(out / f"p-{s // 10}.tar", "w") as tar:
            for i in range(s, min(N, s + 10)):
                key = f"k{i:05d}"
                for ext, body in (("jpg", jpeg(i)), ("depth.jpg", jpeg(i + 20)),
                                  ("cls", str(i).encode()), ("txt", caption(key).encode())):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
    return f"{out}/p-{{0..{(N - 1) // 10}}}.tar"


DEPTH = {"from": "depth.jpg", "kind": "image", "resize": 12, "crop": 8}


def check_pairs(b, depth_shape=(8, 8)):
    """Each row's second image is its own sample's (its shade), of its own recipe's size."""
    images, depth = np.asarray(b["image"]), np.asarray(b["depth"])
    labels = np.asarray(b["label"])
    assert depth.shape == (len(labels), 3) + depth_shape and images.shape[2:] == (16, 16)
    for k, n in enumerate(labels):
        assert abs(images[k].mean() - shade(int(n))) < 3, (n, images[k].mean())
        assert abs(depth[k].mean() - shade(int(n) + 20)) < 3, (n, depth[k].mean())
    return labels.tolist()


def test_a_sample_of_two_images_gives_both_from_shards_and_parquet(tmp_path):
    pattern = write_pairs(tmp_path / "pairs")
    seen = []
    for rank in range(2):
        l = flowgate.ImageLoader(flowgate.Shards(pattern), labels="cls", rank=rank, world_size=2,
                                 fields={"depth": DEPTH, "caption": "txt"}, **ARGS)
        for b in l:
            assert list(b) == ["image", "depth", "label", "caption"]
            labels = check_pairs(b)
            assert b["caption"] == [caption(f"k{n:05d}") for n in labels]
            seen += labels
    assert sorted(set(seen)) == list(range(N)) and len(seen) == 44, "equal counts"
    # The per-item function sees it as media.
    l = flowgate.ImageLoader(flowgate.Shards(pattern), labels="cls", fields={"depth": DEPTH},
                             map=lambda s: {**s, "depth": 255 - np.asarray(s["depth"])}, **ARGS)
    for b in l:
        labels = np.asarray(b["label"])
        for k, n in enumerate(labels):
            assert abs(np.asarray(b["depth"])[k].mean() - (255 - shade(int(n) + 20))) < 3
    # Parquet: a second binary column.
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    table = pa.table({"image": [jpeg(i) for i in range(N)],
                      "depth": [jpeg(i + 20) for i in range(N)], "id": list(range(N))})
    pq.write_table(table, tmp_path / "pairs.parquet", row_group_size=6)
    l = flowgate.ImageLoader(flowgate.Parquet(str(tmp_path / "pairs.parquet"), column="image"),
                             labels="id", fields={"depth": dict(DEPTH, **{"from": "depth"})},
                             **ARGS)
    assert sorted(n for b in l for n in check_pairs(b)) == list(range(N))


def test_a_second_image_broken_fails_its_item_and_what_cannot_be_is_refused(tmp_path):
    out = tmp_path / "broken"
    out.mkdir()
    with tarfile.open(out / "b-0.tar", "w") as tar:
        for i in range(9):
            key = f"k{i:05d}"
            for ext, body in (("jpg", jpeg(i)), ("depth.jpg", jpeg(i)[:30] if i == 4 else jpeg(i)),
                              ("cls", str(i).encode())):
                info = tarfile.TarInfo(f"{key}.{ext}")
                info.size = len(body)
                tar.addfile(info, io.BytesIO(body))
    l = flowgate.ImageLoader(flowgate.Shards(str(out / "b-0.tar")), labels="cls",
                             fields={"depth": DEPTH}, **ARGS)
    got = sorted(n for b in l for n in np.asarray(b["label"]).tolist())
    assert got == [0, 1, 2, 3, 5, 6, 7, 8]
    (failure,) = l.failures()
    assert "k00004" in failure[1] and 'field "depth"' in failure[2], failure
    with pytest.raises(ValueError, match="a media field is required"):
        flowgate.ImageLoader(flowgate.Shards(str(out / "b-0.tar")),
                             fields={"depth": dict(DEPTH, optional=True)}, **ARGS)
    with pytest.raises(ValueError, match="depth.*crop"):
        flowgate.ImageLoader(flowgate.Shards(str(out / "b-0.tar")),
                             fields={"depth": dict(DEPTH, crop=0)}, **ARGS)
