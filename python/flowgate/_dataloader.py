"""``flowgate.DataLoader``: ``torch.utils.data.DataLoader``'s arguments over a map-style
dataset, on flowgate's engine. The order (a seeded shuffle, ranks, equal counts), the
checkpoints and the failure policy are the library's; this module maps torch's arguments onto
them and names what it cannot do."""

from __future__ import annotations

import copy
import sys
import warnings
import weakref
from typing import Any, Callable, Dict, Iterator, List, Optional

from . import _native
from ._args import _process_group_ranks
from ._process import _OPEN, _Pass, _end_passes
from ._sources import _check_ints


class DataLoader:
    """A drop-in for ``torch.utils.data.DataLoader`` over a map-style ``Dataset``::

        loader = flowgate.DataLoader(dataset, batch_size=32, shuffle=True, num_workers=8,
                                     collate_fn=collate)   # was torch.utils.data.DataLoader
        for epoch in range(epochs):
            loader.set_epoch(epoch)
            for batch in loader: ...

    A batch is made as a torch worker makes one, ``dataset[i]`` for its positions (or
    ``dataset.__getitems__(positions)`` where the dataset has it) then ``collate_fn``
    (default: torch's ``default_collate``, or lists without torch), but on threads of this
    process the tuner sizes (``num_workers``: how many to start with; 0 leaves it to the
    tuner). Each thread calls a copy of the dataset of its own (``copy.copy``, and so the
    torch datasets it holds: a ``Subset``'s, a ``ConcatDataset``'s; made afresh each pass;
    with ``persistent_workers`` kept, a thread that ends leaving its copy to the next new
    one), as each torch worker has one, and a ``collate_fn`` that is the dataset's method
    runs on the thread's copy: a file the
    dataset opens lazily is that thread's; objects the dataset already holds are shared
    and must be safe to call from threads at once (a dataset that cannot be copied is shared
    whole, with a warning). ``num_workers`` above the process's cores (its share of the
    node: a container's quota or the affinity mask, over ``LOCAL_WORLD_SIZE`` ranks) is for a
    dataset that waits (network reads): exactly that many batches are made at once, as by
    torch's workers. Batches come in the positions' order: with ``shuffle=False`` torch's
    batches. Ahead of the loop wait at
    most ``prefetch_factor`` (default 2) batches per worker for it, and as many in the stage
    (torch's bound; Python objects are not measured, so the bound is in batches).

    What torch lacks: under ``torchrun`` (``RANK``/``WORLD_SIZE``) each rank reads its share,
    every share as long (padded by repeating the epoch's start, as ``DistributedSampler``;
    ``drop_last=True`` drops the remainder instead); ``state_dict()`` / ``load_state_dict()``
    resume an epoch exactly where it stopped; ``skip_errors=True`` leaves an item whose
    ``__getitem__`` raises out of its batch (counted; the batch keeps its place; a batch whose
    ``__getitems__`` raises is read item by item, one whose ``collate_fn`` raises keeps the
    items halving finds collate together, each left out counted), where the default raises
    :class:`LoaderError` naming it (the dataset's exception its ``__cause__``). A batch whose
    every item fails is left out in one process (no item comes twice in an epoch), and made up
    of the readable items after it under a world size above 1, so every rank still makes
    ``len()`` batches (``stats()["filled"]`` counts the items read again); an epoch with no
    readable item raises. The first skipped item is said once, as a
    :class:`SkippedItemsWarning` with its reason, and each epoch that skipped items ends with
    one giving the count (and the batches delivered, where ``len()`` counted others);
    ``failures()`` lists them.
    ``stats()["gil"]``: how many threads were busy in the dataset's calls (``threads_busy``) on
    how many cores (``cores_used``); ``stats()["gil_bound"]`` when several took turns on about
    one core: the dataset's Python code holds the GIL, and more threads cannot help.

    The order of a shuffled epoch follows from ``seed`` (or ``generator.initial_seed()``) and
    the epoch (``set_epoch``, else one more each pass read through; with several ranks a pass
    left early costs no epoch, as ``DistributedSampler``'s, and so does a peek at one batch
    of a resumed epoch); it is not torch's permutation. Without ``seed`` or ``generator`` the
    seed is 0, whatever ``torch.manual_seed`` says (every rank must shuffle alike, and a
    resume in another process must find the same order): pass ``seed=`` to vary it.
    Refused, with the reason: ``sampler``, ``batch_sampler``, ``worker_init_fn`` and
    ``timeout`` (there are no worker processes).
    """

    def __init__(self, dataset: Any, batch_size: Optional[int] = 1, shuffle: Optional[bool] = None,
                 sampler: Any = None, batch_sampler: Any = None, num_workers: int = 0,
                 collate_fn: Optional[Callable[[Any], Any]] = None, pin_memory: bool = False,
                 drop_last: bool = False, timeout: float = 0, worker_init_fn: Any = None,
                 multiprocessing_context: Any = None, generator: Any = None, *,
                 prefetch_factor: Optional[int] = None, persistent_workers: bool = False,
                 pin_memory_device: str = "", in_order: bool = True, seed: Optional[int] = None,
                 rank: Optional[int] = None, world_size: Optional[int] = None,
                 skip_errors: bool = False, cpu_budget: Any = None) -> None:
        for name, given, why in (
                ("sampler", sampler is not None, "it orders the dataset itself: shuffle, seed "
                 "and the ranks from the environment"),
                ("batch_sampler", batch_sampler is not None, "it batches in order with "
                 "batch_size and drop_last"),
                ("worker_init_fn", worker_init_fn is not None, "there are no worker "
                 "processes: items are fetched on threads of this process"),
                ("timeout", timeout not in (0, None), "there are no worker processes to "
                 "time out")):
            if given:
                raise ValueError(f"flowgate.DataLoader takes no {name}: {why}")
        if batch_size is None and drop_last:
            # torch's refusal: without batches there is no last partial one to drop.
            raise ValueError("batch_size=None option disables auto-batching and is mutually "
                             "exclusive with drop_last")
        data = sys.modules.get("torch.utils.data")
        if (not hasattr(dataset, "__getitem__") or not hasattr(dataset, "__len__")
                or (data is not None and isinstance(dataset, data.IterableDataset))):
            # (An IterableDataset has torch's Dataset.__getitem__, which raises.)
            raise TypeError("flowgate.DataLoader needs a map-style dataset (__getitem__ and "
                            f"__len__), not {type(dataset).__name__}")
        _native._check_limit("num_workers", num_workers)
        if batch_size is not None:
            _native._check_limit("batch_size", batch_size)
        if seed is None:
            seed = generator.initial_seed() % 2**64 if generator is not None else 0
        self.dataset = dataset
        self.batch_size = batch_size
        self.drop_last = drop_last
        settings: Dict[str, Any] = _process_group_ranks(dict(
            batch_size=1 if batch_size is None else batch_size, shuffle=bool(shuffle),
            seed=seed, drop_last=drop_last,
            order="input" if in_order else "completion", skip_errors=skip_errors,
            cpu_budget=cpu_budget, rank=rank, world_size=world_size))
        native = _native.Pipeline.indexed(len(dataset), settings)
        if collate_fn is None:
            collate_fn = _default_collate(batched=batch_size is not None)
        if batch_size is not None:
            # A batch's positions, fetched and collated by one call on a tuned thread (as a
            # torch worker makes a batch): one GIL turn a batch, not one an item.
            native.batch(batch_size, drop_last)
        # More workers than cores are for a dataset that waits (network reads): that many
        # calls at once, as torch's workers; else threads the tuner sizes to the cores,
        # starting at num_workers.
        # An item that raises is a failed item (fatal, or with skip_errors counted and left
        # out); a batch whose every item fails is, under a world size above 1, made up of the
        # readable items after it in the rank's own share (the library's `MakeUp`), so every
        # rank still makes len() batches, and in one process left out (no item comes twice in
        # an epoch).
        # Each thread calls a copy of the dataset of its own (made afresh each pass unless
        # persistent_workers, where a thread that ended leaves its copy to the next new one),
        # as each torch worker has one: kept here, by thread, where the garbage collector sees
        # them (the fetch holds this loader weakly: a cycle through the dataset or collate_fn
        # is freed).
        self._copies: Dict[int, Any] = {}
        self._spare: List[Any] = []
        self._persistent = bool(persistent_workers)
        self.collate_fn = collate_fn
        native.map(_native.Fetch(weakref.ref(self), skip_errors, batch_size is not None,
                                 _thread_copy if _copies(dataset) else None,
                                 self._persistent, native),
                   num_workers, "fetch", num_workers > _cores())
        # Made ahead of the loop, as torch's `prefetch_factor` per worker: at most that many
        # batches per thread waiting in the stage and as many for the loop (Python objects are
        # not measured, so the bound is in batches; it was 256 whatever their size).
        if prefetch_factor is not None:
            _native._check_limit("prefetch_factor", prefetch_factor)
        # Refused past the library's bound, naming both numbers (it was cut to it unsaid).
        native.prefetch(_native._batches_ahead(prefetch_factor, num_workers, _cores()))
        self._native = native
        self._pin, self._pin_warned = pin_memory, False
        # What torch's DataLoader exposes, for code that reads it.
        self.num_workers, self.collate_fn, self.pin_memory = num_workers, collate_fn, pin_memory
        self.generator, self.prefetch_factor = generator, prefetch_factor
        self.persistent_workers, self.batch_sampler = persistent_workers, None
        #: ``loader.sampler.set_epoch(epoch)`` (DDP code's habit) sets the loader's epoch.
        self.sampler = _EpochSetter(self)
        _OPEN.add(self)
        self._built = True

    def __setattr__(self, name: str, value: Any) -> None:
        # As torch's: what the pipeline was built from cannot change under it (a dataset set
        # anew was read at the old length, or not at all with persistent_workers).
        if name in _FIXED and self.__dict__.get("_built"):
            raise ValueError(f"{name} attribute should not be set after "
                             f"{type(self).__name__} is initialized")
        super().__setattr__(name, value)

    def __copy__(self) -> Any:
        raise TypeError("a flowgate.DataLoader does not copy (its pipeline and threads are its "
                        "own): build another with the same arguments")

    def __deepcopy__(self, memo: Any) -> Any:
        return self.__copy__()

    def __len__(self) -> int:
        share = self._native.share
        if self.batch_size is None:
            return share
        return _native._batches_of(share, self.batch_size, self.drop_last)

    def __iter__(self) -> Iterator[Any]:
        convert = None
        if self._pin:
            import torch
            if torch.cuda.is_available():
                from torch.utils.data._utils.pin_memory import pin_memory
                convert = pin_memory
            elif not self._pin_warned:
                # Said once a loader, as torch says it: the batches stay in pageable memory.
                self._pin_warned = True
                warnings.warn("pin_memory=True, but no CUDA device is available: the batches "
                              "are not pinned", UserWarning, stacklevel=2)
        if not self._persistent:
            self._copies.clear()
        return _Pass(self, convert)

    def set_epoch(self, epoch: int) -> None:
        """Makes ``epoch`` the next one iterated (as ``DistributedSampler.set_epoch``): its
        order follows from the seed and the epoch. A no-op when it is the next already, so a
        position from :meth:`load_state_dict` is kept when ``epoch`` is the checkpoint's own
        (naming another epoch leaves it); during a pass, the next pass's epoch."""
        _check_epoch(epoch)
        self._native.set_epoch(int(epoch))

    def state_dict(self) -> Dict[str, Any]:
        """What the training loop has received: ``load_state_dict`` on a loader built alike
        continues with exactly the batches that were not delivered."""
        return self._native.state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resumes ``state`` at the next ``iter()``; a loop running at the time raises (it
        ended quietly, as if its epoch were over: a roll-back after a loss spike lost the
        rest of the epoch unnoticed)."""
        _end_passes(self, "load_state_dict()", lambda: self._native.load_state_dict(state))

    def stats(self) -> Dict[str, Any]:
        """The stages' statistics (threads, items), and what the dataset's calls took
        (``gil``: threads busy, cores used, whether the GIL bound them)."""
        s = self._native.stats()
        s["gil_bound"] = s["gil"]["bound"]
        return s

    def failures(self, epoch: Optional[int] = None) -> List[Any]:
        """The items skipped in ``epoch`` (default: the epoch being iterated, or the last one
        started), the last 1,000 kept: ``(stage, item, message)`` tuples."""
        return self._native.failures(epoch)

    def tuner_trace(self) -> List[Dict[str, Any]]:
        """The tuner's recent ticks (each thread count it set and why: ``decisions``), as
        the loaders' ``tuner_trace()``; empty before the first ``iter()``."""
        return self._native.tuner_trace()

    def close(self) -> None:
        """Stops the threads (an iterator running at the time raises :class:`LoaderError`);
        a later ``iter()`` starts them again."""
        self._native.close()


