"""VideoLoader from Python: frames, the audio track, labels and a broken clip; decoder threads
the tuner's unless pinned; random windows redrawn every epoch, reproducible, and resumed
exactly through chained checkpoints."""

import os

import numpy as np
import pytest

import flowgate


video = pytest.mark.skipif("video" not in flowgate.build_info()["features"],
                           reason="built without the video feature")


@video
def test_video_frames_audio_labels_and_a_broken_clip(videos, tmp_path):
    clips = (videos / "video.txt").read_text().split()
    broken = tmp_path / "broken.mp4"
    broken.write_bytes(b"\0\0\0\x18ftypmp42 truncated")
    paths = clips + [str(broken)]
    loader = flowgate.VideoLoader(paths, batch_size=3, frames=4, resize=64, crop=48,
                                  audio_seconds=0.5, labels=list(range(len(paths))),
                                  return_paths=True, shuffle=False)
    got = list(loader)
    assert sum(len(x) for x, *_ in got) == 4
    for x, audio, y, ps in got:
        assert x.shape == (len(ps), 4, 48, 48, 3) and x.dtype == "uint8"
        assert audio.shape == (len(ps), 8000) and audio.dtype == "float32"
        assert np.abs(np.asarray(audio)).max() > 0, "the clip's tone"
        assert np.asarray(y).tolist() == [paths.index(p) for p in ps]
        # Frames differ over time (a moving pattern), so the samples are distinct frames.
        frames = np.asarray(x)[0]
        assert len({frames[t].tobytes() for t in range(4)}) == 4
    assert [item for _, item, _ in loader.failures()] == [str(broken)]
    ncthw = next(iter(flowgate.VideoLoader(clips, batch_size=2, frames=4, resize=64, crop=48,
                                           layout="ncthw", shuffle=False)))
    assert ncthw.shape == (2, 3, 4, 48, 48)
    assert np.array_equal(np.asarray(ncthw).transpose(0, 2, 3, 4, 1), np.asarray(got[0][0])[:2])
    with pytest.raises(ValueError, match="layout"):
        flowgate.VideoLoader(clips, layout="nchw")


@video
def test_video_decoder_threads_are_the_tuners_unless_pinned(videos):
    """threads=0 (the default): FFmpeg's threads per clip are a tuner knob, shown in stats()
    and within the cores; a number pins them (no knob); a negative one is refused."""
    clips = (videos / "video.txt").read_text().split() * 10
    loader = flowgate.VideoLoader(clips, batch_size=4, frames=4, resize=64, crop=48, workers=1,
                                  shuffle=False)
    assert sum(len(x) for x in loader) == len(clips)
    threads = loader.stats()["stages"]["decode"]["item_threads"]
    assert 1 <= threads <= os.cpu_count()
    raised = [d for r in loader.tuner_trace() for d in r["decisions"]
              if d.startswith("SetItemThreads")]
    assert threads == 1 or raised, "threads moved without a decision in the trace"
    pinned = flowgate.VideoLoader(clips[:4], batch_size=4, frames=4, resize=64, crop=48,
                                  threads=2, shuffle=False)
    assert len(next(iter(pinned))) == 4
    assert "item_threads" not in pinned.stats()["stages"]["decode"]
    with pytest.raises(ValueError, match="threads"):
        flowgate.VideoLoader(clips, threads=-1)


def test_video_windows_are_redrawn_every_epoch_and_reproducible(videos):
    """VideoLoader(stride=, train=True): a random window of consecutive frames per clip, new
    every epoch, the same for the same seed (what a resumed run redraws)."""
    def epochs(seed):
        loader = flowgate.VideoLoader(videos / "video.txt", batch_size=4, frames=3, stride=2,
                                      train=True, seed=seed, resize=32, crop=32,
                                      return_paths=True)
        out = []
        for _ in range(3):
            ep = {}
            for frames, paths in loader:
                for f, p in zip(np.asarray(frames), paths):
                    assert f.shape == (3, 32, 32, 3)
                    ep[p] = f.copy()
            out.append(ep)
        return out

    a, b = epochs(5), epochs(5)
    for ea, eb in zip(a, b):
        assert ea.keys() == eb.keys() and all(np.array_equal(ea[k], eb[k]) for k in ea)
    assert any(not np.array_equal(a[0][k], a[e][k]) for k in a[0] for e in (1, 2)), \
        "a new window in another epoch"
    with pytest.raises(ValueError, match="set stride"):
        flowgate.VideoLoader(videos / "video.txt", train=True)


@video
def test_video_windows_resume_exactly_through_chained_checkpoints(videos):
    """Random windows mid-epoch 1, resumed twice (a checkpoint of a resumed run resumed
    again): every clip once, with the very frames of the uninterrupted epoch 1."""
    args = dict(batch_size=1, frames=3, stride=2, train=True, seed=11, resize=32, crop=32,
                return_paths=True)

    def frames_by_path(batches):
        return {p: np.asarray(f)[i].tobytes() for f, paths in batches
                for i, p in enumerate(paths)}

    whole = flowgate.VideoLoader(videos / "video.txt", **args)
    list(whole)
    e1 = frames_by_path(whole)
    assert len(e1) == 4
    first = flowgate.VideoLoader(videos / "video.txt", **args)
    list(first)
    it = iter(first)
    got = frames_by_path([next(it)])
    state = first.state_dict()
    first.close()
    for _ in range(2):
        again = flowgate.VideoLoader(videos / "video.txt", **args)
        again.load_state_dict(state)
        it = iter(again)
        batch = next(it)
        assert not set(batch[1]) & set(got), "a clip delivered twice"
        got.update(frames_by_path([batch]))
        state = again.state_dict()
        if len(got) == 3:
            got.update(frames_by_path(list(it)))
        again.close()
    assert got == e1
