#!/usr/bin/env python3
"""Image-text tar shards (LAION's layout: KEY.jpg, KEY.txt a caption, KEY.json a record) read
with their captions, side by side: flowgate's ImageLoader with `fields=` (threads the tuner
sizes, from a cold process), the same loader without the fields (what the captions cost), and
webdataset + PyTorch's DataLoader at each worker count given (`.decode("pil").to_tuple("jpg",
"txt", "json")`, the peers' recipe: PIL decode, Resize(256), CenterCrop(224), PILToTensor,
batches of 32, captions and records as lists).

With `--pairs`, each sample holds a second image (`KEY.depth.jpg`, another photo) beside its
caption, decoded and cropped like the first: flowgate's media field (`fields={"depth": {"from":
"depth.jpg", "kind": "image", ...}}`) against webdataset's `.to_tuple("jpg", "depth.jpg",
"txt")`.

Interleaved repetitions, one process per run, timed by the peers' EpochMeter (the epoch only;
CPU seconds of the process and its children); ratios per repetition against the best
webdataset setting of that repetition; Markdown on stdout.

    scripts/bench_image_text.py --peers ../shared/peers --list IMAGES.txt --reps 5 \\
        --wds-workers 1,2,3
"""
import argparse
import json
import os
import sys

HERE = os.path.abspath(__file__)


def make_shards(paths, out, per_shard=64, pairs=False):
    """The images with a caption and a record each, naming the key (with `pairs`, a second
    image and a caption); returns the pattern."""
    sys.path.insert(0, os.path.dirname(HERE))
    from bench_side import write_shards

    def pair(i, key):
        with open(paths[(i + 1) % len(paths)], "rb") as f:
            return [("depth.jpg", f.read()), ("txt", f"a photo-like picture, number {i} ({key})")]

    if pairs:
        return write_shards(paths, out, "jpg", pair, per_shard)

    def sidecars(i, key):
        record = {"key": key, "url": paths[i], "width": 500, "height": 375}
        return [("txt", f"a photo-like picture, number {i} ({key})"),
                ("json", json.dumps(record))]
    return write_shards(paths, out, "jpg", sidecars, per_shard)


def run_flowgate(peers, pattern, fields, pairs=False):
    sys.path.insert(0, peers)
    from _common import EpochMeter, emit

    import flowgate
    if pairs:
        fields = {"caption": "txt", "depth": {"from": "depth.jpg", "kind": "image",
                                              "resize": 256, "crop": 224}}
    loader = flowgate.ImageLoader(
        flowgate.Shards(pattern), batch_size=32, resize=256, crop=224, shuffle=False,
        fields=({"caption": "txt", "meta": "json"} if fields is True else fields) or None)
    m, n = EpochMeter(), 0
    m.start()
    for b in loader:
        m.first_batch()
        if pairs:
            assert b["depth"].shape == b["image"].shape
        if fields:
            images, captions = b["image"], b["caption"]
            assert len(captions) == images.shape[0] and captions[0].endswith(")")
        else:
            images = b
        n += images.shape[0]
    m.stop()
    emit(m.result(f"flowgate{'+fields' if fields else ''}", n))


def run_wds(peers, pattern, workers, pairs=False):
    sys.path.insert(0, peers)
    import webdataset as wds
    from _common import EpochMeter, emit
    from torchvision import transforms
    transform = transforms.Compose([transforms.Resize(256), transforms.CenterCrop(224),
                                    transforms.PILToTensor()])
    dataset = wds.WebDataset(pattern, shardshuffle=False, nodesplitter=wds.single_node_only,
                             workersplitter=wds.split_by_worker).decode("pil")
    if pairs:
        dataset = (dataset.to_tuple("jpg", "txt", "depth.jpg")
                   .map_tuple(lambda im: transform(im.convert("RGB")), str,
                              lambda im: transform(im.convert("RGB"))))
    else:
        dataset = (dataset.to_tuple("jpg", "txt", "json")
                   .map_tuple(lambda im: transform(im.convert("RGB")), str, dict))
    dataset = dataset.batched(32, partial=True)
    loader = wds.WebLoader(dataset, batch_size=None, num_workers=workers)
    m, n = EpochMeter(), 0
    m.start()
    for images, captions, third in loader:
        m.first_batch()
        assert len(captions) == images.shape[0]
        if pairs:
            assert third.shape == images.shape
        n += images.shape[0]
    m.stop()
    emit(m.result(f"webdataset-{workers}", n))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--peers", default="../shared/peers")
    ap.add_argument("--list")
    ap.add_argument("--pattern")
    ap.add_argument("--out", default="/tmp/flowgate-image-text")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--wds-workers", default="1,2,3")
    ap.add_argument("--pairs", action="store_true")
    ap.add_argument("--one")
    args = ap.parse_args()
    args.peers = os.path.abspath(args.peers)
    if args.one:
        if args.one.startswith("webdataset-"):
            run_wds(args.peers, args.pattern, int(args.one.split("-")[1]), args.pairs)
        else:
            run_flowgate(args.peers, args.pattern, args.one == "flowgate+fields", args.pairs)
        return
    if args.pattern is None:
        with open(args.list) as f:
            paths = [line.strip() for line in f if line.strip()]
        args.pattern = make_shards(paths, args.out, pairs=args.pairs)
    ours = "flowgate+fields"
    runs = [ours] + ([] if args.pairs else ["flowgate"]) + [
        f"webdataset-{w}" for w in args.wds_workers.split(",")]
    sys.path.insert(0, os.path.dirname(HERE))
    from bench_side import compare
    extra = ["--pairs"] if args.pairs else []
    compare(HERE, ["--peers", args.peers, "--pattern", args.pattern, *extra], runs, ours,
            "webdataset", args.reps)


if __name__ == "__main__":
    main()
