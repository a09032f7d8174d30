"""`evolve`: the sharding domain's fold of the events it reads (its own and the registry's). A
`shard.plan_changed` is folded by running the planner (`strata.sharding`) on the members it
records; docs/sharding.md says why the event carries the members and not the plan.
"""

from __future__ import annotations

from typing import Final

from strata.events import (
    DatasetRegistered,
    Event,
    ShardPlanChanged,
    ShardProgress,
    ShardProgressRestored,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
)
from strata.services.sharding.state import EpochPlan, JobSharding, ShardingState, _spec
from strata.sharding import initial_plan, replan

# -- evolve ---------------------------------------------------------------------------------------


FOLDS: Final[tuple[type[Event], ...]] = (
    WorkerRegistered,
    WorkerFailed,
    WorkerLeft,
    DatasetRegistered,
    ShardPlanChanged,
    ShardProgressRestored,
    ShardProgress,
)
"""The event types `evolve` folds; it ignores every other. The read model routes by this."""
REQUESTED: Final[tuple[type[Event], ...]] = (DatasetRegistered, ShardProgress)
"""Of those, the ones this service records in answer to a worker's request (the dashboard's
requests/s)."""

UNCOUNTED_KEPT = 1_000
"""Progress events counted for nothing remembered per job (`JobSharding.uncounted`)."""


def _reported_under_live_lease(job: JobSharding, event: ShardProgress) -> bool:
    """Whether the lease `event` was reported under is still the worker's, in stream order."""
    current = job.leases.current.get(event.worker_id)
    if current is None:
        return False
    return event.lease_epoch is None or event.lease_epoch == current[1]


def evolve(state: ShardingState, event: Event) -> ShardingState:
    if isinstance(event, WorkerRegistered):
        job = state.job(event.job)
        job.live.add(event.worker_id)
        job.leases.fold(event)
        job.membership_epoch = max(job.membership_epoch, event.membership_epoch)
    elif isinstance(event, WorkerFailed | WorkerLeft):
        job = state.job(event.job)
        job.live.discard(event.worker_id)
        job.leases.fold(event)
        job.membership_epoch = max(job.membership_epoch, event.membership_epoch)
    elif isinstance(event, DatasetRegistered):
        state.job(event.job).datasets.setdefault(event.dataset_id, _spec(event))
    elif isinstance(event, ShardPlanChanged):
        job = state.job(event.job)
        spec = job.datasets.get(event.dataset_id)
        if spec is None:
            return state
        key = (event.dataset_id, event.epoch)
        current = job.plans.get(key)
        if current is None:
            plan = initial_plan(spec, event.epoch, event.members)
            plan.version = event.plan_version
            job.plans[key] = EpochPlan(plan)
            job.drop_plans_before(event.dataset_id, event.epoch)
        else:
            current.plan, _ = replan(current.plan, event.members)
            current.plan.version = event.plan_version
    elif isinstance(event, ShardProgressRestored):
        job = state.job(event.job)
        job.restored[event.dataset_id] = (event.epoch, event.checkpoint_step)
        job.restores[event.dataset_id] = job.restores.get(event.dataset_id, 0) + 1
        for key in [k for k in job.plans if k[0] == event.dataset_id and k[1] > event.epoch]:
            job.retired[key] = job.plans.pop(key).plan.version
        epoch_plan = job.plans.get((event.dataset_id, event.epoch))
        if epoch_plan is not None:
            size = epoch_plan.plan.owner.size
            epoch_plan.plan.reset_progress(s for s in event.completed if s < size)
            epoch_plan.restored = frozenset(s for s in event.completed if s < size)
            epoch_plan.offsets = {
                p.shard_id: p.offset
                for p in event.partial
                if p.shard_id < size and not epoch_plan.plan.done[p.shard_id]
            }
    elif isinstance(event, ShardProgress):
        job = state.job(event.job)
        if not _reported_under_live_lease(job, event):
            # Decided before the reporter's end was folded, stored after it: the re-plan that
            # end caused has moved these shards on from the offsets recorded before this report,
            # so counting it would count its samples twice.
            job.uncounted[event.id] = None
            while len(job.uncounted) > UNCOUNTED_KEPT:
                del job.uncounted[next(iter(job.uncounted))]
            return state
        epoch_plan = job.plans.get((event.dataset_id, event.epoch))
        if epoch_plan is None:
            return state
        valid = [s for s in event.completed if s < epoch_plan.plan.owner.size]
        epoch_plan.plan.mark_done(valid)
        for shard in valid:
            epoch_plan.offsets.pop(shard, None)
        for item in event.partial:
            if (
                item.shard_id < epoch_plan.plan.owner.size
                and not epoch_plan.plan.done[item.shard_id]
            ):
                previous = epoch_plan.offsets.get(item.shard_id, 0)
                epoch_plan.offsets[item.shard_id] = max(previous, item.offset)
    return state
