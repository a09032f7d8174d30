"""The epochs' plans as decisions: when a request or a membership change calls for a plan
(`shard.plan_changed`), which epochs may be planned or read, and what a worker's `get_shards`
and a plan summary read from a plan.
"""

from __future__ import annotations

from strata.errors import ConflictError, EpochOutOfRange, NotFound, StrataError, ValidationError
from strata.events import Event, ShardPlanChanged
from strata.events.ids import event_id
from strata.events.requests import (
    SHARDS_PER_REPLY,
    GetShardsRequest,
    PlanSummary,
    ShardAssignment,
    ShardSpan,
)
from strata.services.domain import Decision
from strata.services.sharding.state import EPOCHS_KEPT, SOURCE, JobSharding, ShardingState
from strata.sharding import Plan, replan


def _plan_event(
    job: JobSharding, dataset_id: str, epoch: int, now_ns: int, reason: str
) -> ShardPlanChanged | None:
    """The event that brings (dataset, epoch) in line with the live members, if anything must."""
    members = sorted(job.live)
    current = job.plans.get((dataset_id, epoch))
    if current is not None and current.plan.members == members and not current.plan.unowned():
        return None
    if not members:
        return None
    if current is None:
        version, moved = job.retired.get((dataset_id, epoch), -1) + 1, 0
    else:
        version = current.plan.version + 1
        _, moved = replan(current.plan, members)
    return ShardPlanChanged(
        # The restore count too: versions of far-off epochs are forgotten, and a plan made again
        # after another restore must not carry the id of one the stream already holds.
        id=event_id(
            "plan",
            job.job,
            dataset_id,
            epoch,
            version,
            job.restored.get(dataset_id),
            job.restores.get(dataset_id, 0),
        ),
        job=job.job,
        source=SOURCE,
        ts=now_ns,
        dataset_id=dataset_id,
        epoch=epoch,
        plan_version=version,
        members=members,
        membership_epoch=job.membership_epoch,
        reason=reason,
        moved_shards=moved,
    )


def _known(state: ShardingState, job_id: str, dataset_id: str) -> JobSharding | StrataError:
    job = state.jobs.get(job_id)
    if job is None or dataset_id not in job.datasets:
        return NotFound(
            f"dataset {dataset_id!r} is not registered in job {job_id!r}: "
            "call register_dataset first"
        )
    return job


def _out_of_window(job: JobSharding, dataset_id: str, epoch: int) -> EpochOutOfRange | None:
    """Why `epoch` may not be planned or read now, if it may not."""
    window = job.epoch_window(dataset_id)
    if window is None:
        return None
    low, high = window
    if epoch < low:
        return EpochOutOfRange(
            f"epoch {epoch} of {dataset_id!r} in job {job.job!r} is no longer planned: the "
            f"plans of the {EPOCHS_KEPT} latest epochs are kept ({low}..{high - 1}); to go back "
            "to an earlier epoch, restore a checkpoint taken in it (restore_progress)"
        )
    if epoch > high:
        return EpochOutOfRange(
            f"epoch {epoch} of {dataset_id!r} in job {job.job!r} is more than one past the "
            f"latest planned epoch, {high - 1}: ask for epochs in order (the next is {high}), "
            "or restore a checkpoint to resume at its epoch (restore_progress)"
        )
    return None


def get_shards(state: ShardingState, request: GetShardsRequest, now_ns: int) -> Decision[None]:
    """Plan the epoch on its first request, or catch it up with the membership. Only epochs
    within the window (`JobSharding.epoch_window`) may be planned."""
    job = _known(state, request.job, request.dataset_id)
    if isinstance(job, StrataError):
        return Decision(error=job)
    fenced = job.leases.check(request.job, request.lease)
    if fenced is not None:
        return Decision(error=fenced)
    refused = _out_of_window(job, request.dataset_id, request.epoch)
    if refused is not None:
        return Decision(error=refused)
    if request.worker_id not in job.live:
        return Decision(
            error=NotFound(
                f"worker {request.worker_id!r} is not a live member of job {request.job!r}: "
                "register it (strata.Worker.start) before asking for shards"
            )
        )
    first = (request.dataset_id, request.epoch) not in job.plans
    event = _plan_event(
        job,
        request.dataset_id,
        request.epoch,
        now_ns,
        "first request of the epoch" if first else "membership changed",
    )
    return Decision([event] if event else [])


