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

The hand-out's books (which actor holds which unit, units issued again when an actor dies,
actors started and retired) are the library's (``flowgate::tuner::pool::dispatch``, tested
against simulated workers); this module carries out its commands on Ray. The pool's size
follows what the training loop waits (``flowgate::tuner::pool``): once a second the sizer sees the loop's wait, the units decoded and in hand, the workers starting and
the cluster's free CPUs, and adds or retires a worker, with its reason in ``tuner_trace()``.
"""

from __future__ import annotations

import concurrent.futures
import os
import time
from typing import Any, Dict, List, Optional, Tuple

from . import _native
from ._process import _converter, _warn_again
from ._units import _decode_unit, _read_only, _unit_args, _unit_loader

#: Seconds a pinned pool waits for CPUs that killed actors give back before it says the
#: cluster cannot place it.
_FREED_WAIT = 2.0

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
    ``ray`` package (``pip install ray``).

    The ranges and rules are the library's (``flowgate::loader::PoolSettings``): workers up
    to 4,096, ``batches_per_unit`` up to 1,024, ``start_timeout`` up to a day; a
    ``ValueError`` names the key, in the words a Rust program gets."""

    def __init__(self, workers: Any = "auto", max_workers: int = _native.DEFAULT_MAX_WORKERS,
                 min_workers: Optional[int] = None, cpus_per_worker: Optional[float] = None,
                 local: bool = True, batches_per_unit: int = _native.DEFAULT_BATCHES_PER_UNIT,
                 start_timeout: float = _native.DEFAULT_START_TIMEOUT,
                 address: Optional[str] = None) -> None:
        if address is not None and not isinstance(address, str):
            raise TypeError(f"address must be a str (a Ray address) or None, not {address!r}")
        # Checked by the library (`flowgate::loader::PoolSettings`): its ranges and words.
        self._settings = _native.PoolSettings(dict(
            workers=workers, max_workers=max_workers, min_workers=min_workers,
            cpus_per_worker=cpus_per_worker, local=local, batches_per_unit=batches_per_unit,
            start_timeout=start_timeout))
        self.address = address

    def __getattr__(self, name: str) -> Any:
        # The settings as the library resolved them: workers, max_workers, min_workers,
        # cpus_per_worker (None: what fits the largest node), local, batches_per_unit,
        # start_timeout.
        if name.startswith("_"):
            raise AttributeError(name)
        try:
            return self._settings.resolved[name]
        except KeyError:
            raise AttributeError(name) from None

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

    def __init__(self, cls_name: str, args: Dict[str, Any], cores: float, cwd: str) -> None:
        # Relative paths are the training process's: read from its directory where this
        # machine has it (an actor starts wherever Ray started its worker process).
        if os.path.isdir(cwd):
            os.chdir(cwd)
        # Held to its reserved CPUs, a budget of this process alone (the library holds a
        # budget to the cores the node has).
        os.environ["FLOWGATE_NODE_KEY"] = f"ray-actor-{os.getpid()}"
        self._loader = _unit_loader(cls_name, dict(args, cpu_budget=max(1, int(cores))))

    def pid(self) -> int:
        return os.getpid()

    def run(self, state: Dict[str, Any]) -> Dict[str, Any]:
        return _decode_unit(self._loader, state)


