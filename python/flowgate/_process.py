"""How a loader lives around the training process: one epoch's iterator (which knows the
process it belongs to), loaders across ``fork`` (the child rebuilds its native side),
``DataLoader`` workers (each reads its share), pickling, and batches converted to torch
tensors or NumPy arrays."""

from __future__ import annotations

import atexit
import os
import re
import sys
import tempfile
import uuid
import warnings
import weakref
from typing import Any, Callable, Dict, Optional, Tuple

from . import _native
from ._native import Batch


class _Epoch:
    """An iterator over one epoch of a loader (the GIL is released while waiting)."""

    def __init__(self, native: Any, convert: Optional[Callable[[Any], Any]] = None) -> None:
        self._native = native
        self._convert = convert
        self._pid = os.getpid()
        self._number = None
        started = native._start_epoch()
        if started is not None:
            # A loader's: the iterator's number, and an abandoned epoch it starts again.
            self._number, again = started
            if again is not None:
                _warn_again(*again)

    def __del__(self) -> None:
        # Left with `break` (or dropped mid-way): stop the epoch's pipeline now, so its
        # threads and buffers do not outlive the loop. Not in a forked child: the pipeline's
        # threads are the parent's.
        if self._number is not None and os.getpid() == self._pid:
            try:
                self._native._abandon(self._number)
            except Exception:  # interpreter shutting down
                pass

    def __iter__(self) -> "_Epoch":
        return self

    def __next__(self) -> Any:
        if os.getpid() != self._pid:
            raise RuntimeError(
                "this epoch's iterator was made before a fork, and its threads are the parent "
                "process's; call iter(loader) again in this process")
        if self._number is None:
            item = self._native._next()
        else:
            # Ended once a newer iterator of the loader took the epoch over.
            item = self._native._next(self._number)
        if item is None and self._number is not None:
            # A loader's end of the epoch (a Pipeline's raises StopIteration: its results
            # may be None).
            raise StopIteration
        return item if self._convert is None else self._convert(item)


class _Pass:
    """One ``iter()`` of a :class:`Pipeline` or :class:`DataLoader`: its pipeline's pass,
    ended with an error once a newer ``iter()`` of the same owner took the pipeline over (two
    live iterators would otherwise share one stream of results, each missing the other's)."""

    def __init__(self, owner: Any, convert: Optional[Callable[[Any], Any]] = None) -> None:
        owner._passes = getattr(owner, "_passes", 0) + 1
        owner._ended_by = None
        self._owner, self._n = owner, owner._passes
        self._epoch = _Epoch(owner._native, convert)

    def __iter__(self) -> "_Pass":
        return self

    def __next__(self) -> Any:
        self._check()
        try:
            return next(self._epoch)
        except StopIteration:
            # Ended while it waited, by a load_state_dict() from another thread: said too.
            self._check()
            raise

    def _check(self) -> None:
        if self._n != self._owner._passes:
            if getattr(self._owner, "_ended_by", None) is not None:
                raise RuntimeError(
                    f"{self._owner._ended_by} during this loop ended it: iter() again "
                    "continues from the loaded state")
            raise RuntimeError(
                "a newer iter() of this loader took its pipeline over: one iterator at a time "
                "(torch's DataLoader runs workers per iterator; flowgate runs one pipeline "
                "per loader)")


def _end_passes(owner: Any, by: str, f: Callable[[], Any]) -> Any:
    """Runs ``f``, which ends the owner's live ``iter()`` (``by``: what ended it, as its error
    says), as a newer ``iter()`` would: its loop raises rather than stop as if the epoch were
    over (also one waiting on another thread meanwhile). Where ``f`` raises, nothing ended."""
    passes, ended_by = getattr(owner, "_passes", 0), getattr(owner, "_ended_by", None)
    owner._passes, owner._ended_by = passes + 1, by
    try:
        return f()
    except BaseException:
        owner._passes, owner._ended_by = passes, ended_by
        raise


# Pipelines and DataLoaders alive: closed at exit, before the interpreter stops running
# Python (their threads call into it).
_OPEN: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _close_open() -> None:
    # Each pipeline stops on a thread of its own; exit waits for them and for the calls under
    # way at most a minute (`_join_closing`: Ctrl-C ends the process at once), where joining
    # here waited forever for a __getitem__ that never returns.
    _native._closing_at_exit()
    for owner in list(_OPEN):
        try:
            owner.close()
        except Exception:  # noqa: BLE001 - exiting anyway
            pass
    # And those the garbage collector freed on their own threads, stopping elsewhere.
    _native._join_closing()


