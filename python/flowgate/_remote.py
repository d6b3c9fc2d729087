"""Decoding on a pool of Ray actors: ``ImageLoader(..., remote=flowgate.Ray(...))``.

The training process's loader keeps the epoch's plan — the same order, ranks, seeds and
checkpoints as a local loader — and cuts it into *units* of a few batches
(``Loader._plan_units``). A unit is a checkpoint in which everything else in the epoch is
delivered: a loader built with the same arguments that resumes it decodes exactly the unit,
so a unit is a pure function of (dataset, seed, epoch, unit) and a unit lost with its actor is
issued again. Actors (``FlowgateDecoder``, one process each) decode units with flowgate's
native loader and its own tuned threads and return them through Ray's object store (NumPy
arrays: one copy into the store, none out of it); the training process may decode units
itself too (``local=True``). The loader yields units in plan order, so the training loop sees
every item once per epoch in the same order whatever the pool's size, and ``state_dict`` is
the local loader's at that batch.

The pool's size follows what the training loop waits (``flowgate::tuner::pool``): once a
second the sizer sees the loop's wait, the units decoded and in hand, the workers starting and
the cluster's free CPUs, and adds or retires a worker, with its reason in ``tuner_trace()``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import os
import time
import warnings
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

from . import _native

#: A new actor that dies before finishing a unit this many times in a row is a configuration
#: error (its constructor fails), not a lost worker: raised, not retried.
_STARTUP_DEATHS = 3


class Ray:
    """Where and how a loader decodes remotely: a pool of Ray actors (``FlowgateDecoder``).

    ``workers``: ``"auto"`` (default) sizes the pool from what the training loop waits,
    between ``min_workers`` and ``max_workers`` and within the CPUs the Ray cluster has free;
    an int pins it. ``cpus_per_worker``: CPUs each actor reserves from Ray and decodes on (its
    native threads are held to that many cores). ``local``: the training process decodes
    units too, on its own threads (the pool adds to the node's cores instead of replacing
    them); ``False`` keeps the node's CPUs for training. ``batches_per_unit``: batches per
    unit of work (more: less overhead per batch, more lost with an actor). ``address``: the
    Ray cluster to join when Ray is not initialised yet (default: ``RAY_ADDRESS``, or a local
    one). Requires the ``ray`` package (``pip install ray``)."""

    def __init__(self, workers: Any = "auto", max_workers: int = 16,
                 min_workers: Optional[int] = None, cpus_per_worker: float = 4,
                 local: bool = True, batches_per_unit: int = 2,
                 address: Optional[str] = None) -> None:
        if workers != "auto" and not (isinstance(workers, int) and not isinstance(workers, bool)
                                      and workers >= (0 if local else 1)):
            raise ValueError(f'workers must be "auto" or a number of actors (at least '
                             f'{0 if local else 1}), not {workers!r}')
        for name, v, low in (("max_workers", max_workers, 1),
                             ("batches_per_unit", batches_per_unit, 1)):
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int of at least {low}, not {v!r}")
        floor = 0 if local else 1
        if min_workers is None:
            min_workers = floor
        if not isinstance(min_workers, int) or isinstance(min_workers, bool) or \
                not floor <= min_workers <= max_workers:
            raise ValueError(f"min_workers must be an int in [{floor}, max_workers], not "
                             f"{min_workers!r}")
        if not isinstance(cpus_per_worker, (int, float)) or isinstance(cpus_per_worker, bool) \
                or not cpus_per_worker > 0:
            raise ValueError(f"cpus_per_worker must be a number above 0, not {cpus_per_worker!r}")
        self.workers = workers
        self.max_workers = max_workers
        self.min_workers = min_workers
        self.cpus_per_worker = float(cpus_per_worker)
        self.local = bool(local)
        self.batches_per_unit = batches_per_unit
        self.address = address

    def __repr__(self) -> str:
        return (f"flowgate.Ray(workers={self.workers!r}, max_workers={self.max_workers}, "
                f"min_workers={self.min_workers}, cpus_per_worker={self.cpus_per_worker:g}, "
                f"local={self.local}, batches_per_unit={self.batches_per_unit})")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "remote=flowgate.Ray(...) decodes on Ray actors and needs the `ray` package, "
            "which is not installed: pip install ray") from None
    return ray


def _unit_args(args: Dict[str, Any], output: str) -> Dict[str, Any]:
    """A unit loader's arguments: the training loader's, at its rank and world size (as
    resolved there), decoding units, on the CPU, not remote again."""
    from ._args import _rank_and_world
    rank, world = _rank_and_world(args)
    return dict(args, rank=rank, world_size=world, remote=None, device="cpu",
                device_memory_mb=None, output=output, decodes_units=True)


def _decode_unit(loader: Any, state: Dict[str, Any]) -> Dict[str, Any]:
    """Decodes the unit `state` names with `loader` (built by `_unit_args`): its batches as
    the loader yields them, the positions delivered after each, the failures skipped, and
    the seconds it took."""
    start = time.perf_counter()
    native = loader._native
    epoch = state["epoch"]
    # The loader keeps the epoch's failures across its units: this unit's are the new ones.
    before = len(native.failures(epoch))
    native.load_state_dict(state)
    batches, progress = [], []
    for item in loader:
        batches.append(item)
        progress.append(_native._delivered_since(native.state_dict(), state))
    return {"batches": batches, "progress": progress,
            "failures": native.failures(epoch)[before:],
            "seconds": time.perf_counter() - start}


def _unit_loader(cls_name: str, args: Dict[str, Any]) -> Any:
    """A loader of class `cls_name` built from `_unit_args` (as unpickling builds one)."""
    import flowgate
    cls = getattr(flowgate, cls_name)
    loader = cls.__new__(cls)
    loader._setup(args)
    return loader


class FlowgateDecoder:
    """A Ray actor that decodes units of one loader (its class name is what ``ray list
    actors`` and the process list show: ``ray::FlowgateDecoder``)."""

    def __init__(self, cls_name: str, args: Dict[str, Any], cores: float) -> None:
        # Held to its reserved CPUs: a budget of this process alone.
        os.environ["FLOWGATE_NODE_KEY"] = f"ray-actor-{os.getpid()}"
        budget = max(1, min(int(cores), os.cpu_count() or 1))
        self._loader = _unit_loader(cls_name, dict(args, cpu_budget=budget))

    def pid(self) -> int:
        return os.getpid()

    def run(self, state: Dict[str, Any]) -> Dict[str, Any]:
        return _decode_unit(self._loader, state)


class _Worker:
    """One actor (or the training process's own decode, ``actor is None``) and the units in
    its hands, oldest first."""

    def __init__(self, actor: Any, name: str) -> None:
        self.actor = actor
        self.name = name
        self.units: Deque[Tuple[int, Any]] = collections.deque()
        self.finished = 0
        self.retiring = False
        self.busy_seconds = 0.0


class _Pool:
    """A loader's actors, kept across its epochs; the local decoder; the sizer."""

    def __init__(self, loader: Any, remote: Ray) -> None:
        self.ray = _ray()
        if not self.ray.is_initialized():
            self.ray.init(address=remote.address, ignore_reinit_error=True,
                          log_to_driver=False)
        self.remote = remote
        self.cls_name = type(loader).__name__
        self.args = _unit_args(loader._args, "numpy")
        self.local_args = _unit_args(loader._args, loader._args["output"])
        self.actor_class = self.ray.remote(FlowgateDecoder)
        self.workers: List[_Worker] = []
        self.local: Optional[_Worker] = None
        self.local_loader: Any = None
        self.executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.started = 0
        self.deaths_before_a_unit = 0
        self.reissued = 0
        self.trace: Deque[Dict[str, Any]] = collections.deque(maxlen=1000)
        self.t0 = time.monotonic()
        # The sizer's window (it runs across epochs): its start, the loop's wait in it, and
        # the units the loop took.
        self.window_start = self.t0
        self.waited = 0.0
        self.consumed = 0
        self.sizer = None
        if remote.workers == "auto":
            self.sizer = _native.PoolSizer(remote.min_workers, remote.max_workers,
                                           remote.cpus_per_worker, remote.local)
            initial = max(remote.min_workers, 1)
        else:
            initial = remote.workers
        if remote.local:
            self.local = _Worker(None, "local")
            self.executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="flowgate-local-units")
        for _ in range(min(initial, remote.max_workers)):
            self.start_worker()

    def start_worker(self) -> None:
        self.started += 1
        actor = self.actor_class.options(num_cpus=self.remote.cpus_per_worker).remote(
            self.cls_name, self.args, self.remote.cpus_per_worker)
        self.workers.append(_Worker(actor, f"FlowgateDecoder-{self.started}"))

    def remote_workers(self) -> List[_Worker]:
        return [w for w in self.workers if not w.retiring]

    def hands(self) -> List[_Worker]:
        """The workers that take new units: the live actors and the local decoder."""
        return self.remote_workers() + ([self.local] if self.local is not None else [])

    def issue(self, worker: _Worker, unit: int, state: Dict[str, Any]) -> None:
        if worker.actor is None:
            if self.local_loader is None:
                self.local_loader = _unit_loader(self.cls_name, self.local_args)
            assert self.executor is not None
            ref = self.executor.submit(_decode_unit, self.local_loader, state)
        else:
            ref = worker.actor.run.remote(state)
        worker.units.append((unit, ref))

    def retire(self, worker: _Worker) -> None:
        worker.retiring = True
        self.reap()

    def reap(self) -> None:
        """Kills retired actors whose units are all collected."""
        for w in list(self.workers):
            if w.retiring and not w.units:
                self.workers.remove(w)
                try:
                    self.ray.kill(w.actor)
                except Exception:
                    pass

    def close(self) -> None:
        for w in self.workers:
            try:
                self.ray.kill(w.actor)
            except Exception:
                pass
        self.workers = []
        if self.executor is not None:
            self.executor.shutdown(wait=True)
            self.executor = None
        if self.local_loader is not None:
            self.local_loader.close()
            self.local_loader = None