#: Attributes set once: torch's DataLoader refuses setting them after it is built too.
_FIXED = frozenset({"dataset", "batch_size", "drop_last", "sampler", "batch_sampler",
                    "persistent_workers"})


def _thread_copy(dataset: Any, memo: Optional[Dict[int, Any]] = None,
                 shared: Optional[List[str]] = None, name: str = "dataset") -> Any:
    """A thread's copy of ``dataset``: ``copy.copy``, and so, the same way, every torch
    ``Dataset`` it holds in an attribute (alone, or in a list or tuple of them): a
    ``Subset``'s or ``random_split``'s dataset, a ``ConcatDataset``'s, a wrapper's. Each
    torch worker has a copy of them all; a shallow copy shared the inner dataset, and a file
    it opened lazily, among the threads (most items were then read through another thread's
    file). An inner dataset that cannot be copied is shared, its name added to ``shared``."""
    memo = {} if memo is None else memo
    if id(dataset) in memo:
        return memo[id(dataset)]
    mine = memo[id(dataset)] = copy.copy(dataset)
    data = sys.modules.get("torch.utils.data")
    state = getattr(mine, "__dict__", None)
    if data is None or state is None or state is getattr(dataset, "__dict__", None):
        return mine

    def inner(v: Any, at: str) -> Any:
        try:
            return _thread_copy(v, memo, shared, at)
        except Exception:  # noqa: BLE001 - shared as before, and said at build
            if shared is not None:
                shared.append(at)
            return v

    for k, v in list(state.items()):
        if isinstance(v, data.Dataset):
            state[k] = inner(v, f"{name}.{k}")
        elif (isinstance(v, (list, tuple)) and v
              and all(isinstance(x, data.Dataset) for x in v)):
            state[k] = type(v)(inner(x, f"{name}.{k}[{i}]") for i, x in enumerate(v))
    return mine


