"""flowgate: a self-tuning, thread-based data loader for training loops, written in Rust.

The loaders decode on native threads (no GIL), tune their own concurrency and buffers while
they run, and yield batches that NumPy and PyTorch read without a copy::

    import flowgate, torch

    loader = flowgate.ImageLoader("/data/train", batch_size=32, resize=256, crop=224)
    for epoch in range(3):
        for batch in loader:                    # one epoch per iteration
            x = torch.from_dlpack(batch)        # zero-copy, uint8, 32x3x224x224
            ...
    state = loader.state_dict()                 # exact resume after a preemption

:class:`Pipeline` runs Python callables as stages (each call holds the GIL; the engine's
threads, queues and tuner do not).
"""

from __future__ import annotations

import os
from typing import (Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional,
                    Sequence, Tuple, Union)

from . import _native
from ._native import (Batch, DeviceUnavailable, LoaderError, SkippedItemsWarning, build_info,
                      skip_part)
from ._dataloader import DataLoader
from ._sources import Mix, Parquet, Shards
from ._process import _OPEN, _Pass
from ._remote import Ray
from ._loader import _Loader
from ._native import IMAGENET_MEAN, IMAGENET_STD  # noqa: F401  (flowgate.IMAGENET_MEAN, ...)
from ._args import _build

#: The package's version (the native library's).
__version__: str = _native.__version__

__all__ = ["ImageLoader", "AudioLoader", "VideoLoader", "DataLoader", "Shards", "Parquet", "Mix",
           "Pipeline", "Ray", "Batch", "LoaderError", "SkippedItemsWarning", "DeviceUnavailable", "merge_state_dicts", "skip_part",
           "build_info", "report_ranks"]


def report_ranks(loader: Any, log: Optional[Callable[[str], None]] = print) -> Optional[str]:
    """At an epoch's end under ``torch.distributed``: gathers every rank's pace (items/s, the
    share of the time its loop waited, its bottleneck: a few numbers, one ``all_gather_object``)
    and returns, on rank 0, one line naming the slowest rank and its bottleneck (also given to
    ``log``; ``None`` on the other ranks, and without an initialised process group). A
    collective: every rank must call it, at the same point of its loop::

        for epoch in range(epochs):
            for batch in loader: ...
            flowgate.report_ranks(loader)   # rank 0 prints: slowest rank 2: 310 items/s ...
    """
    import torch.distributed as dist
    if not (dist.is_available() and dist.is_initialized()):
        return None
    pace = dict(loader._here()._pace(), rank=dist.get_rank())
    paces: list = [None] * dist.get_world_size()
    dist.all_gather_object(paces, pace)
    if dist.get_rank() != 0:
        return None
    slow = min(paces, key=lambda p: p["items_per_s"])
    fast = max(p["items_per_s"] for p in paces)
    line = (f"flowgate: slowest rank {slow['rank']} of {len(paces)}: "
            f"{slow['items_per_s']:.0f} items/s (fastest {fast:.0f}), its loop waited "
            f"{100 * slow['wait']:.0f}% of the time, held back by {slow['held_back_by']}")
    if log is not None:
        log(line)
    return line


