"""The sharding service's NATS adapter: dataset registration, shard requests, progress, re-planning.

Requests are decided in batches (group commit, `strata.services.commit`): when a job's workers all
ask for their epoch's shards at once, the epoch is planned by the first request of the batch, the
others read it, and the whole batch costs one round trip to the stream. A batch that asks for
shards or restores progress first catches up with the stream (`sync()`), so a worker that has just
registered (an event the registry wrote a moment ago) is already a member here. Membership changes
re-plan the latest epoch of every dataset of the job at once, not on the next request.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import structlog
from strata.bus import Bus, RpcServer
from strata.config import Settings
from strata.events import ShardPlanChanged, WorkerFailed, WorkerLeft, WorkerRegistered
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
from strata.services.commit import MAX_BATCH, GroupCommit
from strata.services.domain import Decision
from strata.services.projection import Projection
from strata.services.sharding import domain
from strata.services.sharding.domain import Command, ShardingState
from strata.sharding.plan import PREPARED, Plan, frozen, initial_plan, replan

log = structlog.get_logger("strata.sharding")

RPC_CONCURRENCY = 4096
"""Requests in hand at once; each waits for its batch (see `strata.services.commit`)."""
PLAN_OFF_LOOP_SHARDS = 50_000
"""Datasets of at least this many shards are planned in the planner thread before their plan
event is folded (`prepare_fold`); smaller ones take less than a thread's round trip."""


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

    def __init__(self, *, max_batch: int = MAX_BATCH) -> None:
        """`max_batch=1` decides and stores one request at a time (the benchmark's baseline)."""
        super().__init__()
        self._rpc: RpcServer | None = None
        self.limits = domain.DEFAULT_LIMITS
        self.commits: GroupCommit[Command, Decision[None]] = GroupCommit(
            self, self._decide_all, max_batch=max_batch, prepare=self._catch_up
        )
        # One plan at a time: the feed folds one event at a time anyway, and a second thread
        # would only take a core from the requests.
        self._planner = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strata-planner")

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        self.limits = domain.ShardingLimits(
            max_datasets=settings.max_datasets_per_job,
            max_shards=settings.max_shards_per_dataset,
        )
        # Membership may have changed while this service was down.
        async with self.lock:
            for job in list(self.state.jobs):
                now_ns = self.now_ns()
                await self._apply(domain.replan_after_membership_change(self.state, job, now_ns))
        self.spawn(self.commits.run(), "commits")
        self._rpc = await self.rpc_server(bus, settings, concurrency=RPC_CONCURRENCY)
        self._rpc.serve(REGISTER_DATASET, self._register_dataset)
        self._rpc.serve(GET_SHARDS, self._get_shards)
        self._rpc.serve(REPORT_PROGRESS, self._report_progress)
        self._rpc.serve(PLAN, self._plan)
        self._rpc.serve(RESTORE_PROGRESS, self._restore_progress)
        await self._rpc.start()

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()

    async def prepare_fold(self, event: Event) -> None:
        """Plan a large dataset's epoch in the planner thread, before its `shard.plan_changed`
        is folded: the fold then takes the plan computed here (`strata.sharding.plan.PREPARED`)
        instead of holding the event loop, and with it every other job's requests, for the
        fraction of a second a plan of up to a million shards takes. The plan is the same pure
        function of the same inputs either way; nothing else is folded while it is computed."""
        if not isinstance(event, ShardPlanChanged):
            return
        job = self.state.jobs.get(event.job)
        spec = job.datasets.get(event.dataset_id) if job is not None else None
        if job is None or spec is None or spec.num_shards < PLAN_OFF_LOOP_SHARDS:
            return
        if not event.members:
            return
        loop = asyncio.get_running_loop()
        current = job.plans.get((event.dataset_id, event.epoch))
        if current is None:
            plan = await loop.run_in_executor(
                self._planner, initial_plan, spec, event.epoch, event.members
            )
            PREPARED.put_initial(spec, event.epoch, event.members, plan)
        else:
            await self._prepare_replan(current.plan, event.members)

    async def _prepare_replan(self, plan: Plan, members: list[str]) -> None:
        made_from = frozen(plan)
        loop = asyncio.get_running_loop()
        result = await loop.run_in_executor(self._planner, replan, made_from, members)
        PREPARED.put_replan(plan, members, result, made_from)

    async def _prepare_membership_replans(self, job_id: str) -> None:
        """The re-plans a membership change calls for (each counts the shards it moves), made in
        the planner thread for the job's large datasets before the domain decides them."""
        job = self.state.jobs.get(job_id)
        if job is None or not job.live:
            return
        members = sorted(job.live)
        for dataset_id, spec in sorted(job.datasets.items()):
            epoch = job.latest_epoch(dataset_id)
            current = job.plans.get((dataset_id, epoch)) if epoch is not None else None
            if current is None or spec.num_shards < PLAN_OFF_LOOP_SHARDS:
                continue
            if current.plan.members != members:
                await self._prepare_replan(current.plan, members)

    async def on_applied(self, event: Event) -> None:
        if isinstance(event, WorkerRegistered | WorkerFailed | WorkerLeft):
            async with self.lock:
                await self._prepare_membership_replans(event.job)
                events = domain.replan_after_membership_change(self.state, event.job, self.now_ns())
                await self._apply(events)

    async def _apply(self, events: list[Event]) -> None:
        """Record re-plans this service decided on its own (membership changes)."""
        for event in events:
            _log_plan(event)
        await self.publish_all(events)

    def _decide_all(self, commands: list[Command]) -> list[Decision[None]]:
        decisions = domain.decide_all(self.state, commands, self.now_ns(), self.limits)
        for decision in decisions:
            for event in decision.events:
                _log_plan(event)
        return decisions

    async def _catch_up(self, commands: list[Command]) -> None:
        # Everything stored before the batch's requests arrived is folded in before they are
        # decided: one look at the stream for the batch.
        if any(isinstance(c, GetShardsRequest | RestoreProgressRequest) for c in commands):
            await self.sync()

    async def _register_dataset(self, request: RegisterDatasetRequest) -> DatasetInfo:
        def answer(decision: Decision[None]) -> DatasetInfo:
            return domain.dataset_info(
                self.state, request.job, request.dataset_id, created=bool(decision.events)
            )

        return await self.commits.submit(request, answer)

    async def _get_shards(self, request: GetShardsRequest) -> ShardAssignment:
        plan = await self.commits.submit(request, lambda _: domain.plan_of(self.state, request))
        if plan is not None:
            # A worker's reading order in a large plan is a sort of up to a million shards:
            # made in a thread (numpy lets go of the GIL), the other jobs' requests go on.
            await asyncio.to_thread(plan.ordered_shards, request.worker_id)
        return domain.assignment(self.state, request)

    async def _report_progress(self, request: ReportProgressRequest) -> ProgressResult:
        def answer(decision: Decision[None]) -> ProgressResult:
            event = decision.events[0] if decision.events else None
            return domain.progress_answer(self.state, request, event)

        return await self.commits.submit(request, answer)

    async def _restore_progress(self, request: RestoreProgressRequest) -> ProgressResult:
        return await self.commits.submit(request, lambda _: self._progress(request))

    def _progress(self, request: ReportProgressRequest | RestoreProgressRequest) -> ProgressResult:
        return domain.progress_result(self.state, request)

    async def _plan(self, request: PlanRequest) -> PlanSummary:
        return domain.plan_summary(self.state, request.job, request.dataset_id, request.epoch)


def _log_plan(event: Event) -> None:
    if isinstance(event, ShardPlanChanged):
        log.info(
            "plan_changed",
            job=event.job,
            dataset=event.dataset_id,
            epoch=event.epoch,
            moved=event.moved_shards,
        )


def create() -> Sharding:
    return Sharding()
