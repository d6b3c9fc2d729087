"""ASR training input from FLAC + transcript tar shards, in length-aware batches.

    pip install ./python torch
    python examples/python/asr.py target/sample-data/audio.txt
    torchrun --nproc_per_node=2 examples/python/asr.py target/sample-data/audio.txt

A speech corpus as WebDataset shards holds `KEY.flac` beside `KEY.txt`, its transcript; the
script writes a few from the listed clips (each transcript naming its key) unless `--shards
PATTERN` names existing ones (`flowgate gen-data --audio 64 --audio-seconds 1,12` lists some).
flowgate reads each clip's declared length once before the first epoch, then gives batches
of clips of similar length (at most `--max-seconds` of padded audio each, padded only to the
longest clip) with each clip's transcript beside it: the batch is a dict whose `text` list
is in the rows' order. The transcripts become CTC targets (characters to ids, padded to the
batch's longest, with their lengths) on the loader's own threads (`map_batch=`), so the loop
gets `targets` and `target_lengths` beside `audio` and `lengths`. Under torchrun each rank
gets the same number of batches; the script checks each transcript belongs to its clip and
its targets, and stops half way through to resume from `state_dict()`.
"""

import argparse
import io
import os
import tarfile
import tempfile

import numpy as np
import torch

import flowgate

ALPHABET = " abcdefghijklmnopqrstuvwxyz0123456789'"


def write_shards(clips, out, per_shard=8):
    """Speech shards of the listed clips, with a transcript naming each key."""
    os.makedirs(out, exist_ok=True)
    n = (len(clips) + per_shard - 1) // per_shard
    for s in range(n):
        with tarfile.open(os.path.join(out, f"{s:05d}.tar"), "w") as tar:
            for i in range(s * per_shard, min(len(clips), (s + 1) * per_shard)):
                key = f"utt{i:06d}"
                tar.add(clips[i], arcname=f"{key}.flac")
                raw = f"the speaker reads sample {key}".encode()
                info = tarfile.TarInfo(f"{key}.txt")
                info.size = len(raw)
                tar.addfile(info, io.BytesIO(raw))
    return os.path.join(out, f"{{00000..{n - 1:05d}}}.tar")


def char_ids(text):
    """A transcript's characters as ids (0 is CTC's blank)."""
    return [ALPHABET.index(c) + 1 for c in text.lower() if c in ALPHABET]


def ctc_targets(batch):
    """The batch's transcripts as CTC targets padded to its longest, and their lengths: on the
    loader's threads (`map_batch=`), a pure function of the batch (a resume makes the same)."""
    ids = [char_ids(t) for t in batch["text"]]
    lengths = np.array([len(r) for r in ids], dtype=np.int64)
    targets = np.zeros((len(ids), max(1, int(lengths.max()))), dtype=np.int64)
    for row, r in enumerate(ids):
        targets[row, :len(r)] = r
    return {"targets": targets, "target_lengths": lengths}


def main():
    p = argparse.ArgumentParser()
    p.add_argument("clips", nargs="?", default="target/sample-data/audio.txt")
    p.add_argument("--shards", help="existing speech shards (a brace pattern)")
    p.add_argument("--max-seconds", type=float, default=60.0)
    a = p.parse_args()
    pattern = a.shards
    if pattern is None:
        with open(a.clips) as f:
            clips = [line.strip() for line in f if line.strip()]
        pattern = write_shards(clips, tempfile.mkdtemp(prefix="speech-"))
    make = lambda: flowgate.AudioLoader(  # noqa: E731 - built twice: before and after resume
        flowgate.Shards(pattern), rate=16000, max_batch_seconds=a.max_seconds, seed=0,
        output="torch", return_paths=True, fields={"text": "txt"}, map_batch=ctc_targets)
    loader = make()
    print(f"rank {os.environ.get('RANK', 0)}: {len(loader)} batches an epoch")
    half, state, seen = max(1, len(loader) // 2), None, 0
    for step, batch in enumerate(loader):
        audio, lengths = batch["audio"], batch["lengths"]
        targets, target_lengths = batch["targets"], batch["target_lengths"]
        for row, (path, text) in enumerate(zip(batch["path"], batch["text"])):
            assert text.endswith(path.rsplit(":", 1)[1]), (path, text)
            ids = char_ids(text)
            assert target_lengths[row] == len(ids), (path, text)
            assert targets[row, :len(ids)].tolist() == ids, (path, text)
        assert audio.shape[0] * audio.shape[1] <= a.max_seconds * 16000
        seen += audio.shape[0]
        if step + 1 == half:
            state = loader.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    for batch in resumed:
        seen += batch["audio"].shape[0]
    print(f"audio {tuple(audio.shape)} {audio.dtype} (lengths {lengths.tolist()}), targets "
          f"{tuple(targets.shape)} (lengths {target_lengths.tolist()}); {seen} clips in the "
          f"epoch, resumed after {half} batches; stats: "
          f"{ {k: resumed.stats()[k] for k in ('delivered', 'failures')} }")


if __name__ == "__main__":
    main()
