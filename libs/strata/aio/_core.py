"""The worker's identity, settings and registration: what every other part of it builds on.

`_WorkerCore` holds the state of one worker (its job, ids, registration, progress, connection)
and answers the questions about it (the public properties); it asks the registry to register and
to leave. The heartbeats, membership and life of the worker are layered on it.
"""

from __future__ import annotations

import asyncio
import socket
import time
import uuid
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, replace
from typing import Any, Final, Protocol, TypedDict, Unpack

import pydantic
import structlog
from nats.aio.subscription import Subscription

from strata._checks import check_id, check_int
from strata._metrics import MetricBatcher
from strata._supervise import Supervisor
from strata.aio._sampling import ProcessSampler
from strata.bus import Bus
from strata.config import Settings, load_settings
from strata.errors import ConfigError, ConflictError, NotFound, StrataError, ValidationError
from strata.events import LIVE_STATES, LiveState, MetricSampled
from strata.events.codec import validation_error
from strata.events.models import MAX_RANK
from strata.events.requests import (
    Lease,
    LeaveRequest,
    LeaveResult,
    RegisterRequest,
    Registration,
)
from strata.launch import launched_as
from strata.logs import configure_library_logging
from strata.security import job_of_shared_user, worker_identity

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
_NATS_SCHEMES: Final = ("nats://", "tls://", "ws://", "wss://")

OnRejoin = Callable[[Registration], Awaitable[None] | None]
"""Called after the worker re-registered on its own, having been marked failed."""


@dataclass(frozen=True, kw_only=True)
class WorkerOptions:
    """How a worker joins its job, besides the job and the NATS URL: what `strata.Worker` and
    `strata.aio.Worker` take, as `options=` or as keyword arguments (`gpus=8`), which replace
    the fields they name. Left out, the settings are read from the environment (`STRATA_*`)."""

    worker_id: str | None = None
    """The worker's id; by default the NATS credential's, the launcher's, or one the registry
    makes up."""
    hostname: str | None = None
    """Reported to the registry; by default this machine's name."""
    gpus: int = 0
    """GPUs this worker uses, reported to the registry."""
    labels: dict[str, str] | None = None
    """Free-form labels reported to the registry."""
    settings: Settings | None = None
    """The settings (NATS, heartbeats, storage); by default read from the environment."""
    on_rejoin: OnRejoin | None = None
    """Called after the worker registered again on its own, having been marked failed."""
    rank: int | None = None
    """The rank to ask for; by default `STRATA_RANK`, the launcher's, or the lowest free one."""
    saves_timeout: float = SAVES_TIMEOUT_S
    """Seconds `stop()` waits for pending checkpoint saves."""

    def __post_init__(self) -> None:
        timeout = self.saves_timeout
        if not isinstance(timeout, int | float) or not 0 <= timeout <= 86_400:
            raise ValidationError(
                f"saves_timeout must be seconds in [0, 86400], got {timeout!r}",
                field="saves_timeout",
            )


class WorkerArgs(TypedDict, total=False):
    """`WorkerOptions`' fields as keyword arguments of the constructors."""

    worker_id: str | None
    hostname: str | None
    gpus: int
    labels: dict[str, str] | None
    settings: Settings | None
    on_rejoin: OnRejoin | None
    rank: int | None
    saves_timeout: float


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
        shared = job_of_shared_user(user)
        if shared is not None:
            if job is None and "job" in settings.model_fields_set:
                job = settings.job
            if job is not None and job != shared:
                raise ConfigError(
                    f"the NATS credential {user!r} is shared by the workers of job {shared!r}, "
                    f"but job {job!r} was asked for: pass job=... or set STRATA_JOB to match "
                    "it, or use that job's own credential"
                )
            return shared, worker_id
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


