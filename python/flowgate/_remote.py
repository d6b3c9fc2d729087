"""Decoding on a pool of Ray actors: ``ImageLoader(..., remote=flowgate.Ray(...))``.

The training process's loader keeps the epoch as its own — the same order, ranks, seeds,
checkpoints, failures and breaks as a local epoch (``Loader._start_units``) — and cuts it
into *units* of a few batches. A unit is a checkpoint in which everything else in the epoch is
delivered: a loader built with the same arguments that resumes it decodes exactly the unit,
so a unit is a pure function of (dataset, seed, epoch, unit) and a unit lost with its actor is
issued again. Actors (``FlowgateDecoder``, one process each) decode units with flowgate's
native loader and its own tuned threads and return them through Ray's object store (NumPy
arrays: one copy into the store, none out of it); the training process may decode units
itself too (``local=True``). The loader takes the units' batches in plan order and yields
them as they are, or — where a skipped item left a batch short — regrouped by the batch size
(rows copied), so the training loop sees the local loader's batches, every item once per
epoch, whatever the pool's size; ``state_dict`` is the local loader's at that batch (the
positions of the rows yielded).

The pool's size follows what the training loop waits (``flowgate::tuner::pool``): once a
second the sizer sees the loop's wait, the units decoded and in hand, the workers starting and
the cluster's free CPUs, and adds or retires a worker, with its reason in ``tuner_trace()``.
"""

from __future__ import annotations

import collections
import concurrent.futures
import math
import os
import time
from typing import Any, Deque, Dict, List, Optional, Tuple

from . import _native
from ._process import _converter, _warn_again
from ._units import _decode_unit, _read_only, _unit_args, _unit_loader

#: Seconds a pinned pool waits for CPUs that killed actors give back before it says the
#: cluster cannot place it.
_FREED_WAIT = 2.0

#: A new actor that dies before finishing a unit this many times in a row is a configuration
#: error (its constructor fails), not a lost worker: raised, not retried.
_STARTUP_DEATHS = 3


