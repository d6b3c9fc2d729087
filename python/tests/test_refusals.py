"""The Python loaders refuse the numbers of tests/data/refusals.json with the words every
front end says (tests/refusals.rs holds pipeline files to the same table): the library checks
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


@pytest.mark.parametrize("case", CASES, ids=[f"{c['key']}-{i}" for i, c in enumerate(CASES)])
def test_a_python_loader_refuses_each_number_in_the_shared_words(case, data, tmp_path):
    with pytest.raises(ValueError) as e:
        if "shards" in case:
            flowgate.Shards(str(tmp_path / "s.tar"), **_numbers(case["shards"]))
        else:
            cls = getattr(flowgate, case.get("python_loader", "ImageLoader"))
            cls(data / "images.txt", **_numbers(case["python"]))
    said = str(e.value)
    assert said.startswith(case["key"]) and said.endswith(case["says"]), said


def test_the_table_covers_every_limit_the_issue_names():
    keys = {c["key"] for c in CASES}
    assert {"batch_size", "prefetch", "cache_mb", "workers", "buffer", "memory_mb"} <= keys
