"""The sharding service's NATS adapter: dataset registration, shard requests, progress, re-planning.

A worker's shards are answered after `sync()`, so a worker that has just registered (an event the
registry wrote a moment ago) is already a member here. Membership changes re-plan the latest epoch
of every dataset of the job at once, not on the next request.
"""

from __future__ import annotations

from typing import Any

import structlog
from strata.bus import Bus, RpcServer
from strata.config import Settings
from strata.events import WorkerFailed, WorkerLeft, WorkerRegistered
from strata.events.models import Event
from strata.events.requests import (
    GET_SHARDS,
    PLAN,
    REGISTER_DATASET,
    REPORT_PROGRESS,
    RESTORE_PROGRESS,
    DatasetInfo,
    GetShardsRequest,
    PlanRequest,
    PlanSummary,
    ProgressResult,
    RegisterDatasetRequest,
    ReportProgressRequest,
    RestoreProgressRequest,
    ShardAssignment,
)
from strata.services.domain import Decision
from strata.services.projection import Projection
from strata.services.sharding import domain
from strata.services.sharding.domain import ShardingState

log = structlog.get_logger("strata.sharding")


class Sharding(Projection[ShardingState]):
    name = "sharding"

    def initial_state(self) -> ShardingState:
        return ShardingState()

    def evolve(self, state: ShardingState, event: Event) -> ShardingState:
        return domain.evolve(state, event)

    def snapshot(self, state: ShardingState) -> dict[str, Any]:
        return domain.snapshot(state)

    def restore(self, data: dict[str, Any]) -> ShardingState:
        return domain.restore(data)

    def __init__(self) -> None:
        super().__init__()
        self._rpc: RpcServer | None = None

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        self._rpc = RpcServer(bus.nc, self.name)
        self._rpc.serve(REGISTER_DATASET, self._register_dataset)
        self._rpc.serve(GET_SHARDS, self._get_shards)
        self._rpc.serve(REPORT_PROGRESS, self._report_progress)
        self._rpc.serve(PLAN, self._plan)
        self._rpc.serve(RESTORE_PROGRESS, self._restore_progress)
        await self._rpc.start()
        # Membership may have changed while this service was down.
        async with self.lock:
            for job in list(self.state.jobs):
                now_ns = self.now_ns()
                await self._apply(domain.replan_after_membership_change(self.state, job, now_ns))

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()

    async def on_applied(self, event: Event) -> None:
        if isinstance(event, WorkerRegistered | WorkerFailed | WorkerLeft):
            async with self.lock:
                events = domain.replan_after_membership_change(self.state, event.job, self.now_ns())
                await self._apply(events)

    async def _apply(self, events: list[Event]) -> None:
        for event in events:
            log.info(
                "plan_changed",
                job=event.job,
                dataset=getattr(event, "dataset_id", None),
                epoch=getattr(event, "epoch", None),
                moved=getattr(event, "moved_shards", None),
            )
        await self.publish_and_apply(events)

    async def _decided(self, decision: Decision[None]) -> None:
        if decision.error is not None:
            raise decision.error
        await self._apply(decision.events)

    async def _register_dataset(self, request: RegisterDatasetRequest) -> DatasetInfo:
        async with self.lock:
            decision = domain.register_dataset(self.state, request, self.now_ns())
            await self._decided(decision)
            return domain.dataset_info(
                self.state, request.job, request.dataset_id, created=bool(decision.events)
            )

    async def _get_shards(self, request: GetShardsRequest) -> ShardAssignment:
        await self.sync()
        async with self.lock:
            await self._decided(domain.get_shards(self.state, request, self.now_ns()))
            return domain.assignment(self.state, request)

    async def _report_progress(self, request: ReportProgressRequest) -> ProgressResult:
        async with self.lock:
            await self._decided(domain.report_progress(self.state, request, self.now_ns()))
            return domain.progress_result(self.state, request)

    async def _restore_progress(self, request: RestoreProgressRequest) -> ProgressResult:
        await self.sync()
        async with self.lock:
            await self._decided(domain.restore_progress(self.state, request, self.now_ns()))
            return domain.progress_result(self.state, request)

    async def _plan(self, request: PlanRequest) -> PlanSummary:
        return domain.plan_summary(self.state, request.job, request.dataset_id, request.epoch)


def create() -> Sharding:
    return Sharding()
