"""A loader's arguments as the native side takes them: paths and labels in the types it
reads, the loader's settings and the media's arguments as dicts the library reads (its
``LoaderSettings`` and ``MediaArgs``: defaults, rules and words once, for every front end)."""

from __future__ import annotations

import os
import sys
from typing import Any, Dict, List, Mapping, Sequence

from . import _native
from ._sources import Mix, Parquet, Shards


def _paths(paths: Any) -> Any:
    if isinstance(paths, (Shards, Parquet, Mix)):
        return paths
    if isinstance(paths, (str, os.PathLike)):
        return os.fspath(paths)
    return [os.fspath(p) for p in paths]


#: The keys of ``flowgate::loader::LoaderSettings``: the library reads them, with its
#: defaults, limits and words (a pipeline file's are the same).
_SETTINGS = ("batch_size", "shuffle", "seed", "rank", "world_size", "drop_last", "workers",
             "order", "skip_errors", "fill_skipped", "memory_mb", "cpu_budget",
             "max_batch_seconds", "max_batch_frames", "buckets", "return_lengths")


def _build(args: Dict[str, Any], kind: str, media: Sequence[str]) -> Any:
    """A native loader from a loader's arguments (its ``locals()``): the settings and the
    media's arguments (``kind`` and the names in ``media``) as the library reads them."""
    for k in ("batch_size", "workers", "buckets"):
        # Whole numbers in the library's words, an int past 64 bits too (the settings' data
        # cannot hold one).
        if args.get(k) is not None:
            _native._check_limit(k, args[k])
    return _native.loader(
        _paths(args["paths"]), {k: args[k] for k in _SETTINGS if k in args},
        dict({k: args[k] for k in media}, kind=kind), labels=_labels(args["labels"]),
        return_paths=args["return_paths"], device=args["device"],
        device_memory_mb=args["device_memory_mb"], reader=args.get("reader"),
        units=bool(args.get("decodes_units")), plans_units=args.get("remote") is not None,
        fields=args.get("fields"), map=args.get("map"),
        map_fields=_names(args.get("map_fields")), map_batch=args.get("map_batch"))


def _process_group_ranks(args: Dict[str, Any]) -> Dict[str, Any]:
    """``args`` with the rank and world size of an initialized ``torch.distributed`` process
    group where neither is given nor in the environment: DDP launched by
    ``torch.multiprocessing.spawn`` (``init_process_group(rank=..., world_size=...)``) sets no
    ``RANK``/``WORLD_SIZE``, and each rank read the whole dataset. The library's rule (the
    arguments, else the environment) decides everywhere else; the values are kept in the
    arguments, so a DataLoader worker or a copy reads the same share."""
    if (args.get("rank") is not None or args.get("world_size") is not None
            or "RANK" in os.environ or "WORLD_SIZE" in os.environ):
        return args
    dist = sys.modules.get("torch.distributed")  # never imported here for this
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return args
    return dict(args, rank=dist.get_rank(), world_size=dist.get_world_size())


def _names(names: Any) -> List[str]:
    """Field names: one str is one name, not its letters."""
    if names is None:
        return []
    return [names] if isinstance(names, str) else [str(n) for n in names]


def _labels(labels: Any) -> Any:
    if labels is None or isinstance(labels, str):
        return labels
    if isinstance(labels, Mapping):
        return {os.fspath(k): int(v) for k, v in labels.items()}
    return [int(v) for v in labels]
