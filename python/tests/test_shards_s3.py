"""Tar shards and Parquet on S3 through the Python loaders, against a real S3-compatible
server (s3s-fs, which `scripts/setup.sh --test` installs) started on 127.0.0.1 for each test
and stopped after it: the same pixels and labels as the local shards and Parquet file,
shards through the disk cache, and a missing shard named."""


import numpy as np
import pytest

import flowgate
from faults import s3_store
from test_shards import ARGS, by_label, paths_of, write_shards


def _has_s3() -> bool:
    try:
        flowgate.ImageLoader(flowgate.Shards("s3://x/y.tar"), **ARGS)
    except ValueError as e:
        return "`s3` feature" not in str(e)
    except Exception:
        return True
    return True


@pytest.fixture
def s3_root(tmp_path, monkeypatch):
    """A server over a folder: its subfolders are buckets, their files objects."""
    for root, _ in s3_store(tmp_path, monkeypatch, faults=False, available=_has_s3()):
        yield root


def test_shards_on_s3_give_the_local_shards_pixels_and_labels(data, tmp_path, s3_root):
    paths = paths_of(data)
    pattern = write_shards(paths, s3_root / "data" / "train")
    want = by_label(flowgate.ImageLoader(flowgate.Shards(pattern, buffer=8), labels="cls",
                                         return_paths=True, **ARGS))
    url = "s3://data/train/" + pattern.rsplit("/", 1)[1]
    cache = tmp_path / "cache"
    loader = flowgate.ImageLoader(
        flowgate.Shards(url, buffer=8, cache_dir=cache, cache_mb=64), labels="cls",
        return_paths=True, **ARGS)
    got = by_label(loader)
    assert sorted(got) == sorted(want)
    for lab, (img, name) in got.items():
        assert np.array_equal(img, want[lab][0]), name
        assert name.startswith("s3://data/train/shard-"), name
    assert list((cache / "data" / "train").glob("shard-*.tar@*")), "shards in the disk cache"
    # A second epoch from the cache gives the same samples.
    assert sorted(by_label(loader)) == sorted(want)
    # The shards' prefetch is the decode stage's read-ahead, which the tuner may deepen.
    assert loader.stats()["stages"]["decode"]["read_ahead"] >= 2


def test_a_missing_shard_on_s3_is_named(data, tmp_path, s3_root):
    write_shards(paths_of(data)[:10], s3_root / "data" / "train")
    with pytest.raises(ValueError, match=r"s3://data/train/shard-000001.tar: no such shard"):
        flowgate.ImageLoader(
            flowgate.Shards("s3://data/train/shard-{000000..000001}.tar",
                            cache_dir=tmp_path / "cache"), **ARGS)


def test_parquet_on_s3_gives_the_local_files_rows(data, tmp_path, s3_root):
    pytest.importorskip("pyarrow")
    from test_parquet import write as write_parquet
    paths = paths_of(data)
    (s3_root / "data" / "hf").mkdir(parents=True)
    local = write_parquet(paths, s3_root / "data" / "hf" / "train.parquet")
    want = {}
    for images, labels in flowgate.ImageLoader(flowgate.Parquet(local), labels="label", **ARGS):
        for img, lab in zip(np.asarray(images), np.asarray(labels)):
            want[int(lab)] = img.copy()
    got = {}
    remote = flowgate.ImageLoader(flowgate.Parquet("s3://data/hf/"), labels="label", **ARGS)
    for images, labels in remote:
        for img, lab in zip(np.asarray(images), np.asarray(labels)):
            assert int(lab) not in got
            got[int(lab)] = img.copy()
    assert sorted(got) == sorted(want) == [7 * i for i in range(len(paths))]
    for lab, img in got.items():
        assert np.array_equal(img, want[lab]), lab


def test_a_list_of_s3_urls_is_read_from_s3(data, s3_root):
    """A Python list of s3:// URLs is read from S3 (it was read as local paths: every item
    failed), as the library's file lists and list files are: the same pixels as the local
    files, in the list's order."""
    import shutil
    local = paths_of(data)[:9]
    (s3_root / "data" / "img").mkdir()
    for i, p in enumerate(local):
        shutil.copy(p, s3_root / "data" / "img" / f"{i}.jpg")
    urls = [f"s3://data/img/{i}.jpg" for i in range(len(local))]
    args = dict(ARGS, shuffle=False)
    on_s3 = [np.asarray(b) for b in flowgate.ImageLoader(urls, **args)]
    here = [np.asarray(b) for b in flowgate.ImageLoader(local, **args)]
    assert len(on_s3) == len(here) and all((a == b).all() for a, b in zip(on_s3, here))
    with pytest.raises(ValueError, match="all s3:// URLs of one bucket"):
        flowgate.ImageLoader(urls[:2] + [local[2]], **args)
