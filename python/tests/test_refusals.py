"""The Python loaders refuse the numbers of tests/data/refusals.json with the words every
front end says (tests/integration/refusals.rs holds pipeline files to the same table): the library checks
them, once, whichever front end passes them."""

import json
import pathlib

import pytest

import flowgate

TABLE = pathlib.Path(__file__).parents[2] / "tests" / "data" / "refusals.json"
CASES = json.loads(TABLE.read_text())["cases"]


def _numbers(v):
    """The table's values with its names of the numbers JSON cannot hold as floats."""
    if isinstance(v, dict):
        return {k: _numbers(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_numbers(x) for x in v]
    return float(v) if v in ("inf", "-inf", "nan") else v


PYTHON = [c for c in CASES if {"python", "shards", "dataloader"} & set(c)]


@pytest.mark.parametrize("case", PYTHON, ids=[f"{c['key']}-{i}" for i, c in enumerate(PYTHON)])
def test_a_python_loader_refuses_each_number_in_the_shared_words(case, data, tmp_path):
    with pytest.raises(ValueError) as e:
        if "shards" in case:
            flowgate.Shards(str(tmp_path / "s.tar"), **_numbers(case["shards"]))
        elif "dataloader" in case:
            flowgate.DataLoader(list(range(10)), **_numbers(case["dataloader"]))
        else:
            cls = getattr(flowgate, case.get("python_loader", "ImageLoader"))
            cls(data / "images.txt", **_numbers(case["python"]))
    said = str(e.value)
    assert said.startswith(case["key"]) and said.endswith(case["says"]), said


def test_the_table_covers_every_limit_the_issue_names():
    keys = {c["key"] for c in PYTHON}
    assert {"batch_size", "prefetch", "cache_mb", "workers", "buffer", "memory_mb",
            "num_workers", "prefetch_factor"} <= keys


def test_any_python_value_is_refused_in_the_range_words(data, tmp_path):
    # Past 64 bits the loaders said "... is out of range", a complex or bytes "not a complex"
    # without the argument's name; every entrance now gives the range's words.
    import re
    for bad, shown in ((2**64, str(2**64)), (-(2**200), str(-(2**200))),
                       (1 + 2j, "(1+2j)"), (b"3", "b'3'")):
        def says(key, lo, hi):
            return rf"^{key}: must be in {lo}\.\.={hi}, not {re.escape(shown)}$"
        with pytest.raises(ValueError, match=says("batch_size", 1, 65536)):
            flowgate.ImageLoader(data / "images.txt", batch_size=bad)
        with pytest.raises(ValueError, match=says("workers", 1, 1024)):
            flowgate.ImageLoader(data / "images.txt", workers=bad)
        with pytest.raises(ValueError, match=says("buckets", 1, 1000)):
            flowgate.AudioLoader(data / "images.txt", buckets=bad)
        with pytest.raises(ValueError, match=says("batch_size", 1, 65536)):
            flowgate.DataLoader([1, 2, 3], batch_size=bad)
        with pytest.raises(ValueError, match=says("buffer", 0, 4294967296)):
            flowgate.Shards(str(tmp_path / "s.tar"), buffer=bad)
