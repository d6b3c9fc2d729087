import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def data() -> pathlib.Path:
    """A small generated dataset: 40 JPEGs and 8 FLAC clips (flowgate gen-data)."""
    d = pathlib.Path(os.environ.get("FLOWGATE_TEST_DATA", ROOT / "target" / "pytest-data"))
    if not (d / "images.txt").exists() or not (d / "audio.txt").exists():
        subprocess.run(
            ["cargo", "run", "--quiet", "--locked", "--bin", "flowgate", "--",
             "gen-data", "--out", str(d), "--images", "40", "--audio", "8"],
            cwd=ROOT, check=True,
        )
    return d