def _warn_again(epoch: int, delivered: int) -> None:
    """An abandoned epoch started again from its beginning: silent after a peek (one
    batch), a warning after a loop left mid-way (it reads the same batches again)."""
    if delivered >= 2:
        warnings.warn(
            f"flowgate: epoch {epoch} starts again from its beginning: the last loop over it "
            f"stopped after {delivered} batches (a break, or a new iter() while it ran). An "
            "epoch ends only at its end; to move on, call loader.set_epoch(epoch) at each "
            "epoch's start, as with DistributedSampler",
            UserWarning, stacklevel=4)


# Loaders alive in this process: before a fork, each notes the epoch a child should start at.
_LIVE: "weakref.WeakSet[Any]" = weakref.WeakSet()


def _before_fork() -> None:
    for loader in list(_LIVE):
        # The forked DataLoader workers mark this process's marker, not its parent's.
        loader._own_marker()
        if loader._pid == os.getpid():
            try:
                epoch = loader._native._epoch_for_fork()
                if epoch is not None:
                    loader._fork_epoch = epoch
            except Exception:
                pass


def _after_fork_in_child() -> None:
    # A forked child (a DataLoader worker) serves no metrics: the port is the parent's.
    for loader in list(_LIVE):
        if getattr(loader, "metrics_address", None) is not None:
            loader.metrics_address = None
            try:
                loader._native._forget_metrics_in_fork()
            except Exception:
                pass


if hasattr(os, "register_at_fork"):
    # Registered first, so its `before` runs last, just before the fork: no pipeline thread is
    # then making a Python thread state (a CPython race that hangs the child).
    os.register_at_fork(before=_native._before_fork, after_in_parent=_native._after_fork)
    os.register_at_fork(before=_before_fork, after_in_child=_native._after_fork_in_child)
    os.register_at_fork(after_in_child=_after_fork_in_child)

# From interpreter exit on, freed loaders join their threads without releasing the GIL.
atexit.register(_native._exiting)
# Registered after, so run before: Python-calling pipelines stop while Python still runs.
atexit.register(_close_open)


def _worker_info() -> Any:
    """``torch.utils.data.get_worker_info()`` if torch is loaded, else None. A module another
    thread is importing now (torch imported lazily by the first ``iter()`` while a thread
    polls ``stats()``) has no worker info yet: this process is no worker then (workers import
    torch before they run)."""
    data = sys.modules.get("torch.utils.data")
    get = getattr(data, "get_worker_info", None)
    return None if get is None else get()


def _in_worker() -> bool:
    """Whether this process is a ``torch.utils.data.DataLoader`` worker."""
    return _worker_info() is not None


def _worker_split() -> Optional[Tuple[int, int]]:
    """``(worker id, workers)`` inside a ``torch.utils.data.DataLoader`` worker of several,
    else None."""
    info = _worker_info()
    if info is None or info.num_workers <= 1:
        return None
    return info.id, info.num_workers


def _register_with_torch() -> None:
    """Makes the loaders ``torch.utils.data.IterableDataset`` instances to ``isinstance`` (an ABC
    registration; torch is not imported for it), so ``DataLoader(loader, batch_size=None)``
    takes the iterable route."""
    data = sys.modules.get("torch.utils.data")
    if data is not None and not getattr(_register_with_torch, "done", False):
        data.IterableDataset.register(sys.modules["flowgate"]._Loader)
        _register_with_torch.done = True  # type: ignore[attr-defined]


def _converter(output: str, from_numpy: bool = False) -> Optional[Callable[[Any], Any]]:
    """Converts a batch (a :class:`Batch`, or with ``from_numpy`` a unit's NumPy array; or a
    tuple holding some) to ``output``'s type: ``"numpy"`` (a unit's arrays as they are:
    read-only views of Ray's object store or of the process's own decode), ``"torch"``
    (tensors sharing the memory), ``"batch"`` (a unit's arrays copied once)."""
    import numpy
    kind = numpy.ndarray if from_numpy else Batch
    if output == "batch" and not from_numpy:
        return None
    if output == "torch":
        import torch

        def one(a: Any) -> Any:
            if not from_numpy:
                return torch.from_dlpack(a)
            with warnings.catch_warnings():
                # Read-only memory shared, not copied: the training loop reads batches.
                warnings.simplefilter("ignore", UserWarning)
                return torch.from_numpy(a)
    elif output == "numpy":
        def one(a: Any) -> Any:
            return a if from_numpy else numpy.asarray(a)
    else:
        def one(a: Any) -> Any:
            b = _native._batch_from_bytes(None, str(a.dtype), list(a.shape))
            numpy.asarray(b)[...] = a
            return b

    def convert(item: Any) -> Any:
        if isinstance(item, tuple):
            return tuple(one(x) if isinstance(x, kind) else x for x in item)
        if isinstance(item, dict):
            return {k: one(x) if isinstance(x, kind) else x for k, x in item.items()}
        return one(item)
    return convert


