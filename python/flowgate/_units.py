"""Units: a loader's epoch cut into runs of batches that another loader decodes alone
(``Loader._start_units`` in the native module, ``flowgate::loader::EpochPlan`` in Rust), as
the remote mode (``_remote.py``: Ray actors) hands them out: the unit loader's arguments,
decoding a unit, marking its arrays read-only. Regrouping the units'
batches into the local loader's is the library's (``EpochPlan.regroup``)."""

from __future__ import annotations

import time
from typing import Any, Dict

from . import _native
from ._process import _Epoch, _converter


def _unit_args(loader: Any) -> Dict[str, Any]:
    """A unit loader's arguments: the training loader's, at the rank and world size its
    native side resolved (the arguments', else ``RANK``/``WORLD_SIZE``), decoding units into
    NumPy arrays on the CPU, not remote again."""
    shard = loader._native.state_dict()["shard"]
    return dict(loader._args, rank=shard["rank"], world_size=shard["world_size"], remote=None,
                device="cpu", device_memory_mb=None, output="numpy", decodes_units=True)


def _decode_unit(loader: Any, state: Dict[str, Any]) -> Dict[str, Any]:
    """Decodes the unit `state` names with `loader` (built from `_unit_args`): its batches
    (NumPy arrays, or tuples holding some), each batch's positions (``[start, end)`` pairs:
    one per row, in row order for input order), the failures skipped, and the seconds it
    took."""
    start = time.perf_counter()
    native = loader._native
    epoch = state["epoch"]
    # The loader keeps the epoch's failures across its units: this unit's are the new ones.
    before = len(native.failures(epoch))
    native.load_state_dict(state)
    batches, rows = [], []
    prev = state
    # The native loader's own epoch, not the wrapper's iteration: a unit loader inside a
    # DataLoader worker is not that worker's split of the rank.
    for item in _Epoch(native, _converter("numpy")):
        now = native.state_dict()
        batches.append(item)
        rows.append(_native._delivered_since(now, prev))
        prev = now
    return {"batches": batches, "rows": rows, "failures": native.failures(epoch)[before:],
            "seconds": time.perf_counter() - start}


def _unit_loader(cls_name: str, args: Dict[str, Any]) -> Any:
    """A loader of class `cls_name` built from `_unit_args` (as unpickling builds one)."""
    import flowgate
    cls = getattr(flowgate, cls_name)
    loader = cls.__new__(cls)
    loader._setup(args)
    return loader


def _read_only(item: Any) -> Any:
    """Marks a batch's arrays read-only (as those out of Ray's object store are), so every
    batch of a remote loader behaves alike."""
    for x in item if isinstance(item, tuple) else (item,):
        if hasattr(x, "flags"):
            x.flags.writeable = False
    return item
