"""The shape every stateful service shares: a projection of the event stream that also decides.

On start it restores its snapshot, replays the stream from there, then goes live. Its state changes
only by folding events read back from the stream, each checked first against the provenance rule
(its own subject, a source that may emit it: `strata.events.provenance`), and its commands are
serialised: a command's
events are published, then the command waits until they are folded in, so the next decision sees
them (`publish_and_apply`). The one exception is named: `apply_before_storage`, for a service that
must answer before the stream's round trip. `sync()` gives read-your-writes across services (wait
until everything stored so far is in).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any, Generic, TypeVar

import nats.errors
import structlog
from nats.aio.client import Client as NATS
from nats.js.api import PubAck
from nats.js.kv import KeyValue
from strata._supervise import Supervisor
from strata.bus import Bus, Delivered, EventFeed, RpcServer
from strata.bus.connection import ConnectOptions, backoff_delays, connect, retry_transient
from strata.bus.intake import RequestIntakeClient
from strata.bus.publish import MSG_ID
from strata.bus.snapshots import (
    SNAPSHOT_HEADROOM,
    JobSnapshots,
    load_job_snapshots,
    load_snapshot,
    save_job_snapshots,
    save_snapshot,
    snapshot_bucket,
)
from strata.bus.streams import MAX_MSG_SIZE
from strata.config import Settings
from strata.errors import BusError, ServiceUnavailable, StrataError
from strata.events import encode_event, subject_for, subjects
from strata.events.models import Event
from strata.metrics import MESSAGES_REJECTED, observe_decided

S = TypeVar("S")

log = structlog.get_logger("strata.service")

APPLY_TIMEOUT_S = 30.0
SYNC_DEADLINE_S = 20.0
SNAPSHOT_EVERY_S = 10.0


class Projection(Generic[S]):
    """Base of the registry, sharding, barrier and checkpoint services."""

    name: str = "service"
    provisions_streams = True

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.clock = clock
        self.state: S = self.initial_state()
        self.last_seq = 0
        self.folding_seq = 0
        """The stream sequence of the event `evolve` is folding (for services that track one)."""
        self.bus_: Bus | None = None
        self.lock = asyncio.Lock()
        self._applied = asyncio.Condition()
        self._feed: EventFeed | None = None
        self._kv: KeyValue | None = None
        self._rpc_ncs: list[NATS] = []
        self.tasks = Supervisor(self.name)
        """Every task of this service: one that dies makes it unready and ends the process."""
        self._reactions: asyncio.Queue[Event] = asyncio.Queue()
        self.live = False
        # A service without reactions does not pay a queued no-op per event it folds.
        self._reacts = type(self).on_applied is not Projection.on_applied
        self._prepares = type(self).prepare_fold is not Projection.prepare_fold
        self._restored: JobSnapshots | None = None
        """The per-job snapshot restored, while the feed is still below what it covers."""
        self._unconfirmed: set[str] = set()
        """Ids of events published without an ack, until the feed delivers them (`publish_all`)."""

    # -- to implement -----------------------------------------------------------------------------

    def initial_state(self) -> S:
        raise NotImplementedError

    def evolve(self, state: S, event: Event) -> S:
        raise NotImplementedError

    def snapshot(self, state: S) -> dict[str, Any] | None:
        """Plain data of the state, or None for a service that always replays."""
        return None

    def restore(self, data: dict[str, Any]) -> S:
        raise NotImplementedError

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        """Subscriptions, RPC routes and tasks, once the state is rebuilt."""

    async def rpc_server(self, bus: Bus, settings: Settings, *, concurrency: int) -> RpcServer:
        """This service's request server, with the admission control and pending bounds the
        settings give (`STRATA_RPC_*`, docs/operations.md), on a NATS connection of its own:
        a flood of requests then queues in that connection only, never ahead of the events this
        service reads back and the acks it waits for on `bus` (its requests' own answers). Each
        partition of workers' requests (`STRATA_RPC_PARTITIONS`) has a connection of its own
        too, so one job's flood queues only where its partition's requests come in."""

        async def connection(name: str, client: Callable[[], NATS] = NATS) -> NATS:
            options = ConnectOptions(
                name=name, user=settings.nats_user, password=settings.nats_password
            )
            nc = await connect(settings.nats_servers, options, client)
            self._rpc_ncs.append(nc)
            return nc

        nc = await connection(f"strata-{self.name}-rpc")
        partitions = [
            await connection(f"strata-{self.name}-rpc-p{partition}", RequestIntakeClient)
            for partition in range(settings.rpc_partitions)
        ]
        return RpcServer(
            nc,
            self.name,
            concurrency=concurrency,
            admission=settings.admission_limits(),
            pending_msgs=settings.rpc_sub_pending_msgs,
            pending_bytes=settings.rpc_sub_pending_mb * 1024 * 1024,
            spawn=self.spawn,
            partitions=partitions,
        )

    async def prepare_fold(self, event: Event) -> None:
        """Work the fold of `event` needs that may run off the event loop (a thread), done just
        before `evolve` folds it; nothing else is folded meanwhile. By default, none."""

    async def on_applied(self, event: Event) -> None:
        """Called after an event was folded in (for reactions such as re-planning)."""

    async def before_stop(self) -> None:
        """Undo `go_live` (RPC servers, subscriptions)."""

    # -- life -------------------------------------------------------------------------------------

    def now_ns(self) -> int:
        """The clock in the domains' unit: wall-clock nanoseconds, like every event's `ts`."""
        return int(self.clock() * 1e9)

    @property
    def bus(self) -> Bus:
        if self.bus_ is None:
            raise BusError(f"{self.name} is not started")
        return self.bus_

    async def start(self, bus: Bus, settings: Settings) -> None:
        self.bus_ = bus
        started = time.monotonic()
        # Start-up reads ride through a JetStream that has no leader for a moment (a node
        # restarting, buckets and streams that other services are creating right now).
        kv = self._kv = await retry_transient(
            functools.partial(snapshot_bucket, bus.js, settings.stream_replicas),
            "opening the snapshot bucket",
        )
        parts = await retry_transient(
            functools.partial(load_job_snapshots, kv, self.name),
            f"loading the {self.name} snapshot",
        )
        # A snapshot of an earlier release: one value for every job.
        data = None
        if parts is None:
            data = await retry_transient(
                functools.partial(load_snapshot, kv, self.name),
                f"loading the {self.name} snapshot",
            )
        try:
            if parts is not None:
                self.state = self.restore(parts.data)
                self.last_seq = parts.start_seq - 1
                self._restored = parts
                if parts.replay:
                    log.warning(
                        "snapshot_jobs_replayed",
                        service=self.name,
                        jobs=sorted(parts.replay)[:20],
                        reason="their part of the snapshot was too large or unreadable",
                    )
            elif data is not None:
                self.state = self.restore(data)
                self.last_seq = int(data["last_seq"])
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            log.warning("snapshot_ignored", service=self.name, error=str(exc))
            self.state, self.last_seq, self._restored = self.initial_state(), 0, None
        restored_at = self.last_seq
        # Everything stored before the feed starts is folded in before going live.
        info = await retry_transient(
            functools.partial(bus.js.stream_info, subjects.EVENTS_STREAM), "reading the stream"
        )
        target = info.state.last_seq
        self._feed = EventFeed(
            bus.js,
            subjects.EVENTS_STREAM,
            subjects.all_events(),
            start_seq=self.last_seq + 1,
            name=self.name,
            on_reject=self._on_reject,
            # Only what the owner of each event type decided is folded (a forged event is
            # counted, skipped, and its sequence passed over like a malformed one's).
            provenance=True,
        )
        await retry_transient(self._feed.start, "starting the event feed")
        self.spawn(self._follow(self._feed), "feed")
        await self.wait_applied(target, timeout=None)
        log.info(
            "state_rebuilt",
            service=self.name,
            snapshot_seq=restored_at,
            last_seq=self.last_seq,
            seconds=round(time.monotonic() - started, 3),
        )
        self.spawn(self._react(), "reactions")
        await self.go_live(bus, settings)
        if self.snapshot(self.state) is not None:
            self.spawn(self._snapshots(), "snapshots")
        self.live = True

    async def stop(self) -> None:
        self.live = False
        await self.before_stop()
        await self.tasks.stop()
        connections, self._rpc_ncs = self._rpc_ncs, []
        for nc in connections:
            with contextlib.suppress(Exception):
                await nc.close()
        if self._feed is not None:
            await self._feed.stop()
        await self.save_snapshot()

    def ready(self) -> tuple[bool, str]:
        if self.tasks.failure is not None:
            return self.tasks.status()
        return (True, "ok") if self.live else (False, "rebuilding state from the stream")

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> asyncio.Task[None]:
        """Run `coro` for this service, supervised (`self.tasks`)."""
        return self.tasks.spawn(coro, name)

    # -- state ------------------------------------------------------------------------------------

    async def _follow(self, feed: EventFeed) -> None:
        async for delivered in feed:
            self.folding_seq = delivered.seq
            restored = self._restored
            if restored is not None:
                if delivered.seq > restored.last_seq and delivered.seq > max(
                    restored.covered.values(), default=0
                ):
                    self._restored = None
                elif delivered.seq <= restored.floor(delivered.event.job):
                    # Folded already into the job's part of the snapshot.
                    self.last_seq = delivered.seq
                    continue
            if self._prepares:
                try:
                    await self.prepare_fold(delivered.event)
                except Exception:  # the fold computes what was not prepared itself
                    log.exception("fold_not_prepared", service=self.name, seq=delivered.seq)
            try:
                self.state = self.evolve(self.state, delivered.event)
            except Exception:  # one event the domain cannot take must not stop the projection
                log.exception("event_not_folded", service=self.name, seq=delivered.seq)
                MESSAGES_REJECTED.labels(self.name, "not_folded").inc()
            self.last_seq = delivered.seq
            if self._unconfirmed and delivered.event.id in self._unconfirmed:
                self._confirm(delivered)
            async with self._applied:
                self._applied.notify_all()
            if self.live and self._reacts:
                # Reactions run on their own task: one that publishes waits for this very loop.
                self._reactions.put_nowait(delivered.event)

    def _confirm(self, delivered: Delivered) -> None:
        """An event `publish_all` sent without an ack is stored: journaled as if acknowledged."""
        self._unconfirmed.discard(delivered.event.id)
        journal = self.bus.publish_options.journal
        if journal is not None:
            journal.record(
                delivered.event.id, PubAck(stream=subjects.EVENTS_STREAM, seq=delivered.seq)
            )

    async def _react(self) -> None:
        while True:
            event = await self._reactions.get()
            try:
                await self.on_applied(event)
            except Exception:  # a reaction's failure must not stop the projection
                log.exception("reaction_failed", service=self.name, event=event.type)

    def _on_reject(self, subject: str, error: StrataError) -> None:
        # Messages are taken in order, so every valid event before this one is folded in already.
        assert self._feed is not None
        self.last_seq = max(self.last_seq, self._feed.position)
        self.spawn(self._wake_waiters(), "wake")

    async def _wake_waiters(self) -> None:
        async with self._applied:
            self._applied.notify_all()

    async def wait_applied(self, seq: int, timeout: float | None = APPLY_TIMEOUT_S) -> None:
        """Wait until every event up to stream sequence `seq` is folded in (or rejected)."""

        def applied() -> bool:
            return self.last_seq >= seq

        async with self._applied:
            await asyncio.wait_for(self._applied.wait_for(applied), timeout)

    async def publish_and_apply(self, events: list[Event]) -> None:
        """Publish each event and wait until the feed has folded it in."""
        for event in events:
            ack = await self.bus.publish(event)
            observe_decided(event)
            await self.wait_applied(ack.seq)

    async def publish_all(self, events: Sequence[Event]) -> None:
        """Publish `events` in order and wait once until the last is folded in.

        Only the last waits for a JetStream acknowledgement: the others go out before it on the
        same connection (so they are stored before it, in order) with no ack to wait for, and
        the feed, which delivers everything stored, confirms them as it folds them. An event it
        has not delivered by then was lost (a leader change) or was a duplicate of one stored
        earlier: it is published again with an ack, which stores it or names the earlier copy.
        An acknowledgement per event costs the service a message to read and a future to settle
        each, the larger part of storing a job start's registrations.
        """
        if not events:
            return
        unconfirmed = {event.id for event in events[:-1]}
        self._unconfirmed |= unconfirmed
        try:
            for event in events[:-1]:
                await self.bus.nc.publish(
                    subject_for(event), encode_event(event), headers={MSG_ID: event.id}
                )
            (ack,) = await self.bus.publish_many(events[-1:])
            await self.wait_applied(ack.seq)
            unconfirmed &= self._unconfirmed
            if unconfirmed:
                again = [event for event in events if event.id in unconfirmed]
                acks = await self.bus.publish_many(again)
                await self.wait_applied(max(ack.seq for ack in acks))
        finally:
            self._unconfirmed -= unconfirmed
        for event in events:
            observe_decided(event)

    def apply_before_storage(self, events: list[Event]) -> None:
        """Fold `events` into the state now, before they are stored: the one exception to
        "the state changes only by folding events read back from the stream".

        For a service whose answer cannot wait for the stream's round trip (the barrier: release
        latency is its product, and the next arrival must see this one). It is sound only when
        `evolve` is idempotent for these events, since each is folded again, unchanged, when it
        comes back from the stream; and only for decisions that can be made again from what the
        stream holds, since an event applied here may never be stored (a crash before its ack).
        The caller publishes the events afterwards and tells no one an outcome that rests on an
        event not yet stored.
        """
        for event in events:
            self.state = self.evolve(self.state, event)

    async def sync(self, deadline_s: float = SYNC_DEADLINE_S) -> None:
        """Wait until every event stored so far is folded in (read-your-writes across services).

        Asking the stream for its last sequence is retried through a leader election; past the
        deadline the caller gets `ServiceUnavailable`, which clients retry.
        """
        delays = backoff_delays(0.05, 1.0)
        deadline = time.monotonic() + deadline_s
        while True:
            try:
                info = await self.bus.js.stream_info(subjects.EVENTS_STREAM)
                break
            except (TimeoutError, nats.errors.Error) as exc:
                if time.monotonic() >= deadline:
                    raise ServiceUnavailable(
                        f"{self.name} cannot read the event stream ({type(exc).__name__}: "
                        f"{exc}); is NATS electing a leader? Try again"
                    ) from None
                await asyncio.sleep(next(delays))
        await self.wait_applied(info.state.last_seq)

    # -- snapshots --------------------------------------------------------------------------------

    async def _snapshots(self) -> None:
        saved = self.last_seq
        while True:
            await asyncio.sleep(SNAPSHOT_EVERY_S)
            if self.last_seq != saved:
                saved = self.last_seq
                await self.save_snapshot()

    async def save_snapshot(self) -> None:
        if self._kv is None:
            return
        data = self.snapshot(self.state)
        if data is None:
            return
        try:
            if isinstance(data.get("jobs"), list):
                limit = min(MAX_MSG_SIZE, self.bus.nc.max_payload) - SNAPSHOT_HEADROOM
                await save_job_snapshots(self._kv, self.name, data, self.last_seq, limit)
            else:
                await save_snapshot(self._kv, self.name, {**data, "last_seq": self.last_seq})
        except (StrataError, Exception) as exc:  # a failed snapshot only slows the next start
            log.warning("snapshot_failed", service=self.name, error=str(exc))
