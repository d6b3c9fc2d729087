"""Length-aware batches from Python: AudioLoader(max_batch_seconds=...) and VideoLoader(fps=..., max_batch_frames=...)."""

import os
import pathlib
from collections import Counter

import numpy as np
import pytest

import flowgate
from conftest import ROOT, gen_data

CAP, RATE = 30.0, 16000


@pytest.fixture(scope="module")
def clips() -> pathlib.Path:
    """30 FLAC clips of 1-12 s (flowgate gen-data --audio-seconds)."""
    d = pathlib.Path(os.environ.get("FLOWGATE_TEST_CLIPS", ROOT / "target" / "pytest-clips"))
    if not (d / "audio.txt").exists():
        gen_data(d, "--images", "0", "--audio", "30", "--audio-seconds", "1,12", "--seed", "3")
    return d / "audio.txt"


def epoch(loader):
    out = []
    for audio, lengths, paths in loader:
        a, n = np.asarray(audio), np.asarray(lengths)
        assert a.dtype == np.float32 and a.ndim == 2 and a.shape[0] == len(n) == len(paths)
        assert a.shape[0] * a.shape[1] <= CAP * RATE, "over the cap"
        assert a.shape[1] == n.max(), "padded to the longest clip only"
        for row, k in enumerate(n):
            assert not a[row, k:].any(), "zeros after a clip's length"
        out.append(tuple(paths))
    return out


def test_batches_by_length_cover_each_clip_once_under_the_cap(clips):
    files = open(clips).read().split()
    loader = flowgate.AudioLoader(clips, max_batch_seconds=CAP, buckets=6, return_paths=True,
                                  seed=1)
    first = epoch(loader)
    assert len(first) == len(loader)
    assert sorted(p for b in first for p in b) == sorted(files), "each clip once"
    second = epoch(loader)
    assert sorted(map(sorted, first)) != sorted(map(sorted, second)), "new batches per epoch"
    # Fewer rows than a fixed batch would need for the short clips, more for the long ones.
    assert len({len(b) for b in first}) > 1


def test_a_bad_clip_is_left_out_and_named(clips, tmp_path):
    files = open(clips).read().split()
    bad = tmp_path / "bad.flac"
    # A FLAC header that declares a length, then garbage: planned, then fails to decode.
    good = pathlib.Path(files[0]).read_bytes()
    bad.write_bytes(good[:200] + b"\x00" * 4000)
    loader = flowgate.AudioLoader(files + [str(bad)], max_batch_seconds=CAP, buckets=4,
                                  return_paths=True)
    got = [p for b in epoch(loader) for p in b]
    assert sorted(got) == sorted(files)
    assert [item for _, item, _ in loader.failures()] == [str(bad)]
    assert loader.stats()["failures"] == 1, "counted as a failed item"
    # Fail-fast: the clip stops the epoch with an error naming it.
    strict = flowgate.AudioLoader(files + [str(bad)], max_batch_seconds=CAP, buckets=4,
                                  return_paths=True, skip_errors=False)
    with pytest.raises(Exception, match="bad.flac"):
        epoch(strict)
    with pytest.raises(ValueError, match="max_batch_seconds"):
        flowgate.AudioLoader(clips, max_batch_seconds=0)
    with pytest.raises(ValueError, match="buckets"):
        flowgate.AudioLoader(clips, max_batch_seconds=CAP, buckets=0)


def test_video_batches_by_frames_cover_each_clip_once_under_the_cap(videos):
    """VideoLoader(fps=, max_batch_frames=): each clip's frames follow its length; batches
    of similar lengths padded to their longest, at most the cap of padded frames."""
    cap = 24
    files = open(videos / "video.txt").read().split()
    loader = flowgate.VideoLoader(videos / "video.txt", fps=2.0, max_batch_frames=cap,
                                  buckets=2, resize=32, crop=32, return_paths=True, seed=5)
    seen = []
    for frames, lengths, paths in loader:
        f, n = np.asarray(frames), np.asarray(lengths)
        assert f.dtype == np.uint8 and f.shape[2:] == (32, 32, 3)
        assert f.shape[0] == len(n) == len(paths)
        assert f.shape[0] * f.shape[1] <= cap, "over the cap"
        assert f.shape[1] == n.max(), "padded to the longest clip only"
        for row, k in enumerate(n):
            assert 1 <= k <= cap
            assert not f[row, k:].any(), "zeros after a clip's frames"
            assert all(f[row, j].any() for j in range(k)), "real frames are not blank"
        seen += paths
    assert Counter(seen) == Counter(files), "every clip once"
    # The clips of a batch decode with the tuner's threads per clip, as single clips do.
    threads = loader.stats()["stages"]["decode"]["item_threads"]
    assert 1 <= threads <= os.cpu_count()
    with pytest.raises(ValueError, match="fps must be set"):
        flowgate.VideoLoader(videos / "video.txt", max_batch_frames=cap)
    with pytest.raises(ValueError, match="nthwc"):
        flowgate.VideoLoader(videos / "video.txt", fps=2.0, max_batch_frames=cap,
                             layout="ncthw")
