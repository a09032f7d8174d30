"""The gateway's live read model: the event stream and heartbeats folded as they are stored.

It follows STRATA_EVENTS from its first message (every job) and the latest heartbeat of every
worker on STRATA_TELEMETRY, keeps only what passes the provenance rule (an event on its own
subject from a publisher that may emit it, a heartbeat on its worker's subject from that worker),
folds both through `strata.services.readmodel` (the code `strata replay` runs),
counts the rates only a live view has, and wakes the push streams of a job when it changes.
Along the way it keeps snapshots of each job's state (`strata.services.readmodel.snapshots`), so
time travel folds only from the nearest one.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncGenerator, Callable, Coroutine, Iterator
from typing import Any, Final

import nats.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy
from prometheus_client import Counter, Gauge
from strata._supervise import Supervisor
from strata.bus import Bus, Delivered
from strata.errors import StrataError
from strata.events import MetricSampled, WorkerHeartbeat, decode_event, provenance, subjects
from strata.history import Record, dumps, follow_records
from strata.metrics import MESSAGES_REJECTED
from strata.services.gateway.metrics_history import MetricHistory, follow_samples
from strata.services.readmodel import (
    REQUEST_TYPES,
    JobState,
    LiveRates,
    ReadModel,
    render_dashboard,
    with_rates,
)
from strata.services.readmodel.snapshots import SnapshotStore
from strata.services.readmodel.views import Dashboard

log = structlog.get_logger("strata.gateway")

RATE_WINDOW_S: Final = 10
CONSUMER: Final = "gateway"

FOLDED: Final = Counter(
    "strata_gateway_folded_total", "Messages folded into the gateway's read model.", ["kind"]
)
JOBS: Final = Gauge("strata_gateway_jobs", "Jobs in the gateway's read model.")
STREAM_CLIENTS: Final = Gauge(
    "strata_gateway_stream_clients", "Open /api/stream (Server-Sent Events) connections."
)
FOLD_ERRORS: Final = Counter(
    "strata_gateway_fold_errors_total", "Events a domain's evolve raised on (left out of the view)."
)
_FOLDED_EVENTS: Final = FOLDED.labels("event")
_FOLDED_HEARTBEATS: Final = FOLDED.labels("heartbeat")


class RateWindow:
    """Messages per second over the last `span` seconds, counted by stored time."""

    def __init__(self, span: int = RATE_WINDOW_S) -> None:
        self._span = span
        self._counts: dict[int, int] = {}
        self._newest = 0

    def add(self, stored_ns: int) -> None:
        second = stored_ns // 1_000_000_000
        counts = self._counts
        counts[second] = counts.get(second, 0) + 1
        if second > self._newest:
            self._newest = second
            # Dropped only when a new second starts: once a second, not once per message.
            for old in [s for s in counts if s <= second - self._span]:
                del counts[old]

    def rate(self, now: float) -> float:
        """Over the last `span` whole seconds: the figure changes once a second, not per call."""
        current = int(now)
        first = current - self._span
        total = sum(n for s, n in self._counts.items() if first <= s < current)
        return round(total / self._span, 3)


class JobRates:
    def __init__(self) -> None:
        self.events = RateWindow()
        self.requests = RateWindow()
        self.heartbeats = RateWindow()

    def now(self, now: float) -> LiveRates:
        return LiveRates(
            events_per_s=self.events.rate(now),
            requests_per_s=self.requests.rate(now),
            heartbeats_per_s=self.heartbeats.rate(now),
        )


class ChangeSignal:
    """Wakes every waiter once per change; costs one attribute test when nobody waits."""

    def __init__(self) -> None:
        self._waiter: asyncio.Future[None] | None = None
        self.watchers = 0

    def notify(self) -> None:
        waiter, self._waiter = self._waiter, None
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def wait(self, timeout: float) -> bool:
        """True when a change came within `timeout` seconds."""
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_future()
        try:
            await asyncio.wait_for(asyncio.shield(self._waiter), timeout)
        except TimeoutError:
            return False
        return True


class LiveModel:
    """The read model of every job, kept current by the streams."""

    def __init__(
        self,
        clock: Callable[[], float] = time.time,
        snapshots: SnapshotStore | None = None,
        metric_history: MetricHistory | None = None,
        tasks: Supervisor | None = None,
    ) -> None:
        self.clock = clock
        self.model = ReadModel()
        self.snapshots = snapshots if snapshots is not None else SnapshotStore()
        """Snapshots of the jobs' states as they were, for time travel (`/api/replay`)."""
        self.rates: dict[str, JobRates] = {}
        self.signals: dict[str, ChangeSignal] = {}
        self.caught_up = asyncio.Event()
        """Set once every event stored when the gateway started is folded."""
        self.metric_history = metric_history if metric_history is not None else MetricHistory()
        self._static: dict[str, tuple[int, Dashboard]] = {}
        self._encoded: dict[str, tuple[int, LiveRates, bytes]] = {}
        self._telemetry: JetStreamContext.PushSubscription | None = None
        self.tasks = tasks if tasks is not None else Supervisor("gateway")
        """The tasks that follow the streams (the gateway's own, given): one that dies makes
        the gateway unready and ends its process."""

    # -- life -------------------------------------------------------------------------------------

    async def start(self, bus: Bus) -> LiveModel:
        # Read through a flow-controlled consumer of its own: a gateway catching up with a
        # long stream holds a bounded buffer however slowly it folds, and loses nothing.
        events = follow_records(
            bus.js,
            "events",
            subjects.all_events(),
            start_seq=1,
            caught_up=self.caught_up,
            consumer=CONSUMER,
        )
        self._spawn(self._follow_events(events), "events")
        # Telemetry is kept only for registered workers, so it is read once the registrations
        # stored before the start are folded.
        self._spawn(self._follow_telemetry(bus), "telemetry")
        return self

    async def _follow_telemetry(self, bus: Bus) -> None:
        await self.caught_up.wait()
        # The latest heartbeat of each worker, then every new one: a restarted gateway shows the
        # last sign of life of every worker at once, without replaying hours of telemetry.
        self._telemetry = await bus.js.subscribe(
            subjects.all_heartbeats(),
            stream=subjects.TELEMETRY_STREAM,
            ordered_consumer=True,
            deliver_policy=DeliverPolicy.LAST_PER_SUBJECT,
            idle_heartbeat=2.0,
            pending_msgs_limit=1_000_000,
        )
        self._spawn(self._follow_heartbeats(self._telemetry), "heartbeats")
        self._spawn(
            follow_samples(bus, self.metric_history, self.registered, self.fold_sample), "metrics"
        )

    async def stop(self) -> None:
        await self.tasks.stop()
        if self._telemetry is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._telemetry.unsubscribe()

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self.tasks.spawn(coro, name)

    async def _follow_events(self, events: AsyncGenerator[Record, None]) -> None:
        async with contextlib.aclosing(events):
            async for record in events:
                self.fold_record(record)

    async def _follow_heartbeats(self, sub: JetStreamContext.PushSubscription) -> None:
        async for message in sub.messages:
            self.fold_heartbeat(message)

    # -- folding ----------------------------------------------------------------------------------

    def _job_rates(self, job: str) -> JobRates:
        rates = self.rates.get(job)
        if rates is None:
            rates = self.rates[job] = JobRates()
            JOBS.set(len(self.rates))
        return rates

    def fold_event(self, delivered: Delivered) -> None:
        self.fold_record(Record(delivered.seq, delivered.stored_ns, delivered.event))

    def fold_record(self, record: Record) -> None:
        """Fold one record of the events stream (provenance already checked)."""
        event = record.event
        if isinstance(event, WorkerHeartbeat):
            return  # not on the events stream by construction; never a state change
        state = self.model.job(event.job)
        errors = state.fold_errors
        state.apply_event(record.seq, event, record.stored_ns)
        self.snapshots.folded(state, record.stored_ns)
        if state.fold_errors != errors:
            FOLD_ERRORS.inc()
            log.error("event_not_folded", job=event.job, error=state.last_fold_error)
        rates = self._job_rates(event.job)
        rates.events.add(record.stored_ns)
        if event.type in REQUEST_TYPES:
            rates.requests.add(record.stored_ns)
        _FOLDED_EVENTS.inc()
        self._changed(event.job)

    def fold_heartbeat(self, message: Msg) -> None:
        meta = message.metadata
        try:
            event = decode_event(message.data)
        except StrataError as exc:
            MESSAGES_REJECTED.labels(CONSUMER, exc.code).inc()
            return
        if (
            not isinstance(event, WorkerHeartbeat)
            or provenance.heartbeat_refusal(message.subject, event) is not None
        ):
            MESSAGES_REJECTED.labels(CONSUMER, "not_a_heartbeat").inc()
            return
        state = self.model.jobs.get(event.job)
        if state is None or not state.apply_heartbeat(event):
            MESSAGES_REJECTED.labels(CONSUMER, "not_registered").inc()
            return
        self._job_rates(event.job).heartbeats.add(int(meta.timestamp.timestamp() * 1e9))
        _FOLDED_HEARTBEATS.inc()
        self._changed(event.job)

    def fold_sample(self, sample: MetricSampled) -> None:
        """A registered worker's metric sample: its step advances the worker's."""
        state = self.model.jobs.get(sample.job)
        worker = sample.worker_id or sample.source
        if (
            state is not None
            and sample.step is not None
            and state.apply_metric_step(worker, sample.step)
        ):
            self._changed(sample.job)

    def _changed(self, job: str) -> None:
        signal = self.signals.get(job)
        if signal is not None:
            signal.notify()

    # -- views ------------------------------------------------------------------------------------

    def job(self, job: str) -> JobState | None:
        return self.model.jobs.get(job)

    def registered(self, job: str, worker: str) -> bool:
        """Whether `worker` has registered in `job` (live or gone): whose samples are kept."""
        state = self.model.jobs.get(job)
        if state is None:
            return False
        registry_job = state.registry.jobs.get(job)
        return registry_job is not None and worker in registry_job.members

    def static_dashboard(self, state: JobState) -> Dashboard:
        """The dashboard without live rates, rendered once per version of the job."""
        cached = self._static.get(state.job)
        if cached is not None and cached[0] == state.version:
            return cached[1]
        document = render_dashboard(state)
        self._static[state.job] = (state.version, document)
        return document

    def live_rates(self, job: str) -> LiveRates:
        rates = self.rates.get(job)
        return JobRates().now(self.clock()) if rates is None else rates.now(self.clock())

    def dashboard(self, state: JobState, rates: LiveRates | None = None) -> Dashboard:
        """The dashboard with the live rates: the cached render, with the rates of now."""
        if rates is None:
            rates = self.live_rates(state.job)
        return with_rates(self.static_dashboard(state), rates)

    def dashboard_json(self, state: JobState) -> tuple[bytes, LiveRates]:
        """The dashboard as JSON bytes, encoded once per version of the job and of its rates."""
        rates = self.live_rates(state.job)
        cached = self._encoded.get(state.job)
        if cached is not None and cached[0] == state.version and cached[1] == rates:
            return cached[2], rates
        body = dumps(self.dashboard(state, rates)).encode()
        self._encoded[state.job] = (state.version, rates, body)
        return body, rates

    @contextlib.contextmanager
    def watching(self, job: str) -> Iterator[ChangeSignal]:
        """The change signal of `job` while a push stream needs it (kept only while watched)."""
        signal = self.signals.get(job)
        if signal is None:
            signal = self.signals[job] = ChangeSignal()
        signal.watchers += 1
        STREAM_CLIENTS.inc()
        try:
            yield signal
        finally:
            STREAM_CLIENTS.dec()
            signal.watchers -= 1
            if signal.watchers == 0:
                del self.signals[job]