def _copies(dataset: Any) -> bool:
    """Whether the dataset copies (:func:`_thread_copy`) for each thread; where it does
    not, a warning says its threads share it (a wrapper whose ``__getattr__`` forwards to
    an attribute that a copy does not have yet recurses)."""
    shared: List[str] = []
    try:
        _thread_copy(dataset, shared=shared)
        if shared:
            warnings.warn(
                f"flowgate.DataLoader: {', '.join(shared)} cannot be copied for each thread "
                "(copy.copy raised), so the threads share it: its calls must be safe from "
                "several threads at once. Define __copy__ to give each thread its own, as "
                "torch's workers have.", stacklevel=3)
        return True
    except Exception as e:  # noqa: BLE001 - any reason is said
        warnings.warn(
            f"flowgate.DataLoader: the dataset cannot be copied for each thread (copy.copy "
            f"raised {type(e).__name__}: {e}), so its threads share it: its calls must be "
            "safe from several threads at once (a file opened lazily in __getitem__ is "
            "shared). Define __copy__ to give each thread its own, as torch's workers have.",
            stacklevel=3)
        return False


def _cores() -> int:
    """The cores this process may use, as the tuner counts them: its share of the node's
    (a container's quota or the affinity mask, over ``LOCAL_WORLD_SIZE`` ranks)."""
    return _native._process_cores()


class _EpochSetter:
    """``loader.sampler``: what DDP code calls ``set_epoch`` on, and its share's length. It
    holds the loader's pipeline, not the loader: a loader in a reference cycle would be
    freed by the garbage collector, at any call into Python, on any thread."""

    def __init__(self, loader: DataLoader) -> None:
        self._native = loader._native

    def set_epoch(self, epoch: int) -> None:
        _check_epoch(epoch)
        self._native.set_epoch(int(epoch))

    def __len__(self) -> int:
        return self._native.share


def _check_epoch(epoch: Any) -> None:
    # The loaders' check, in their words.
    _check_ints({"epoch": epoch}, epoch=0)


def _default_collate(batched: bool) -> Callable[[Any], Any]:
    """torch's ``default_collate`` (``default_convert`` without batching); without torch,
    a batch is the list of its items."""
    try:
        from torch.utils.data import default_collate, default_convert
    except ImportError:
        return (lambda items: items) if batched else (lambda item: item)
    return default_collate if batched else default_convert
