"""The sources a loader reads besides local files: :class:`Shards` (WebDataset tar shards),
:class:`Parquet` (rows) and :class:`Mix` (several by weight), and the argument checks they
share with the loaders."""

from __future__ import annotations

import operator
import os
from typing import Any, Dict, Optional, Sequence, Union

from . import _native


#: Arguments whose range is the library's (``flowgate::limits``): checked there, in its
#: words, which a pipeline file's check uses too.
_LIMITS = ("batch_size", "workers", "prefetch", "buffer", "epoch")


def _check_ints(args: Dict[str, Any], **least: int) -> None:
    """Raises ValueError naming the argument if one of ``least``'s (when given) is not an
    integer in its range: the library's limit where it has one, else at least its value in
    ``least`` (a negative count would otherwise surface as an OverflowError from the native
    side)."""
    for name, low in least.items():
        v = args.get(name)
        if name in _LIMITS:
            # The library's limit and words, whatever was given (None too: a pipeline file
            # cannot leave these empty either).
            _native._check_limit(name, v)
            continue
        if v is None:
            continue
        if isinstance(v, bool) or not hasattr(v, "__index__"):
            raise ValueError(f"{name} must be an integer, not {v!r}")
        if operator.index(v) < low:
            raise ValueError(f"{name} must be at least {low}, not {v}")


class Shards:
    """WebDataset tar shards, for any loader's ``paths``::

        loader = flowgate.ImageLoader(
            flowgate.Shards("/data/train/shard-{000000..000063}.tar", buffer=1000),
            labels="cls", batch_size=32, train=True)
        for images, labels in loader: ...

    ``pattern``: a shard's path, a brace pattern (``shard-{000000..000063}.tar``), several
    separated by commas, or a directory (its ``.tar`` files). Each sample is the members that
    share a key (``000123.jpg``, ``000123.cls``, ...); the loader decodes its first field among
    ``fields`` (default: the loader's extensions: ``jpg``/``jpeg``/``png``/``webp`` for
    images, ``flac``/``wav``/``mp3``/``ogg``/``m4a`` for audio, ``mp4``/... for video), and
    ``labels="cls"`` (any field's extension) reads each sample's integer label from that field.

    With the loader's ``shuffle`` (the default), the shard order is reshuffled every epoch from
    ``seed`` and each rank's samples pass through a shuffle buffer of ``buffer`` samples
    (webdataset's ``shuffle(buffer)``; it reorders positions, so it holds no data). Ranks
    (``rank``/``world_size`` or ``RANK``/``WORLD_SIZE``) each read a contiguous run of whole
    shards, and get as many samples each (padded, or cut with ``drop_last``). ``state_dict``
    resumes exactly to the sample, reading nothing it skips. A damaged shard (cut off, not a
    tar file, empty) keeps the samples before the damage; each problem is one skipped failure
    naming the shard and the key (or raises with ``skip_errors=False``).

    On S3 (a package built with the ``s3`` feature): ``"s3://bucket/train/shard-{000..127}.tar"``,
    a prefix (``"s3://bucket/train/"``) or a manifest (``"s3://bucket/train/shards.json"``,
    webdataset's ``wids`` format). Each shard is downloaded whole, in one streamed GET, into a
    disk cache (``cache_dir``, default ``$FLOWGATE_SHARD_CACHE`` or
    ``~/.cache/flowgate/shards``) that keeps ``cache_mb`` of shards beyond those being read
    (``stats()["shard_caches"]``: each cache's ``bytes``, ``limit``, and ``pinned``, the shards
    it may not evict now; it holds at most the larger of the two), and
    the next ``prefetch`` shards of the rank's order are fetched ahead (a start: when the
    loader's readers wait for downloads the tuner doubles it, up to ``max(16, prefetch)``;
    ``stats()["stages"]["decode"]["read_ahead"]`` shows it; 0 turns it off). Sample counts come from
    ``shards.json`` beside the shards (``flowgate gen-data --shards`` writes it); without it,
    opening downloads every shard once to count its samples. Credentials come from the AWS
    chain (``AWS_ACCESS_KEY_ID``, profiles, instance roles); ``endpoint`` (or
    ``AWS_ENDPOINT_URL``) reaches S3-compatible stores.
    """

    _flowgate_shards = True

    def __init__(self, pattern: Union[str, "os.PathLike[str]"], buffer: int = _native.DEFAULT_BUFFER,
                 fields: Optional[Sequence[str]] = None, endpoint: Optional[str] = None,
                 cache_dir: Optional[Union[str, "os.PathLike[str]"]] = None,
                 cache_mb: float = 0.0, prefetch: int = _native.DEFAULT_PREFETCH) -> None:
        _check_ints(locals(), buffer=0, prefetch=0)
        # A number as a pipeline file's `cache_mb` is (not a bool or a string), in range.
        _native._check_limit("cache_mb", cache_mb)
        self.pattern = os.fspath(pattern)
        self.buffer = buffer
        self.fields = None if fields is None else [str(f) for f in fields]
        self.endpoint = endpoint
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self.cache_mb = float(cache_mb)
        self.prefetch = prefetch

    def __repr__(self) -> str:
        return f"Shards({self.pattern!r}, buffer={self.buffer}, fields={self.fields!r})"


