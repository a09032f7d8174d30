"""Progress through an epoch: a worker's report of shards done and partial offsets, a restore of
an epoch to a checkpoint's cursors (re-planned so every unfinished shard has a live reader),
and the answer of either.
"""

from __future__ import annotations

import copy

from strata.errors import ConflictError, NotFound, StaleLease, StrataError, ValidationError
from strata.events import Event, ShardOffset, ShardProgress, ShardProgressRestored
from strata.events.ids import event_id
from strata.events.requests import ProgressResult, ReportProgressRequest, RestoreProgressRequest
from strata.services.domain import Decision
from strata.services.sharding.fold import evolve
from strata.services.sharding.plans import _known, _out_of_window, _plan_event
from strata.services.sharding.state import SOURCE, JobSharding, ShardingState


def report_progress(
    state: ShardingState, request: ReportProgressRequest, now_ns: int
) -> Decision[None]:
    job = _known(state, request.job, request.dataset_id)
    if isinstance(job, StrataError):
        return Decision(error=job)
    fenced = job.leases.check(request.job, request.lease, request.worker_id)
    if fenced is not None:
        return Decision(error=fenced)
    epoch_plan = job.plans.get((request.dataset_id, request.epoch))
    if epoch_plan is None:
        refused = _out_of_window(job, request.dataset_id, request.epoch)
        return Decision(
            error=refused
            or NotFound(
                f"epoch {request.epoch} of {request.dataset_id!r} has no plan yet: get_shards first"
            )
        )
    plan = epoch_plan.plan
    size = plan.owner.size
    named = [*request.completed, *(p.shard_id for p in request.partial)]
    outside = [s for s in named if s >= size]
    if outside:
        return Decision(
            error=ValidationError(
                f"shards {outside[:5]} do not exist ({request.dataset_id!r} has {size})",
                field="completed",
            )
        )
    mine = set(plan.shards_of(request.worker_id))
    # A done shard never moves: its owner finished it. One named by another worker was read
    # there after it moved away (a reader that paused, then read on): refused, not ignored.
    finished_elsewhere = [
        s
        for s in named
        if s not in mine and plan.done[s] and plan.owner[s] >= 0 and s not in epoch_plan.restored
    ]
    if finished_elsewhere:
        shard = finished_elsewhere[0]
        finisher = plan.members[int(plan.owner[shard])]
        return Decision(
            error=ConflictError(
                f"shards {finished_elsewhere[:5]} of {request.dataset_id!r} epoch "
                f"{request.epoch} were already finished by another worker ({finisher!r} for "
                f"shard {shard}), not by {request.worker_id!r}: this worker read them after "
                "they moved away, and that reading is not counted; fetch this worker's shards "
                "again"
            )
        )
    foreign = [s for s in named if s not in mine and not plan.done[s]]
    if foreign:
        return Decision(
            error=ConflictError(
                f"shards {foreign[:5]} belong to other workers in plan version {plan.version} "
                f"of {request.dataset_id!r}, not to {request.worker_id!r}; if the plan changed, "
                "fetch this worker's shards again"
            )
        )
    completed = [s for s in dict.fromkeys(request.completed) if not plan.done[s]]
    partial = [p for p in request.partial if not plan.done[p.shard_id]]
    if not completed and not partial:
        return Decision()
    return Decision(
        [
            ShardProgress(
                job=request.job,
                source=SOURCE,
                ts=now_ns,
                dataset_id=request.dataset_id,
                epoch=request.epoch,
                worker_id=request.worker_id,
                completed=completed,
                partial=[ShardOffset(shard_id=p.shard_id, offset=p.offset) for p in partial],
                lease_epoch=request.lease.epoch if request.lease is not None else None,
            )
        ]
    )


