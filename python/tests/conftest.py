import os
import pathlib
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def unreadable(folder: pathlib.Path, n: int) -> list:
    """`n` files named like JPEGs that are not (paths as strings)."""
    folder.mkdir(parents=True, exist_ok=True)
    out = []
    for i in range(n):
        b = folder / f"bad-{i}.jpg"
        b.write_bytes(b"not a jpeg")
        out.append(str(b))
    return out


def with_unreadable(data: pathlib.Path, folder: pathlib.Path) -> list:
    """The 40 test JPEGs (sorted) with a run of 9 unreadable files after the 20th: with
    `seed=2`, 3 ranks and batches of 3, ranks skip different numbers of them (the fill tests'
    case)."""
    good = sorted(str(p) for p in (data / "images").glob("*.jpg"))
    return good[:20] + unreadable(folder, 9) + good[20:]


def flowgate_command() -> list:
    """The `flowgate` command: `$FLOWGATE_CLI` where the test command built it already
    (scripts/test.sh), else `cargo run` (a build of its own features)."""
    cli = os.environ.get("FLOWGATE_CLI")
    if cli:
        return [cli]
    return ["cargo", "run", "--quiet", "--locked", "-p", "flowgate-cli", "--bin", "flowgate",
            "--"]


def gen_data(out: pathlib.Path, *args: str) -> None:
    """Runs `flowgate gen-data --out OUT ARGS...` (the sample dataset generator)."""
    subprocess.run([*flowgate_command(), "gen-data", "--out", str(out), *args], cwd=ROOT,
                   check=True)


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


def run_clean(code: str, times: int = 1) -> str:
    """Runs `code` in a fresh interpreter `times` times: each must exit 0 with no traceback,
    panic or deadlock on stderr (an abort at exit is a failure). Returns the last stdout."""
    import subprocess
    import sys
    for _ in range(times):
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr[-3000:]
        assert "deadlock" not in r.stderr and "panicked" not in r.stderr, r.stderr[-3000:]
    return r.stdout
