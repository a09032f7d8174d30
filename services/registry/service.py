"""The registry's NATS adapter: RPC commands, heartbeat intake, failure detection, snapshots.

State changes only through events read back from the stream (the same `evolve` as a replay), and
commands are serialised: a command's events are published, then the command waits until the feed
has folded them in before the next command is decided. Heartbeats are the exception, kept in
memory (see `domain.observe_heartbeat`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.kv import KeyValue
from strata.bus import Bus, EventFeed, RpcServer
from strata.bus.snapshots import load_snapshot, save_snapshot, snapshot_bucket
from strata.config import Settings
from strata.errors import StrataError
from strata.events import WorkerHeartbeat, decode_event, pack, subjects
from strata.events.models import Event
from strata.events.requests import (
    LeaveRequest,
    LeaveResult,
    MembersRequest,
    MembersResult,
    RegisterRequest,
    Registration,
    WorkerNotice,
)
from strata.metrics import MESSAGES_REJECTED
from strata.services.registry import domain
from strata.services.registry.domain import Leave, Policy, Register, RegistryState

log = structlog.get_logger("strata.registry")

SNAPSHOT_KEY = "registry"
SNAPSHOT_EVERY_S = 10.0
APPLY_TIMEOUT_S = 30.0
HEARTBEATS = "registry.heartbeats"


class Registry:
    name = "registry"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self.state = RegistryState()
        self.policy = Policy()
        self.rejected: Counter[str] = Counter()
        self.heartbeats = 0
        self._bus: Bus | None = None
        self._feed: EventFeed | None = None
        self._rpc: RpcServer | None = None
        self._hb_sub: Subscription | None = None
        self._kv: KeyValue | None = None
        self._lock = asyncio.Lock()
        self._applied = asyncio.Condition()
        self._outbox: asyncio.Queue[Event] = asyncio.Queue(maxsize=100_000)
        self._notified: dict[tuple[str, str], float] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._live = False

    # -- life -------------------------------------------------------------------------------------

    async def start(self, bus: Bus, settings: Settings) -> None:
        self._bus = bus
        self.policy = Policy(settings.heartbeat_interval, settings.heartbeat_timeout)
        self._kv = await snapshot_bucket(bus.js, settings.stream_replicas)
        snap = await load_snapshot(self._kv, SNAPSHOT_KEY)
        if snap is not None:
            try:
                self.state = domain.restore(snap)
            except (ValueError, KeyError, TypeError, IndexError) as exc:
                log.warning("snapshot_ignored", error=str(exc))
                self.state = RegistryState()
        restored_at = self.state.last_seq
        self._feed = EventFeed(
            bus.js,
            subjects.EVENTS_STREAM,
            subjects.area_events("*", "worker"),
            start_seq=self.state.last_seq + 1,
            name="registry",
        )
        await self._feed.start()
        self._tasks.append(asyncio.create_task(self._follow(self._feed), name="registry-feed"))
        # Set by the feed only once the last stored event has been folded in by `_follow`.
        await self._feed.caught_up.wait()
        domain.begin_grace(self.state, self._clock())
        log.info(
            "registry_rebuilt",
            snapshot_seq=restored_at,
            last_seq=self.state.last_seq,
            jobs=len(self.state.jobs),
        )
        self._hb_sub = await bus.nc.subscribe(
            subjects.job_heartbeats("*"), cb=self._on_heartbeat, pending_msgs_limit=1_000_000
        )
        self._rpc = RpcServer(bus.nc, self.name)
        self._rpc.route("register", RegisterRequest, self._register)
        self._rpc.route("leave", LeaveRequest, self._leave)
        self._rpc.route("members", MembersRequest, self._members)
        await self._rpc.start()
        self._tasks.append(asyncio.create_task(self._detect_failures(), name="registry-detector"))
        self._tasks.append(asyncio.create_task(self._drain_outbox(), name="registry-outbox"))
        self._tasks.append(asyncio.create_task(self._snapshots(), name="registry-snapshots"))
        self._live = True

    async def stop(self) -> None:
        self._live = False
        if self._rpc is not None:
            await self._rpc.stop()
        if self._hb_sub is not None:
            with contextlib.suppress(Exception):
                await self._hb_sub.unsubscribe()
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        self._tasks.clear()
        if self._feed is not None:
            await self._feed.stop()
        await self._save_snapshot()

    def ready(self) -> tuple[bool, str]:
        return (True, "ok") if self._live else (False, "rebuilding state from the stream")

    # -- state ------------------------------------------------------------------------------------

    async def _follow(self, feed: EventFeed) -> None:
        async for delivered in feed:
            domain.evolve(self.state, delivered.event)
            self.state.last_seq = delivered.seq
            async with self._applied:
                self._applied.notify_all()
        # The iterator only ends when the subscription is closed.

    async def _publish_and_apply(self, events: list[Event]) -> None:
        assert self._bus is not None
        for event in events:
            ack = await self._bus.publish(event)

            def applied(seq: int = ack.seq) -> bool:
                return self.state.last_seq >= seq

            async with self._applied:
                await asyncio.wait_for(self._applied.wait_for(applied), APPLY_TIMEOUT_S)

    async def _run(self, command: domain.Command) -> domain.Decision:
        decision = domain.decide(self.state, command, self._clock(), self.policy)
        if decision.error is not None:
            raise decision.error
        await self._publish_and_apply(decision.events)
        return decision

    # -- commands ---------------------------------------------------------------------------------

    async def _register(self, request: RegisterRequest) -> Registration:
        async with self._lock:
            worker_id = domain.worker_id_for(request)
            job = self.state.jobs.get(request.job)
            before = job.members.get(worker_id) if job else None
            rejoined = before is not None and not before.live
            await self._run(Register(request))
            job = self.state.job(request.job)
            log.info(
                "worker_registered",
                job=request.job,
                worker=worker_id,
                rank=job.members[worker_id].rank,
                world_size=job.world_size,
            )
            return domain.registration(job, worker_id, self.policy, rejoined)

    async def _leave(self, request: LeaveRequest) -> LeaveResult:
        async with self._lock:
            await self._run(Leave(request))
            return domain.leave_result(self.state.job(request.job), request.worker_id)

    async def _members(self, request: MembersRequest) -> MembersResult:
        return domain.members(self.state, request.job, request.include_gone)

    async def _detect_failures(self) -> None:
        period = max(0.02, min(self.policy.heartbeat_interval, self.policy.heartbeat_timeout) / 4)
        while True:
            await asyncio.sleep(period)
            try:
                async with self._lock:
                    decision = domain.decide(
                        self.state, domain.DetectFailures(), self._clock(), self.policy
                    )
                    if decision.events:
                        await self._publish_and_apply(decision.events)
                        for event in decision.events:
                            log.warning("worker_failed", **_fields(event, "worker_id", "reason"))
            except StrataError as exc:
                log.error("failure_detection_failed", error=str(exc))

    # -- heartbeats -------------------------------------------------------------------------------

    def _reject(self, code: str) -> None:
        self.rejected[code] += 1
        MESSAGES_REJECTED.labels(HEARTBEATS, code).inc()

    async def _on_heartbeat(self, msg: Msg) -> None:
        self.heartbeats += 1
        try:
            event = decode_event(msg.data)
        except StrataError as exc:
            self._reject(exc.code)
            return
        if not isinstance(event, WorkerHeartbeat):
            self._reject("not_a_heartbeat")
            return
        try:
            job, worker = subjects.parse_heartbeat_subject(msg.subject)
        except ValueError:
            self._reject("bad_subject")
            return
        if (job, worker) != (event.job, event.worker_id):
            self._reject("subject_mismatch")
            return
        outcome = domain.observe_heartbeat(self.state, event, self._clock())
        if outcome.rejected is not None:
            self._reject(outcome.rejected)
        for changed in outcome.events:
            try:
                self._outbox.put_nowait(changed)
            except asyncio.QueueFull:
                self._reject("outbox_full")
        if outcome.reregister is not None:
            await self._notify(event, outcome.reregister)

    async def _notify(self, hb: WorkerHeartbeat, reason: str) -> None:
        """Tell a stranger to register again, at most once per heartbeat interval."""
        key = (hb.job, hb.worker_id)
        now = self._clock()
        if now - self._notified.get(key, 0.0) < self.policy.heartbeat_interval:
            return
        self._notified[key] = now
        assert self._bus is not None
        notice = WorkerNotice(job=hb.job, worker_id=hb.worker_id, kind="reregister", reason=reason)
        with contextlib.suppress(Exception):
            await self._bus.nc.publish(
                subjects.control_subject(hb.job, hb.worker_id), pack(notice.model_dump())
            )

    async def _drain_outbox(self) -> None:
        """State changes seen in heartbeats, published in order, off the heartbeat path."""
        assert self._bus is not None
        while True:
            event = await self._outbox.get()
            try:
                await self._bus.publish(event)
            except StrataError as exc:
                log.error("state_change_not_published", error=str(exc))

    # -- snapshots --------------------------------------------------------------------------------

    async def _snapshots(self) -> None:
        saved = self.state.last_seq
        while True:
            await asyncio.sleep(SNAPSHOT_EVERY_S)
            if self.state.last_seq != saved:
                saved = self.state.last_seq
                await self._save_snapshot()

    async def _save_snapshot(self) -> None:
        if self._kv is None:
            return
        try:
            await save_snapshot(self._kv, SNAPSHOT_KEY, domain.snapshot(self.state))
        except Exception as exc:  # a failed snapshot only makes the next start-up slower
            log.warning("snapshot_failed", error=str(exc))


def _fields(event: Event, *names: str) -> dict[str, Any]:
    return {name: getattr(event, name) for name in names}


def create() -> Registry:
    return Registry()


__all__ = ["Registry", "create"]
