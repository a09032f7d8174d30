"""The registry's NATS adapter: the wiring of its parts and the requests it answers.

Membership changes only through events folded from the stream (see `Projection`). Heartbeats are
the exception: kept in memory (see `domain.observe_heartbeat`), with state changes they reveal
published in order off the heartbeat path. The parts live by concern, one class each, on the
shared `base`: `notices` (to workers), `heartbeats` (the intake), `partitions` (what heartbeat
partitions tell the leader), `detector` (failure detection) and `suspects` (peers reported dead,
judged on a probe), which this module assembles.

Heartbeat intake can be split over several registry processes (`STRATA_REGISTRY_PARTITIONS`): each
takes in the heartbeat buckets of its partition (`subjects.partition_heartbeats`) and watches those
workers for silence. Partition 0 is the leader, the one writer of membership: it alone answers
requests, announces worlds, saves snapshots and records failures, the ones other partitions find
included (they send them to it, `subjects.registry_silences`, and it confirms them against its own
state), so every guarantee of a single registry holds with several.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import structlog
from strata.bus import Bus, RpcServer
from strata.clock import monotonic_ns, wall
from strata.config import Settings
from strata.errors import StrataError
from strata.events import WorkerFailed, WorkerLeft, WorkerRegistered, subjects
from strata.events.models import Event
from strata.events.requests import (
    LEAVE,
    MEMBERS,
    REGISTER,
    SUSPECT,
    LeaveRequest,
    LeaveResult,
    MembersRequest,
    MembersResult,
    RegisterRequest,
)
from strata.metrics import WORKERS_BY_STATUS
from strata.services.commit import GroupCommit
from strata.services.domain import Decision
from strata.services.registry import domain
from strata.services.registry.base import _fields
from strata.services.registry.domain import Leave, Policy, Register, RegistryState
from strata.services.registry.suspects import SuspectReports

log = structlog.get_logger("strata.registry")

RPC_CONCURRENCY = 4096
"""Requests in hand at once; each waits for its batch (see `strata.services.commit`)."""


class Registry(SuspectReports):
    name = "registry"

    def __init__(
        self, clock: Callable[[], float] = wall, liveness_ns: Callable[[], int] = monotonic_ns
    ) -> None:
        super().__init__(clock, liveness_ns)
        WORKERS_BY_STATUS.add(self)
        self._rpc: RpcServer | None = None
        self._commits: GroupCommit[Register | Leave, Decision[bool]] = GroupCommit(
            self, self._decide_all, committed=self._committed
        )

    def evolve(self, state: RegistryState, event: Event) -> RegistryState:
        state = domain.evolve(state, event)
        if isinstance(event, WorkerRegistered | WorkerFailed | WorkerLeft):
            self._worlds_changed.add(event.job)
            self._world_wakeup.set()
        if event.type.startswith("worker."):
            self._worker_seqs[event.job] = max(
                self._worker_seqs.get(event.job, 0), self.folding_seq
            )
        if self.live and isinstance(event, WorkerRegistered):
            # Folded late (a slow stream, a reconnect): the registration is a sign of life now,
            # not only when it was decided, or the worker would be failed on arrival. On the
            # liveness clock: the event's wall-clock stamp may be anywhere after a clock step.
            member = state.job(event.job).members[event.worker_id]
            member.last_seen_ns = self._liveness_ns()
        return state

    def _on_reject(self, subject: str, error: StrataError) -> None:
        super()._on_reject(subject, error)
        # A message refused on a job's worker subjects is still the last one stored there: a
        # failure's conditional write must expect it, or it would be refused for ever.
        with contextlib.suppress(ValueError):
            job, event_type = subjects.parse_event_subject(subject)
            if event_type.startswith("worker.") and self._feed is not None:
                self._worker_seqs[job] = max(self._worker_seqs.get(job, 0), self._feed.position)

    def worker_statuses(self) -> dict[str, list[str]]:
        """Each job's workers' statuses now (`strata_workers`), once this registry is live: one
        still replaying its history would report a membership of the past."""
        if not self.live or not self.leader:
            return {}
        return {
            job.job: [member.status for member in job.members.values()]
            for job in self.state.jobs.values()
        }

    def snapshot(self, state: RegistryState) -> dict[str, Any]:
        return domain.snapshot(state)

    def restore(self, data: dict[str, Any]) -> RegistryState:
        return domain.restore(data)

    async def save_snapshot(self) -> None:
        # Every partition folds the same stream; the leader's snapshot serves them all.
        if self.leader:
            await super().save_snapshot()

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        self.policy = Policy(settings.heartbeat_interval, settings.heartbeat_timeout)
        self.partition, self.partitions = settings.registry_partition, settings.registry_partitions
        self._settings = settings
        domain.begin_grace(self.state, self._liveness_ns())
        await self._open_intake()
        self._listening = True
        log.info("heartbeat_intake", partition=self.partition, partitions=self.partitions)
        self.spawn(self._detect_failures(), "detector")
        self.spawn(self._drain_outbox(), "outbox")
        self.spawn(self._send_notices(), "notices")
        if not self.leader:
            self.spawn(self._report_progress(), "progress")
            return
        await bus.nc.subscribe(subjects.registry_silences(), cb=self._on_silences)
        await bus.nc.subscribe(subjects.registry_progress(), cb=self._on_progress)
        # Requests are taken concurrently and decided in batches (group commit): a job's start
        # is a few round trips to the stream, not one per worker.
        self._rpc = await self.rpc_server(bus, settings, concurrency=RPC_CONCURRENCY)
        self._rpc.serve(REGISTER, self._register)
        self._rpc.serve(LEAVE, self._leave)
        self._rpc.serve(MEMBERS, self._members)
        self._rpc.serve(SUSPECT, self._suspect)
        await self._rpc.start()
        self.spawn(self._commits.run(), "commits")
        self.spawn(self._announce_worlds(), "worlds")

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()
        self._listening = False
        if self._hb_nc is not None and not self._hb_nc.is_closed:
            with contextlib.suppress(Exception):
                await self._hb_nc.close()

    def _decide_all(self, commands: list[Register | Leave]) -> list[Decision[bool]]:
        return domain.decide_all(self.state, commands, self.now_ns(), self.policy)

    # -- commands ---------------------------------------------------------------------------------

    async def _register(self, request: RegisterRequest) -> dict[str, Any]:
        worker_id = domain.worker_id_for(request)

        def answer(decision: Decision[bool]) -> dict[str, Any]:
            job = self.state.job(request.job)
            return domain.registration_reply(
                job, worker_id, self.policy, rejoined=bool(decision.result)
            )

        return await self._commits.submit(Register(request), answer)

    def _committed(self, commands: list[Register | Leave], decisions: list[Decision[bool]]) -> None:
        """One line per job and batch: a job start of thousands of workers is a few lines."""
        registered: Counter[str] = Counter()
        for decision in decisions:
            for event in decision.events:
                if isinstance(event, WorkerRegistered):
                    registered[event.job] += 1
                elif isinstance(event, WorkerFailed):
                    log.warning("worker_failed", **_fields(event, "job", "worker_id", "reason"))
        for name, count in registered.items():
            job = self.state.job(name)
            log.info(
                "workers_registered",
                job=name,
                count=count,
                world_size=job.world_size,
                membership_epoch=job.membership_epoch,
            )

    async def _leave(self, request: LeaveRequest) -> LeaveResult:
        def answer(_: Decision[bool]) -> LeaveResult:
            return domain.leave_result(self.state.job(request.job), request.worker_id)

        return await self._commits.submit(Leave(request), answer)

    async def _members(self, request: MembersRequest) -> MembersResult:
        return domain.members(self.state, request.job, request.include_gone)


def create() -> Registry:
    return Registry()
