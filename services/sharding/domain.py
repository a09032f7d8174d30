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

This module is the domain's face, which the adapter, the read model and the tests import: the
batches of a group commit (`decide_all`) are here; the rest lives by concern beside it and is
re-exported: the state and its bounds (`state`), the fold (`fold`), dataset registration
(`datasets`), plans and what a request reads from them (`plans`), progress and restores
(`progress`), and snapshots (`snapshots`).
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.events.requests import (
    GetShardsRequest,
    Lease,
    RegisterDatasetRequest,
    ReportProgressRequest,
    RestoreProgressRequest,
)
from strata.services.domain import Decision
from strata.services.sharding.datasets import dataset_info, register_dataset
from strata.services.sharding.fold import FOLDS, REQUESTED, UNCOUNTED_KEPT, evolve
from strata.services.sharding.plans import (
    assignment,
    get_shards,
    plan_of,
    plan_summary,
    replan_after_membership_change,
)
from strata.services.sharding.progress import (
    progress_answer,
    progress_result,
    report_progress,
    restore_progress,
)
from strata.services.sharding.snapshots import SNAPSHOT_VERSION, restore, snapshot
from strata.services.sharding.state import (
    DEFAULT_LIMITS,
    EPOCHS_KEPT,
    MAX_DATASETS,
    SOURCE,
    VERSIONS_REMEMBERED,
    EpochPlan,
    JobSharding,
    ShardingLimits,
    ShardingState,
)

__all__ = [
    "DEFAULT_LIMITS",
    "EPOCHS_KEPT",
    "FOLDS",
    "MAX_DATASETS",
    "REQUESTED",
    "SNAPSHOT_VERSION",
    "SOURCE",
    "UNCOUNTED_KEPT",
    "VERSIONS_REMEMBERED",
    "Command",
    "EpochPlan",
    "JobSharding",
    "ShardingLimits",
    "ShardingState",
    "assignment",
    "current_lease",
    "dataset_info",
    "decide",
    "decide_all",
    "evolve",
    "get_shards",
    "plan_of",
    "plan_summary",
    "progress_answer",
    "progress_result",
    "register_dataset",
    "replan_after_membership_change",
    "report_progress",
    "restore",
    "restore_progress",
    "snapshot",
]


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