def merge_state_dicts(states: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Merges the :meth:`~ImageLoader.state_dict` of every rank, taken at the same step,
    into one checkpoint of the whole world's progress. A loader of any world size resumes
    it with ``load_state_dict``: the rest of the epoch is dealt out evenly to its ranks
    (equal counts per rank with ``drop_last`` or padding, as the loaders shard). Raises
    ``ValueError`` if the states do not fit together (another dataset or seed, a rank
    missing or given twice, different epochs)::

        states = [None] * world_size
        torch.distributed.all_gather_object(states, loader.state_dict())
        merged = flowgate.merge_state_dicts(states)   # save this one
    """
    return _native.merge_state_dicts(list(states))


# Defined in ._sources and ._remote, documented and pickled as flowgate's own.
for _cls in (Shards, Parquet, Mix, Ray):
    _cls.__module__ = __name__
del _cls



PathsLike = Union[str, "os.PathLike[str]", Sequence[Union[str, "os.PathLike[str]"]], "Shards", "Mix",
                  "Parquet"]
Labels = Union[None, str, Sequence[int], Mapping[Union[str, "os.PathLike[str]"], int]]


class ImageLoader(_Loader):
    """JPEG/PNG/WebP files → batches of ``batch_size x 3 x crop x crop`` uint8 (``"nchw"``) or
    ``batch_size x crop x crop x 3`` (``"nhwc"``): torchvision's ``Resize(resize)`` +
    ``CenterCrop(crop)`` geometry.

    ``paths``: a directory (walked for image files), a list file (one path per line), a
    sequence of paths, :class:`Shards` (WebDataset tar shards) or :class:`Parquet`. ``shuffle``/``seed``: a new order every epoch. ``rank``/``world_size``
    (default: the ``RANK``/``WORLD_SIZE`` environment variables): this rank's shard; every
    rank gets as many items (an epoch that does not divide is padded by repeating the start
    of its order, as ``DistributedSampler`` does). ``drop_last``: drop the remainder instead,
    and no partial last batch. ``workers``: pin the decode
    concurrency (default: the tuner decides). ``order``: ``"input"`` (default) batches items in
    the epoch's order, so the same ``seed`` gives the same batches in the same order on every
    run (``shuffle=False``: the dataset's order); ``"completion"`` batches them as they finish
    decoding (a slow file no longer holds the others back; runs are not repeatable).
    ``skip_errors``: skip and count unreadable
    files (default) instead of raising :class:`LoaderError`. ``fill_skipped``: a rank whose
    files were skipped still makes ``len(loader)`` batches an epoch, making up the batches the
    skips cost from items of its epoch read again (the first ones first), so that ranks with a
    collective per step (DDP) never wait on one that ended early; ``stats()["filled"]`` counts
    the items read again (with ``remote=``, made up in the training process after the
    units). Default (``None``): on under a world size
    above 1 (``world_size``, or ``WORLD_SIZE`` from ``torchrun``), off for one process. ``memory_mb``: the most the
    loader may hold — files in work, decoded items, batches waiting — in MiB (default: half
    the available memory, or of the container's limit); :meth:`stats` shows what each stage
    holds against it. A budget that cannot hold four batches, an item per decode worker and
    one waiting (what the stages hold at least) is refused when the loader is built, naming
    both sizes.
    ``metrics_port``: serve Prometheus metrics on ``GET /metrics`` at that port of the
    loopback address (or ``"host:port"``, ``"[::1]:9100"``; 0 picks a free port;
    ``metrics_address`` says which), the same series as ``flowgate run``'s endpoint, each
    labelled with ``rank`` and ``local_rank`` (from ``torchrun``'s environment); served by the
    training process only, until :meth:`close` (copies and forked ``DataLoader`` workers do
    not serve, and the decoding those workers do is not in the parent's series: iterate the
    loader in the training process to see it).
    ``cpu_budget``: cores the ranks of this node may keep busy decoding, together — a count
    (``2``), a fraction (``0.4``) or a percentage (``"40%"``) of the node's cores. Ranks that
    give the same budget share it (``torchrun`` ranks of one job; ``FLOWGATE_NODE_KEY`` names
    another group): at no instant do they decode more items than it has cores, a rank whose
    training loop waits uses the cores the others leave idle, and a rank that dies gives its
    cores back at once. Only loaders (and pipelines) given a ``cpu_budget`` are held to it; a
    process is on one budget at most (another size raises). Default: none (each rank tunes
    within its share of the node's cores).

    ``train``: torchvision's ``RandomResizedCrop(crop, scale, ratio)`` (bilinear) and
    ``RandomHorizontalFlip`` instead of resize + center crop (``resize`` unused), drawn anew
    every epoch and reproducibly from ``seed``, the epoch and the file (an exact resume redraws
    the same crops). ``normalize``: float32 ``(x / 255 - mean) / std`` per channel instead of
    uint8: ``True`` for ImageNet's statistics, or a ``(mean, std)`` pair of 3 floats each.
    ``draft``: decode JPEGs at 1/2, 1/4 or 1/8 scale in the DCT domain where the crop window
    stays at least twice ``crop`` pixels wide (Pillow's ``Image.draft``): less inverse DCT,
    colour conversion and resizing on photos much larger than the output (not less entropy
    decoding), pixels 1.2-1.5 levels from the exact resize on average but not bit-identical
    (default ``False``: torchvision's geometry, not its pixels bit for bit: on photos about
    13% of the values differ from torchvision's by one level, from rounding in the resize).

    ``labels``: ``"folder"`` (torchvision ``ImageFolder``'s classes: every folder at the
    root, sorted, each file labelled by the top-level folder it lies under at any depth,
    files at the root left out, an empty class folder refused; names in :attr:`classes`;
    for a list of paths, each file's parent folder), a sequence of ints (one
    per file, in dataset order: the list's, the sequence's, or the sorted directory walk's),
    or a mapping from path (as the loader reads it) to int. Each batch then comes as
    ``(images, labels)``, ``labels`` an int64 :class:`Batch` of the batch's length, aligned
    with the images even when files are skipped. With :class:`Shards`, ``labels`` names the
    field holding each sample's label (``"cls"``). ``return_paths``: add the batch's file
    paths (a list of str; ``SHARD:KEY`` for shards) as the tuple's last element.

    ``fields``: a sample's fields besides its media, from its other tar members (by
    extension) or a Parquet row's other columns: ``{"caption": "txt", "meta": "json"}``, each
    name mapped to an extension or column, a list of them (the first present wins), or
    ``{"from": ..., "kind": "text" | "json" | "int" | "bytes", "optional": True}`` (the kind
    by default from the extension: ``txt`` text, ``json`` parsed, ``cls`` an int, else
    bytes). Each batch is then a dict: the media under ``"image"`` (``"audio"``,
    ``"video"``; ``"lengths"`` and a video's ``"audio"`` track beside it), ``"label"`` and
    ``"path"`` where asked, and each field as a list in the batch's order (``None`` where an
    optional field is missing). A sample without a required field, or whose field is not
    what its kind reads (text that is not UTF-8, JSON that does not parse), is a failed item
    (skipped and counted, or fatal, as ``skip_errors`` says). For :class:`Shards`,
    :class:`Parquet`, :class:`Mix` (each source reads the fields) and loose files (from the
    files beside each: ``a.jpg`` reads ``"txt"`` from ``a.txt``).
    A table whose ``kind`` is ``"image"``, ``"audio"`` or ``"video"`` is decoded as media by a
    recipe of its own (the table's other keys are that modality's arguments): ``{"depth":
    {"from": "depth.png", "kind": "image", "resize": 256, "crop": 224}}`` gives
    ``batch["depth"]``, a tensor beside ``batch["image"]`` (a required field; a sample whose
    field is missing or does not decode is a failed item).

    ``map``: a function run on every decoded item, on a stage of the loader's own (``"map"``
    in ``stats()["stages"]``, its threads sized by the tuner): it gets the item as a dict —
    the media under the batch's names (``"image"``: a zero-copy :class:`Batch`, ``np.asarray``
    it), ``"label"`` where there are labels, ``"index"`` and ``"epoch"`` (seed what it draws
    with them, for ``state_dict`` to resume to the same items), and each field — and returns
    the dict: arrays (NumPy, torch on the CPU; ``uint8``, ``float32`` or ``int64``) become the
    item's media, of one shape per batch; other values its fields (``None``, ``int``, ``str``,
    ``bytes``, or anything JSON holds: lists, dicts, floats, arrays through ``tolist()``).
    ``map_fields``: names of fields it adds (``None`` until it sets them): ``map=lambda s:
    {**s, "tokens": tok(s["caption"])}, map_fields=["tokens"]``. An exception is the item's
    failure (skipped and counted, or fatal). Each call holds the GIL: code that releases it
    (NumPy, PIL, tokenizers) runs on several threads at once, pure Python on about one core;
    ``stats()["gil"]`` says which. Not with length-aware batches or ``remote=``.

    ``map_batch``: a function run on every collated batch, on a stage of its own after
    collation and before the upload to ``device`` (``"map_batch"`` in ``stats()["stages"]``,
    sized by the tuner): tokenizing a batch's captions at once and padding them to its
    longest, a mixup. It gets the dict the loop would receive (without ``"path"``), with
    ``"index"`` (each row's) and ``"epoch"`` to seed what it draws, and returns a dict whose
    keys replace or add to the batch's: arrays (``uint8``, ``float32``, ``int64``; the batch's
    rows first) become tensors, lists or tuples (a value per row) fields, ``"label"`` the
    labels. Keys it leaves out stay as they were (media it leaves alone are not copied), and
    the rows stay the loader's: a checkpoint counts them. Batches are then always dicts. An
    exception is the failure of the batch's items (skipped and counted, or fatal). It works
    with length-aware batches, not with ``remote=``.

    ``output``: ``"batch"`` (:class:`Batch`, zero-copy to NumPy and DLPack), ``"torch"``
    (``torch.Tensor`` objects, zero-copy through DLPack) or ``"numpy"`` (arrays, zero-copy).

    ``device``: ``"cpu"`` (default), ``"cuda"`` or ``"cuda:N"``: batches (labels and lengths
    too) are collated into pinned host memory and copied to the GPU by flowgate's uploader on
    its own CUDA stream; ``torch.from_dlpack(batch)`` (or ``output="torch"``) gives a CUDA
    tensor ready on the current stream, which waits for the copy on the device (the host never
    blocks), and the memory is freed after the work queued on that stream. At most
    ``device_memory_mb`` (default 1024) of uploaded batches wait for the training loop; the
    tuner sizes that buffer within it. Without a usable GPU (no driver, a wheel built without
    the ``cuda`` feature) the constructor raises :class:`DeviceUnavailable`. ``"simulated"``
    runs the same path on a simulated copy engine in host memory (for tests without a GPU).

    ``remote``: a :class:`Ray` to decode on a pool of Ray actors (``FlowgateDecoder``, one
    process each; ``pip install ray``). This process keeps the epoch's plan — order, ranks,
    seeds, checkpoints — and hands out units of ``batches_per_unit`` batches; each actor
    decodes its units with this loader's arguments on its own tuned threads (with
    ``local=True`` this process decodes units too) and returns them through Ray's object
    store; batches are yielded in plan order. So the batches (items, order, augmentation) are
    the local loader's for the same arguments, whatever the pool's size (where a skipped item
    left a unit's batch short, its rows are regrouped as the local loader fills a batch); a
    unit lost with its actor is decoded again, so every item still arrives once per epoch;
    ``state_dict()`` is the local loader's at that batch and resumes locally or remotely, at
    any world size. With ``workers="auto"`` the pool grows while the loop waits with every
    worker busy and shrinks when decoded units pile up (``tuner_trace()`` gives each second's
    window and every change with its reason). Batches arrive in host memory, read-only:
    ``output="numpy"`` as arrays in the object store, ``"torch"`` as tensors sharing them,
    ``"batch"`` as :class:`Batch` objects (copied once); ``device`` must be ``"cpu"``. Iterate
    a remote loader in the training process (not in ``DataLoader`` workers); see the guide's
    "Decoding on a Ray cluster".

    The loader runs its own threads, so a ``DataLoader`` adds nothing but processes; where a
    ``Dataset`` is expected it is an ``IterableDataset`` that batches itself
    (``DataLoader(loader, batch_size=None, num_workers=N)``; import torch before building the
    loader): each worker reads its part of the rank's share (every ``N``-th item, never
    padded: the rank's workers read its share once) and yields torch tensors; call
    :meth:`set_epoch` before each epoch as with ``DistributedSampler`` (with
    ``persistent_workers=True`` the workers read consecutive epochs from the first, whatever
    ``set_epoch`` says later). With ``drop_last=True`` the workers split the rank's epoch by
    whole batches instead (worker ``w`` of ``N`` decodes batches ``w``, ``w + N``, ...): the
    ``DataLoader`` yields the local loader's batches in its order, only the last partial one
    dropped. A loader is picklable
    (rebuilt from its arguments, at its epoch) and fork-safe (a forked child builds its own
    threads at its first ``iter()``, starting the epoch the parent was at).
    """

    def __init__(
        self,
        paths: PathsLike,
        batch_size: int = _native.DEFAULT_BATCH_SIZE,
        resize: int = _native.DEFAULT_RESIZE,
        crop: int = _native.DEFAULT_CROP,
        layout: str = "nchw",
        train: bool = False,
        scale: Tuple[float, float] = _native.DEFAULT_SCALE,
        ratio: Tuple[float, float] = _native.DEFAULT_RATIO,
        normalize: Union[bool, Tuple[Sequence[float], Sequence[float]]] = False,
        draft: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        workers: Optional[int] = None,
        order: str = "input",
        skip_errors: bool = True,
        fill_skipped: Optional[bool] = None,
        labels: Labels = None,
        return_paths: bool = False,
        fields: Optional[Mapping[str, Any]] = None,
        map: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
        map_fields: Sequence[str] = (),
        map_batch: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
        memory_mb: Optional[float] = None,
        cpu_budget: Union[int, float, str, None] = None,
        device: str = "cpu",
        device_memory_mb: Optional[float] = None,
        output: str = "batch",
        remote: Optional[Ray] = None,
        metrics_port: Union[int, str, None] = None,
    ) -> None:
        self._setup(locals())

    def _build(self, a: Dict[str, Any]) -> Any:
        return _build(a, "image", ("resize", "crop", "layout", "train", "scale", "ratio",
                                   "normalize", "draft"))


class AudioLoader(_Loader):
    """WAV/FLAC/MP3/Ogg/M4A files → batches of ``batch_size x (rate*seconds)`` float32, mono,
    cropped or zero-padded (at another sample rate, resampled). ``train``: a window at a random
    offset in each clip, new every epoch and reproducible from ``seed`` (clips no longer than
    the window are taken whole). ``keep_channels``: ``batch_size x channels x (rate*seconds)``,
    the files' channels kept (every file of the dataset must have as many; a pipeline file's
    ``decode.keep_channels``). ``return_lengths``: each batch is ``(audio, lengths, ...)``,
    ``lengths`` an int64 :class:`Batch` of each clip's real samples (the rest is padding), for
    masking or ragged models. Other arguments (``labels`` and ``return_paths`` too) as
    :class:`ImageLoader`.

    ``max_batch_seconds``: length-aware batches instead of ``batch_size`` clips in a fixed
    window. Clips are grouped by the length their files declare (read without decoding) into
    ``buckets`` length buckets; each batch holds clips of one bucket, padded only to its
    longest clip, with at most ``max_batch_seconds`` of padded audio (clips x longest); a clip
    longer than that is cropped to it. Batches are always ``(audio, lengths, ...)``, ``audio``
    ``B x T`` with ``B`` and ``T`` varying per batch. Each bucket is reshuffled every epoch
    (``seed``), every clip is read once per epoch, ranks get equal batch counts (padded as
    with files, or cut with ``drop_last``) and ``state_dict`` resumes exactly. From local
    files, tar shards or Parquet (each sample is read once before the first epoch, for the
    length its header declares), not S3 nor a :class:`Mix`; each row keeps its own label,
    path and ``fields=`` (a speech corpus's ``KEY.flac`` beside its ``KEY.txt`` transcript:
    ``fields={"text": "txt"}``). ``batch_size``, ``seconds`` and ``train`` do not apply."""

    def __init__(
        self,
        paths: PathsLike,
        batch_size: int = _native.DEFAULT_BATCH_SIZE,
        rate: int = _native.DEFAULT_RATE,
        seconds: float = _native.DEFAULT_SECONDS,
        train: bool = False,
        keep_channels: bool = False,
        return_lengths: bool = False,
        max_batch_seconds: Optional[float] = None,
        buckets: int = _native.DEFAULT_BUCKETS,
        shuffle: bool = True,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        workers: Optional[int] = None,
        order: str = "input",
        skip_errors: bool = True,
        fill_skipped: Optional[bool] = None,
        labels: Labels = None,
        return_paths: bool = False,
        fields: Optional[Mapping[str, Any]] = None,
        map: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
        map_fields: Sequence[str] = (),
        map_batch: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
        memory_mb: Optional[float] = None,
        cpu_budget: Union[int, float, str, None] = None,
        device: str = "cpu",
        device_memory_mb: Optional[float] = None,
        output: str = "batch",
        remote: Optional[Ray] = None,
        metrics_port: Union[int, str, None] = None,
    ) -> None:
        self._setup(locals())

    def _build(self, a: Dict[str, Any]) -> Any:
        return _build(a, "audio", ("rate", "seconds", "train", "keep_channels"))


class VideoLoader(_Loader):
    """MP4/MKV/WebM/MOV/AVI clips → batches of ``batch_size x frames x crop x crop x 3``
    uint8 (``"nthwc"``) or ``batch_size x 3 x frames x crop x crop`` (``"ncthw"``): ``frames``
    frames at the middles of equal spans of each clip, the shorter side scaled to ``resize``,
    center-cropped; only what the samples need is decoded (seeking across long gaps).
    ``threads``: FFmpeg threads per clip; 0 (default): the tuner's (one per clip, more on trial
    where ``workers=`` is pinned and cores idle; see ``stats()``), a number pins them.

    ``audio_seconds``: also the clip's audio track, mono float32 at ``audio_rate``, cropped
    or zero-padded to that length: each batch is then ``(frames, audio, ...)``. Other
    arguments (``labels`` and ``return_paths`` too) as :class:`ImageLoader`.

    ``stride``: a window of ``frames`` consecutive frames ``stride`` stream frames apart
    instead of frames spread over the clip (``stride=4, frames=16``: 16 frames over 61 stream
    frames), centered in the clip; with ``train``, at a random start drawn anew every epoch,
    the same for the same ``seed``, epoch and file (so a resumed run redraws it). A clip shorter
    than the window repeats its last frame.

    ``draft``: skip the in-loop deblocking filter on every frame (H.264/HEVC): ~12% less
    decoding work, but the sampled frames differ slightly from a full decode's (see
    ``docs/performance.md``).

    ``max_batch_frames`` with ``fps``: length-aware batches instead of ``batch_size`` clips
    of ``frames`` frames. Each clip yields the frames shown at ``(k + 0.5) / fps`` seconds, as
    many as its declared duration holds (``floor(seconds * fps)``, at least one, at most
    ``max_batch_frames``); clips are grouped by that length, read from the container without
    decoding, into ``buckets`` length buckets, and each batch holds clips of one bucket, padded
    with zeros to its longest clip, with at most ``max_batch_frames`` padded frames (clips x
    longest). Batches are always ``(frames, lengths, ...)``: ``frames`` ``B x T x crop x crop
    x 3`` uint8 (``"nthwc"`` only) with ``B`` and ``T`` varying per batch, ``lengths`` the
    real frames of each clip. Shuffling, ranks and resume work as for
    :class:`AudioLoader`'s ``max_batch_seconds`` (local files, shards or Parquet; no
    ``audio_seconds``).

    Needs the package built with video support (FFmpeg's libraries, which
    ``scripts/setup.sh`` installs): ``MATURIN_PEP517_ARGS="--features video" pip install
    ./python``.
    """

    def __init__(
        self,
        paths: PathsLike,
        batch_size: int = _native.DEFAULT_VIDEO_BATCH_SIZE,
        frames: int = _native.DEFAULT_FRAMES,
        resize: int = _native.DEFAULT_VIDEO_RESIZE,
        crop: int = _native.DEFAULT_VIDEO_CROP,
        layout: str = "nthwc",
        threads: int = 0,
        audio_seconds: Optional[float] = None,
        audio_rate: int = _native.DEFAULT_RATE,
        fps: Optional[float] = None,
        max_batch_frames: Optional[int] = None,
        buckets: int = _native.DEFAULT_BUCKETS,
        stride: Optional[int] = None,
        train: bool = False,
        draft: bool = False,
        shuffle: bool = True,
        seed: int = 0,
        rank: Optional[int] = None,
        world_size: Optional[int] = None,
        drop_last: bool = False,
        workers: Optional[int] = None,
        order: str = "input",
        skip_errors: bool = True,
        fill_skipped: Optional[bool] = None,
        labels: Labels = None,
        return_paths: bool = False,
        fields: Optional[Mapping[str, Any]] = None,
        map: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
        map_fields: Sequence[str] = (),
        map_batch: Optional[Callable[[Dict[str, Any]], Dict[str, Any]]] = None,
        memory_mb: Optional[float] = None,
        cpu_budget: Union[int, float, str, None] = None,
        device: str = "cpu",
        device_memory_mb: Optional[float] = None,
        output: str = "batch",
        remote: Optional[Ray] = None,
        metrics_port: Union[int, str, None] = None,
    ) -> None:
        if "video" not in _native.build_info()["features"]:
            raise RuntimeError(
                "flowgate was built without video support; rebuild it with "
                'MATURIN_PEP517_ARGS="--features video" pip install ./python'
            )
        self._setup(locals())

    def _build(self, a: Dict[str, Any]) -> Any:
        return _build(a, "video", ("frames", "resize", "crop", "layout", "threads",
                                   "audio_seconds", "audio_rate", "fps", "stride", "train",
                                   "draft"))


class Pipeline:
    """A pipeline of Python callables on flowgate's engine::

        p = flowgate.Pipeline(lambda epoch: range(1000)).map(load, workers=4).batch(32)
        for batch in p:          # lists of 32 results, one epoch per iteration
            ...

    ``source``: an iterable, or a callable ``source(epoch)`` returning one. Each ``map``
    stage runs ``f(item)`` on its own threads (a starting count; the tuner may change it);
    calls hold the GIL, so the gain is in overlapping I/O and native code that releases it.
    An exception in ``f`` raises :class:`LoaderError` naming the stage and the item, unless
    ``skip_errors=True`` (skip and count); so does a part ``f`` leaves out of its result with
    :func:`skip_part` (``skip_part(name, exception)``). ``cpu_budget``: as the loaders'.
    """

    def __init__(self, source: Union[Iterable[Any], Callable[[int], Iterable[Any]]],
                 skip_errors: bool = False,
                 cpu_budget: Union[int, float, str, None] = None) -> None:
        self._native = _native.Pipeline(source, skip_errors, cpu_budget)
        _OPEN.add(self)

    def map(self, f: Callable[[Any], Any], workers: int = 1,
            name: Optional[str] = None) -> "Pipeline":
        """Adds a stage applying ``f`` on ``workers`` threads to start with (0: as many as
        the tuner starts with)."""
        self._native.map(f, workers, name)
        return self

    def batch(self, size: int, drop_last: bool = False) -> "Pipeline":
        """Groups results into lists of ``size``."""
        self._native.batch(size, drop_last)
        return self

    def __iter__(self) -> Iterator[Any]:
        return _Pass(self)

    def stats(self) -> Dict[str, Any]:
        """The stages' statistics (``stages``: threads, items) and the calls' (``gil``)."""
        return self._native.stats()

    def tuner_trace(self) -> List[Dict[str, Any]]:
        """The tuner's recent ticks, as :meth:`ImageLoader.tuner_trace`'s (the pipeline
        running now; empty before the first ``iter()``)."""
        return self._native.tuner_trace()

    def close(self) -> None:
        """Stops the pipeline and joins its threads."""
        self._native.close()
