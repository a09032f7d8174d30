"""The sharding service's pure core: datasets, plans per (dataset, epoch), progress, re-planning.

Plans are never stored as assignments: `shard.plan_changed` records the members an epoch is planned
over, and `evolve` recomputes the plan with the pure planner (`strata.sharding`), so every replica
and every replay agrees. Membership comes from the registry's worker events. No I/O, no clock reads:
the time is passed in (`now_ns`). The snapshot of the state (`snapshot`, `restore`) is here too.

What a worker can make the service keep, and the work one request may cost, are bounded: a job
registers at most `ShardingLimits.max_datasets` datasets of at most `max_shards` shards each
(`quota_exceeded` past either), each keeps the plans of its `EPOCHS_KEPT` newest epochs only, and a
`get_shards` answer holds at most `SHARDS_PER_REPLY` shards (the rest are further pages). A
request may plan an epoch from the oldest kept to one past the latest, so epochs are planned in
order; going back further, or jumping ahead, is a restore (`restore_progress`), which replaces
the later plans.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final

import numpy as np
from strata.errors import (
    ConflictError,
    EpochOutOfRange,
    NotFound,
    QuotaExceeded,
    StaleLease,
    StrataError,
    ValidationError,
)
from strata.events import (
    DatasetRegistered,
    Event,
    ShardOffset,
    ShardPlanChanged,
    ShardProgress,
    ShardProgressRestored,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
)
from strata.events.ids import event_id
from strata.events.models import MAX_SHARDS
from strata.events.requests import (
    SHARDS_PER_REPLY,
    DatasetInfo,
    GetShardsRequest,
    Lease,
    PlanSummary,
    ProgressResult,
    RegisterDatasetRequest,
    ReportProgressRequest,
    RestoreProgressRequest,
    ShardAssignment,
    ShardSpan,
)
from strata.services.domain import Decision
from strata.services.leases import Leases
from strata.sharding import DatasetSpec, Plan, initial_plan, replan

SOURCE = "sharding"

EPOCHS_KEPT: Final = 4
"""Plans kept per dataset: the newest epoch's and the three before it (ranks finishing an epoch
while others start the next, a late progress report, a look at the previous epoch)."""
VERSIONS_REMEMBERED: Final = 64
"""Epochs on either side of the newest plan whose dropped plan's version is remembered, so a plan
made again goes on with newer versions (and new event ids); further ones are forgotten."""
MAX_DATASETS: Final = 256
"""Datasets one job may register, by default (`STRATA_MAX_DATASETS_PER_JOB`)."""


@dataclass(frozen=True)
class ShardingLimits:
    """What one job may make the service hold (the `STRATA_MAX_*` settings)."""

    max_datasets: int = MAX_DATASETS
    max_shards: int = MAX_SHARDS


DEFAULT_LIMITS: Final = ShardingLimits()


@dataclass
class EpochPlan:
    plan: Plan
    offsets: dict[int, int] = field(default_factory=dict)
    """Samples consumed of shards not yet done."""
    restored: frozenset[int] = frozenset()
    """Shards done by the last restore (a checkpoint's cursors), not by a reader of this plan:
    any rank may name them again (a sampler resuming from its cursor), whoever owns them now."""

    def fork(self) -> EpochPlan:
        """A copy that `evolve` may change without changing this one. Only progress (`done`,
        `offsets`) and the version change in place; a re-plan makes new owner arrays."""
        return EpochPlan(
            replace(self.plan, done=self.plan.done.copy()), dict(self.offsets), self.restored
        )


@dataclass
class JobSharding:
    job: str
    membership_epoch: int = 0
    live: set[str] = field(default_factory=set)
    datasets: dict[str, DatasetSpec] = field(default_factory=dict)
    plans: dict[tuple[str, int], EpochPlan] = field(default_factory=dict)
    restored: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Dataset id -> (epoch, checkpoint step) of the last restore."""
    retired: dict[tuple[str, int], int] = field(default_factory=dict)
    """(dataset id, epoch) -> the version of its plan that a restore dropped. The epoch's next plan
    goes on from there: versions only grow, so a worker that saw the dropped plan takes the new
    one for what it is, a newer plan (and its id is new to the stream)."""
    restores: dict[str, int] = field(default_factory=dict)
    """Dataset id -> how many restores it has had: part of a restore's event id, so a second
    restore to the same checkpoint (a failure before the next one committed) is not dropped as
    a duplicate of the first."""
    leases: Leases = field(default_factory=Leases)
    """Each live worker's registration (lease): requests carrying an ended one are refused."""
    uncounted: dict[str, None] = field(default_factory=dict)
    """Ids of the latest progress events stored after their reporter's lease ended, so counted
    nothing (`evolve`): the answer to their report says so (`progress_answer`). Oldest dropped
    past `UNCOUNTED_KEPT`; not in snapshots (an answer is given once, right after the fold)."""

    def fork(self, dataset_ids: set[str]) -> JobSharding:
        """A copy that `evolve` may change without changing this one, for events of the datasets
        `dataset_ids` (and membership): the plans of other datasets are shared, not copied."""
        return JobSharding(
            job=self.job,
            membership_epoch=self.membership_epoch,
            live=set(self.live),
            datasets=dict(self.datasets),
            plans={
                key: plan.fork() if key[0] in dataset_ids else plan
                for key, plan in self.plans.items()
            },
            restored=dict(self.restored),
            retired=dict(self.retired),
            restores=dict(self.restores),
            leases=self.leases.copy(),
            uncounted=dict(self.uncounted),
        )

    def latest_epoch(self, dataset_id: str) -> int | None:
        epochs = [epoch for (ds, epoch) in self.plans if ds == dataset_id]
        return max(epochs) if epochs else None

    def epoch_window(self, dataset_id: str) -> tuple[int, int] | None:
        """The epochs a request may plan or read (both ends included); None before the first
        plan, when any epoch may be the first."""
        latest = self.latest_epoch(dataset_id)
        if latest is None:
            return None
        return max(0, latest - EPOCHS_KEPT + 1), latest + 1

    def drop_plans_before(self, dataset_id: str, epoch: int) -> None:
        """Keep the plans of `EPOCHS_KEPT` epochs up to `epoch`, newly planned; remember the
        versions of those dropped, and forget versions of epochs far from it."""
        for key in [k for k in self.plans if k[0] == dataset_id and k[1] <= epoch - EPOCHS_KEPT]:
            self.retired[key] = self.plans.pop(key).plan.version
        for key in [
            k
            for k in self.retired
            if k[0] == dataset_id and abs(k[1] - epoch) > VERSIONS_REMEMBERED
        ]:
            del self.retired[key]


@dataclass
class ShardingState:
    jobs: dict[str, JobSharding] = field(default_factory=dict)
    last_seq: int = 0

    def job(self, job: str) -> JobSharding:
        found = self.jobs.get(job)
        if found is None:
            found = self.jobs[job] = JobSharding(job)
        return found


def _spec(event: DatasetRegistered | RegisterDatasetRequest) -> DatasetSpec:
    return DatasetSpec(
        event.dataset_id, event.total_samples, event.shard_size, event.shuffle, event.seed
    )


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


# -- decisions ------------------------------------------------------------------------------------


def register_dataset(
    state: ShardingState,
    request: RegisterDatasetRequest,
    now_ns: int,
    limits: ShardingLimits = DEFAULT_LIMITS,
) -> Decision[None]:
    wanted = _spec(request)
    datasets = state.jobs.get(request.job, JobSharding(request.job)).datasets
    existing = datasets.get(request.dataset_id)
    if existing is None and len(datasets) >= limits.max_datasets:
        return Decision(
            error=QuotaExceeded(
                f"job {request.job!r} has registered {len(datasets)} datasets, the most one job "
                "may; reuse one of them (the same id and parameters), or raise "
                "STRATA_MAX_DATASETS_PER_JOB on the sharding service"
            )
        )
    if existing is None and wanted.num_shards > limits.max_shards:
        return Decision(
            error=QuotaExceeded(
                f"dataset {request.dataset_id!r} of job {request.job!r} would have "
                f"{wanted.num_shards} shards ({request.total_samples} samples of "
                f"{request.shard_size}); one dataset may have at most {limits.max_shards}: use "
                "larger shards, or raise STRATA_MAX_SHARDS_PER_DATASET on the sharding service"
            )
        )
    if existing is not None:
        if existing == wanted:
            return Decision()
        return Decision(
            error=ConflictError(
                f"dataset {request.dataset_id!r} of job {request.job!r} is already registered "
                f"with total_samples={existing.total_samples}, shard_size={existing.shard_size}, "
                f"shuffle={existing.shuffle}, seed={existing.seed}; register it under another "
                "id to change its sharding"
            )
        )
    try:
        event = DatasetRegistered(
            id=event_id("dataset", request.job, request.dataset_id),
            job=request.job,
            source=SOURCE,
            ts=now_ns,
            dataset_id=request.dataset_id,
            total_samples=request.total_samples,
            shard_size=request.shard_size,
            shuffle=request.shuffle,
            seed=request.seed,
        )
    except ValueError as exc:  # the shard-count bound lives on the event
        return Decision(error=ValidationError(str(exc).splitlines()[-1], field="shard_size"))
    return Decision([event])


def dataset_info(state: ShardingState, job: str, dataset_id: str, created: bool) -> DatasetInfo:
    spec = state.job(job).datasets[dataset_id]
    return DatasetInfo(
        job=job,
        dataset_id=dataset_id,
        total_samples=spec.total_samples,
        shard_size=spec.shard_size,
        shuffle=spec.shuffle,
        seed=spec.seed,
        num_shards=spec.num_shards,
        created=created,
    )


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


# -- batches (group commit) -----------------------------------------------------------------------

Command = RegisterDatasetRequest | GetShardsRequest | ReportProgressRequest | RestoreProgressRequest
"""The requests this service decides: each names its job and dataset."""


def decide(
    state: ShardingState,
    command: Command,
    now_ns: int,
    limits: ShardingLimits = DEFAULT_LIMITS,
) -> Decision[None]:
    """The events of one request, or its error."""
    if isinstance(command, RegisterDatasetRequest):
        return register_dataset(state, command, now_ns, limits)
    if isinstance(command, GetShardsRequest):
        return get_shards(state, command, now_ns)
    if isinstance(command, ReportProgressRequest):
        return report_progress(state, command, now_ns)
    return restore_progress(state, command, now_ns)


def decide_all(
    state: ShardingState,
    commands: Sequence[Command],
    now_ns: int,
    limits: ShardingLimits = DEFAULT_LIMITS,
) -> list[Decision[None]]:
    """Decide `commands` in order, each against the state the previous ones' events make: one
    batch of a group commit. `state` itself is left as it is (it changes only by folding what the
    stream stored): the batch works on forks of the jobs it touches, in which only the plans of
    the datasets it names are copied (a job's other datasets' plans are shared, unchanged)."""
    touched: dict[str, set[str]] = {}
    for command in commands:
        touched.setdefault(command.job, set()).add(command.dataset_id)
    scratch = ShardingState(dict(state.jobs), state.last_seq)
    for name, dataset_ids in touched.items():
        if name in scratch.jobs:
            scratch.jobs[name] = scratch.jobs[name].fork(dataset_ids)
    decisions: list[Decision[None]] = []
    for command in commands:
        decision = decide(scratch, command, now_ns, limits)
        for event in decision.events:
            evolve(scratch, event)
        decisions.append(decision)
    return decisions


def current_lease(state: ShardingState, job_id: str, worker_id: str) -> Lease | None:
    """The lease of `worker_id`'s live registration, as this service knows it."""
    job = state.jobs.get(job_id)
    held = job.leases.current.get(worker_id) if job is not None else None
    if held is None:
        return None
    return Lease(worker_id=worker_id, instance=held[0], epoch=held[1])


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


# -- snapshots ------------------------------------------------------------------------------------

SNAPSHOT_VERSION = 5
"""2: restore counts and retired plan versions. 3: only the plans of each dataset's newest epochs
(`domain.EPOCHS_KEPT`), with the versions of those dropped. 4: each plan's reading order, which a
re-plan changes (moved shards go last), so it no longer follows from (seed, epoch). 5: each live
worker's lease, and how the last lease of each other one ended. An older
snapshot is ignored: the stream is replayed instead, which rebuilds all of it as evolve does."""


def snapshot(state: ShardingState) -> dict[str, Any]:
    """Plans are history-dependent, so their owner and reading-order arrays are stored, not
    recomputed."""
    jobs = []
    for job in state.jobs.values():
        jobs.append(
            {
                "job": job.job,
                "membership_epoch": job.membership_epoch,
                "live": sorted(job.live),
                "leases": [[w, i, e] for w, (i, e) in sorted(job.leases.current.items())],
                "ended": [[w, how] for w, how in sorted(job.leases.ended.items())],
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
                        "position": ep.plan.position.astype(np.int32).tobytes(),
                        "done": np.packbits(ep.plan.done).tobytes(),
                        "offsets": [[s, o] for s, o in ep.offsets.items()],
                        "restored": sorted(ep.restored),
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
        job.leases = Leases(
            {w: (i, int(e)) for w, i, e in raw["leases"]}, {w: how for w, how in raw["ended"]}
        )
        job.restored = {ds: (e, step) for ds, e, step in raw.get("restored", [])}
        job.restores = {ds: int(count) for ds, count in raw.get("restores", [])}
        job.retired = {(ds, e): int(version) for ds, e, version in raw.get("retired", [])}
        for ds, total, size, shuffle, seed in raw["datasets"]:
            job.datasets[ds] = DatasetSpec(ds, total, size, shuffle, seed)
        for p in raw["plans"]:
            spec = job.datasets[p["dataset_id"]]
            owner = np.frombuffer(p["owner"], dtype=np.int32).astype(np.int64)
            position = np.frombuffer(p["position"], dtype=np.int32).astype(np.int64)
            done = np.unpackbits(np.frombuffer(p["done"], dtype=np.uint8))[: owner.size]
            plan = Plan(spec, p["epoch"], list(p["members"]), owner, position, p["version"])
            plan.done = done.astype(np.bool_)
            job.plans[(p["dataset_id"], p["epoch"])] = EpochPlan(
                plan,
                {int(s): int(o) for s, o in p["offsets"]},
                frozenset(int(s) for s in p["restored"]),
            )
    return state
