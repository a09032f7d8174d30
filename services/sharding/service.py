"""The sharding service's NATS adapter: dataset registration, shard requests, progress, re-planning.

A worker's shards are answered after `sync()`, so a worker that has just registered (an event the
registry wrote a moment ago) is already a member here. Membership changes re-plan the latest epoch
of every dataset of the job at once, not on the next request.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import structlog
from strata.bus import Bus, RpcServer
from strata.config import Settings
from strata.errors import ConflictError
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
from strata.services.projection import Projection
from strata.services.sharding import domain
from strata.services.sharding.domain import Decision, EpochPlan, ShardingState
from strata.sharding import DatasetSpec, Plan, shard_order

log = structlog.get_logger("strata.sharding")

SNAPSHOT_VERSION = 3
"""2: restore counts and retired plan versions. 3: only the plans of each dataset's newest epochs
(`domain.EPOCHS_KEPT`), with the versions of those dropped. An older snapshot is ignored: the
stream is replayed instead, which drops the old plans exactly as evolve does."""


class Sharding(Projection[ShardingState]):
    name = "sharding"

    def initial_state(self) -> ShardingState:
        return ShardingState()

    def evolve(self, state: ShardingState, event: Event) -> ShardingState:
        return domain.evolve(state, event)

    def snapshot(self, state: ShardingState) -> dict[str, Any]:
        return snapshot(state)

    def restore(self, data: dict[str, Any]) -> ShardingState:
        return restore(data)

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
                now = self.clock()
                await self._apply(domain.replan_after_membership_change(self.state, job, now))

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()

    async def on_applied(self, event: Event) -> None:
        if isinstance(event, WorkerRegistered | WorkerFailed | WorkerLeft):
            async with self.lock:
                events = domain.replan_after_membership_change(self.state, event.job, self.clock())
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

    async def _decided(self, decision: Decision) -> None:
        if decision.error is not None:
            raise decision.error
        await self._apply(decision.events)

    async def _register_dataset(self, request: RegisterDatasetRequest) -> DatasetInfo:
        async with self.lock:
            decision = domain.register_dataset(self.state, request, self.clock())
            await self._decided(decision)
            return domain.dataset_info(
                self.state, request.job, request.dataset_id, created=bool(decision.events)
            )

    async def _get_shards(self, request: GetShardsRequest) -> ShardAssignment:
        await self.sync()
        async with self.lock:
            await self._decided(domain.get_shards(self.state, request, self.clock()))
            return domain.assignment(self.state, request)

    async def _report_progress(self, request: ReportProgressRequest) -> ProgressResult:
        async with self.lock:
            await self._decided(domain.report_progress(self.state, request, self.clock()))
            return domain.progress_result(self.state, request)

    async def _restore_progress(self, request: RestoreProgressRequest) -> ProgressResult:
        await self.sync()
        async with self.lock:
            await self._decided(domain.restore_progress(self.state, request, self.clock()))
            epoch_plan = self.state.job(request.job).plans.get((request.dataset_id, request.epoch))
            if epoch_plan is None:  # no live member to plan the epoch over
                raise ConflictError(
                    f"epoch {request.epoch} of {request.dataset_id!r} was restored but has no "
                    "plan: no live worker of the job to read it; register workers, then ask "
                    "for shards"
                )
            plan = epoch_plan.plan
            return ProgressResult(
                job=request.job,
                dataset_id=request.dataset_id,
                epoch=request.epoch,
                done_shards=int(plan.done.sum()),
                total_shards=int(plan.owner.size),
            )

    async def _plan(self, request: PlanRequest) -> PlanSummary:
        return domain.plan_summary(self.state, request.job, request.dataset_id, request.epoch)


def snapshot(state: ShardingState) -> dict[str, Any]:
    """Plans are history-dependent, so their owner arrays are stored, not recomputed."""
    jobs = []
    for job in state.jobs.values():
        jobs.append(
            {
                "job": job.job,
                "membership_epoch": job.membership_epoch,
                "live": sorted(job.live),
                "restored": [[ds, e, step] for ds, (e, step) in job.restored.items()],
                "restores": [[ds, count] for ds, count in job.restores.items()],
                "retired": [[ds, e, version] for (ds, e), version in job.retired.items()],
                "datasets": [
                    [s.dataset_id, s.total_samples, s.shard_size, s.shuffle, s.seed]
                    for s in job.datasets.values()
                ],
                "plans": [
                    {
                        "dataset_id": ds,
                        "epoch": epoch,
                        "members": ep.plan.members,
                        "version": ep.plan.version,
                        "owner": ep.plan.owner.astype(np.int32).tobytes(),
                        "done": np.packbits(ep.plan.done).tobytes(),
                        "offsets": [[s, o] for s, o in ep.offsets.items()],
                    }
                    for (ds, epoch), ep in job.plans.items()
                ],
            }
        )
    return {"v": SNAPSHOT_VERSION, "jobs": jobs}


def restore(data: dict[str, Any]) -> ShardingState:
    if data.get("v") != SNAPSHOT_VERSION:
        raise ValueError(f"unknown sharding snapshot version {data.get('v')!r}")
    state = ShardingState()
    for raw in data["jobs"]:
        job = state.job(raw["job"])
        job.membership_epoch = raw["membership_epoch"]
        job.live = set(raw["live"])
        job.restored = {ds: (e, step) for ds, e, step in raw.get("restored", [])}
        job.restores = {ds: int(count) for ds, count in raw.get("restores", [])}
        job.retired = {(ds, e): int(version) for ds, e, version in raw.get("retired", [])}
        for ds, total, size, shuffle, seed in raw["datasets"]:
            job.datasets[ds] = DatasetSpec(ds, total, size, shuffle, seed)
        for p in raw["plans"]:
            spec = job.datasets[p["dataset_id"]]
            order = shard_order(spec, p["epoch"])
            position = np.empty_like(order)
            position[order] = np.arange(order.size, dtype=np.int64)
            owner = np.frombuffer(p["owner"], dtype=np.int32).astype(np.int64)
            done = np.unpackbits(np.frombuffer(p["done"], dtype=np.uint8))[: owner.size]
            plan = Plan(spec, p["epoch"], list(p["members"]), owner, position, p["version"])
            plan.done = done.astype(np.bool_)
            job.plans[(p["dataset_id"], p["epoch"])] = EpochPlan(
                plan, {int(s): int(o) for s, o in p["offsets"]}
            )
    return state


def create() -> Sharding:
    return Sharding()
