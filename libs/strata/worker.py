"""The synchronous worker SDK: `strata.Worker`, for ordinary (non-asyncio) training loops.

It runs a `strata.aio.Worker` on a background event loop (`strata._loop`), so heartbeats keep
flowing while the caller's thread trains, and the caller never touches asyncio. A worker started
and never stopped leaves the job when the interpreter exits.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import inspect
import os
import threading
import weakref
from collections.abc import Callable
from dataclasses import replace
from types import TracebackType
from typing import Any, Final, Self, Unpack

import structlog

from strata import _signals
from strata._loop import LoopRunner
from strata.aio import MEMBERS_RETRY_S, OnRejoin, WorkerArgs, WorkerOptions
from strata.aio import Worker as AsyncWorker
from strata.bus import Bus
from strata.config import Settings
from strata.errors import StrataError, ValidationError
from strata.events import LiveState
from strata.events.requests import Lease, MembersResult, Registration, SuspectResult

__all__ = ["Worker", "WorkerArgs", "WorkerOptions", "default_worker"]

EXIT_STOP_TIMEOUT_S: Final = 10.0

log = structlog.get_logger("strata.worker")


def _off_the_loop(callback: OnRejoin | None) -> OnRejoin | None:
    """Run a user callback in a thread, so it may call the worker's blocking methods."""
    if callback is None:
        return None
    user_callback: Callable[[Registration], Any] = callback

    async def call(registration: Registration) -> None:
        outcome = await asyncio.to_thread(user_callback, registration)
        if inspect.isawaitable(outcome):
            await outcome

    return call


def _stop_at_exit(ref: weakref.ReferenceType[Worker], pid: int) -> None:
    worker = ref()
    # A forked child inherits the hook but not the loop thread, nor the membership.
    if worker is None or os.getpid() != pid or not worker.started:
        return
    # Pending checkpoint saves are waited for (up to the worker's saves_timeout), as at the end
    # of a `with` block: a script that saves and simply ends must not abort its checkpoint.
    bound = worker._aio._saves_timeout + EXIT_STOP_TIMEOUT_S
    try:
        worker.stop(timeout=bound)
    except StrataError as exc:
        log.error(
            "checkpoint_save_lost_at_exit",
            worker=worker.id,
            error=str(exc),
            consequence="the step of that save aborts; the latest committed checkpoint is older",
            fix="call CheckpointManager.wait() before the script ends, or raise saves_timeout",
        )
    except Exception as exc:
        log.error("worker_stop_at_exit_failed", worker=worker.id, error=str(exc))


def _register_exit_hook(hook: Callable[[], None]) -> None:
    """Run `hook` when the interpreter exits, while threads can still be started.

    Callbacks of `threading._register_atexit` run when the main thread ends, before the thread
    pools shut down (and before `atexit` handlers, which run once pools refuse work). A pending
    save still writes its files through a thread pool, so the wait for it goes there; the
    `atexit` registration is kept for interpreters without that hook, and for a hook that could
    not run (a stopped worker makes the second call a no-op).
    """
    import concurrent.futures.thread  # noqa: F401  (its own exit hook first, so ours runs before)

    register = getattr(threading, "_register_atexit", None)
    if register is not None:
        with contextlib.suppress(RuntimeError):  # already shutting down
            register(hook)
    atexit.register(hook)


