"""The registry's NATS adapter: RPC commands, heartbeat intake, failure detection.

Membership changes only through events folded from the stream (see `Projection`). Heartbeats are
the exception: kept in memory (see `domain.observe_heartbeat`), with state changes they reveal
published in order off the heartbeat path.
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
from strata.bus import Bus, RpcServer
from strata.config import Settings
from strata.errors import StrataError
from strata.events import WorkerHeartbeat, WorkerRegistered, decode_event, pack, subjects
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
from strata.services.projection import Projection
from strata.services.registry import domain
from strata.services.registry.domain import Leave, Policy, Register, RegistryState

log = structlog.get_logger("strata.registry")

HEARTBEATS = "registry.heartbeats"


class Registry(Projection[RegistryState]):
    name = "registry"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self.policy = Policy()
        self.rejected: Counter[str] = Counter()
        self.heartbeats = 0
        self._rpc: RpcServer | None = None
        self._hb_sub: Subscription | None = None
        self._outbox: asyncio.Queue[Event] = asyncio.Queue(maxsize=100_000)
        self._notified: dict[tuple[str, str], float] = {}

    def initial_state(self) -> RegistryState:
        return RegistryState()

    def evolve(self, state: RegistryState, event: Event) -> RegistryState:
        state = domain.evolve(state, event)
        if self.live and isinstance(event, WorkerRegistered):
            # Folded late (a slow stream, a reconnect): the registration is a sign of life now,
            # not only when it was decided, or the worker would be failed on arrival.
            member = state.job(event.job).members[event.worker_id]
            member.last_seen = max(member.last_seen, self.clock())
        return state

    def snapshot(self, state: RegistryState) -> dict[str, Any]:
        return domain.snapshot(state)

    def restore(self, data: dict[str, Any]) -> RegistryState:
        return domain.restore(data)

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        self.policy = Policy(settings.heartbeat_interval, settings.heartbeat_timeout)
        domain.begin_grace(self.state, self.clock())
        self._hb_sub = await bus.nc.subscribe(
            subjects.job_heartbeats("*"), cb=self._on_heartbeat, pending_msgs_limit=1_000_000
        )
        self._rpc = RpcServer(bus.nc, self.name)
        self._rpc.route("register", RegisterRequest, self._register)
        self._rpc.route("leave", LeaveRequest, self._leave)
        self._rpc.route("members", MembersRequest, self._members)
        await self._rpc.start()
        self.spawn(self._detect_failures(), "detector")
        self.spawn(self._drain_outbox(), "outbox")

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()
        if self._hb_sub is not None:
            with contextlib.suppress(Exception):
                await self._hb_sub.unsubscribe()

    async def _run(self, command: domain.Command) -> domain.Decision:
        decision = domain.decide(self.state, command, self.clock(), self.policy)
        if decision.error is not None:
            raise decision.error
        await self.publish_and_apply(decision.events)
        return decision

    # -- commands ---------------------------------------------------------------------------------

    async def _register(self, request: RegisterRequest) -> Registration:
        async with self.lock:
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
        async with self.lock:
            await self._run(Leave(request))
            return domain.leave_result(self.state.job(request.job), request.worker_id)

    async def _members(self, request: MembersRequest) -> MembersResult:
        return domain.members(self.state, request.job, request.include_gone)

    async def _detect_failures(self) -> None:
        period = max(0.02, min(self.policy.heartbeat_interval, self.policy.heartbeat_timeout) / 4)
        while True:
            await asyncio.sleep(period)
            try:
                async with self.lock:
                    decision = await self._run(domain.DetectFailures())
                for event in decision.events:
                    log.warning("worker_failed", **_fields(event, "job", "worker_id", "reason"))
            except (StrataError, TimeoutError) as exc:
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
        outcome = domain.observe_heartbeat(self.state, event, self.clock())
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
        now = self.clock()
        if now - self._notified.get(key, 0.0) < self.policy.heartbeat_interval:
            return
        self._notified[key] = now
        notice = WorkerNotice(job=hb.job, worker_id=hb.worker_id, kind="reregister", reason=reason)
        with contextlib.suppress(Exception):
            await self.bus.nc.publish(
                subjects.control_subject(hb.job, hb.worker_id), pack(notice.model_dump())
            )

    async def _drain_outbox(self) -> None:
        """State changes seen in heartbeats, published in order, off the heartbeat path."""
        while True:
            event = await self._outbox.get()
            try:
                await self.bus.publish(event)
            except StrataError as exc:
                log.error("state_change_not_published", error=str(exc))


def _fields(event: Event, *names: str) -> dict[str, Any]:
    return {name: getattr(event, name) for name in names}


def create() -> Registry:
    return Registry()
