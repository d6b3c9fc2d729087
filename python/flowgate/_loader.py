"""What the media loaders share (``_Loader``): iteration by epochs — locally, as one of the
readers of a rank's epoch in ``DataLoader`` workers, or on Ray actors with ``remote=`` —
checkpoints, statistics, and how a loader lives in other processes (pickling, ``fork``,
``DataLoader`` workers)."""

from __future__ import annotations

import operator
import os
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ._args import _process_group_ranks
from ._native import DeviceUnavailable
from ._process import (_LIVE, _Epoch, _WorkerMarker, _converter, _in_worker,
                       _rebuild, _register_with_torch, _worker_split)
from ._remote import Ray, _Pool, _RemoteEpoch
from ._sources import _check_ints


class _Loader:
    """What the media loaders share: iteration by epochs, checkpoints, statistics, and how
    they live in other processes (pickling, ``fork``, ``DataLoader`` workers)."""

    _native: Any
    #: The loader's arguments (what pickling and a forked child rebuild it from).
    _args: Dict[str, Any]
    #: The process the native side belongs to, and the DataLoader worker split it was built
    #: for.
    _pid: int
    _split: Optional[Tuple[int, int]]
    _fork_epoch: int
    #: A state loaded in the training process and not yet iterated there: the processes
    #: it forks (DataLoader workers) resume from it too.
    _resume: Optional[Dict[str, Any]]
    #: Set by DataLoader workers that read this loader (see ``state_dict``).
    _marker: _WorkerMarker
    batch_size: int
    dataset: Any

    def _setup(self, args: Dict[str, Any], marker: Optional[_WorkerMarker] = None) -> None:
        """Builds the native side from the constructor's arguments (its ``locals()``);
        ``marker``: the training process's, for a loader unpickled in a worker."""
        args = _process_group_ranks({k: v for k, v in args.items()
                                     if k not in ("self", "__class__")})
        if args.get("output") not in ("batch", "torch", "numpy"):
            raise ValueError(f'output must be "batch", "torch" or "numpy", not '
                             f'{args.get("output")!r}')
        self._args = args
        #: Samples per batch (the last one of an epoch may be smaller unless ``drop_last``).
        self.batch_size = args["batch_size"]
        #: What the loader reads, as given (``paths``).
        self.dataset = args["paths"]
        self._split = None
        self._fork_epoch = 0
        self._resume = None
        self._marker = marker if marker is not None else _WorkerMarker()
        remote = args.get("remote")
        if remote is not None:
            if not isinstance(remote, Ray):
                raise TypeError(f"remote must be a flowgate.Ray(...) or None, not {remote!r}")
            # What units cannot carry (fields, map=, map_batch=, a device) the library
            # refuses when the loader is built (`LoaderBuilder::plans_units`).
        #: The remote pool (made at the first remote epoch). A remote epoch is the native
        #: loader's own (its checkpoint, failures and a break, as a local epoch's).
        self._pool: Optional[_Pool] = None
        self._native = self._build(args)
        #: Where the Prometheus endpoint serves (``metrics_port=``): ``(host, port)``, or None.
        self.metrics_address: Optional[Tuple[str, int]] = None
        if args.get("metrics_port") is not None:
            self.metrics_address = self._native._serve_metrics(
                _metrics_address(args["metrics_port"]))
        self._pid = os.getpid()
        _LIVE.add(self)
        _register_with_torch()

    def _build(self, args: Dict[str, Any]) -> Any:
        raise NotImplementedError

    def _here(self) -> Any:
        """The native loader for this process: after a ``fork`` (or in a ``DataLoader``
        worker of several) a new one, built from the arguments and starting at the epoch the
        parent was at (resuming a state the parent loaded for it); in worker ``w`` of ``W``
        it is reader ``w`` of ``W`` of the rank's epochs (the library's split): the rank's
        batches ``w``, ``w + W``, ..., so ``DataLoader``, taking its workers' batches in
        turn, gives the rank's batches, count and order."""
        split = _worker_split()
        if os.getpid() == self._pid and split == self._split:
            return self._native
        if split is not None and self._args.get("device", "cpu") != "cpu":
            raise DeviceUnavailable(
                f"device={self._args['device']!r} uploads from the training process: iterate "
                "the loader there, or give DataLoader workers a loader with device='cpu' "
                "(and pin_memory=True)")
        if os.getpid() != self._pid:
            # The parent's loader, freed below, is forgotten here (its threads are the
            # parent's: see the native loader's drop).
            epoch = self._fork_epoch
            self._own_marker()
        else:
            epoch = self._native._next_epoch()
            self._native.close()
        args = dict(self._args)
        if split is not None:
            args["reader"] = split
        self._native = self._build(args)
        self._native.set_epoch(epoch)
        if self._resume is not None and self._resume.get("epoch") == epoch:
            self._native.load_state_dict(self._resume)
        self._pid, self._split = os.getpid(), split
        return self._native

    def _own_marker(self) -> None:
        """A process that uses the loader and is not a DataLoader worker (a child the training
        runs in, a copy's process) gets its own worker marker: its ``state_dict`` asks whether
        *its* workers read the loader, not its parent's."""
        if os.getpid() != self._marker.owner and not _in_worker():
            self._marker = _WorkerMarker()

    def _remote_pool(self) -> _Pool:
        if self._pool is None:
            self._pool = _Pool(self, self._args["remote"])
        return self._pool

    def _output(self) -> str:
        # The same type with DataLoader workers as without: a Batch leaves a worker pickled
        # (its bytes), a torch tensor (output="torch") through shared memory.
        return self._args["output"]

    def __iter__(self) -> Iterator[Any]:
        """Iterates one epoch. After its end the next ``iter()`` starts the next epoch; a
        loop left mid-way (``break``, ``next(iter(loader))`` to peek, a new ``iter()``) is
        abandoned — its pipeline stops at once — and the next ``iter()`` starts that epoch
        again from where it started, in the same order (as ``DistributedSampler`` until
        ``set_epoch``; a warning says so when more than one batch had been delivered). Yields a :class:`Batch`, or with
        ``labels`` and/or ``return_paths`` a tuple ``(batch, labels, paths)`` of what was asked
        for (with ``output="torch"``/``"numpy"``, tensors/arrays instead of batches)."""
        if self._args.get("remote") is not None:
            if _in_worker() or os.getpid() != self._pid:
                raise RuntimeError(
                    "a loader with remote= hands its units to Ray actors from the training "
                    "process: iterate it there (not in DataLoader workers or a forked child)")
            return _RemoteEpoch(self)
        native = self._here()
        if _in_worker():
            self._marker.mark()
        elif os.getpid() == self._marker.owner:
            # Iterated here: this process's state covers what it delivers from now on.
            self._resume = None
            self._marker.clear()
        return _Epoch(native, _converter(self._output()))

    def __getitem__(self, index: Any) -> Any:
        raise TypeError(
            "a flowgate loader is an iterable dataset that batches and decodes on its own "
            "threads, not a map-style one: iterate it directly, or pass it as "
            "DataLoader(loader, batch_size=None) (import torch before building the loader)")

    def __len__(self) -> int:
        """Batches per epoch (on this rank): what an epoch delivers, also through
        ``DataLoader`` workers (which read whole batches of the rank's epoch, together its
        ``len``), unless files are skipped as unreadable in a single process (under a world
        size above 1, ``fill_skipped`` keeps the count by default)."""
        return len(self._native)

    def __repr__(self) -> str:
        paths = self._args["paths"]
        shown = f"[{len(paths)} paths]" if isinstance(paths, (list, tuple)) else repr(paths)
        return (f"{type(self).__name__}({shown}, batch_size={self.batch_size}, "
                f"len={len(self)}, epoch={self.epoch})")

    def __reduce__(self) -> Any:
        epoch = self._native._next_epoch() if os.getpid() == self._pid else self._fork_epoch
        # Pickled for the workers of this process (spawn): they mark this process's marker.
        self._own_marker()
        # A copy does not serve metrics: the port is this loader's.
        args = dict(self._args, metrics_port=None)
        return (_rebuild, (type(self), args, epoch, self._marker, self._resume))

    def set_epoch(self, epoch: int) -> None:
        """Makes ``epoch`` the next epoch iterated (as ``DistributedSampler.set_epoch``):
        its order and augmentation follow from ``seed`` and the epoch. A no-op when it is
        the next already (so a loop calling it keeps a position from
        :meth:`load_state_dict`); an epoch being iterated is abandoned. ``DataLoader``
        workers start at the epoch set in the parent."""
        _check_ints({"epoch": epoch}, epoch=0)
        native = self._here()
        if self._pool is not None:
            # A remote epoch being iterated is abandoned, as a local one is.
            self._pool.abandon()
        native.set_epoch(epoch)
        if self._resume is not None and self._resume.get("epoch") != epoch:
            # Another epoch: the loaded state no longer applies (for workers started later).
            self._resume = None

    @property
    def classes(self) -> Optional[List[str]]:
        """With ``labels="folder"``: the class names, index = label; otherwise None."""
        return self._native.classes

    @property
    def epoch(self) -> int:
        """The epoch being iterated, or the next one."""
        return self._here().epoch

    def stats(self) -> Dict[str, Any]:
        """Delivered batches, failures, the consumer's wait, and per-stage workers and rates.
        With ``remote=``, also ``remote``: the pool's workers, units issued again, and the
        training process's own unit loader's statistics (``local``) when it decodes."""
        s = self._here().stats()
        if self._pool is not None:
            p = self._pool
            s["remote"] = dict(p.dispatch.stats(),
                               local=p.local_loader.stats() if p.local_loader else None)
        return s

    def tuner_trace(self) -> List[Dict[str, Any]]:
        """The tuner's recent ticks, oldest first: ``t``, ``rate`` (batches/s), ``wait``,
        per-stage ``stages``/``workers``/``budgets``, ``bytes``, ``memory_budget``,
        ``rss_bytes`` and ``decisions`` (what changed and why). Empty with the tuner off.

        With ``remote=``, the pool's windows instead (about one a second): ``t``,
        ``workers`` (actors), ``local``, ``wait`` (the fraction of the window the loop
        waited), ``ready`` and ``in_flight`` units, ``starting`` actors, ``rate`` (units/s
        taken), ``worker_rate``/``local_rate`` (units/s a busy actor / the training process
        decodes) and ``decisions`` (``RemoteWorkers(n -> m): why``, and units issued again
        after an actor died)."""
        if self._pool is not None:
            return self._pool.dispatch.trace()
        return self._here().tuner_trace()

    def failures(self, epoch: Optional[int] = None) -> List[Tuple[str, str, str]]:
        """The failures skipped in ``epoch`` (default: the epoch being iterated, or the last
        one started): ``(stage, path, message)``, of the last 1,000 kept."""
        return self._here().failures(epoch)

    def state_dict(self) -> Dict[str, Any]:
        """A small checkpoint (plain ints and lists) of what this epoch has delivered.

        Raises ``RuntimeError`` in the training process when the loader's batches were read
        in ``DataLoader`` worker processes: what they delivered is not known here (a state
        taken anyway would train on those batches again after a resume). Iterate the loader
        in the training process instead — ``DataLoader(loader, batch_size=None)`` with the
        default ``num_workers=0``, or the loader itself: it decodes on its own threads."""
        self._own_marker()
        if self._split is None and self._marker.marked():
            raise RuntimeError(
                "this loader's batches were read in DataLoader worker processes, so the "
                "training process does not know which were delivered: a state_dict() taken "
                "here would train on them again after a resume. Iterate the loader in the "
                "training process to checkpoint it: DataLoader(loader, batch_size=None) "
                "with num_workers=0, or `for batch in loader` (flowgate decodes on its own "
                "threads; DataLoader workers add processes, not throughput)")
        return self._here().state_dict()

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Continue from :meth:`state_dict`: the next epoch iterated yields exactly the
        batches' items not delivered yet (same loader arguments required). ``DataLoader``
        workers forked (or spawned) before that epoch is iterated here resume from it too,
        each its part of the rank's rest."""
        self._here().load_state_dict(state)
        if self._pool is not None:
            self._pool.abandon()
        self._resume = dict(state)

    def close(self) -> None:
        """Stops the pipeline and joins its threads (also done when the loader is freed)."""
        if os.getpid() == self._pid:
            self._native._stop_metrics()
            self.metrics_address = None
            self._native.close()
            if self._pool is not None:
                self._pool.close()
                self._pool = None

    def __enter__(self) -> "_Loader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _metrics_address(port: Any) -> str:
    """``metrics_port``: a port on the loopback address, or ``"host:port"`` (``"0.0.0.0:9100"``
    for a scraper on another machine), as the library reads an address; 0 picks a free
    port."""
    if isinstance(port, str):
        return port
    if isinstance(port, bool) or not hasattr(port, "__index__"):
        raise ValueError(f'metrics_port must be a port in 0..=65535 or "host:port", not {port!r}')
    return str(operator.index(port))