class _WorkerCore:
    """A worker's state and registration; see `strata.aio.Worker`."""

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
        worker_id, rank, hostname = options.worker_id, options.rank, options.hostname
        settings = options.settings
        self._settings = settings if settings is not None else load_settings()
        self._saves_timeout = float(options.saves_timeout)
        self._savers: weakref.WeakSet[_Saver] = weakref.WeakSet()
        if not structlog.is_configured():
            # structlog's default prints to stdout, which belongs to the training program: hand
            # the lines to stdlib logging instead, whose set-up is the program's.
            configure_library_logging(self._settings.log_format)
        job, worker_id = _credential_identity(self._settings, job, worker_id)
        if rank is None and self._settings.rank is None:
            # The launcher's rank (strata.launch has the one rule), and its worker id.
            launched = launched_as()
            if launched is not None:
                rank = launched.rank
                worker_id = worker_id or launched.worker_id
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
                gpus=options.gpus,
                labels=dict(options.labels or {}),
                rank=rank,
            )
        except pydantic.ValidationError as exc:
            raise validation_error(exc, "worker settings") from None
        self._on_rejoin = options.on_rejoin

        # One tuple, replaced whole: a heartbeat never mixes one call's step with another's epoch.
        self._progress: tuple[LiveState, int, int] = ("idle", 0, 0)
        self._registration: Registration | None = None
        self._membership_view: tuple[int, int] = (0, 0)
        """(membership epoch, world size), replaced whole for readers on other threads."""
        self._rejoin_count = 0
        self._registered_at = 0.0
        # The lease: the current registration holds while the registry cannot have failed it,
        # i.e. until a heartbeat timeout after the last heartbeat known to have reached NATS.
        self._lease: Lease | None = None
        self._beat_sent_at = 0.0
        """Monotonic time the last heartbeat was handed to the connection."""
        self._lease_confirmed_at = 0.0
        """Monotonic time of the last heartbeat (or registration) NATS confirmed receiving."""
        self._lease_lost = False
        """The registry said the current registration is over (a notice to register again)."""
        self._lease_doubt_since: float | None = None
        """Set when a heartbeat was confirmed after a gap longer than the heartbeat timeout: the
        registry may have failed this worker in the gap, so the lease counts as expired until a
        service accepts it again (`_lease_verified`), a heartbeat timeout of confirmed heartbeats
        passes with no notice to register again, or a new registration replaces it."""
        self._probe: tuple[object, asyncio.Task[None]] | None = None
        """The PING confirming heartbeats in flight, with the connection it was sent on."""
        self._register_sent_at = 0.0
        self._rejoining = False
        self._next_instance: str | None = None
        """The instance a re-registration in progress registers as, kept across its retries."""
        self._superseded: str | None = None
        """Why another process now holds this worker id, once this one was told."""

        self._bus: Bus | None = None
        self._control: Subscription | None = None
        self._probes: Subscription | None = None
        self._world_sub: Subscription | None = None
        self._heartbeat_task: asyncio.Task[None] | None = None
        self._rejoin_task: asyncio.Task[None] | None = None
        self._tasks = Supervisor("strata-worker")
        """The worker's background tasks (heartbeats, metrics, re-registration): one that dies
        is raised from the next call (`_check_tasks`)."""
        self._lifecycle_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None
        self._started = False
        self._stopping = False

        self._seq = 0
        self._heartbeat_failures = 0
        self._heartbeats_suspended = False
        self._sampler = ProcessSampler()
        self._metrics = MetricBatcher(self._job, lambda: self._worker_id, self._publish_sample)
        self._log = log.bind(job=self._job, worker=self._worker_id)

    def __repr__(self) -> str:
        where = f"rank={self._registration.rank}" if self._registration else "not registered"
        state = self._progress[0]
        return f"<strata.aio.Worker {self._job}/{self._worker_id} {where} state={state}>"

    # -- properties -------------------------------------------------------------------------------

    async def _publish_sample(self, sample: MetricSampled) -> None:
        """One batch's sample of `log_metrics`, unless the worker id is another process's now."""
        if self._superseded is None:
            await self.bus.publish_telemetry(sample)

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
    def lease(self) -> Lease:
        """This worker's lease: its current registration (instance and the membership epoch it
        was granted at). Requests that change sharding state carry it; a service refuses one
        that is no longer current (`strata.StaleLease`). A re-registration is a new lease."""
        self._check_tasks()
        self._registered("lease")
        assert self._lease is not None
        return self._lease

    @property
    def lease_expired(self) -> bool:
        """True when the registry may have failed this worker: its last heartbeat NATS confirmed
        is older than the heartbeat timeout (monotonic clock), or the registry said so. A worker
        whose lease expired must not read more data under it (`ShardSampler` waits for a
        confirmed heartbeat or a new registration)."""
        registration = self._registration
        if registration is None or self._lease_lost or self._superseded is not None:
            return True
        if self._lease_doubt_since is not None:
            return True
        return time.monotonic() - self._lease_confirmed_at > registration.heartbeat_timeout

    @property
    def lease_in_doubt(self) -> bool:
        """A heartbeat was confirmed after a gap longer than the heartbeat timeout (this process
        or its connection was held up): the lease may have ended in the gap, and holds again
        only once a service accepts it (`strata.DatasetRegistry` asks the sharding service)."""
        return self._lease_doubt_since is not None and not self._lease_lost

    @property
    def lease_age(self) -> float:
        """Seconds since the heartbeat (or registration) that last renewed the lease was sent."""
        return time.monotonic() - self._lease_confirmed_at

    def _lease_verified(self, lease: Lease, asked_at: float) -> None:
        """A service accepted `lease` for a request sent at `asked_at` (monotonic): if that was
        after the heartbeat that ended a gap, the lease holds again."""
        doubt = self._lease_doubt_since
        if doubt is not None and lease == self._lease and asked_at >= doubt:
            self._lease_doubt_since = None
            self._lease_confirmed_at = max(self._lease_confirmed_at, doubt)

    def _confirm_beat(self, sent_at: float) -> None:
        """NATS confirmed receiving the heartbeats sent up to `sent_at` (monotonic)."""
        registration = self._registration
        if registration is None or sent_at <= self._lease_confirmed_at:
            return
        gap = sent_at - self._lease_confirmed_at
        if gap > registration.heartbeat_timeout and self._lease_doubt_since is None:
            self._log.warning(
                "lease_in_doubt",
                gap_s=round(gap, 3),
                heartbeat_timeout=registration.heartbeat_timeout,
                consequence="no data is read until a service accepts the lease again or the "
                "worker registers again",
            )
            self._lease_doubt_since = sent_at
        elif (
            self._lease_doubt_since is not None
            and not self._lease_lost
            and sent_at - self._lease_doubt_since >= registration.heartbeat_timeout
        ):
            # A heartbeat timeout of heartbeats NATS received, and no notice to register again
            # (a failed worker's next heartbeat draws one): the registry did not fail it.
            self._lease_doubt_since = None
        self._lease_confirmed_at = sent_at

    @property
    def settings(self) -> Settings:
        """The settings this worker was built with (storage, heartbeats, NATS)."""
        return self._settings

    @property
    def options(self) -> WorkerOptions:
        """The options this worker was made with."""
        return self._options

    @property
    def job(self) -> str:
        """The job this worker belongs to."""
        return self._job

    @property
    def rank(self) -> int:
        """The rank the registry gave this worker: the one asked for with `rank=` (or
        `STRATA_RANK`, or the launcher's: `strata.launch`), else the lowest free one when it
        registered."""
        return self._registered("rank").rank

    @property
    def requested_rank(self) -> int | None:
        """The rank asked for (`rank=`, `STRATA_RANK` or the launcher's), or None for the lowest
        free one."""
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

    # -- the registry and tasks -------------------------------------------------------------------

    def _lock(self) -> asyncio.Lock:
        # The sync Worker may run this object on more than one loop over its life (start, stop,
        # start again), and an asyncio.Lock belongs to one loop.
        loop = asyncio.get_running_loop()
        if self._lifecycle_lock is None or self._lifecycle_lock[0] is not loop:
            self._lifecycle_lock = (loop, asyncio.Lock())
        return self._lifecycle_lock[1]

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        return self._tasks.spawn(coro, f"{name}-{self._worker_id}")

    def _check_tasks(self) -> None:
        """Raise `strata.BackgroundTaskFailed` once a background task of this worker died of an
        exception it did not handle (its heartbeats, say: the registry will fail this worker).
        The cause is the task's exception; stop the worker and start it again."""
        self._tasks.check()

    async def _register(self, *, rejoin: bool = False) -> Registration:
        # The same instance makes a retried register idempotent on the registry's side. A rejoin
        # asks for the same rank as the first registration did (its request is the same).
        request = self._register_request
        self._register_sent_at = time.monotonic()
        if rejoin:
            # A new lease: a new instance replacing this one, under the same worker id.
            if self._next_instance is None:
                self._next_instance = uuid.uuid4().hex
            request = request.model_copy(
                update={
                    "rejoin": True,
                    "instance": self._next_instance,
                    "worker_id": self._worker_id,
                    "replaces": self._instance,
                }
            )
        return await self.bus.rpc.call(
            REGISTRY,
            "register",
            request,
            result=Registration,
            timeout=RPC_TIMEOUT_S,
            retry_for=REGISTER_RETRY_S,
            idempotent=True,
        )

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
