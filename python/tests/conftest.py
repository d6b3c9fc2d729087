import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def gen_data(out: pathlib.Path, *args: str) -> None:
    """Runs `flowgate gen-data --out OUT ARGS...` (the sample dataset generator)."""
    subprocess.run(
        ["cargo", "run", "--quiet", "--locked", "-p", "flowgate-cli", "--bin", "flowgate", "--",
         "gen-data", "--out", str(out), *args],
        cwd=ROOT, check=True,
    )


@pytest.fixture(scope="session")
def data() -> pathlib.Path:
    """A small generated dataset: 40 JPEGs and 8 FLAC clips (flowgate gen-data)."""
    d = pathlib.Path(os.environ.get("FLOWGATE_TEST_DATA", ROOT / "target" / "pytest-data"))
    if not (d / "images.txt").exists() or not (d / "audio.txt").exists():
        gen_data(d, "--images", "40", "--audio", "8")
    return d


@pytest.fixture(scope="session")
def videos() -> pathlib.Path:
    """Four generated MP4 clips (H.264 + an AAC tone; flowgate gen-data, which runs ffmpeg)."""
    d = pathlib.Path(os.environ.get("FLOWGATE_TEST_VIDEO", ROOT / "target" / "pytest-video"))
    if not (d / "video.txt").exists():
        gen_data(d, "--images", "0", "--video", "4")
    return d
