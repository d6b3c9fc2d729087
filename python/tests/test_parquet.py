"""Parquet in the Hugging Face image layout, written by pyarrow: the loaders read the right
images (the same pixels as the files the bytes came from) and labels, shard by row group,
resume exactly, and name bad rows."""

import numpy as np
import pytest

import flowgate

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def paths_of(data):
    return [str(p) for p in sorted((data / "images").glob("*.jpg"))]


def write(paths, out, corrupt=()):
    """image: struct<bytes, path> (the `datasets` Image feature), label: int64 (7 * i),
    caption: string; row groups of 15 rows."""
    images = []
    for i, p in enumerate(paths):
        raw = open(p, "rb").read() if i not in corrupt else b"not an image"
        images.append({"bytes": raw, "path": p})
    table = pa.table({
        "image": images,
        "label": pa.array([7 * i for i in range(len(paths))], pa.int64()),
        "caption": [f"picture {i}" for i in range(len(paths))],
    })
    assert pa.types.is_struct(table.schema.field("image").type)
    pq.write_table(table, out, row_group_size=15)
    return out


ARGS = dict(batch_size=4, crop=32, resize=32, seed=2, workers=1)


def labelled(loader):
    out = {}
    for images, labels in loader:
        for img, lab in zip(np.asarray(images), np.asarray(labels)):
            assert int(lab) not in out
            out[int(lab)] = img.copy()
    return out


def test_hugging_face_layout_gives_the_files_pixels_and_labels(data, tmp_path):
    paths = paths_of(data)
    f = write(paths, tmp_path / "train-00000-of-00001.parquet")
    loader = flowgate.ImageLoader(flowgate.Parquet(f, buffer=8), labels="label", **ARGS)
    assert len(loader) == 10
    got = labelled(loader)
    assert sorted(got) == [7 * i for i in range(len(paths))]
    files = labelled(flowgate.ImageLoader(paths, labels=[7 * i for i in range(len(paths))],
                                          shuffle=False, **ARGS))
    for lab, img in got.items():
        assert np.array_equal(img, files[lab]), lab
    # A directory of files reads the same rows.
    d = flowgate.ImageLoader(flowgate.Parquet(tmp_path), labels="label", **ARGS)
    assert sorted(labelled(d)) == sorted(got)


def test_ranks_resume_and_bad_rows(data, tmp_path):
    f = write(paths_of(data), tmp_path / "t.parquet", corrupt={5})
    pqs = flowgate.Parquet(f, buffer=6)
    seen = []
    for rank in range(2):
        loader = flowgate.ImageLoader(pqs, labels="label", rank=rank, world_size=2, **ARGS)
        seen += [int(x) for _, lab in loader for x in np.asarray(lab)]
        fails = loader.failures()
        assert all(":rg0/row5" in m for _, _, m in fails), fails
    assert sorted(seen) == [7 * i for i in range(40) if i != 5]

    whole = [int(x) for _, lab in flowgate.ImageLoader(pqs, labels="label", **ARGS)
             for x in np.asarray(lab)]
    first = flowgate.ImageLoader(pqs, labels="label", **ARGS)
    it = iter(first)
    head = [int(x) for _ in range(4) for x in np.asarray(next(it)[1])]
    state = first.state_dict()
    again = flowgate.ImageLoader(pqs, labels="label", **ARGS)
    again.load_state_dict(state)
    # The same rows, each once (collate on two workers, as the tuner may give it, can swap
    # whole batches, so the order is not compared).
    assert sorted(head + [int(x) for _, lab in again for x in np.asarray(lab)]) == sorted(whole)

    with pytest.raises(ValueError, match="no column \"jpg\""):
        flowgate.ImageLoader(flowgate.Parquet(f, column="jpg"))
    with pytest.raises(FileNotFoundError):
        flowgate.ImageLoader(flowgate.Parquet(tmp_path / "missing.parquet"))