class Worker:
    """One training process's membership of a job (the blocking twin of `strata.aio.Worker`).

    >>> with strata.Worker(job="resnet") as w:          # doctest: +SKIP
    ...     w.set_state("training", step=0, epoch=0)
    """

    def __init__(
        self,
        job: str | None = None,
        nats_url: str | None = None,
        *,
        options: WorkerOptions | None = None,
        **overrides: Unpack[WorkerArgs],
    ) -> None:
        options = replace(options or WorkerOptions(), **overrides)
        self._options = options
        # The callback runs in a thread of its own, so that it may call this face's methods.
        on_loop = replace(options, on_rejoin=_off_the_loop(options.on_rejoin))
        self._aio = AsyncWorker(job, nats_url, options=on_loop)
        self._runner = LoopRunner(name=f"strata-worker-{self._aio.id}")
        self._exit_hook: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return repr(self._aio).replace("strata.aio.Worker", "strata.Worker", 1)

    # -- life -------------------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> Self:
        """Connect, register and start heartbeating in the background; returns the worker.
        Idempotent.

        A live process registered under the same worker id is superseded (recorded as failed):
        this one takes its place, with its rank unless `rank=` asks for another. Raises
        `ConflictError` when the requested rank is held by another live worker, `BusError` when
        NATS cannot be reached within 30 s, `ServiceUnavailable` when no registry answers for 60 s.
        The blocking `strata.Worker.start(timeout=...)` gives up after `timeout` seconds.
        """
        try:
            self._runner.run(self._aio.start(), timeout)
        except BaseException:
            if not self._aio.started:
                self._runner.close()  # no thread left behind by a refused start
            raise
        if self._exit_hook is None:
            self._exit_hook = functools.partial(_stop_at_exit, weakref.ref(self), os.getpid())
            _register_exit_hook(self._exit_hook)
        _started[(self.job, self.id)] = self
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Wait for this worker's pending checkpoint saves (up to `saves_timeout`), stop
        heartbeating, leave the job and disconnect. Idempotent. Raises a save that failed or did
        not finish in time (`code="pending_saves"`), after leaving; never raises for a leave the
        registry cannot take (it then marks the worker failed after the heartbeat timeout). The
        blocking `strata.Worker.stop(timeout=...)` also ends its background thread, and gives up
        after `timeout` seconds."""
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        if not self._runner.running:
            return
        try:
            self._runner.run(self._aio.stop(), timeout)
        finally:
            self._runner.close()

    def leave_on_sigterm(self) -> None:
        """Leave the job gracefully on SIGTERM, then let SIGTERM do what it did before (by
        default: end the process, with the usual status), so the registry records `worker.left`
        at once instead of failing the worker after its heartbeat timeout.

        Opt in: the library installs no signal handler unless this is called. Call it on the
        main thread (Python runs signal handlers only there): `strata.Worker`'s from that thread,
        `strata.aio.Worker`'s from a coroutine on its event loop (it uses
        `loop.add_signal_handler`); `strata.ConfigError` otherwise.
        """
        _signals.install_sync(self.id, lambda: self.stop(timeout=EXIT_STOP_TIMEOUT_S))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if exc is None:
            self.stop()  # a save that failed or is still pending is raised here
            return
        try:
            self.stop()
        except StrataError as failure:  # the block's own exception is the one to see
            log.error("worker_stop_failed", worker=self.id, error=str(failure))

    # -- calls ------------------------------------------------------------------------------------

    def set_state(
        self, state: LiveState, *, step: int | None = None, epoch: int | None = None
    ) -> None:
        """Record what the worker is doing; a new state is announced at once, step and epoch
        alone ride on the next heartbeat (so calling this every step costs no messages)."""
        # Recorded on the caller's thread: calling this every training step costs no round trip.
        if self._aio._record_progress(state, step, epoch) and self._aio.started:
            self._runner.run(self._aio._beat())

    def log_metrics(self, metrics: dict[str, float], *, step: int | None = None) -> None:
        """Record training figures, e.g. `{"loss": 0.31, "samples_per_s": 812}`, at `step` (by
        default the step last given to `set_state`). Never waits on the network: samples are
        buffered and published as `metric.sampled` events about once a second (sooner when many
        wait) and when the worker stops. Names are 1 to 64 of `a-z0-9_` starting with a letter,
        values finite numbers, at most 64 per call; anything else raises
        `strata.ValidationError` naming the metric."""
        # Buffered on the caller's thread: logging every training step costs no round trip.
        self._aio._add_metrics(metrics, step)

    @property
    def metrics_published(self) -> int:
        """Samples of `log_metrics` published so far."""
        return self._aio.metrics_published

    def flush_metrics(self) -> int:
        """Publish the samples `log_metrics` buffered now rather than at the next tick; returns
        how many were sent."""
        return self._runner.run(self._aio.flush_metrics())

    def members(
        self, *, include_gone: bool = False, retry_for: float = MEMBERS_RETRY_S
    ) -> MembersResult:
        """The job's membership as the registry sees it (live workers; all with include_gone)."""
        return self._runner.run(self._aio.members(include_gone=include_gone, retry_for=retry_for))

    def report_suspect(self, worker_id: str) -> SuspectResult:
        """Report a peer of this job suspected dead (a collective with it failed); returns what
        the registry decided. It probes the peer's registration: if NATS answers that nobody
        listens there (the peer's connection is gone, as after a kill), its failure is recorded
        at once (`failed`), without waiting for the heartbeat timeout; a peer that answers is
        `alive`, and one that does not answer in time (paused) is left to the heartbeat timeout
        (`unanswered`). `not_live`: the peer holds no live registration. Needs this worker's
        live lease (`StaleLease` otherwise)."""
        return self._runner.run(self._aio.report_suspect(worker_id))

    def barrier(self, name: str, timeout: float = 60.0, *, expected: int | None = None) -> int:
        """Wait until every expected participant has arrived at `name`; returns the generation.

        Expected participants are the job's live workers when the barrier opens, or `expected`
        workers when given. Raises `strata.BarrierBroken` as soon as a participant fails or
        leaves, and `strata.BarrierTimeout` if it is not complete within `timeout` seconds.
        """
        return self._runner.run(self._aio.barrier(name, timeout, expected=expected))

    # -- properties -------------------------------------------------------------------------------

    @property
    def aio(self) -> AsyncWorker:
        """The asyncio worker underneath, for the other SDK parts (run its coroutines on
        `runner`)."""
        return self._aio

    @property
    def runner(self) -> LoopRunner:
        """The background event loop the async worker lives on."""
        return self._runner

    @property
    def bus(self) -> Bus:
        """The NATS connection, for the other SDK parts that work on behalf of this worker."""
        return self._aio.bus

    @property
    def settings(self) -> Settings:
        """The settings this worker was built with (storage, heartbeats, NATS)."""
        return self._aio.settings

    @property
    def options(self) -> WorkerOptions:
        """The options this worker was made with."""
        return self._options

    @property
    def id(self) -> str:
        """The worker id: the one given, else the one the registry derived from `instance`."""
        return self._aio.id

    @property
    def instance(self) -> str:
        """Random per Worker object: tells the registry a retry from a second process."""
        return self._aio.instance

    @property
    def job(self) -> str:
        """The job this worker belongs to."""
        return self._aio.job

    @property
    def rank(self) -> int:
        """The rank the registry gave this worker: the one asked for with `rank=` (or
        `STRATA_RANK`, or the launcher's: `strata.launch`), else the lowest free one when it
        registered."""
        return self._aio.rank

    @property
    def requested_rank(self) -> int | None:
        """The rank asked for (`rank=`, `STRATA_RANK` or the launcher's), or None for the lowest
        free one."""
        return self._aio.requested_rank

    @property
    def world_size(self) -> int:
        """Live workers in the job, kept current from the registry's membership events."""
        return self._aio.world_size

    @property
    def membership_epoch(self) -> int:
        """Grows with every join, leave and failure in the job."""
        return self._aio.membership_epoch

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats, as the registry asked at registration."""
        return self._aio.heartbeat_interval

    @property
    def heartbeat_timeout(self) -> float:
        """Seconds without a heartbeat after which the registry fails this worker."""
        return self._aio.heartbeat_timeout

    @property
    def registration(self) -> Registration:
        """The registry's latest answer to this worker's registration."""
        return self._aio.registration

    @property
    def state(self) -> LiveState:
        """What the worker last said it is doing (idle, loading, training, ...)."""
        return self._aio.state

    @property
    def step(self) -> int:
        """The step last recorded with `set_state`."""
        return self._aio.step

    @property
    def epoch(self) -> int:
        """The epoch last recorded with `set_state`."""
        return self._aio.epoch

    @property
    def started(self) -> bool:
        """True from a successful `start()` until `stop()`."""
        return self._aio.started

    @property
    def rejoined(self) -> bool:
        """The current registration took over an id that had failed or left (restore state!)."""
        return self._aio.rejoined

    @property
    def rejoin_count(self) -> int:
        """How often this worker registered again on its own after being marked failed."""
        return self._aio.rejoin_count

    @property
    def superseded(self) -> bool:
        """A newer process registered this worker id (a restart): this one no longer counts
        as the worker. It stops heartbeating and never registers again; stop it."""
        return self._aio.superseded

    @property
    def lease(self) -> Lease:
        """This worker's lease: its current registration (instance and the membership epoch it
        was granted at). Requests that change sharding state carry it; a service refuses one
        that is no longer current (`strata.StaleLease`). A re-registration is a new lease."""
        return self._aio.lease

    @property
    def lease_in_doubt(self) -> bool:
        """A heartbeat was confirmed after a gap longer than the heartbeat timeout (this process
        or its connection was held up): the lease may have ended in the gap, and holds again
        only once a service accepts it (`strata.DatasetRegistry` asks the sharding service)."""
        return self._aio.lease_in_doubt

    @property
    def lease_age(self) -> float:
        """Seconds since the heartbeat (or registration) that last renewed the lease was sent."""
        return self._aio.lease_age

    @property
    def lease_expired(self) -> bool:
        """True when the registry may have failed this worker: its last heartbeat NATS confirmed
        is older than the heartbeat timeout (monotonic clock), or the registry said so. A worker
        whose lease expired must not read more data under it (`ShardSampler` waits for a
        confirmed heartbeat or a new registration)."""
        return self._aio.lease_expired


# -- the implicit worker ---------------------------------------------------------------------------

_implicit: Worker | None = None
_implicit_lock = threading.Lock()
_started: weakref.WeakValueDictionary[tuple[str, str], Worker] = weakref.WeakValueDictionary()
"""Every worker this process started, by (job, worker id)."""


def default_worker() -> Worker:
    """This process's implicit worker: what `CheckpointManager(path=...)` and
    `DatasetRegistry()` use when no worker is passed, like torch's default process group.

    Built from the environment (STRATA_JOB, STRATA_NATS_URL, STRATA_RANK, credentials; under a
    launcher, its rank: `strata.launch`) and started on first use; it leaves the job when the
    process exits. Where the program already started a `Worker` of the same job and worker id
    (under torchrun, both are `rank-<RANK>`), that one is the implicit worker: two would take
    the id from each other.
    """
    global _implicit
    with _implicit_lock:
        if _implicit is None or not _implicit.started:
            made = Worker()
            same = _started.get((made.job, made.id))
            _implicit = same if same is not None and same.started else made.start()
        return _implicit


def resolve_worker(worker: object, owner: str, first_keyword: str | None = None) -> Worker:
    """`worker`, or the implicit worker when it is None; a clear error for anything else."""
    if worker is None:
        return default_worker()
    if isinstance(worker, Worker):
        return worker
    hint = f"; pass {first_keyword}=... by name" if first_keyword else ""
    raise ValidationError(
        f"{owner}'s first argument is a strata.Worker (or nothing, for the process's implicit "
        f"worker), got {type(worker).__name__} {worker!r}{hint}",
        field="worker",
    )
