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
            ["cargo", "run", "--quiet", "--locked", "-p", "flowgate-cli", "--bin", "flowgate", "--",
             "gen-data", "--out", str(d), "--images", "40", "--audio", "8"],
            cwd=ROOT, check=True,
        )
    return d


@pytest.fixture(scope="session")
def videos() -> pathlib.Path:
    """Four generated MP4 clips (H.264 + an AAC tone; flowgate gen-data, which runs ffmpeg)."""
    d = pathlib.Path(os.environ.get("FLOWGATE_TEST_VIDEO", ROOT / "target" / "pytest-video"))
    if not (d / "video.txt").exists():
        subprocess.run(
            ["cargo", "run", "--quiet", "--locked", "-p", "flowgate-cli", "--bin", "flowgate", "--",
             "gen-data", "--out", str(d), "--images", "0", "--video", "4"],
            cwd=ROOT, check=True,
        )
    return d
