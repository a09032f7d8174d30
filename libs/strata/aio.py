"""The asyncio worker SDK: join a job, heartbeat in the background, and follow its membership.

`Worker` is what asyncio training code uses directly; the synchronous `strata.Worker` runs one on a
background event loop. Later SDK parts (datasets, checkpoints, barriers) reuse its `bus`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import os
import socket
import sys
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from types import TracebackType
from typing import Any, Final, Protocol, Self

import pydantic
import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from strata import _signals
from strata._barrier import BarrierClient
from strata._checks import check_id, check_int
from strata._metrics import MetricBatcher, check_metrics
from strata.bus import Bus, Caller
from strata.config import Settings, load_settings
from strata.errors import (
    ConfigError,
    ConflictError,
    NotFound,
    StrataError,
    ValidationError,
    WorkerSuperseded,
)
from strata.events import (
    LIVE_STATES,
    LiveState,
    MetricSampled,
    WorkerHeartbeat,
    decode_model,
    subjects,
)
from strata.events.codec import validation_error
from strata.events.models import MAX_EPOCH, MAX_RANK, MAX_STEP
from strata.events.requests import (
    LeaveRequest,
    LeaveResult,
    MembersRequest,
    MembersResult,
    RegisterRequest,
    Registration,
    WorkerNotice,
    WorldNotice,
)
from strata.logs import configure_library_logging
from strata.security import worker_identity

__all__ = [
    "CheckpointManager",
    "DatasetRegistry",
    "OnRejoin",
    "Worker",
    "WorkerNotStarted",
]

REGISTRY: Final = "registry"
RPC_TIMEOUT_S: Final = 5.0
REGISTER_RETRY_S: Final = 60.0
"""How long start() and a re-registration keep trying: long enough for a registry restart."""
LEAVE_RETRY_S: Final = 5.0
MEMBERS_RETRY_S: Final = 30.0
"""How long members() keeps asking while no registry answers: long enough for a restart."""
CLOSE_TIMEOUT_S: Final = 5.0
SAVES_TIMEOUT_S: Final = 300.0
"""How long stop() (the end of a `with` block) waits for pending checkpoint saves by default."""
_MAX_CPU_PERCENT: Final = 100_000.0
_NATS_SCHEMES: Final = ("nats://", "tls://", "ws://", "wss://")

OnRejoin = Callable[[Registration], Awaitable[None] | None]
"""Called after the worker re-registered on its own, having been marked failed."""


class _Saver(Protocol):
    """What `stop()` needs of a checkpoint manager: wait until its saves are durable."""

    async def wait(self) -> None: ...


log = structlog.get_logger("strata.worker")


class WorkerNotStarted(StrataError):
    """A property or call that needs a registration was used before `start()`."""

    code = "not_started"


def _check_state(state: object) -> LiveState:
    for live in LIVE_STATES:
        if state == live:
            return live
    raise ValidationError(
        f"unknown worker state {state!r}; a worker can set one of: {', '.join(LIVE_STATES)} "
        "(failed and left are decided by the registry)",
        field="state",
    )


def _check_nats_url(url: str) -> str:
    for part in url.split(","):
        if not part.strip().startswith(_NATS_SCHEMES):
            raise ConfigError(
                f"{part.strip()!r} is not a NATS URL; use nats://host:port "
                "(several may be given, separated by commas)"
            )
    return url


def _credential_identity(
    settings: Settings, job: str | None, worker_id: str | None
) -> tuple[str | None, str | None]:
    """The job and worker id a worker credential (`STRATA_NATS_USER=<worker>@<job>`, as `strata
    up --secure` makes them) stands for, checked against those asked for; with any other user,
    those asked for. A worker credential lets its holder act as that worker of that job only."""
    user = settings.nats_user
    identity = worker_identity(user)
    if identity is None:
        return job, worker_id
    own_job, own_worker = identity
    if job is None and "job" in settings.model_fields_set:
        job = settings.job
    for kind, asked, own, how in (
        ("job", job, own_job, "pass job=... or set STRATA_JOB"),
        ("worker id", worker_id, own_worker, "pass worker_id=..."),
    ):
        if asked is not None and asked != own:
            raise ConfigError(
                f"the NATS credential {user!r} is for worker {own_worker!r} of job {own_job!r}, "
                f"but {kind} {asked!r} was asked for: {how} to match it, or use that "
                f"{kind}'s own credential"
            )
    return own_job, own_worker


# -- what a heartbeat reports about this process --------------------------------------------------


def _rss_bytes() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        pass
    try:
        import resource
    except ImportError:
        return None
    # Without /proc only the peak is known; macOS reports it in bytes, the others in KiB.
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class _ProcessSampler:
    """CPU use of the whole process between two samples, and its resident memory."""

    def __init__(self) -> None:
        self._cpu = self._cpu_seconds()
        self._wall = time.monotonic()
        self._percent: float | None = None
        self._gpu_utilization_works = True

    @staticmethod
    def _cpu_seconds() -> float:
        times = os.times()
        return times.user + times.system

    def sample(self) -> tuple[float | None, int | None]:
        cpu, wall = self._cpu_seconds(), time.monotonic()
        # Over a very short span the clock ticks make the figure noise; keep the previous one.
        if wall - self._wall >= 0.05:
            percent = (cpu - self._cpu) / (wall - self._wall) * 100.0
            self._percent = round(min(max(percent, 0.0), _MAX_CPU_PERCENT), 1)
            self._cpu, self._wall = cpu, wall
        return self._percent, _rss_bytes()

    def gpu(self) -> tuple[float | None, int | None]:
        """Utilisation and allocated memory of this process's busiest GPU, if torch uses CUDA."""
        # Only a torch the training code already imported: importing it here would cost seconds.
        torch = sys.modules.get("torch")
        if torch is None:
            return None, None
        try:
            cuda = torch.cuda
            if not cuda.is_available() or not cuda.is_initialized():
                return None, None
            allocated, device = max(
                (int(cuda.memory_allocated(d)), d) for d in range(cuda.device_count())
            )
        except Exception:
            return None, None
        utilization: float | None = None
        if self._gpu_utilization_works:
            try:
                utilization = min(max(float(cuda.utilization(device)), 0.0), 100.0)
            except Exception:  # needs pynvml; without it, stop asking
                self._gpu_utilization_works = False
        return utilization, allocated


