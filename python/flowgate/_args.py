"""A loader's arguments as the native side takes them: paths and labels in the types it
reads, the options every loader shares (``_native.Options``), pairs and normalisation checked
with errors naming the argument, and the rank and world size a loader resolves."""

from __future__ import annotations

import os
from typing import Any, Dict, Mapping, Optional, Tuple

from . import _native
from ._sources import Mix, Parquet, Shards, _check_ints

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _paths(paths: Any) -> Any:
    if isinstance(paths, (Shards, Parquet, Mix)):
        return paths
    if isinstance(paths, (str, os.PathLike)):
        return os.fspath(paths)
    return [os.fspath(p) for p in paths]


_OPTIONS = ("batch_size", "shuffle", "seed", "rank", "world_size", "drop_last", "workers",
            "order", "skip_errors", "fill_skipped", "return_paths", "memory_mb", "cpu_budget", "device",
            "device_memory_mb")


def _options(args: Dict[str, Any]) -> Any:
    """The arguments every loader shares (taken from its ``locals()``), as native options."""
    _check_ints(args, batch_size=1, seed=0, rank=0, world_size=1, workers=1)
    return _native.Options(labels=_labels(args["labels"]), reader=args.get("reader"),
                           units=bool(args.get("decodes_units")),
                           **{k: args[k] for k in _OPTIONS})


def _rank_and_world(args: Dict[str, Any]) -> Tuple[int, int]:
    """This rank and the world size: the arguments', else ``RANK``/``WORLD_SIZE``, else one
    process (the native side has checked them when the loader was built)."""
    if args.get("rank") is not None:
        return args["rank"], args["world_size"]
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    return 0, 1


def _pair(name: str, v: Any) -> Tuple[float, float]:
    try:
        a, b = v
        return float(a), float(b)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a pair of numbers (low, high), not {v!r}") from None


def _normalize(normalize: Any) -> Optional[Tuple[Tuple[float, ...], Tuple[float, ...]]]:
    """``normalize`` as (mean, std) of 3 floats each, or None; ValueError naming it."""
    if normalize is False or normalize is None:
        return None
    if normalize is True:
        return IMAGENET_MEAN, IMAGENET_STD
    try:
        mean, std = normalize
        mean, std = tuple(float(x) for x in mean), tuple(float(x) for x in std)
    except (TypeError, ValueError):
        mean = std = ()
    if len(mean) != 3 or len(std) != 3:
        raise ValueError(f"normalize must be True, False or (mean, std) with 3 floats each "
                         f"(one per channel), not {normalize!r}")
    return mean, std


def _labels(labels: Any) -> Any:
    if labels is None or isinstance(labels, str):
        return labels
    if isinstance(labels, Mapping):
        return {os.fspath(k): int(v) for k, v in labels.items()}
    return [int(v) for v in labels]