class _Pool:
    """A loader's actors, kept across its epochs, and the training process's own decoder. The
    books (which actor holds which unit, units issued again after a death, actors started
    and retired, the sizer's windows) are the library's dispatcher (``_native.Dispatch``):
    this class carries out its commands on Ray and reports what happened."""

    def __init__(self, loader: Any, remote: Ray) -> None:
        self.ray = _ray()
        if not self.ray.is_initialized():
            self.ray.init(address=remote.address, ignore_reinit_error=True,
                          log_to_driver=False)
        self.cpus, placed = _placement(self.ray, remote)
        self.remote = remote
        self.cls_name = type(loader).__name__
        self.args = _unit_args(loader)
        self.actor_class = self.ray.remote(FlowgateDecoder)
        #: Actors by worker number, their first answer (their pid), the units in hand.
        self.actors: Dict[int, Any] = {}
        self.answers: Dict[int, Any] = {}
        self.refs: Dict[Tuple[int, int], Any] = {}
        self.local_loader: Any = None
        self.executor: Optional[concurrent.futures.ThreadPoolExecutor] = None
        if remote.local:
            self.executor = concurrent.futures.ThreadPoolExecutor(
                1, thread_name_prefix="flowgate-local-units")
        self.dispatch = _native.Dispatch(remote._settings, self.cpus, time.monotonic())
        said = remote._settings.start_line(self.cpus, self.dispatch.workers, placed)
        if said is not None:  # a sized pool: how many actors it starts, and why
            import logging
            logging.getLogger("flowgate.remote").log(
                logging.WARNING if said[0] else logging.INFO, "flowgate.Ray: %s", said[1])
        self.run()

    def run(self, plan: Any = None) -> None:
        """Carries out the dispatcher's commands (`plan`: the epoch's, for units issued)."""
        for kind, w, unit in self.dispatch.commands():
            if kind == "start":
                actor = self.actor_class.options(num_cpus=self.cpus).remote(
                    self.cls_name, self.args, self.cpus, os.getcwd())
                self.actors[w], self.answers[w] = actor, actor.pid.remote()
            elif kind == "issue":
                state = plan.unit_state(unit)
                if w == 0:  # the training process's own decoder
                    if self.local_loader is None:
                        self.local_loader = _unit_loader(self.cls_name, self.args)
                    assert self.executor is not None, "the pool is closed"
                    self.refs[w, unit] = self.executor.submit(_decode_unit, self.local_loader,
                                                              state)
                else:
                    self.refs[w, unit] = self.actors[w].run.remote(state)
            elif kind == "cancel":
                # Cancelled where not started; an actor busy with it finishes it, unread.
                ref = self.refs.pop((w, unit), None)
                try:
                    ref.cancel() if w == 0 else self.ray.cancel(ref)
                except Exception:
                    pass
            else:  # "kill": retired with nothing in hand, or the pool closed
                self.answers.pop(w, None)
                try:
                    self.ray.kill(self.actors.pop(w))
                except Exception:
                    pass

    def poll(self) -> None:
        """Reports the actors that answered, and those whose start failed."""
        for w in self.dispatch.starting():
            ref = self.answers.get(w)
            if ref is None or not self.ray.wait([ref], timeout=0)[0]:
                continue
            try:
                self.ray.get(ref)
                self.dispatch.ready(w)
            except Exception as e:  # the actor's constructor failed, or it died
                self.died(w, e)

    def died(self, w: int, error: BaseException) -> None:
        """An actor died: its units go back to the dispatcher (issued again first), and an
        actor is started in its place where the pool is under its size."""
        self.actors.pop(w, None)
        self.answers.pop(w, None)
        for key in [k for k in self.refs if k[0] == w]:
            del self.refs[key]
        try:
            self.dispatch.died(w, str(error) or type(error).__name__, time.monotonic())
        except RuntimeError as e:
            raise RuntimeError(
                f"FlowgateDecoder actors: {e} (`ray logs` has more)") from None
        self.run()

    def abandon(self) -> None:
        """No epoch owns the pool: the units in hand are dropped."""
        self.dispatch.abandon()
        self.run()

    def close(self) -> None:
        self.dispatch.close()
        self.run()
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

    #: Seconds a wait lasts before it checks for signals (Ctrl-C) and the pool.
    SLICE = 0.05

    def __init__(self, loader: Any) -> None:
        self._pool: _Pool = loader._remote_pool()
        self._pool.abandon()
        # The native loader keeps the epoch as its own (its checkpoint, failures, a break).
        self._native = loader._native
        self._plan, self._iterator, again = self._native._start_units(
            loader._args["remote"].batches_per_unit)
        if again is not None:
            _warn_again(*again)
        self._token = self._pool.dispatch.begin(len(self._plan))
        # Cancels the last epoch's units, starts actors a death left the pool short of.
        self._pool.run()
        # The units' batches regrouped into the local loader's (the library's view).
        self._regroup = self._plan.regroup(loader._args.get("order", "input"))
        self._convert = _converter(loader._args["output"], from_numpy=True)
        self._convert_here = _converter(loader._args["output"])
        self._finished = False
        self._filling = False

    def __iter__(self) -> "_RemoteEpoch":
        return self

    def __del__(self) -> None:
        # Left with `break` (or dropped mid-way): its units are dropped at once.
        try:
            if not self._finished and self._pool.dispatch.token == self._token:
                self._pool.abandon()
            self._native._abandon(self._iterator)
        except Exception:
            pass

    def __next__(self) -> Any:
        if self._filling:
            return self._made_up()
        item, positions = self._next_batch()
        if item is None:
            # Raises where every item failed, as locally; True where batches lost to skipped
            # items are made up (`fill_skipped`), decoded here as the local loader does.
            self._filling = self._native._finish_units()
            if self._filling:
                return self._made_up()
            self._finished = True
            raise StopIteration
        self._native._units_delivered([(p, p + 1) for p in positions])
        self._tick()
        return self._convert(item)

    def _made_up(self) -> Any:
        """The next batch made up at the epoch's end (the local loader's own epoch)."""
        item = self._native._next(self._iterator)
        if item is None:
            self._finished = True
            raise StopIteration
        self._tick()
        if self._convert_here is not None:
            item = self._convert_here(item)
        return _read_only(item)

    def _next_batch(self) -> Tuple[Any, List[int]]:
        """The next batch and its rows' positions, or ``(None, [])`` at the epoch's end."""
        while True:
            if self._finished or self._pool.dispatch.token != self._token:
                # Ended, or abandoned (another iterator, set_epoch, a resume, close).
                self._finished = True
                raise StopIteration
            unit = self._pool.dispatch.next_unit()
            got = self._regroup.pop(unit is None)
            if got is not None:
                return _read_only(got[0]), got[1]
            if unit is None:
                return None, []
            self._take(unit)

    def _take(self, unit: int) -> None:
        """Waits for `unit`'s result (issued again by the dispatcher if its actor died) and
        queues its batches."""
        pool, d = self._pool, self._pool.dispatch
        d.waiting(time.monotonic())
        while True:
            if d.token != self._token:
                raise StopIteration
            pool.poll()
            d.fill()
            pool.run(self._plan)
            w = d.holder(unit)
            if w is None:  # no actor started yet, nor a local decoder
                self._stalled()
                time.sleep(self.SLICE)
                self._tick()
                continue
            ref = pool.refs[w, unit]
            try:
                if w == 0:
                    result = ref.result(timeout=self.SLICE)
                else:
                    if not pool.ray.wait([ref], timeout=self.SLICE)[0]:
                        self._tick()
                        continue
                    result = pool.ray.get(ref)
            except concurrent.futures.TimeoutError:
                self._tick()
                continue
            except Exception as e:  # noqa: BLE001 - sorted below
                if self._lost_actor(e):
                    pool.died(w, e)
                    continue
                # A unit's error ends the epoch, as locally: the next iter() is the next one.
                pool.abandon()
                self._finished = True
                self._native._fail_units()
                raise _loader_error(e) from None
            break
        del pool.refs[w, unit]
        d.done(unit, result["seconds"], time.monotonic())
        pool.run()
        self._native._units_failed(result["failures"])
        for b, rows in zip(result["batches"], result["rows"]):
            self._regroup.push(b, rows)

    def _stalled(self) -> None:
        """No started actor and no local decoder for ``start_timeout`` seconds: an error."""
        pool = self._pool
        waited = pool.dispatch.stalled(time.monotonic())
        if waited is None:
            return
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

    def _tick(self) -> None:
        """Ends the sizer's window once it has passed: the units decoded in hand, the
        cluster's free CPUs (for a sized pool)."""
        pool, d = self._pool, self._pool.dispatch
        now = time.monotonic()
        if not d.window_due(now):
            return
        decoded = sum(1 for k in d.in_hand() if k in pool.refs and _done(pool.ray, pool.refs[k]))
        free = 0.0
        if d.sized:
            try:
                free = float(pool.ray.available_resources().get("CPU", 0.0))
            except Exception:
                pass
        d.resize(now, decoded, free)
        pool.run()