_MARKER_PREFIX = "flowgate-workers-"


def _sweep_dead_markers(folder: str) -> int:
    """Removes this user's marker files whose training process is gone (killed before its
    loaders were freed): once per process, when its first marker is made. A marker whose
    owner still runs (or whose PID another process now has) is kept. Returns how many went."""
    removed = 0
    try:
        names = [n for n in os.listdir(folder) if n.startswith(_MARKER_PREFIX)]
    except OSError:
        return 0
    uid = os.getuid() if hasattr(os, "getuid") else None
    for name in names:
        pid = name[len(_MARKER_PREFIX):].split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        path = os.path.join(folder, name)
        try:
            if uid is not None and os.lstat(path).st_uid != uid:
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:
            try:
                os.unlink(path)
                removed += 1
            except OSError:
                pass
        except (OSError, OverflowError, ValueError):
            pass  # alive under another user (EPERM), or not ours to judge
    return removed


_SWEPT = False


#: Markers a DataLoader worker could not write, as their paths: learned in the training
#: process when the worker's error is raised there (see `WorkerMarkerError`).
_UNWRITTEN: set = set()


class WorkerMarkerError(RuntimeError):
    """A ``DataLoader`` worker could not write the marker that tells the training process it
    read the loader. Raised in the worker, and raised again by ``DataLoader`` in the training
    process, where making it records the marker as written: that process's ``state_dict()``
    then refuses, as it does when workers read the loader (it cannot know their progress)."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        found = re.search(r"marker file '([^']+)'", message)
        if found:
            _UNWRITTEN.add(found.group(1))


class _WorkerMarker:
    """Whether ``DataLoader`` workers have read a loader: a file named after the loader,
    made by a worker (forked or spawned) and seen by the training process that owns the
    loader (removed with it; a killed process's are removed by the next training process
    that makes one)."""

    def __init__(self) -> None:
        global _SWEPT
        self.owner = os.getpid()
        if not _SWEPT:
            _SWEPT = True
            _sweep_dead_markers(tempfile.gettempdir())
        self.path = os.path.join(tempfile.gettempdir(),
                                 f"{_MARKER_PREFIX}{self.owner}-{uuid.uuid4().hex}")
        weakref.finalize(self, _unlink_if_owner, self.path, self.owner)

    def __reduce__(self) -> Any:
        return (_marker_of, (self.owner, self.path))

    def mark(self) -> None:
        try:
            with open(self.path, "a"):
                pass
        except OSError as e:
            raise WorkerMarkerError(
                f"this DataLoader worker cannot write its marker file {self.path!r} ({e}): "
                "the training process would not know that workers read the loader, and a "
                "state_dict() taken there would lose their progress") from None

    def marked(self) -> bool:
        return os.getpid() == self.owner and (os.path.exists(self.path)
                                              or self.path in _UNWRITTEN)

    def clear(self) -> None:
        _unlink_if_owner(self.path, self.owner)


def _marker_of(owner: int, path: str) -> _WorkerMarker:
    """Unpickles a marker: the training process's, not a new one."""
    m = _WorkerMarker.__new__(_WorkerMarker)
    m.owner, m.path = owner, path
    return m


def _unlink_if_owner(path: str, owner: int) -> None:
    if os.getpid() == owner:
        try:
            os.unlink(path)
        except OSError:
            pass


def _rebuild(cls: type, args: Dict[str, Any], epoch: int,
             marker: Optional[_WorkerMarker] = None,
             resume: Optional[Dict[str, Any]] = None) -> Any:
    """Unpickles a loader: built anew from its arguments, at the epoch it was at (resuming
    the state its training process loaded for that epoch)."""
    loader = cls.__new__(cls)
    # A copy in the same process (deepcopy, pickle round trip) is its own loader, with its
    # own marker; in another process (a spawned DataLoader worker) it marks the original's.
    if marker is not None and marker.owner == os.getpid():
        marker = None
    loader._setup(args, marker)
    loader.set_epoch(epoch)
    if resume is not None and resume.get("epoch") == epoch:
        loader._resume = resume
        loader._native.load_state_dict(resume)
    return loader