def plan_of(state: ShardingState, request: GetShardsRequest) -> Plan | None:
    """The plan a `get_shards` request reads, if its epoch is planned."""
    job = state.jobs.get(request.job)
    epoch_plan = job.plans.get((request.dataset_id, request.epoch)) if job else None
    return epoch_plan.plan if epoch_plan is not None else None


def assignment(state: ShardingState, request: GetShardsRequest) -> ShardAssignment:
    """One page of a worker's shards: from `request.offset` in reading order, at most
    `request.limit` (and `SHARDS_PER_REPLY`) of them. Only the page's spans are built, so the
    answer's size is bounded before it is made, however many shards the worker has."""
    job = state.job(request.job)
    epoch_plan = job.plans.get((request.dataset_id, request.epoch))
    if epoch_plan is None:
        # Planned by this request, then dropped by a restore decided right after it (the same
        # batch): the epoch is no longer the one to read.
        raise ConflictError(
            f"the plan of epoch {request.epoch} of {request.dataset_id!r} was dropped by a "
            "restore of the job's progress; ask for the shards of the restored epoch"
        )
    plan = epoch_plan.plan
    mine = plan.ordered_shards(request.worker_id)
    total = int(mine.size)
    if request.offset > total:
        raise ValidationError(
            f"offset {request.offset} is past the {total} shards of worker "
            f"{request.worker_id!r} in epoch {request.epoch} of {request.dataset_id!r}",
            field="offset",
        )
    size = min(request.limit or SHARDS_PER_REPLY, SHARDS_PER_REPLY)
    page = mine[request.offset : request.offset + size].tolist()
    shard_size = plan.dataset.shard_size
    total_samples = plan.dataset.total_samples
    done = plan.done
    offsets = epoch_plan.offsets
    spans = [
        ShardSpan(
            shard_id=shard,
            start=shard * shard_size,
            end=min(total_samples, (shard + 1) * shard_size),
            done=bool(done[shard]),
            offset=offsets.get(shard, 0),
        )
        for shard in page
    ]
    end = request.offset + len(page)
    return ShardAssignment(
        job=request.job,
        dataset_id=request.dataset_id,
        epoch=request.epoch,
        worker_id=request.worker_id,
        plan_version=plan.version,
        world_size=len(plan.members),
        shards=spans,
        offset=request.offset,
        total_shards=total,
        next_offset=end if end < total else None,
    )


def replan_after_membership_change(state: ShardingState, job_id: str, now_ns: int) -> list[Event]:
    """For each dataset's latest epoch, the plan change the new membership calls for."""
    job = state.jobs.get(job_id)
    if job is None:
        return []
    events: list[Event] = []
    for dataset_id in sorted(job.datasets):
        epoch = job.latest_epoch(dataset_id)
        if epoch is None:
            continue
        event = _plan_event(job, dataset_id, epoch, now_ns, "membership changed")
        if event is not None:
            events.append(event)
    return events


def plan_summary(state: ShardingState, job_id: str, dataset_id: str, epoch: int) -> PlanSummary:
    job = state.jobs.get(job_id)
    epoch_plan = job.plans.get((dataset_id, epoch)) if job else None
    if epoch_plan is None:
        refused = _out_of_window(job, dataset_id, epoch) if job else None
        raise refused or NotFound(f"no plan for epoch {epoch} of {dataset_id!r} in job {job_id!r}")
    plan = epoch_plan.plan
    return PlanSummary(
        job=job_id,
        dataset_id=dataset_id,
        epoch=epoch,
        plan_version=plan.version,
        loads=plan.loads(),
        done_shards=int(plan.done.sum()),
        total_shards=int(plan.owner.size),
    )
