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
    # A memory budget that cannot hold a batch at the cap (it ran 270 KB batches under 10 KiB).
    with pytest.raises(ValueError, match="cannot hold a batch in flight"):
        flowgate.AudioLoader(clips, max_batch_seconds=3600, memory_mb=0.01)


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


def transcript(key):
    return f"what {key} says, naïvely"


def speech_shards(clips, out, faults=False, per_shard=7):
    """A speech corpus as WebDataset shards: KEY.flac, KEY.txt (a transcript naming KEY);
    with `faults`, one clip whose frames are zeros and one without its transcript.
    Returns the pattern and each good key's length in samples (its header's)."""
    import io
    import tarfile
    files = open(clips).read().split()
    samples, keys = [], []
    for i, f in enumerate(files):
        key = f"utt{i:04d}"
        keys.append(key)
        samples.append([(f"{key}.flac", pathlib.Path(f).read_bytes()),
                        (f"{key}.txt", transcript(key).encode())])
    if faults:
        good = pathlib.Path(files[0]).read_bytes()
        samples.insert(5, [("bad.flac", good[:200] + b"\x00" * 4000),
                           ("bad.txt", transcript("bad").encode())])
        samples.insert(13, [("untold.flac", good)])
    out.mkdir(parents=True, exist_ok=True)
    count = 0
    for s in range(0, len(samples), per_shard):
        with tarfile.open(out / f"sp-{count:02d}.tar", "w") as tar:
            for members in samples[s:s + per_shard]:
                for name, body in members:
                    info = tarfile.TarInfo(name)
                    info.size = len(body)
                    tar.addfile(info, io.BytesIO(body))
        count += 1
    return f"{out}/sp-{{00..{count - 1:02d}}}.tar", dict(zip(keys, files))


def speech_rows(batch):
    """(key, transcript, length) per row, checking each transcript is its clip's."""
    assert set(batch) == {"audio", "lengths", "path", "text"}
    a, n = np.asarray(batch["audio"]), np.asarray(batch["lengths"])
    assert a.shape[0] == len(n) == len(batch["path"]) == len(batch["text"])
    assert a.shape[0] * a.shape[1] <= CAP * RATE and a.shape[1] == n.max()
    out = []
    for path, text, k in zip(batch["path"], batch["text"], n):
        key = path.rsplit(":", 1)[1]
        assert text == transcript(key), (path, text)
        out.append((key, text, int(k)))
    return out


def speech_loader(src, **kw):
    return flowgate.AudioLoader(src, max_batch_seconds=CAP, buckets=5, return_paths=True,
                                fields={"text": "txt"}, seed=4, **kw)


def test_speech_shards_batch_by_length_with_each_transcript_beside_its_clip(clips, tmp_path):
    """FLAC + transcript shards in length-aware batches: each row's transcript is its clip's
    and its length is the one that clip's file gives alone; every good clip once across 3
    ranks (equal batch counts), the corrupt clip and the one without a transcript counted by
    name; resumed exactly from a mid-epoch state_dict, still aligned."""
    pattern, files = speech_shards(clips, tmp_path / "faults", faults=True)
    alone = {}
    for audio, lengths, paths in flowgate.AudioLoader(clips, max_batch_seconds=CAP,
                                                      return_paths=True):
        alone.update(zip(paths, np.asarray(lengths).tolist()))
    seen, counts, failed = Counter(), [], set()
    for rank in range(3):
        l = speech_loader(flowgate.Shards(pattern), rank=rank, world_size=3)
        batches = list(l)
        counts.append(len(batches))
        assert len(batches) == len(l)
        for b in batches:
            for key, _, k in speech_rows(b):
                assert k == alone[files[key]], key
                seen[key] += 1
        failed |= {item.rsplit(":", 1)[1] for _, item, _ in l.failures()}
        assert l.stats()["failures"] == len(l.failures())
    assert len(set(counts)) == 1, counts
    assert set(seen) == set(files), "every good clip"
    assert failed == {"bad", "untold"}

    good, _ = speech_shards(clips, tmp_path / "good")
    whole = [r for b in speech_loader(flowgate.Shards(good)) for r in speech_rows(b)]
    assert sorted(k for k, _, _ in whole) == sorted(files)
    first = speech_loader(flowgate.Shards(good))
    it = iter(first)
    got = [r for _ in range(2) for r in speech_rows(next(it))]
    state = first.state_dict()
    del it
    again = speech_loader(flowgate.Shards(good))
    again.load_state_dict(state)
    got += [r for b in again for r in speech_rows(b)]
    assert got == whole, "the rest, exactly, in the same batches"


def test_speech_parquet_rows_batch_by_length_with_their_text_column(clips, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    files = open(clips).read().split()
    keys = [f"row{i:03d}" for i in range(len(files))]
    table = pa.table({"audio": [pathlib.Path(f).read_bytes() for f in files],
                      "text": [transcript(k) for k in keys], "id": list(range(len(files)))})
    path = tmp_path / "speech.parquet"
    pq.write_table(table, path, row_group_size=4)
    l = flowgate.AudioLoader(flowgate.Parquet(str(path), column="audio"), labels="id",
                             max_batch_seconds=CAP, buckets=4, fields={"text": "text"})
    got = []
    for b in l:
        assert set(b) == {"audio", "lengths", "label", "text"}
        for i, text in zip(np.asarray(b["label"]), b["text"]):
            assert text == transcript(keys[int(i)])
            got.append(int(i))
    assert sorted(got) == list(range(len(files)))


def test_an_identity_map_gives_the_same_batches_lengths_and_all(clips):
    """A 0-d length went back as `[1]`, the batch's lengths `[B, 1]`."""
    plain = flowgate.AudioLoader(clips, batch_size=4, return_lengths=True, shuffle=False)
    mapped = flowgate.AudioLoader(clips, batch_size=4, return_lengths=True, shuffle=False,
                                  map=lambda s: s)
    for (a, n), (b, m) in zip(plain, mapped):
        assert np.asarray(n).shape == np.asarray(m).shape == (np.asarray(a).shape[0],)
        assert (np.asarray(n) == np.asarray(m)).all() and (np.asarray(a) == np.asarray(b)).all()


def test_length_batches_over_s3_are_refused_before_any_request():
    """The S3 listing came first, and its connection error."""
    for src in (flowgate.Shards("s3://bucket/speech-{00..03}.tar"),
                flowgate.Parquet("s3://bucket/speech.parquet", column="audio")):
        with pytest.raises(ValueError, match="not S3"):
            flowgate.AudioLoader(src, max_batch_seconds=CAP)


def test_keep_channels_gives_each_files_channels(clips):
    # A pipeline file's `decode.keep_channels`, which the Python loader lacked.
    mono = flowgate.AudioLoader(clips, batch_size=4, seconds=1.0, shuffle=False)
    kept = flowgate.AudioLoader(clips, batch_size=4, seconds=1.0, shuffle=False,
                                keep_channels=True)
    for a, b in zip(mono, kept):
        a, b = np.asarray(a), np.asarray(b)
        assert b.shape == (a.shape[0], 1, a.shape[1]) and (b[:, 0] == a).all()
    with pytest.raises(ValueError, match="length-aware batches of audio are mono"):
        flowgate.AudioLoader(clips, keep_channels=True, max_batch_seconds=CAP)