def _already_restored(job: JobSharding, request: RestoreProgressRequest) -> bool:
    """The epoch's progress is exactly the checkpoint's and nothing was planned past it: a retry,
    or the same restore from another rank. Progress reported since the last restore to this
    checkpoint (the job failed again before the next one committed) calls for a new reset."""
    if job.restored.get(request.dataset_id) != (request.epoch, request.checkpoint_step):
        return False
    if any(d == request.dataset_id and e > request.epoch for d, e in job.plans):
        return False
    epoch_plan = job.plans.get((request.dataset_id, request.epoch))
    if epoch_plan is None:
        return False
    completed = set(request.completed)
    partial = {p.shard_id: p.offset for p in request.partial if p.shard_id not in completed}
    done = {int(s) for s in epoch_plan.plan.done.nonzero()[0]}
    return done == completed and epoch_plan.offsets == partial


def restore_progress(
    state: ShardingState, request: RestoreProgressRequest, now_ns: int
) -> Decision[None]:
    """Plan the epoch if needed, then reset its progress to the checkpoint's cursors."""
    job = _known(state, request.job, request.dataset_id)
    if isinstance(job, StrataError):
        return Decision(error=job)
    fenced = job.leases.check(request.job, request.lease, request.worker_id)
    if fenced is not None:
        return Decision(error=fenced)
    spec = job.datasets[request.dataset_id]
    named = [*request.completed, *(p.shard_id for p in request.partial)]
    outside = sorted({s for s in named if s >= spec.num_shards})
    if outside:
        return Decision(
            error=ValidationError(
                f"shards {outside[:5]} do not exist ({request.dataset_id!r} has "
                f"{spec.num_shards}); is this cursor from another dataset?",
                field="completed",
            )
        )
    if _already_restored(job, request):
        return Decision()
    events: list[Event] = []
    if (request.dataset_id, request.epoch) not in job.plans:
        if request.worker_id not in job.live:
            return Decision(
                error=NotFound(
                    f"worker {request.worker_id!r} is not a live member of job {request.job!r}"
                )
            )
        planned = _plan_event(job, request.dataset_id, request.epoch, now_ns, "restored")
        events += [planned] if planned else []
    restored = ShardProgressRestored(
        id=event_id(
            "restored",
            request.job,
            request.dataset_id,
            request.epoch,
            request.checkpoint_step,
            job.restores.get(request.dataset_id, 0),
        ),
        job=request.job,
        source=SOURCE,
        ts=now_ns,
        dataset_id=request.dataset_id,
        epoch=request.epoch,
        checkpoint_step=request.checkpoint_step,
        completed=sorted(set(request.completed)),
        partial=list(request.partial),
    )
    events.append(restored)
    # Shards done after the checkpoint are unfinished again. Those whose reader has gone since
    # (failed, left, restarted under a new id) have no reader now, and the epoch's members may
    # be stale if it was not the latest epoch: the plan is brought in line with the live members
    # as it stands after the restore, so every unfinished shard has a live reader.
    after = ShardingState({job.job: copy.deepcopy(job)})
    for event in events:
        evolve(after, event)
    replanned = _plan_event(
        after.job(job.job), request.dataset_id, request.epoch, now_ns, "restored"
    )
    events += [replanned] if replanned else []
    return Decision(events)


def progress_answer(
    state: ShardingState, request: ReportProgressRequest, event: Event | None
) -> ProgressResult:
    """The answer to a progress report once its event (`event`, None when it recorded nothing)
    is folded: refused when the event was stored after the reporter's lease ended, since then it
    counted nothing (`evolve`), else `progress_result`."""
    job = state.job(request.job)
    if event is not None and event.id in job.uncounted:
        raise job.leases.check(request.job, request.lease, request.worker_id) or StaleLease(
            f"the progress of worker {request.worker_id!r} of job {request.job!r} was stored "
            "after its registration ended, and is not counted; the SDK registers again as a "
            "new instance and starts over from the plan"
        )
    return progress_result(state, request)


def progress_result(
    state: ShardingState, request: ReportProgressRequest | RestoreProgressRequest
) -> ProgressResult:
    """How much of the epoch is done, once a report or a restore is folded in. A restore with no
    live member to plan the epoch over leaves it without a plan: a conflict, not an answer."""
    epoch_plan = state.job(request.job).plans.get((request.dataset_id, request.epoch))
    if epoch_plan is None:
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