class Ray:
    """Where and how a loader decodes remotely: a pool of Ray actors (``FlowgateDecoder``).

    ``workers``: ``"auto"`` (default) sizes the pool from what the training loop waits,
    between ``min_workers`` and ``max_workers`` and within the CPUs the Ray cluster has free
    (it starts at ``min_workers``, at least one actor unless ``local``); an int pins it.
    ``cpus_per_worker``: CPUs each actor reserves from Ray and decodes on (its native threads
    are held to that many cores); default: what fits the cluster's largest node, at most 4.
    A pinned pool (``workers=N``) that Ray cannot place (``N * cpus_per_worker`` more than
    the CPUs free) raises at once, naming the CPUs needed and free; ``"auto"`` logs in one
    line (logger ``flowgate.remote``) how many actors it starts and why — a warning when it
    can start none. ``local``: the training process decodes units too, on its
    own threads (the pool adds to the node's cores instead of replacing them); ``False``
    keeps the node's CPUs for training. ``batches_per_unit``: batches per unit of work (more:
    less overhead per batch, more decoded again when an actor is lost). ``start_timeout``:
    seconds the loop may wait with no actor started and nothing decoding locally before a
    ``RuntimeError`` says Ray cannot place the actors. ``address``: the Ray cluster to join
    when Ray is not initialised yet (default: ``RAY_ADDRESS``, or a local one). Requires the
    ``ray`` package (``pip install ray``)."""

    def __init__(self, workers: Any = "auto", max_workers: int = 16,
                 min_workers: Optional[int] = None, cpus_per_worker: Optional[float] = None,
                 local: bool = True, batches_per_unit: int = 2,
                 start_timeout: float = 300.0, address: Optional[str] = None) -> None:
        if not isinstance(local, bool):
            raise TypeError(f"local must be True or False, not {local!r}")
        floor = 0 if local else 1

        def count(name: str, v: Any, low: int) -> int:
            if not isinstance(v, int) or isinstance(v, bool) or v < low:
                raise ValueError(f"{name} must be an int of at least {low}, not {v!r}")
            return v

        count("max_workers", max_workers, 1)
        count("batches_per_unit", batches_per_unit, 1)
        if workers != "auto":
            count('workers (or "auto")', workers, floor)
            if workers > max_workers:
                raise ValueError(f"workers={workers} is more than max_workers={max_workers}")
        if min_workers is None:
            min_workers = floor if workers == "auto" else workers
        count("min_workers", min_workers, floor)
        if min_workers > max_workers:
            raise ValueError(f"min_workers={min_workers} is more than max_workers={max_workers}")
        if workers != "auto" and min_workers != workers:
            raise ValueError(f"min_workers={min_workers} with a pinned pool of workers={workers}: "
                             'give one of them (min_workers applies to workers="auto")')
        for name, v in (("cpus_per_worker", cpus_per_worker), ("start_timeout", start_timeout)):
            if v is None and name == "cpus_per_worker":
                continue
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not (
                    v > 0 and math.isfinite(v)):
                raise ValueError(f"{name} must be a finite number above 0, not {v!r}")
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a str (a Ray address) or None, not {address!r}")
        self.workers = workers
        self.max_workers = max_workers
        self.min_workers = min_workers
        #: None: what fits the cluster's largest node (at most 4), found when the pool starts.
        self.cpus_per_worker = None if cpus_per_worker is None else float(cpus_per_worker)
        self.local = local
        self.batches_per_unit = batches_per_unit
        self.start_timeout = float(start_timeout)
        self.address = address

    def __repr__(self) -> str:
        return (f"flowgate.Ray(workers={self.workers!r}, max_workers={self.max_workers}, "
                f"min_workers={self.min_workers}, cpus_per_worker={self.cpus_per_worker!r}, "
                f"local={self.local}, batches_per_unit={self.batches_per_unit})")


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise ImportError(
            "remote=flowgate.Ray(...) decodes on Ray actors and needs the `ray` package, "
            "which is not installed: pip install ray") from None
    return ray


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
    its hands, oldest first: ``(epoch token, unit, ObjectRef or Future)``."""

    def __init__(self, actor: Any, name: str, ready: Any = None) -> None:
        self.actor = actor
        self.name = name
        self.units: Deque[Tuple[int, int, Any]] = collections.deque()
        self.finished = 0
        self.retiring = False
        self.busy_seconds = 0.0
        #: The actor's first answer (its pid): until it comes, it gets no units.
        self.ready_ref = ready
        self.ready = actor is None


class _Pool:
    """A loader's actors, kept across its epochs; the local decoder; the sizer; which epoch
    (token) owns the units in hand."""

    def __init__(self, loader: Any, remote: Ray) -> None:
        self.ray = _ray()
        if not self.ray.is_initialized():
            self.ray.init(address=remote.address, ignore_reinit_error=True,
                          log_to_driver=False)
        self.cpus, placed = _placement(self.ray, remote)
        self.remote = remote
        self.cls_name = type(loader).__name__
        self.args = _unit_args(loader._args)
        self.actor_class = self.ray.remote(FlowgateDecoder)
        self.workers: List[_Worker] = []
        self.local: Optional[_Worker] = None
        self.local_loader: Any = None
        self.executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self.started = 0
        self.deaths_before_a_unit = 0
        self.last_death = ""
        self.reissued = 0
        #: Units decoded by actors (of every epoch), as the training process received them.
        self.units_by_actors = 0
        self.trace: Deque[Dict[str, Any]] = collections.deque(maxlen=1000)
        self.t0 = time.monotonic()
        #: The epoch whose units the workers hold (a new iterator, set_epoch, a resume or
        #: close end the last one's).
        self.current = 0
        self.tokens = 0
        # The sizer's window (it runs across epochs): its start, the loop's wait in it, and
        # the units the loop took.
        self.window_start = self.t0
        self.waited = 0.0
        self.consumed = 0
        self.sizer = None
        if remote.workers == "auto":
            self.sizer = _native.PoolSizer(remote.min_workers, remote.max_workers,
                                           self.cpus, remote.local)
            initial = remote.min_workers if remote.local else max(remote.min_workers, 1)
            _say_auto(remote, self.cpus, min(initial, remote.max_workers), placed)
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
        actor = self.actor_class.options(num_cpus=self.cpus).remote(
            self.cls_name, self.args, self.cpus)
        self.workers.append(_Worker(actor, f"FlowgateDecoder-{self.started}",
                                    actor.pid.remote()))

    def begin(self) -> int:
        """A new epoch takes the pool: the units of any other are dropped."""
        self.abandon()
        self.tokens += 1
        self.current = self.tokens
        return self.current

    def abandon(self) -> None:
        """No epoch owns the pool: units in hand are dropped (cancelled where not started; an
        actor busy with one finishes it, and its result is never read)."""
        self.current = 0
        for w in self.workers + ([self.local] if self.local else []):
            for _, _, ref in w.units:
                try:
                    if isinstance(ref, concurrent.futures.Future):
                        ref.cancel()
                    else:
                        self.ray.cancel(ref)
                except Exception:
                    pass
            w.units.clear()
        self.reap()

    def remote_workers(self) -> List[_Worker]:
        return [w for w in self.workers if not w.retiring]

    def check_ready(self) -> None:
        """Notes the actors that have started; buries those whose start failed."""
        for w in list(self.workers):
            if w.ready or w.ready_ref is None:
                continue
            done, _ = self.ray.wait([w.ready_ref], timeout=0)
            if not done:
                continue
            try:
                self.ray.get(w.ready_ref)
                w.ready = True
            except Exception as e:  # the actor's constructor failed, or it died
                self.died(w, e)

    def died(self, worker: _Worker, error: BaseException) -> List[int]:
        """Removes a dead actor; returns the units it held (of the current epoch). A pinned
        pool is kept at its size, a sized one at its floor (the sizer grows it)."""
        if worker in self.workers:
            self.workers.remove(worker)
        lost = [u for t, u, _ in worker.units if t == self.current]
        worker.units.clear()
        if worker.finished == 0:
            self.deaths_before_a_unit += 1
            self.last_death = str(error).strip().splitlines()[-1][:500] if str(error) else \
                type(error).__name__
            if self.deaths_before_a_unit >= _STARTUP_DEATHS:
                raise RuntimeError(
                    f"{_STARTUP_DEATHS} FlowgateDecoder actors in a row died before decoding a "
                    f"unit, the last with: {self.last_death} (their loader cannot be built "
                    "there, or the cluster kills them; `ray logs` has more)")
        floor = self.remote.min_workers if self.sizer is not None else self.remote.workers
        if not worker.retiring and len(self.remote_workers()) < max(floor,
                                                                    int(self.local is None)):
            self.start_worker()
        return lost

    def hands(self) -> List[_Worker]:
        """The workers that take new units: the started actors and the local decoder."""
        self.check_ready()
        out = [w for w in self.remote_workers() if w.ready]
        return out + ([self.local] if self.local is not None else [])

    def issue(self, worker: _Worker, token: int, unit: int, state: Dict[str, Any]) -> None:
        if worker.actor is None:
            if self.local_loader is None:
                self.local_loader = _unit_loader(self.cls_name, self.args)
            assert self.executor is not None, "the pool is closed"
            ref = self.executor.submit(_decode_unit, self.local_loader, state)
        else:
            ref = worker.actor.run.remote(state)
        worker.units.append((token, unit, ref))

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
        self.abandon()
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
    """One epoch of a remote loader: units handed out to the pool, their batches yielded in
    plan order (regrouped where a skipped item left one short), the loader's checkpoint kept
    at each batch."""

    #: Units issued or waiting per worker (and for the local decoder).
    WINDOW_PER_WORKER = 2
    #: Seconds between the sizer's windows.
    WINDOW_SECONDS = 1.0
    #: Seconds a wait lasts before it checks for signals (Ctrl-C) and the pool.
    SLICE = 0.05

    def __init__(self, loader: Any) -> None:
        self._pool: _Pool = loader._remote_pool()
        self._token = self._pool.begin()
        # The native loader keeps the epoch as its own (its checkpoint, failures, a break).
        self._native = loader._native
        self._plan, self._iterator, again = self._native._start_units(
            loader._args["remote"].batches_per_unit)
        if again is not None:
            _warn_again(*again)
        self._units = len(self._plan)
        # The units' batches regrouped into the local loader's (the library's view).
        self._regroup = self._plan.regroup(loader._args.get("order", "input"))
        self._issued = 0          # units handed out: 0.._issued
        self._at = 0              # the next unit to take
        self._states: Dict[int, Dict[str, Any]] = {}
        self._convert = _converter(loader._args["output"], from_numpy=True)
        self._no_hands_since: Optional[float] = None
        self._finished = False

    def __iter__(self) -> "_RemoteEpoch":
        return self

    def __del__(self) -> None:
        # Left with `break` (or dropped mid-way): its units are dropped at once.
        try:
            if not self._finished and self._pool.current == self._token:
                self._pool.abandon()
            self._native._abandon(self._iterator)
        except Exception:
            pass

    def __next__(self) -> Any:
        if self._finished or self._pool.current != self._token:
            # Ended, or abandoned (another iterator, set_epoch, a resume, close).
            self._finished = True
            raise StopIteration
        item, positions = self._next_batch()
        if item is None:
            self._finished = True
            self._native._finish_units()  # raises where every item failed, as locally
            raise StopIteration
        self._native._units_delivered([(p, p + 1) for p in positions])
        self._maybe_resize()
        return self._convert(item)

    def _next_batch(self) -> Tuple[Any, List[int]]:
        """The next batch and its rows' positions, or ``(None, [])`` at the epoch's end."""
        while True:
            got = self._regroup.pop(self._at >= self._units)
            if got is not None:
                return _read_only(got[0]), got[1]
            if self._at >= self._units:
                return None, []
            self._take(self._at)

    def _fill(self) -> None:
        """Hands out units up to the window, each to the worker with the fewest in hand."""
        pool = self._pool
        while self._issued < self._units:
            hands = pool.hands()
            if not hands:
                return
            if self._issued - self._at >= self.WINDOW_PER_WORKER * len(hands):
                return
            worker = min(hands, key=lambda w: len(w.units))
            if len(worker.units) >= self.WINDOW_PER_WORKER:
                return
            u = self._issued
            self._states[u] = self._plan.unit_state(u)
            pool.issue(worker, self._token, u, self._states[u])
            self._issued += 1

    def _holder(self, unit: int) -> Optional[Tuple[_Worker, Tuple[int, int, Any]]]:
        pool = self._pool
        for w in pool.workers + ([pool.local] if pool.local else []):
            for entry in w.units:
                if entry[0] == self._token and entry[1] == unit:
                    return w, entry
        return None

    def _take(self, unit: int) -> None:
        """Waits for `unit`'s result (issuing it again if its actor died) and queues its
        batches."""
        pool = self._pool
        ray = pool.ray
        start = time.monotonic()
        while True:
            if pool.current != self._token:
                raise StopIteration
            self._fill()
            held = self._holder(unit)
            if held is None:
                if not pool.hands():
                    self._no_hands(start)
                    time.sleep(self.SLICE)
                    self._maybe_resize(waiting_since=start)
                    continue
                # Its worker died and no one has it: hand it out again.
                self._reissue([unit])
                continue
            worker, entry = held
            ref = entry[2]
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
                    self._bury(worker, e)
                    continue
                # A unit's error ends the epoch, as locally: the next iter() is the next one.
                self._pool.abandon()
                self._finished = True
                self._native._fail_units()
                raise _loader_error(e) from None
            break
        pool.waited += time.monotonic() - start
        worker.units.remove(entry)
        worker.finished += 1
        if worker.actor is not None:
            pool.units_by_actors += 1
        worker.busy_seconds += result["seconds"]
        pool.deaths_before_a_unit = 0
        pool.reap()
        self._native._units_failed(result["failures"])
        for b, rows in zip(result["batches"], result["rows"]):
            self._regroup.push(b, rows)
        self._states.pop(unit, None)
        self._at += 1
        pool.consumed += 1

    def _no_hands(self, start: float) -> None:
        """No started actor and no local decoder: waits for Ray to place one, for at most
        ``start_timeout`` seconds."""
        pool = self._pool
        if self._no_hands_since is None:
            self._no_hands_since = start
        waited = time.monotonic() - self._no_hands_since
        if waited > pool.remote.start_timeout:
            try:
                free = pool.ray.available_resources().get("CPU", 0.0)
            except Exception:
                free = float("nan")
            raise RuntimeError(
                f"no FlowgateDecoder actor started in {waited:.0f} s: each asks Ray for "
                f"cpus_per_worker={pool.cpus:g} CPUs and the cluster has "
                f"{free:g} free (lower cpus_per_worker, add nodes, or use local=True)")

    def _lost_actor(self, e: BaseException) -> bool:
        exc = self._pool.ray.exceptions
        kinds = tuple(getattr(exc, k) for k in ("RayActorError", "ActorDiedError",
                                                 "ActorUnavailableError") if hasattr(exc, k))
        return isinstance(e, kinds)

    def _bury(self, worker: _Worker, error: BaseException) -> None:
        """An actor died: its units go back to the pool, and a new actor replaces it."""
        lost = self._pool.died(worker, error)
        self._pool.reissued += len(lost)
        self._record(None, f"{worker.name} died with {len(lost)} units in hand: issued again")
        self._reissue(lost)

    def _reissue(self, units: List[int]) -> None:
        pool = self._pool
        hands = pool.hands()
        if not hands:
            return  # `_take` waits for an actor to start, then hands them out
        for u in sorted(units):
            worker = min(hands, key=lambda w: len(w.units))
            state = self._states.get(u)
            if state is None:
                state = self._states[u] = self._plan.unit_state(u)
            pool.issue(worker, self._token, u, state)

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
            for t, _, ref in w.units:
                if t != self._token:
                    continue
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
        wait = min(1.0, max(0.0, waited / span))
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
            rec["decisions"] = [f"RemoteWorkers({before} -> {n}): {why}"
                                if window is not None else why]
        pool.trace.append(rec)


def _placement(ray: Any, remote: Ray) -> Tuple[float, Tuple[float, float, float]]:
    """The CPUs each actor reserves (``cpus_per_worker``, or what fits the largest node, at
    most 4) and the cluster's CPUs ``(free, total, largest node)``. A pinned pool that cannot
    be placed raises, naming the CPUs needed and free, rather than decode locally unasked."""
    try:
        nodes = [n for n in ray.nodes() if n.get("Alive", True)]
        largest = max((float(n.get("Resources", {}).get("CPU", 0.0)) for n in nodes),
                      default=0.0)
        total = float(ray.cluster_resources().get("CPU", 0.0))
        free = float(ray.available_resources().get("CPU", 0.0))
    except Exception:  # noqa: BLE001 - an old or unusual runtime: no figures, no checks
        return remote.cpus_per_worker or 1.0, (math.inf, math.inf, math.inf)
    cpus = remote.cpus_per_worker
    if cpus is None:
        cpus = max(1.0, min(4.0, largest))
    if remote.workers != "auto" and remote.workers > 0:
        need = remote.workers * cpus
        if cpus > largest:
            raise RuntimeError(
                f"{remote!r}: an actor needs {cpus:g} CPUs and the Ray cluster's largest node "
                f"has {largest:g}; lower cpus_per_worker")
        # Actors just killed (another loader's pool, closed) give their CPUs back a little
        # later: a pinned pool waits a moment for them before it says it cannot be placed.
        deadline = time.monotonic() + _FREED_WAIT
        while need > free + 1e-9 and time.monotonic() < deadline:
            time.sleep(0.05)
            free = float(ray.available_resources().get("CPU", 0.0))
        if need > free + 1e-9:
            raise RuntimeError(
                f"{remote!r}: {remote.workers} actors of {cpus:g} CPUs need {need:g} CPUs and "
                f"the Ray cluster has {free:g} free (of {total:g}); lower workers or "
                'cpus_per_worker, or use workers="auto" (sized to what is free)')
    return cpus, (free, total, largest)


def _say_auto(remote: Ray, cpus: float, initial: int,
              placed: Tuple[float, float, float]) -> None:
    """``workers="auto"``'s first line on the log: how many actors it starts, and why."""
    import logging
    free, total, largest = placed
    log = logging.getLogger("flowgate.remote")
    local = "; the training process decodes too" if remote.local else ""
    if cpus > largest:
        log.warning("flowgate.Ray(workers=\"auto\") will start no actor: each needs %g CPUs "
                    "and the cluster's largest node has %g; decoding in the training process "
                    "only (lower cpus_per_worker)", cpus, largest)
        return
    grows = (f"actors of {cpus:g} CPUs are added while the training loop waits, up to "
             f"{remote.max_workers}, within the cluster's free CPUs ({free:g} of {total:g} now)")
    level = logging.WARNING if initial == 0 and free + 1e-9 < cpus else logging.INFO
    log.log(level, "flowgate.Ray(workers=\"auto\"): %d actor(s) at the start "
            "(min_workers=%d%s); %s", initial, remote.min_workers, local, grows)


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
