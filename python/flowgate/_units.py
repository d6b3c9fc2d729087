"""Units: a loader's epoch cut into runs of batches that another loader decodes alone
(``Loader._plan_units`` in the native module, ``flowgate::loader::EpochPlan`` in Rust), and
what their consumers share: the unit loader's arguments, decoding a unit, regrouping rows of
short batches, converting NumPy batches to the loader's output. Two consumers: the remote mode
(``_remote.py``: Ray actors) and ``drop_last=True`` through ``DataLoader`` workers
(``_WorkerBatches``: worker ``w`` of ``W`` decodes batches ``w``, ``w + W``, ...)."""

from __future__ import annotations

import os
import time
import warnings
from typing import Any, Callable, Dict, Generator, Iterator, List, Optional, Tuple

from . import _native
from ._process import _Epoch, _converter


def _unit_args(args: Dict[str, Any]) -> Dict[str, Any]:
    """A unit loader's arguments: the training loader's, at its rank and world size (as
    resolved there), decoding units into NumPy arrays on the CPU, not remote again."""
    from ._args import _rank_and_world
    rank, world = _rank_and_world(args)
    return dict(args, rank=rank, world_size=world, remote=None, device="cpu",
                device_memory_mb=None, output="numpy", decodes_units=True)


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


class _Rows:
    """A source batch (NumPy arrays, or a tuple holding some and lists) and its rows'
    positions; `at`: the rows already yielded."""

    def __init__(self, item: Any, positions: List[int]) -> None:
        self.item = item
        self.positions = positions
        self.at = 0

    def __len__(self) -> int:
        return len(self.positions) - self.at

    def take(self, n: int) -> Tuple[Any, List[int]]:
        a, b = self.at, self.at + n
        self.at = b
        return _slice(self.item, a, b), self.positions[a:b]


def _slice(item: Any, a: int, b: int) -> Any:
    if isinstance(item, tuple):
        return tuple(_slice(x, a, b) for x in item)
    return item[a:b]


def _concat(parts: List[Any]) -> Any:
    import numpy
    first = parts[0]
    if isinstance(first, tuple):
        return tuple(_concat([p[k] for p in parts]) for k in range(len(first)))
    if isinstance(first, list):
        return [x for p in parts for x in p]
    return numpy.concatenate(parts)


def _read_only(item: Any) -> Any:
    """Marks a batch's arrays read-only (as those out of Ray's object store are), so every
    batch of a remote loader behaves alike."""
    for x in item if isinstance(item, tuple) else (item,):
        if hasattr(x, "flags"):
            x.flags.writeable = False
    return item


def _expand(ranges: List[Tuple[int, int]]) -> List[int]:
    return [p for a, b in ranges for p in range(a, b)]


def _converter_from_numpy(output: str) -> Callable[[Any], Any]:
    """Converts a unit's batch (NumPy arrays, or a tuple holding some) to ``output``'s type:
    ``"numpy"`` as they are (read-only: views of Ray's object store, or of the training
    process's own decode), ``"torch"`` as tensors sharing them, ``"batch"`` as
    :class:`Batch` objects (one copy)."""
    import numpy
    if output == "numpy":
        def one(a: Any) -> Any:
            return a
    elif output == "torch":
        import torch

        def one(a: Any) -> Any:
            with warnings.catch_warnings():
                # Read-only memory shared, not copied: the training loop reads batches.
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)
    else:
        def one(a: Any) -> Any:
            b = _native._batch_from_bytes(None, str(a.dtype), list(a.shape))
            numpy.asarray(b)[...] = a
            return b

    def convert(item: Any) -> Any:
        if isinstance(item, tuple):
            return tuple(one(x) if isinstance(x, numpy.ndarray) else x for x in item)
        return one(item)
    return convert


class _WorkerBatches:
    """One epoch of a ``drop_last=True`` loader in ``DataLoader`` worker ``w`` of ``W``:
    the rank's epoch is planned here as the training process would (its epoch, and the state
    it loaded), and this worker decodes batches ``w``, ``w + W``, ... of it, the epoch's last
    partial batch left out. ``DataLoader`` takes its workers' batches in turn, so the training
    loop gets the local loader's batches in its order, none dropped but the last partial one
    (an item skipped as unreadable leaves its batch short: the rows that would make it up are
    another worker's). With ``fill_skipped`` a batch whose every item failed is made up from
    one this worker delivered, so the count stays the local loader's."""

    def __init__(self, loader: Any, split: Tuple[int, int], epoch: int,
                 resume: Optional[Dict[str, Any]]) -> None:
        worker, workers = split
        here = getattr(loader, "_units_here", None)
        if here is None or here[0] != os.getpid():
            cls_name = type(loader).__name__
            args = dict(loader._args, worker_split=None, remote=None)
            planner = _unit_loader(cls_name, dict(args, output="numpy"))
            planner._native.set_epoch(epoch)
            if resume is not None and resume.get("epoch") == epoch:
                planner._native.load_state_dict(resume)
            here = (os.getpid(), planner, _unit_loader(cls_name, _unit_args(args)))
            loader._units_here = here
        _, planner, self._decoder = here
        plan = planner._native._plan_units(1)
        planner._native.set_epoch(plan.epoch + 1)
        whole = plan.batches  # the local loader's count: a last partial batch dropped
        self._fill = bool(loader._args.get("fill_skipped"))
        self._convert = _converter_from_numpy(loader._output())
        self._split = split
        self._local = None
        if self._fill and resume is not None and resume.get("epoch") == plan.epoch \
                and resume.get("owed_batches") is not None:
            # A rank's fill_skipped state: what it owes depends on which of its items were
            # skipped before, which whole batches of positions do not show. Each worker runs
            # the rank's resumed epoch as the local loader would and keeps its own batches (w,
            # w + W, ...): the local loader's batches and count, for W times the decoding of
            # this one epoch.
            args = dict(loader._args, worker_split=None, remote=None, output="numpy")
            local = _unit_loader(type(loader).__name__, args)
            local._native.load_state_dict(resume)
            self._local = local
        self._states = [plan.unit_state(u) for u in range(worker, whole, workers)]
        # Where a worker that has delivered nothing makes up from: the rank's other batches.
        self._others = lambda: [plan.unit_state(u) for u in range(whole)
                                if u % workers != worker]
        self.epoch = plan.epoch

    def __iter__(self) -> Iterator[Any]:
        # With fill_skipped, a batch whose every item failed is made up from a batch this
        # worker delivered (the first ones first), or, by a worker that delivered none, from
        # the first of the rank's other batches that decodes.
        if self._local is not None:
            worker, workers = self._split
            for i, b in enumerate(_Epoch(self._local._native, _converter("numpy"))):
                if i % workers == worker:
                    yield self._convert(b)
            return
        done: List[Dict[str, Any]] = []
        owed = 0
        for state in self._states:
            got = _decode_unit(self._decoder, state)["batches"]
            yield from map(self._convert, got)
            if self._fill:
                if got:
                    done.append(state)
                else:
                    owed += 1
                owed = yield from self._make_up(done, owed)
        if owed and not done:
            done.extend(self._others())
            owed = yield from self._make_up(done, owed)

    def _make_up(self, done: List[Dict[str, Any]], owed: int) -> Generator[Any, None, int]:
        """Yields up to `owed` batches decoded again from the unit states in `done` (in turn;
        one that decodes to nothing is dropped); returns how many are still owed."""
        while owed and done:
            again = done.pop(0)
            made = _decode_unit(self._decoder, again)["batches"]
            yield from map(self._convert, made)
            if made:
                done.append(again)  # the next make-up reads the next batch
                owed -= 1
        return owed
