"""The sharding domain's state: each job's live members and their leases, its datasets, the plans
of their newest epochs with their progress, and what restores left behind; with the bounds on
what one job may make the service keep.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Final

from strata.events import DatasetRegistered
from strata.events.models import MAX_SHARDS
from strata.events.requests import RegisterDatasetRequest
from strata.services.leases import Leases
from strata.sharding import DatasetSpec, Plan

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
