#!/usr/bin/env python3
"""A speech corpus as tar shards (KEY.flac, KEY.txt its transcript) read with the
transcripts, side by side: flowgate's AudioLoader in length-aware batches with `fields=`
(at most `--max-seconds` of padded audio per batch, threads the tuner sizes, from a cold
process) and webdataset + PyTorch's DataLoader at each worker count given (the peers' audio
recipe: soundfile decodes each FLAC whole to float32, here from the member's bytes; batches
of `--batch` clips zero-padded to their longest, with their lengths and transcripts as a
list: what a speech loop without bucketing does).

Each row says how much of its batches is padding (`padding`: padded samples over all
samples) and how much audio it delivers (`audio_s_per_s`: seconds of real audio per second).
Interleaved repetitions, one process per run (scripts/bench_side.py); Markdown on stdout.

    scripts/bench_speech.py --peers ../shared/peers --list AUDIO.txt --reps 5 \\
        --wds-workers 1,2,3
"""
import argparse
import io
import os
import sys

HERE = os.path.abspath(__file__)
RATE = 16000


def make_shards(paths, out, per_shard=32):
    """The clips with a transcript each, naming the key; returns the pattern."""
    sys.path.insert(0, os.path.dirname(HERE))
    from bench_side import write_shards
    return write_shards(paths, out, "flac",
                        lambda i, key: [("txt", f"the speaker reads sample {key}")], per_shard)


class Tally:
    """Clips, real samples and padded samples delivered."""

    def __init__(self):
        self.clips = self.real = self.padded = 0

    def add(self, shape, lengths, texts):
        assert shape[0] == len(lengths) == len(texts) and shape[1] == max(lengths)
        self.clips += shape[0]
        self.real += int(sum(lengths))
        self.padded += shape[0] * shape[1]

    def extra(self, seconds):
        return dict(padding=round(1 - self.real / self.padded, 4),
                    audio_s_per_s=round(self.real / RATE / seconds, 1))


def run_flowgate(peers, pattern, max_seconds):
    sys.path.insert(0, peers)
    from _common import EpochMeter, emit

    import flowgate
    import numpy as np
    m, t = EpochMeter(), Tally()
    m.start()
    # Built inside the timed epoch: planning reads every clip's header once.
    loader = flowgate.AudioLoader(flowgate.Shards(pattern), rate=RATE,
                                  max_batch_seconds=max_seconds, shuffle=False,
                                  fields={"text": "txt"})
    for b in loader:
        m.first_batch()
        audio = b["audio"]
        t.add(audio.shape, np.asarray(b["lengths"]).tolist(), b["text"])
    m.stop()
    emit(m.result("flowgate", t.clips, **t.extra(m.t1 - m.t0)))


def run_wds(peers, pattern, workers, batch):
    sys.path.insert(0, peers)
    import numpy as np
    import soundfile as sf
    import torch
    import webdataset as wds
    from _common import EpochMeter, emit

    def decode(raw):
        data, sr = sf.read(io.BytesIO(raw), dtype="float32", always_2d=False)
        assert sr == RATE and data.ndim == 1, (sr, data.shape)
        return data

    def pad(samples):
        clips, texts = zip(*samples)
        lengths = [len(c) for c in clips]
        out = np.zeros((len(clips), max(lengths)), dtype=np.float32)
        for row, c in enumerate(clips):
            out[row, :len(c)] = c
        return torch.from_numpy(out), torch.tensor(lengths), list(texts)

    dataset = (wds.WebDataset(pattern, shardshuffle=False, nodesplitter=wds.single_node_only,
                              workersplitter=wds.split_by_worker)
               .to_tuple("flac", "txt").map_tuple(decode, lambda b: b.decode())
               .batched(batch, collation_fn=pad, partial=True))
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers)
    m, t = EpochMeter(), Tally()
    m.start()
    for audio, lengths, texts in loader:
        m.first_batch()
        t.add(audio.shape, lengths.tolist(), texts)
    m.stop()
    emit(m.result(f"webdataset-{workers}", t.clips, **t.extra(m.t1 - m.t0)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default="../shared/peers")
    ap.add_argument("--list")
    ap.add_argument("--pattern")
    ap.add_argument("--out", default="/tmp/flowgate-speech")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--wds-workers", default="1,2,3")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--max-seconds", type=float, default=120.0)
    ap.add_argument("--one")
    args = ap.parse_args()
    args.peers = os.path.abspath(args.peers)
    if args.one:
        if args.one.startswith("webdataset-"):
            run_wds(args.peers, args.pattern, int(args.one.split("-")[1]), args.batch)
        else:
            run_flowgate(args.peers, args.pattern, args.max_seconds)
        return
    if args.pattern is None:
        with open(args.list) as f:
            paths = [line.strip() for line in f if line.strip()]
        args.pattern = make_shards(paths, args.out)
    runs = ["flowgate"] + [f"webdataset-{w}" for w in args.wds_workers.split(",")]
    sys.path.insert(0, os.path.dirname(HERE))
    from bench_side import compare
    compare(HERE, ["--peers", args.peers, "--pattern", args.pattern, "--batch",
                   str(args.batch), "--max-seconds", str(args.max_seconds)], runs,
            "flowgate", "webdataset", args.reps, extra=("padding", "audio_s_per_s"))


if __name__ == "__main__":
    main()
