"""The registry's heartbeat intake: a NATS connection of its own, read below nats-py's
per-message machinery (`intake.IntakeClient`), every heartbeat checked and applied as a plain
call; the state changes heartbeats reveal are published in order off that path (the outbox).

Heartbeats are kept in memory, never stored as events (see `domain.observe_heartbeat`).
"""

from __future__ import annotations

import asyncio
import weakref
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Final

import msgpack
import nats.errors
import structlog
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector
from strata.bus import ConnectOptions, connect
from strata.clock import monotonic_ns, wall
from strata.errors import StrataError
from strata.events import WorkerHeartbeat, decode_event, provenance, subjects
from strata.events.models import plain_heartbeat
from strata.metrics import MESSAGES_REJECTED
from strata.services.registry import domain
from strata.services.registry.intake import IntakeClient
from strata.services.registry.notices import Notices

log = structlog.get_logger("strata.registry")

HEARTBEATS = "registry.heartbeats"
SENDERS_KEPT = 200_000
"""Heartbeat subjects remembered as proven to belong to their worker (see `_take_heartbeat`)."""


class _HeartbeatCounts(Collector):
    """Heartbeat totals of the registries in this process, read at scrape time.

    Counted as plain integers on the hot path: a Prometheus counter costs a lock per increment.
    """

    def __init__(self) -> None:
        self.registries: weakref.WeakSet[HeartbeatIntake] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        received = CounterMetricFamily(
            "strata_registry_heartbeats_received",
            "Heartbeat messages taken off the bus, valid or not.",
        )
        applied = CounterMetricFamily(
            "strata_registry_heartbeats_applied",
            "Heartbeats that renewed a live member's liveness.",
        )
        registries = list(self.registries)
        received.add_metric([], sum(r.heartbeats for r in registries))
        applied.add_metric([], sum(r.applied for r in registries))
        yield received
        yield applied


HEARTBEAT_COUNTS = _HeartbeatCounts()
REGISTRY.register(HEARTBEAT_COUNTS)