def _done(ray: Any, ref: Any) -> bool:
    if isinstance(ref, concurrent.futures.Future):
        return ref.done()
    ready, _ = ray.wait([ref], timeout=0)
    return bool(ready)


class _RemoteEpoch:
    """One epoch of a remote loader: units handed out to the pool, batches yielded in plan
    order, the loader's checkpoint kept at each batch."""

    #: Units issued or waiting per worker (and for the local decoder).
    WINDOW_PER_WORKER = 2
    #: Seconds between the sizer's windows.
    WINDOW_SECONDS = 1.0
    #: Seconds a wait lasts before it checks for signals (Ctrl-C).
    SLICE = 0.05

    def __init__(self, loader: Any) -> None:
        self._loader = loader
        self._pool: _Pool = loader._remote_pool()
        native = loader._native
        self._plan = native._plan_units(loader._args["remote"].batches_per_unit)
        self.epoch = self._plan.epoch
        # The native loader's next epoch is the one after this (the plan holds this one).
        native.set_epoch(self.epoch + 1)
        self._units = len(self._plan)
        self._issued = 0          # units handed out: 0.._issued
        self._at = 0              # the unit being yielded
        self._states: Dict[int, Dict[str, Any]] = {}
        self._results: Dict[int, Dict[str, Any]] = {}
        self._batches: Deque[Any] = collections.deque()
        self._progress: Deque[List[Tuple[int, int]]] = collections.deque()
        self._convert = _converter_from_numpy(loader._args["output"])
        loader._remote_state = self._plan.state_after(0, [])
        loader._remote_failures.setdefault(self.epoch, [])
        loader._remote_epoch = self.epoch
        self._finished = False

    def __iter__(self) -> "_RemoteEpoch":
        return self

    def __next__(self) -> Any:
        if self._finished:
            raise StopIteration
        while not self._batches:
            if self._at >= self._units:
                self._finish()
                raise StopIteration
            self._take(self._at)
        batch = self._batches.popleft()
        partly = self._progress.popleft()
        if self._batches:
            # Part of the unit delivered.
            self._loader._remote_state = self._plan.state_after(self._at, partly)
        else:
            self._at += 1
            self._pool.consumed += 1
            self._loader._remote_state = self._plan.state_after(self._at, [])
        self._maybe_resize()
        return batch

    def _finish(self) -> None:
        self._finished = True
        self._loader._remote_state = self._plan.state_after(self._units, [])
        self._loader._remote_epoch = None

    def _fill(self) -> None:
        """Hands out units up to the window, each to the worker with the fewest in hand."""
        pool = self._pool
        while self._issued < self._units:
            hands = pool.hands()
            if not hands:
                return
            ahead = self._issued - self._at
            if ahead >= self.WINDOW_PER_WORKER * len(hands):
                return
            worker = min(hands, key=lambda w: len(w.units))
            if len(worker.units) >= self.WINDOW_PER_WORKER:
                return
            u = self._issued
            self._states[u] = self._plan.unit_state(u)
            pool.issue(worker, u, self._states[u])
            self._issued += 1

    def _holder(self, unit: int) -> Optional[Tuple[_Worker, Any]]:
        for w in self._pool.workers + ([self._pool.local] if self._pool.local else []):
            for u, ref in w.units:
                if u == unit:
                    return w, ref
        return None

    def _take(self, unit: int) -> None:
        """Waits for `unit`'s result (reissuing it if its actor died) and queues its batches."""
        ray = self._pool.ray
        start = time.monotonic()
        while True:
            self._fill()
            held = self._holder(unit)
            if held is None:
                # Its worker died and no one has it: hand it out again.
                self._reissue([unit])
                continue
            worker, ref = held
            try:
                if isinstance(ref, concurrent.futures.Future):
                    result = ref.result(timeout=self.SLICE)
                else:
                    ready, _ = ray.wait([ref], timeout=self.SLICE)
                    if not ready:
                        self._maybe_resize(waiting_since=start)
                        continue
                    result = ray.get(ref)
            except concurrent.futures.TimeoutError:
                self._maybe_resize(waiting_since=start)
                continue
            except Exception as e:  # noqa: BLE001 - sorted below
                if self._lost_actor(e):
                    self._bury(worker)
                    continue
                raise _loader_error(e) from None
            break
        self._pool.waited += time.monotonic() - start
        worker.units.popleft()
        worker.finished += 1
        worker.busy_seconds += result["seconds"]
        self._pool.deaths_before_a_unit = 0
        self._pool.reap()
        self._loader._remote_failures[self.epoch].extend(result["failures"])
        for b, p in zip(result["batches"], result["progress"]):
            self._batches.append(b if worker.actor is None else self._convert(b))
            self._progress.append(p)
        self._states.pop(unit, None)
        if not result["batches"]:
            # Every item of the unit failed (skipped): the unit is done, nothing to yield.
            self._at += 1
            self._loader._remote_state = self._plan.state_after(self._at, [])

    def _lost_actor(self, e: BaseException) -> bool:
        exc = self._pool.ray.exceptions
        return isinstance(e, (exc.RayActorError, getattr(exc, "ActorDiedError", exc.RayActorError),
                              getattr(exc, "ActorUnavailableError", exc.RayActorError)))

    def _bury(self, worker: _Worker) -> None:
        """An actor died: its units go back to the pool, and a new actor replaces it."""
        pool = self._pool
        if worker in pool.workers:
            pool.workers.remove(worker)
        lost = [u for u, _ in worker.units]
        worker.units.clear()
        if worker.finished == 0:
            pool.deaths_before_a_unit += 1
            if pool.deaths_before_a_unit >= _STARTUP_DEATHS:
                raise RuntimeError(
                    f"{_STARTUP_DEATHS} FlowgateDecoder actors in a row died before decoding a "
                    "unit: their loader cannot be built there (see the actors' logs: `ray "
                    "logs`), or the cluster kills them")
        # A pinned pool is kept at its size; a sized one at its floor (the sizer grows it).
        floor = self._min_workers() if pool.sizer is not None else pool.remote.workers
        if not worker.retiring and len(pool.remote_workers()) < max(floor, int(pool.local is None)):
            pool.start_worker()
        pool.reissued += len(lost)
        self._record(None, f"{worker.name} died with {len(lost)} units in hand: issued again")
        self._reissue(lost)

    def _min_workers(self) -> int:
        return self._pool.remote.min_workers

    def _reissue(self, units: List[int]) -> None:
        pool = self._pool
        for u in sorted(units):
            hands = pool.hands()
            if not hands:
                pool.start_worker()
                hands = pool.hands()
            worker = min(hands, key=lambda w: len(w.units))
            state = self._states.get(u)
            if state is None:
                state = self._states[u] = self._plan.unit_state(u)
            pool.issue(worker, u, state)

    def _maybe_resize(self, waiting_since: Optional[float] = None) -> None:
        pool = self._pool
        now = time.monotonic()
        span = now - pool.window_start
        if span < self.WINDOW_SECONDS:
            return
        waited = pool.waited + (now - waiting_since if waiting_since is not None else 0.0)
        # A wait in progress counts in this window, not again in the next.
        pool.waited = -(now - waiting_since) if waiting_since is not None else 0.0
        pool.window_start = now
        ray = pool.ray
        remote = pool.remote_workers()
        ready = in_flight = starting = 0
        for w in remote + ([pool.local] if pool.local else []):
            for _, ref in w.units:
                if _done(ray, ref):
                    ready += 1
                else:
                    in_flight += 1
            if w.actor is not None and w.finished == 0:
                starting += 1
        rate = pool.consumed / span
        pool.consumed = 0
        worker_rate = _rate(remote)
        local_rate = _rate([pool.local]) if pool.local else 0.0
        wait = min(1.0, waited / span)
        why = None
        if pool.sizer is not None:
            try:
                free = float(ray.available_resources().get("CPU", 0.0))
            except Exception:
                free = 0.0
            target, why = pool.sizer.decide(len(remote), starting, wait, ready, in_flight, free,
                                            rate, worker_rate, local_rate)
            while len(pool.remote_workers()) < target:
                pool.start_worker()
            while len(pool.remote_workers()) > target:
                idlest = min(pool.remote_workers(), key=lambda w: len(w.units))
                pool.retire(idlest)
        self._record({"wait": wait, "ready": ready, "in_flight": in_flight,
                      "starting": starting, "rate": rate, "worker_rate": worker_rate,
                      "local_rate": local_rate}, why, workers_before=len(remote))

    def _record(self, window: Optional[Dict[str, Any]], why: Optional[str],
                workers_before: Optional[int] = None) -> None:
        pool = self._pool
        n = len(pool.remote_workers())
        rec: Dict[str, Any] = {"t": time.monotonic() - pool.t0, "workers": n,
                               "local": pool.local is not None}
        if window is not None:
            rec.update(window)
        rec["decisions"] = []
        if why is not None:
            before = n if workers_before is None else workers_before
            rec["decisions"] = [f"RemoteWorkers({before} -> {n}): {why}"]
        pool.trace.append(rec)


def _rate(workers: List[Optional[_Worker]]) -> float:
    """Units a second one busy worker decodes, over what `workers` have finished."""
    done = sum(w.finished for w in workers if w is not None)
    busy = sum(w.busy_seconds for w in workers if w is not None)
    return done / busy if busy > 0 and done > 0 else 0.0


def _loader_error(e: BaseException) -> BaseException:
    """A unit's error as the local loader would raise it: the cause inside Ray's wrapper."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        if isinstance(cause, _native.LoaderError):
            return cause
        return _native.LoaderError(str(cause))
    return e


def _converter_from_numpy(output: str) -> Callable[[Any], Any]:
    """Converts an actor's batch (NumPy arrays, or a tuple holding some) to ``output``'s
    type: ``"numpy"`` as they are (read-only views of Ray's object store), ``"torch"`` as
    tensors sharing them, ``"batch"`` as :class:`Batch` objects (one copy)."""
    import numpy
    if output == "numpy":
        def one(a: Any) -> Any:
            return a
    elif output == "torch":
        import torch

        def one(a: Any) -> Any:
            with warnings.catch_warnings():
                # Read-only: the object store's memory. The training loop reads batches.
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
