"""CLIP-style training input from image-text tar shards: images and token ids, aligned.

    pip install ./python torch
    python examples/python/image_text.py target/sample-data/images.txt
    torchrun --nproc_per_node=2 examples/python/image_text.py target/sample-data/images.txt

The shards are LAION's layout (`KEY.jpg`, `KEY.txt` the caption, `KEY.json` a record); the
script writes a few from the listed images (each caption and record naming its key) unless
`--shards PATTERN` names existing ones. flowgate decodes and crops the images on its tuned
threads and reads each sample's caption and record beside them: a batch is a dict whose
`caption` list is in the images' order. The captions are tokenized in the loop (a toy
whitespace vocabulary here; a real tokenizer in training). Under torchrun each rank reads an
equal share; the script checks that every caption belongs to its image and stops half way
through to resume from `state_dict()`.
"""

import argparse
import io
import json
import os
import tarfile
import tempfile

import torch

import flowgate


def write_shards(images, out, per_shard=16):
    """LAION-style shards of the listed images, with captions and records naming each key."""
    os.makedirs(out, exist_ok=True)
    n = (len(images) + per_shard - 1) // per_shard
    for s in range(n):
        with tarfile.open(os.path.join(out, f"{s:05d}.tar"), "w") as tar:
            for i in range(s * per_shard, min(len(images), (s + 1) * per_shard)):
                key = f"{i:09d}"
                tar.add(images[i], arcname=f"{key}.jpg")
                for ext, body in (("txt", f"a synthetic photo, sample {key}"),
                                  ("json", json.dumps({"key": key, "source": images[i]}))):
                    raw = body.encode()
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(raw)
                    tar.addfile(info, io.BytesIO(raw))
    return os.path.join(out, f"{{00000..{n - 1:05d}}}.tar")


class Vocab:
    """A toy tokenizer: whitespace words to ids, padded to `length`."""

    def __init__(self, length=16):
        self.ids, self.length = {"<pad>": 0}, length

    def __call__(self, captions):
        rows = [[self.ids.setdefault(w, len(self.ids)) for w in c.split()][:self.length]
                for c in captions]
        return torch.tensor([r + [0] * (self.length - len(r)) for r in rows])


def main():
    p = argparse.ArgumentParser()
    p.add_argument("images", nargs="?", default="target/sample-data/images.txt")
    p.add_argument("--shards", help="existing image-text shards (a brace pattern)")
    a = p.parse_args()
    pattern = a.shards
    if pattern is None:
        with open(a.images) as f:
            images = [line.strip() for line in f if line.strip()]
        pattern = write_shards(images, tempfile.mkdtemp(prefix="image-text-"))
    make = lambda: flowgate.ImageLoader(  # noqa: E731 - built twice: before and after resume
        flowgate.Shards(pattern, buffer=256), batch_size=32, resize=256, crop=224, train=True,
        seed=0, output="torch", return_paths=True, fields={"caption": "txt", "meta": "json"})
    loader, tokenize = make(), Vocab()
    print(f"rank {os.environ.get('RANK', 0)}: {len(loader)} batches an epoch")
    half, state, seen = max(1, len(loader) // 2), None, 0
    for step, batch in enumerate(loader):
        images, tokens = batch["image"], tokenize(batch["caption"])
        for path, caption, meta in zip(batch["path"], batch["caption"], batch["meta"]):
            key = path.rsplit(":", 1)[1].split(".")[0]
            assert caption.endswith(key) and meta["key"] == key, (path, caption, meta)
        seen += images.shape[0]
        if step + 1 == half:
            state = loader.state_dict()
            break
    resumed = make()
    resumed.load_state_dict(state)
    for batch in resumed:
        seen += batch["image"].shape[0]
    print(f"images {tuple(images.shape)} {images.dtype}, tokens {tuple(tokens.shape)}; "
          f"{seen} samples in the epoch, resumed after {half} batches; stats: "
          f"{ {k: resumed.stats()[k] for k in ('delivered', 'failures')} }")


if __name__ == "__main__":
    main()