class HeartbeatIntake(Notices):
    def __init__(
        self, clock: Callable[[], float] = wall, liveness_ns: Callable[[], int] = monotonic_ns
    ) -> None:
        super().__init__(clock, liveness_ns)
        self.rejected: Counter[str] = Counter()
        HEARTBEAT_COUNTS.registries.add(self)
        self._hb_nc: IntakeClient | None = None
        self._hb_reconnects = 0
        self._listening = False
        self._markers: dict[bytes, asyncio.Future[None]] = {}
        self._senders: dict[bytes, tuple[str, str]] = {}
        self._listening_from = 0
        """The telemetry stream's last sequence when the intake last began to listen."""

    async def _open_intake(self) -> None:
        """Connect the heartbeat intake and subscribe its subjects (again after a dead reader)."""
        settings = self._settings
        assert settings is not None
        # Heartbeats come on a connection of their own: a flood of them must not queue this
        # registry's requests, replies and event feed behind it in one socket.
        nc = await connect(
            settings.nats_servers,
            ConnectOptions(
                name=f"strata-registry-heartbeats-{self.partition}",
                user=settings.nats_user,
                password=settings.nats_password,
            ),
            client=IntakeClient,
        )
        assert isinstance(nc, IntakeClient)
        for pattern in subjects.partition_heartbeats(self.partition, self.partitions):
            await nc.subscribe_direct(pattern, self._take_heartbeat)
        await nc.subscribe_direct(subjects.registry_hearing(self.partition), self._take_marker)
        # The subscriptions are in place at the server before anyone is judged. (This client
        # survives a late PONG: see `ReadingClient._process_pong` in `strata.bus.intake`.)
        await nc.flush()
        self._hb_nc, self._hb_reconnects = nc, nc.stats["reconnects"]
        # Heartbeats stored before this are ones this connection could not have heard.
        try:
            info = await self.bus.js.stream_info(subjects.TELEMETRY_STREAM)
            self._listening_from = info.state.last_seq
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("telemetry_position_unknown", error=str(exc))

    def _take_marker(self, subject: bytes, reply: bytes, data: bytes) -> None:
        arrived = self._markers.get(data)
        if arrived is not None and not arrived.done():
            arrived.set_result(None)

    def _reject(self, code: str) -> None:
        self.rejected[code] += 1
        MESSAGES_REJECTED.labels(HEARTBEATS, code).inc()

    def _take_heartbeat(self, subject: bytes, reply: bytes, data: bytes) -> None:
        """One heartbeat, as the intake parses it (`IntakeClient`): a plain call, no task, no
        lock, no log line on the path almost every heartbeat takes."""
        self.heartbeats += 1
        beat = fast_beat(data)
        # The fast path takes only heartbeats whose source is their worker (`plain_heartbeat`),
        # on a subject already proven to be that worker's (`provenance.heartbeat_belongs`).
        sender = self._senders.get(subject)
        if beat is None or sender is None or sender[0] != beat.job or sender[1] != beat.worker_id:
            beat = self._slow_beat(subject, data, beat)
            if beat is None:
                return
        outcome = domain.observe_beat(self.state, beat, self._beat_clock_ns(), self._liveness_ns())
        if outcome is domain.ALIVE:
            self.applied += 1
            return
        if outcome.rejected is not None:
            self._reject(outcome.rejected)
        elif outcome.reregister is None:
            self.applied += 1
        for changed in outcome.events:
            try:
                self._outbox.put_nowait(changed)
            except asyncio.QueueFull:
                self._reject("outbox_full")
        if outcome.reregister is not None:
            self._notify(beat, "reregister", outcome.reregister)
        elif outcome.superseded is not None:
            self._notify(beat, "superseded", outcome.superseded)

    def _slow_beat(
        self, subject: bytes, data: bytes, beat: domain.Beat | None
    ) -> domain.Beat | None:
        """A heartbeat the fast path could not vouch for: its subject checked (and remembered
        when it belongs to its worker), or the full decode and checks."""
        text = subject.decode(errors="replace")
        if beat is not None and provenance.heartbeat_belongs(
            text, beat.job, beat.worker_id, beat.worker_id
        ):
            if len(self._senders) >= SENDERS_KEPT:
                self._senders.clear()  # strangers or garbage ids must not grow this forever
            self._senders[subject] = (beat.job, beat.worker_id)
            return beat
        return self._checked_beat(text, data)

    def _checked_beat(self, subject: str, data: bytes) -> domain.Beat | None:
        """The full decode and checks, for what the fast path left: a beat, or None (counted)."""
        try:
            event = decode_event(data)
        except StrataError as exc:
            self._reject(exc.code)
            return None
        if not isinstance(event, WorkerHeartbeat):
            self._reject("not_a_heartbeat")
            return None
        refused = provenance.heartbeat_refusal(subject, event)
        if refused is not None:
            self._reject(refused.code)
            return None
        return domain.Beat(
            event.job,
            event.worker_id,
            event.instance,
            event.seq,
            event.state,
            event.step,
            event.epoch,
        )

    async def _drain_outbox(self) -> None:
        """State changes seen in heartbeats, published in order, off the heartbeat path."""
        while True:
            event = await self._outbox.get()
            try:
                await self.bus.publish(event)
            except StrataError as exc:
                log.error("state_change_not_published", error=str(exc))


# -- fast heartbeat decoding ----------------------------------------------------------------------

_MAX_FAST_BYTES: Final = 4096


def fast_beat(data: bytes) -> domain.Beat | None:
    """The `Beat` of a heartbeat in the exact shape the SDK sends, or None for anything else.

    `decode_event` validates the whole pydantic model (most of a heartbeat's cost); this takes
    the model's own fast path (`strata.events.models.plain_heartbeat`: the same verdicts, the
    same bounds) and leaves whatever it does not accept to the full decoder.
    """
    if len(data) > _MAX_FAST_BYTES:
        return None
    try:
        # msgpack's defaults are the codec's options (raw=False, strict_map_key=True); spelling
        # them out as keywords doubles the cost of this call.
        obj = msgpack.unpackb(data)
    except Exception:  # the full decoder reports what is wrong with it
        return None
    facts = plain_heartbeat(obj)
    return None if facts is None else domain.Beat(*facts)


def stored_beat(data: bytes) -> domain.Beat | None:
    """The `Beat` of a heartbeat read back from the telemetry stream, or None if it is none."""
    beat = fast_beat(data)
    if beat is not None:
        return beat
    try:
        event = decode_event(data)
    except StrataError:
        return None
    if not isinstance(event, WorkerHeartbeat):
        return None
    return domain.Beat(
        event.job, event.worker_id, event.instance, event.seq, event.state, event.step, event.epoch
    )