def _placement(ray: Any, remote: Ray) -> Tuple[float, Optional[Tuple[float, float, float]]]:
    """The CPUs each actor reserves and the cluster's CPUs ``(free, total, largest node)``
    (None where Ray does not say), by the library's rules (``PoolSettings``): a pool that
    cannot be placed raises, naming the CPUs needed and free, rather than decode locally
    unasked."""
    def cluster() -> Tuple[float, float, float]:
        nodes = [n for n in ray.nodes() if n.get("Alive", True)]
        largest = max((float(n.get("Resources", {}).get("CPU", 0.0)) for n in nodes),
                      default=0.0)
        return (float(ray.available_resources().get("CPU", 0.0)),
                float(ray.cluster_resources().get("CPU", 0.0)), largest)

    try:
        cpus: Optional[Tuple[float, float, float]] = cluster()
    except Exception:  # noqa: BLE001 - an old or unusual runtime: no figures, no checks
        cpus = None
    settings = remote._settings
    try:
        each = settings.cpus(cpus)
    except RuntimeError as e:
        raise RuntimeError(f"{remote!r}: {e}") from None
    # Actors just killed (another loader's pool, closed) give their CPUs back a little later:
    # a pinned pool waits a moment for them before it says it cannot be placed.
    deadline = time.monotonic() + _FREED_WAIT
    while (short := settings.short_of_cpus(each, cpus)) is not None:
        if time.monotonic() >= deadline:
            raise RuntimeError(f"{remote!r}: {short}")
        time.sleep(0.05)
        cpus = cluster()
    return each, cpus


def _loader_error(e: BaseException) -> BaseException:
    """A unit's error as the local loader would raise it: the cause inside Ray's wrapper."""
    cause = getattr(e, "cause", None)
    if isinstance(cause, BaseException):
        if isinstance(cause, _native.LoaderError):
            return cause
        return _native.LoaderError(str(cause))
    return e
