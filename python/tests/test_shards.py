"""WebDataset tar shards through the Python loaders: written by Python's own tarfile (pax
headers), labels from `cls`, the same pixels as the loose files, ranks, exact resume, and
damaged shards reported by shard and key."""

import io
import tarfile

import numpy as np
import pytest

import flowgate


def paths_of(data):
    return [str(p) for p in sorted((data / "images").glob("*.jpg"))]


def write_shards(paths, out, per_shard=10):
    """KEY.jpg + KEY.cls (the image's number times 3) + KEY.json, `per_shard` a shard, as
    webdataset's writers lay them out (tarfile's default format: pax)."""
    out.mkdir(parents=True, exist_ok=True)
    for s in range(0, len(paths), per_shard):
        with tarfile.open(out / f"shard-{s // per_shard:06d}.tar", "w") as tar:
            for i in range(s, min(len(paths), s + per_shard)):
                key = f"sample{i:04d}"
                tar.add(paths[i], arcname=f"{key}.jpg")
                for ext, body in (("cls", str(3 * i)), ("json", f'{{"i": {i}}}')):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    raw = body.encode()
                    info.size = len(raw)
                    tar.addfile(info, io.BytesIO(raw))
    return f"{out}/shard-{{000000..{(len(paths) - 1) // per_shard:06d}}}.tar"


ARGS = dict(batch_size=4, crop=32, resize=32, seed=5, workers=1)


def by_label(loader):
    out = {}
    for images, labels, names in loader:
        for img, lab, name in zip(np.asarray(images), np.asarray(labels), names):
            assert int(lab) not in out, f"label {lab} twice"
            out[int(lab)] = (img.copy(), name)
    return out


def test_shards_give_the_files_pixels_and_labels(data, tmp_path):
    paths = paths_of(data)
    pattern = write_shards(paths, tmp_path / "shards")
    loader = flowgate.ImageLoader(flowgate.Shards(pattern, buffer=8), labels="cls",
                                  return_paths=True, **ARGS)
    assert len(loader) == 10
    got = by_label(loader)
    assert sorted(got) == [3 * i for i in range(len(paths))]
    # The same images decoded from the loose files (labels given by index).
    files = flowgate.ImageLoader(paths, labels=[3 * i for i in range(len(paths))],
                                 return_paths=True, shuffle=False, **ARGS)
    want = by_label(files)
    for lab, (img, name) in got.items():
        assert np.array_equal(img, want[lab][0]), name
        assert name.endswith(f":sample{lab // 3:04d}")
    # A directory works as well as the pattern, and the order changes between epochs.
    d = flowgate.ImageLoader(flowgate.Shards(tmp_path / "shards", buffer=8), labels="cls",
                             return_paths=True, **ARGS)
    e0 = [n for _, _, names in d for n in names]
    e1 = [n for _, _, names in d for n in names]
    assert sorted(e0) == sorted(e1) and e0 != e1


def test_damaged_shards_are_failures_naming_shard_and_key(data, tmp_path):
    out = tmp_path / "shards"
    write_shards(paths_of(data)[:20], out)
    good = (out / "shard-000001.tar").read_bytes()
    (out / "shard-000002.tar").write_bytes(good[: len(good) // 2])   # cut mid-sample
    (out / "shard-000003.tar").write_bytes(b"not a tar file" * 100)
    loader = flowgate.ImageLoader(flowgate.Shards(out), labels="cls", **ARGS)
    n = sum(len(np.asarray(lab)) for _, lab in loader)
    assert 20 < n < 30
    failures = loader.failures()
    assert len(failures) == 2, failures
    text = "\n".join(m for _, _, m in failures)
    assert "shard-000002.tar, sample sample001" in text and "truncated" in text
    assert "shard-000003.tar, sample @byte 0" in text and "not a tar header" in text
    strict = flowgate.ImageLoader(flowgate.Shards(out), labels="cls", skip_errors=False, **ARGS)
    with pytest.raises(flowgate.LoaderError, match="shard-00000"):
        for _ in strict:
            pass
    with pytest.raises(FileNotFoundError):
        flowgate.ImageLoader(flowgate.Shards(tmp_path / "none-{0..3}.tar"))
    with pytest.raises(ValueError, match="labels names the field"):
        flowgate.ImageLoader(flowgate.Shards(out), labels=[1, 2, 3])


def test_a_label_field_no_sample_has_is_an_error_not_an_empty_epoch(data, tmp_path):
    pattern = write_shards(paths_of(data), tmp_path / "shards")
    loader = flowgate.ImageLoader(flowgate.Shards(pattern), labels="cat", **ARGS)
    with pytest.raises(flowgate.LoaderError, match="delivered nothing.*no field cat"):
        for _ in loader:
            pass