class Parquet:
    """Parquet files, for any loader's ``paths`` (the Hugging Face hub's layout: an ``image``
    struct of ``{bytes, path}`` beside label and caption columns)::

        loader = flowgate.ImageLoader(
            flowgate.Parquet("/data/train", column="image"), labels="label", batch_size=32)
        for images, labels in loader: ...

    ``paths``: a file, a directory (its ``.parquet`` files, sorted) or a sequence of them.
    ``column``: the column to decode (a ``struct<bytes, path>`` or binary column);
    ``labels="label"`` on the loader reads each row's integer label from that column. Only
    those columns are read, a row group at a time. With the loader's ``shuffle``, row groups
    are reshuffled every epoch and each rank's rows pass a shuffle buffer of ``buffer`` rows;
    ranks read contiguous runs of row groups with equal counts; ``state_dict`` resumes to the
    row. A null or undecodable cell is a skipped failure naming ``FILE:rgG/rowR``.

    On S3 (a package built with the ``s3`` feature): ``"s3://bucket/train/"`` (its ``.parquet``
    objects) or object URLs of one bucket; footers and row groups are read by ranged GETs of
    only the requested columns' bytes. ``endpoint`` (or ``AWS_ENDPOINT_URL``) reaches
    S3-compatible stores; credentials come from the AWS chain.
    """

    _flowgate_parquet = True

    def __init__(self, paths: Union[str, "os.PathLike[str]", Sequence[Any]],
                 column: str = _native.DEFAULT_PARQUET_COLUMN,
                 buffer: int = _native.DEFAULT_BUFFER,
                 endpoint: Optional[str] = None) -> None:
        _check_ints(locals(), buffer=0)
        if not isinstance(column, str):
            raise ValueError(f"Parquet: column must be a column's name (a str), not {column!r}")
        if isinstance(paths, (str, os.PathLike)):
            paths = [paths]
        self.paths = [os.fspath(p) for p in paths]
        self.column = str(column)
        self.buffer = buffer
        self.endpoint = endpoint

    def __repr__(self) -> str:
        return f"Parquet({self.paths!r}, column={self.column!r}, buffer={self.buffer})"


class Mix:
    """Several :class:`Shards` and :class:`Parquet` sources drawn by weight, for any loader's
    ``paths`` (multimodal pre-training's blend of corpora)::

        loader = flowgate.ImageLoader(
            flowgate.Mix([flowgate.Shards("/data/web/shard-{000..127}.tar"),
                          flowgate.Parquet("/data/hf", column="image")],
                         weights=[0.7, 0.3], draws=100_000, labels=["cls", "label"]),
            batch_size=32)

    Each draw picks a source with probability proportional to ``weights``, then that source's
    next sample in its own order (reshuffled every epoch and pass with the loader's ``seed``
    when ``shuffle``). ``draws``: samples per epoch (a source drawn to its end starts a new
    pass, so sources cycle); without it, ``stop="all"`` ends the epoch once every source has
    been drawn to its end (each sample at least once) and ``stop="first"`` at the first one
    (each sample at most once). ``labels``: the label field of each source (else the
    loader's ``labels`` for all). The order depends only on the seed and the epoch: ranks
    share it out, and ``state_dict`` resumes exactly. The sources' own ``buffer`` is not
    used, and shards on S3 cannot be mixed yet.
    """

    _flowgate_mix = True

    def __init__(self, sources: Sequence[Union["Shards", "Parquet"]], weights: Sequence[float],
                 draws: Optional[int] = None, stop: str = "all",
                 labels: Optional[Sequence[Optional[str]]] = None) -> None:
        self.sources = list(sources)
        for k, s in enumerate(self.sources):
            if not isinstance(s, (Shards, Parquet)):
                raise ValueError(f"Mix: sources[{k}] must be a flowgate.Shards or "
                                 f"flowgate.Parquet, not {type(s).__name__}")
        self.weights = list(weights)
        if draws is not None:
            # The library's limit and words for any value (a pipeline file's `draws` too).
            try:
                _native._check_limit("draws", draws)
            except ValueError as e:
                raise ValueError(f"Mix: {e}") from None
            draws = operator.index(draws)
        # The library's rules and words (weights, draws, stop), before any source is opened.
        _native._check_mix(len(self.sources), self.weights, draws, stop)
        self.weights = [float(w) for w in self.weights]
        self.draws = draws
        self.stop = stop
        if labels is not None:
            labels = [None if l is None else str(l) for l in labels]
            if len(labels) != len(self.sources):
                raise ValueError(f"Mix: one label field per source: {len(self.sources)} "
                                 f"sources, {len(labels)} labels")
        self.labels = labels

    def __repr__(self) -> str:
        return (f"Mix({self.sources!r}, weights={self.weights!r}, draws={self.draws!r}, "
                f"stop={self.stop!r})")