# -- the worker -----------------------------------------------------------------------------------


class Worker:
    """One training process's membership of a job, for asyncio code.

    `start()` registers with the registry (retrying while it restarts) and heartbeats in the
    background; when the registry has marked the worker failed (a long pause, a partition), the
    worker registers again on its own and calls `on_rejoin`. `stop()` leaves the job. A newer
    process that starts under the same worker id supersedes this one, which then stops
    heartbeating and never registers again (`superseded`).
    """

    def __init__(
        self,
        job: str | None = None,
        nats_url: str | None = None,
        *,
        worker_id: str | None = None,
        hostname: str | None = None,
        gpus: int = 0,
        labels: dict[str, str] | None = None,
        settings: Settings | None = None,
        on_rejoin: OnRejoin | None = None,
        rank: int | None = None,
        saves_timeout: float = SAVES_TIMEOUT_S,
    ) -> None:
        self._settings = settings if settings is not None else load_settings()
        if not isinstance(saves_timeout, int | float) or not 0 <= saves_timeout <= 86_400:
            raise ValidationError(
                f"saves_timeout must be seconds in [0, 86400], got {saves_timeout!r}",
                field="saves_timeout",
            )
        self._saves_timeout = float(saves_timeout)
        self._savers: weakref.WeakSet[_Saver] = weakref.WeakSet()
        if not structlog.is_configured():
            # structlog's default prints to stdout, which belongs to the training program: hand
            # the lines to stdlib logging instead, whose set-up is the program's.
            configure_library_logging(self._settings.log_format)
        job, worker_id = _credential_identity(self._settings, job, worker_id)
        self._job = check_id(
            "job",
            job if job is not None else self._settings.job,
            "pass job=... or set STRATA_JOB",
        )
        if worker_id is not None:
            check_id("worker_id", worker_id, "pass another worker_id=..., or none to get one")
        if rank is None:
            rank = self._settings.rank
        if rank is not None:
            rank = check_int("rank", rank, 0, MAX_RANK)
        self._nats_url = _check_nats_url(nats_url if nats_url else self._settings.nats_url)
        self._instance = uuid.uuid4().hex
        # The registry's rule for an id it has to make up; its reply has the last word.
        self._worker_id = worker_id or f"w-{self._instance[:24]}"
        try:
            self._register_request = RegisterRequest(
                job=self._job,
                instance=self._instance,
                worker_id=worker_id,
                hostname=(hostname if hostname is not None else socket.gethostname())[:253],
                gpus=gpus,
                labels=dict(labels or {}),
                rank=rank,
            )
        except pydantic.ValidationError as exc:
            raise validation_error(exc, "worker settings") from None
        self._on_rejoin = on_rejoin

        # One tuple, replaced whole: a heartbeat never mixes one call's step with another's epoch.
        self._progress: tuple[LiveState, int, int] = ("idle", 0, 0)
        self._registration: Registration | None = None
        self._membership_view: tuple[int, int] = (0, 0)
        """(membership epoch, world size), replaced whole for readers on other threads."""
        self._rejoin_count = 0
        self._registered_at = 0.0
        self._superseded: str | None = None
        """Why another process now holds this worker id, once this one was told."""

        self._bus: Bus | None = None
        self._control: Subscription | None = None
        self._world_sub: Subscription | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._rejoin_task: asyncio.Task[None] | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._lifecycle_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._started = False
        self._stopping = False

        self._seq = 0
        self._heartbeat_failures = 0
        self._heartbeats_suspended = False
        self._sampler = _ProcessSampler()
        self._barriers: BarrierClient | None = None
        self._metrics = MetricBatcher(self._job, lambda: self._worker_id, self._publish_sample)
        self._log = log.bind(job=self._job, worker=self._worker_id)

    def __repr__(self) -> str:
        where = f"rank={self._registration.rank}" if self._registration else "not registered"
        state = self._progress[0]
        return f"<strata.aio.Worker {self._job}/{self._worker_id} {where} state={state}>"

    # -- properties -------------------------------------------------------------------------------

    def _registered(self, what: str) -> Registration:
        if self._registration is None:
            raise WorkerNotStarted(
                f"worker {self._worker_id!r} of job {self._job!r} has no {what} yet: "
                "call start() first (or use the worker as a context manager)"
            )
        return self._registration

    @property
    def id(self) -> str:
        """The worker id: the one given, else the one the registry derived from `instance`."""
        return self._worker_id

    @property
    def instance(self) -> str:
        """Random per Worker object: tells the registry a retry from a second process."""
        return self._instance

    @property
    def settings(self) -> Settings:
        """The settings this worker was built with (storage, heartbeats, NATS)."""
        return self._settings

    @property
    def job(self) -> str:
        """The job this worker belongs to."""
        return self._job

    @property
    def rank(self) -> int:
        """The rank the registry gave this worker: the one asked for with `rank=` (or
        `STRATA_RANK`), else the lowest free one when it registered."""
        return self._registered("rank").rank

    @property
    def requested_rank(self) -> int | None:
        """The rank asked for (`rank=` or `STRATA_RANK`), or None for the lowest free one."""
        return self._register_request.rank

    @property
    def world_size(self) -> int:
        """Live workers in the job, kept current from the registry's membership events."""
        self._registered("world size")
        return self._membership_view[1]

    @property
    def membership_epoch(self) -> int:
        """Grows with every join, leave and failure in the job."""
        self._registered("membership epoch")
        return self._membership_view[0]

    @property
    def heartbeat_interval(self) -> float:
        """Seconds between heartbeats, as the registry asked at registration."""
        return self._registered("heartbeat interval").heartbeat_interval

    @property
    def heartbeat_timeout(self) -> float:
        """Seconds without a heartbeat after which the registry fails this worker."""
        return self._registered("heartbeat timeout").heartbeat_timeout

    @property
    def registration(self) -> Registration:
        """The registry's latest answer to this worker's registration."""
        return self._registered("registration")

    @property
    def state(self) -> LiveState:
        """What the worker last said it is doing (idle, loading, training, ...)."""
        return self._progress[0]

    @property
    def step(self) -> int:
        """The step last recorded with `set_state`."""
        return self._progress[1]

    @property
    def epoch(self) -> int:
        """The epoch last recorded with `set_state`."""
        return self._progress[2]

    @property
    def started(self) -> bool:
        """True from a successful `start()` until `stop()`."""
        return self._started

    @property
    def rejoined(self) -> bool:
        """The current registration took over an id that had failed or left (restore state!)."""
        return self._registration is not None and self._registration.rejoined

    @property
    def rejoin_count(self) -> int:
        """How often this worker registered again on its own after being marked failed."""
        return self._rejoin_count

    @property
    def superseded(self) -> bool:
        """A newer process registered this worker id (a restart): this one no longer counts
        as the worker. It stops heartbeating and never registers again; stop it."""
        return self._superseded is not None

    @property
    def bus(self) -> Bus:
        """The NATS connection, for the other SDK parts that work on behalf of this worker."""
        if self._bus is None:
            raise WorkerNotStarted(
                f"worker {self._worker_id!r} is not connected: call start() first"
            )
        return self._bus

    # -- life -------------------------------------------------------------------------------------

    def _lock(self) -> asyncio.Lock:
        # The sync Worker may run this object on more than one loop over its life (start, stop,
        # start again), and an asyncio.Lock belongs to one loop.
        loop = asyncio.get_running_loop()
        if self._lifecycle_lock is None or self._lifecycle_lock[0] is not loop:
            self._lifecycle_lock = (loop, asyncio.Lock())
        return self._lifecycle_lock[1]

    async def start(self) -> Self:
        """Connect, register and start heartbeating; returns the worker. Idempotent.

        A live process registered under the same worker id is superseded (recorded as failed):
        this one takes its place, with its rank unless `rank=` asks for another. Raises
        `ConflictError` when the requested rank is held by another live worker, `BusError` when
        NATS cannot be reached within 30 s, `ServiceUnavailable` when no registry answers for 60 s.
        """
        async with self._lock():
            if self._started:
                return self
            # Every request goes out as this worker of this job, and its replies come to an inbox
            # of its own: with a worker credential, NATS lets it use no other.
            bus = await Bus.connect(
                self._nats_url,
                settings=self._settings,
                name=f"strata-worker-{self._worker_id}",
                caller=Caller(self._job, self._worker_id),
            )
            self._bus = bus
            try:
                # Subscribed before registering, so no notice is missed. The registry's compact
                # world notices, not the membership events: those would reach every worker from
                # every other one, N squared messages at a job's start.
                self._world_sub = await bus.nc.subscribe(
                    subjects.world_subject(self._job), cb=self._on_world_notice
                )
                await self._subscribe_control()
                registration = await self._register()
                if registration.worker_id != self._worker_id:
                    # A registry that derived another id than the one asked as: be that one.
                    self._worker_id = registration.worker_id
                    self._log = log.bind(job=self._job, worker=self._worker_id)
                    bus.rpc = bus.rpc.bound(Caller(self._job, self._worker_id))
                    await self._subscribe_control()
            except BaseException:
                await self._close_bus()
                raise
            self._apply_registration(registration)
            self._started = True
            self._metrics.start()
            self._heartbeat_task = asyncio.create_task(
                self._heartbeat_loop(), name=f"strata-heartbeat-{self._worker_id}"
            )
            self._log.info(
                "worker_registered",
                rank=registration.rank,
                world_size=self._membership_view[1],
                membership_epoch=self._membership_view[0],
                rejoined=registration.rejoined,
                heartbeat_interval=registration.heartbeat_interval,
            )
            return self

    def _track_saves(self, saver: _Saver) -> None:
        """A checkpoint manager of this worker: `stop()` waits for its pending saves."""
        self._savers.add(saver)

    async def _pending_saves_failure(self) -> BaseException | None:
        """Wait (up to `saves_timeout`) until this worker's checkpoint saves are durable."""
        savers = list(self._savers)
        if not savers or self._superseded is not None:
            return None
        try:
            async with asyncio.timeout(self._saves_timeout):
                for saver in savers:
                    await saver.wait()
        except TimeoutError:
            return StrataError(
                f"checkpoint saves of {self._worker_id!r} still pending after "
                f"{self._saves_timeout:g}s; the worker left the job without them (their steps "
                "abort). Call wait() before leaving, or give Worker(saves_timeout=...) more time",
                code="pending_saves",
            )
        except Exception as exc:  # a failed save: raised here, as wait() would
            return exc
        return None

    async def stop(self) -> None:
        """Wait for this worker's pending checkpoint saves (up to `saves_timeout`), stop
        heartbeating, leave the job and disconnect. Idempotent. Raises a save that failed or did
        not finish in time, after leaving; never raises for a leave the registry cannot take (it
        then marks the worker failed after the heartbeat timeout)."""
        failure = await self._pending_saves_failure() if self._started else None
        async with self._lock():
            if not self._started:
                return
            self._stopping = True
            try:
                await self._metrics.close()  # the last samples go out before the worker leaves
                await self._cancel_background()
                if self._barriers is not None:
                    await self._barriers.close()
                    self._barriers = None
                if self._superseded is None:  # else the id is another process's to leave
                    await self._leave()
            finally:
                await self._close_bus()
                self._started = False
                self._stopping = False
        if failure is not None:
            raise failure

    def leave_on_sigterm(self) -> None:
        """Leave the job gracefully on SIGTERM, then let SIGTERM do what it did before (by
        default: end the process, with the usual status). Opt in: nothing is installed unless
        this is called. Call it from a coroutine on the main thread's event loop (it uses
        `loop.add_signal_handler`); `strata.ConfigError` otherwise."""
        _signals.install_async(self._worker_id, self.stop)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _subscribe_control(self) -> None:
        if self._control is not None:
            with contextlib.suppress(Exception):
                await self._control.unsubscribe()
        self._control = await self.bus.nc.subscribe(
            subjects.control_subject(self._job, self._worker_id), cb=self._on_control
        )

    async def _register(self, *, rejoin: bool = False) -> Registration:
        # The same instance makes a retried register idempotent on the registry's side. A rejoin
        # asks for the same rank as the first registration did (its request is the same).
        request = self._register_request
        if rejoin:
            request = request.model_copy(update={"rejoin": True})
        return await self.bus.rpc.call(
            REGISTRY,
            "register",
            request,
            result=Registration,
            timeout=RPC_TIMEOUT_S,
            retry_for=REGISTER_RETRY_S,
            idempotent=True,
        )

    def _apply_registration(self, registration: Registration) -> None:
        self._registration = registration
        self._registered_at = time.monotonic()
        self._observe_membership(registration.membership_epoch, registration.world_size)

    async def _leave(self) -> None:
        request = LeaveRequest(job=self._job, worker_id=self._worker_id, instance=self._instance)
        try:
            result = await self.bus.rpc.call(
                REGISTRY,
                "leave",
                request,
                result=LeaveResult,
                timeout=RPC_TIMEOUT_S,
                retry_for=LEAVE_RETRY_S,
                idempotent=True,
            )
        except (NotFound, ConflictError) as exc:
            self._log.info("worker_leave_not_needed", reason=exc.message)
        except StrataError as exc:
            self._log.warning(
                "worker_leave_failed",
                error=str(exc),
                consequence="the registry marks this worker failed after its heartbeat timeout",
            )
        else:
            self._log.info("worker_left", membership_epoch=result.membership_epoch)

    async def _cancel_background(self) -> None:
        tasks = [t for t in (self._heartbeat_task, *self._tasks) if t is not None]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        self._heartbeat_task = self._rejoin_task = None
        self._tasks.clear()

    async def _close_bus(self) -> None:
        bus, self._bus = self._bus, None
        self._control, self._world_sub = None, None
        if bus is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(bus.close(), CLOSE_TIMEOUT_S)
        # Draining is refused while reconnecting; the client must still not reconnect forever.
        if not bus.nc.is_closed:
            with contextlib.suppress(Exception):
                await bus.nc.close()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        task = asyncio.create_task(coro, name=f"{name}-{self._worker_id}")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- barriers ---------------------------------------------------------------------------------

    async def barrier(
        self, name: str, timeout: float = 60.0, *, expected: int | None = None
    ) -> int:
        """Wait until every expected participant has arrived at `name`; returns the generation.

        Expected participants are the job's live workers when the barrier opens, or `expected`
        workers when given. Raises `strata.BarrierBroken` as soon as a participant fails or
        leaves, and `strata.BarrierTimeout` if it is not complete within `timeout` seconds.
        """
        self._registered("barrier()")
        if self._barriers is None:
            self._barriers = BarrierClient(self)
        outcome = await self._barriers.wait(name, timeout, expected)
        return outcome.generation

    # -- training metrics -------------------------------------------------------------------------

    async def log_metrics(self, metrics: dict[str, float], *, step: int | None = None) -> None:
        """Record training figures, e.g. `{"loss": 0.31, "samples_per_s": 812}`, at `step` (by
        default the step last given to `set_state`). Never waits on the network: samples are
        buffered and published as `metric.sampled` events about once a second (sooner when many
        wait) and when the worker stops. Names are 1 to 64 of `a-z0-9_` starting with a letter,
        values finite numbers, at most 64 per call; anything else raises
        `strata.ValidationError` naming the metric."""
        self._add_metrics(metrics, step)

    def _add_metrics(self, metrics: object, step: object) -> None:
        pairs, checked_step = check_metrics(metrics, step)
        if not self._started:
            raise WorkerNotStarted(
                f"worker {self._worker_id!r} is not started: call start() before log_metrics() "
                "(or use the worker as a context manager)"
            )
        self._metrics.add(pairs, self._progress[1] if checked_step is None else checked_step)

    @property
    def metrics_published(self) -> int:
        """Samples of `log_metrics` published so far."""
        return self._metrics.published

    async def flush_metrics(self) -> int:
        """Publish the samples `log_metrics` buffered now rather than at the next tick; returns
        how many were sent."""
        self._registered("flush_metrics()")
        return await self._metrics.flush()

    async def _publish_sample(self, sample: MetricSampled) -> None:
        if self._superseded is None:  # the id is another process's now
            await self.bus.publish_telemetry(sample)

    # -- state and heartbeats ---------------------------------------------------------------------

    async def set_state(
        self, state: LiveState, *, step: int | None = None, epoch: int | None = None
    ) -> None:
        """Record what the worker is doing; a new state is announced at once, step and epoch
        alone ride on the next heartbeat (so calling this every step costs no messages)."""
        if self._record_progress(state, step, epoch) and self._started:
            await self._beat()

    def _record_progress(self, state: object, step: object, epoch: object) -> bool:
        """Validate and keep the new progress; True when the state itself changed."""
        previous_state, previous_step, previous_epoch = self._progress
        new_state = _check_state(state)
        new_step = previous_step if step is None else check_int("step", step, 0, MAX_STEP)
        new_epoch = previous_epoch if epoch is None else check_int("epoch", epoch, 0, MAX_EPOCH)
        self._progress = (new_state, new_step, new_epoch)
        return new_state != previous_state

    def _suspend_heartbeats(self, suspended: bool) -> None:
        """Stop or resume sending heartbeats while everything else keeps running (tests)."""
        self._heartbeats_suspended = suspended

    async def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic()
        while True:
            await self._beat()
            interval = self._registered("heartbeat interval").heartbeat_interval
            next_beat += interval
            delay = next_beat - time.monotonic()
            if delay < 0:
                if -delay > self.heartbeat_timeout / 2:
                    self._log.warning(
                        "heartbeat_late",
                        late_s=round(-delay, 3),
                        hint="something blocked the event loop; the registry may mark this "
                        "worker failed",
                    )
                # Beat now and keep the cadence from here, rather than a burst to catch up.
                next_beat, delay = time.monotonic(), 0.0
            await asyncio.sleep(delay)

    async def _beat(self) -> None:
        """Publish one heartbeat; a failure is logged and the next beat tries again."""
        bus = self._bus
        if bus is None or self._heartbeats_suspended or self._superseded is not None:
            return
        try:
            cpu_percent, rss_bytes = self._sampler.sample()
            gpu_util, gpu_mem = self._sampler.gpu()
            self._seq += 1
            state, step, epoch = self._progress
            heartbeat = WorkerHeartbeat(
                job=self._job,
                source=self._worker_id,
                worker_id=self._worker_id,
                instance=self._instance,
                seq=self._seq,
                state=state,
                step=step,
                epoch=epoch,
                cpu_percent=cpu_percent,
                rss_bytes=rss_bytes,
                gpu_util_percent=gpu_util,
                gpu_mem_bytes=gpu_mem,
            )
            await bus.publish_telemetry(heartbeat)
        except Exception as exc:
            self._heartbeat_failures += 1
            if self._heartbeat_failures == 1 or self._heartbeat_failures % 100 == 0:
                self._log.warning(
                    "heartbeat_failed",
                    error=f"{type(exc).__name__}: {exc}",
                    failures=self._heartbeat_failures,
                )
            return
        if self._heartbeat_failures:
            self._log.info("heartbeat_recovered", after_failures=self._heartbeat_failures)
            self._heartbeat_failures = 0

    # -- notices from the registry ----------------------------------------------------------------

    async def _on_control(self, msg: Msg) -> None:
        try:
            notice = decode_model(msg.data, WorkerNotice, "worker notice")
        except StrataError as exc:
            self._log.warning("worker_notice_ignored", error=str(exc))
            return
        if (notice.job, notice.worker_id) != (self._job, self._worker_id):
            return
        if notice.instance is not None and notice.instance != self._instance:
            return  # for another process using this worker id
        if notice.kind == "reregister":
            self._request_rejoin(notice.reason)
        elif notice.kind == "superseded":
            self._supersede(notice.reason)

    def _supersede(self, reason: str) -> None:
        """Another process holds this worker id now: stop heartbeating, never register again."""
        if self._superseded is not None or not self._started or self._stopping:
            return
        self._superseded = reason
        self._log.error(
            "worker_superseded",
            reason=reason,
            consequence="this process no longer counts as the worker: its heartbeats stop, it "
            "will not register again, and its barrier arrivals are refused; stop it",
        )

    def _request_rejoin(self, reason: str) -> None:
        if (
            not self._started
            or self._stopping
            or self._registration is None
            or self._superseded is not None
        ):
            return
        if self._rejoin_task is not None and not self._rejoin_task.done():
            return  # one re-registration answers a whole burst of notices
        # Heartbeats sent before the last registration can still draw notices after it.
        if time.monotonic() - self._registered_at < 2 * self._registration.heartbeat_interval:
            return
        self._rejoin_task = self._spawn(self._rejoin(reason), "strata-rejoin")

    async def _rejoin(self, reason: str) -> None:
        previous_rank = self.rank
        self._log.warning("worker_reregistering", reason=reason)
        try:
            registration = await self._register(rejoin=True)
        except WorkerSuperseded as exc:
            self._supersede(exc.message)
            return
        except StrataError as exc:
            self._log.error(
                "worker_reregister_failed",
                error=str(exc),
                consequence="the registry will ask again on the next heartbeat",
            )
            return
        self._apply_registration(registration)
        if not registration.rejoined:
            # The registry still had this registration live (e.g. it was rebuilding its state).
            self._log.info("worker_reregister_not_needed", rank=registration.rank)
            return
        self._rejoin_count += 1
        self._log.warning(
            "worker_rejoined",
            rank=registration.rank,
            previous_rank=previous_rank,
            world_size=self._membership_view[1],
            membership_epoch=self._membership_view[0],
            rejoin_count=self._rejoin_count,
        )
        if self._on_rejoin is None:
            return
        try:
            outcome = self._on_rejoin(registration)
            if inspect.isawaitable(outcome):
                await outcome
        except Exception:
            self._log.exception("on_rejoin_failed")

    # -- membership -------------------------------------------------------------------------------

    async def members(
        self, *, include_gone: bool = False, retry_for: float = MEMBERS_RETRY_S
    ) -> MembersResult:
        """The job's membership as the registry sees it (live workers; all with include_gone)."""
        result = await self.bus.rpc.call(
            REGISTRY,
            "members",
            MembersRequest(job=self._job, include_gone=include_gone),
            result=MembersResult,
            timeout=RPC_TIMEOUT_S,
            retry_for=retry_for,
            idempotent=True,
        )
        self._observe_membership(result.membership_epoch, result.world_size)
        return result

    def _observe_membership(self, membership_epoch: int, world_size: int) -> None:
        if membership_epoch >= self._membership_view[0]:
            self._membership_view = (membership_epoch, max(0, world_size))

    async def _on_world_notice(self, msg: Msg) -> None:
        """The registry's notice of the job's world: epoch and size, newest wins."""
        try:
            notice = decode_world_notice(msg.data)
        except StrataError:
            return
        if notice.job == self._job:
            self._observe_membership(notice.membership_epoch, notice.world_size)


@functools.lru_cache(maxsize=64)
def decode_world_notice(data: bytes) -> WorldNotice:
    """A world notice; every in-process worker of the job receives the same bytes, decoded once.
    Raises `strata.CodecError` for anything else."""
    return decode_model(data, WorldNotice, "world notice")


# The other asyncio SDK parts, under their public names (they import this module for types only).
from strata.checkpoint import AsyncCheckpointManager as CheckpointManager  # noqa: E402
from strata.datasets import AsyncDatasetRegistry as DatasetRegistry  # noqa: E402
