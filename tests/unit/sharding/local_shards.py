"""`LocalShards`: the sharding service's pure domain answering `ShardSampler`'s calls in memory,
so the sampler's logic is tested without NATS.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping

from strata.events import DatasetRegistered, WorkerFailed, WorkerRegistered
from strata.events.models import Event
from strata.events.requests import (
    GetShardsRequest,
    Lease,
    PlanSummary,
    ProgressResult,
    ReportProgressRequest,
    ShardAssignment,
    ShardOffset,
)
from strata.services.sharding import domain

JOB = "job-1"
DS = "ds"


class LocalShards:
    """The sharding domain in memory, with a sampler-facing view per worker."""

    def __init__(self, total: int, shard_size: int, members: Iterable[str], shuffle: bool = True):
        self.state = domain.ShardingState()
        self.now = 1_000_000_000
        self.membership = 0
        self.reports: list[tuple[str, list[int], list[tuple[int, int]]]] = []
        self.leases: dict[str, Lease] = {}
        self.apply(
            DatasetRegistered(
                job=JOB,
                source="test",
                dataset_id=DS,
                total_samples=total,
                shard_size=shard_size,
                shuffle=shuffle,
                seed=7,
            )
        )
        for worker in members:
            self.join(worker)

    def apply(self, *events: Event) -> None:
        for event in events:
            self.state = domain.evolve(self.state, event)

    def _membership_changed(self) -> None:
        self.apply(*domain.replan_after_membership_change(self.state, JOB, self.now))

    def join(self, worker: str, instance: str | None = None) -> None:
        self.membership += 1
        instance = instance or worker
        self.leases[worker] = Lease(worker_id=worker, instance=instance, epoch=self.membership)
        self.apply(
            WorkerRegistered(
                job=JOB,
                source="registry",
                worker_id=worker,
                instance=instance,
                rank=0,
                world_size=1,
                membership_epoch=self.membership,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
        )
        self._membership_changed()

    def fail(self, worker: str) -> None:
        self.membership += 1
        self.apply(
            WorkerFailed(
                job=JOB,
                source="registry",
                worker_id=worker,
                rank=0,
                reason="test",
                last_heartbeat_ts=0,
                membership_epoch=self.membership,
            )
        )
        self._membership_changed()

    def view(self, worker: str, *, hears_plan_changes: bool = True) -> WorkerView:
        return WorkerView(self, worker, hears_plan_changes)

    def plan_summary(self, epoch: int = 0) -> PlanSummary:
        return domain.plan_summary(self.state, JOB, DS, epoch)

    def samples_of(self, shards: Iterable[int]) -> list[int]:
        spec = self.state.jobs[JOB].datasets[DS]
        return [i for s in shards for i in range(*spec.shard_range(s)[1:])]


class WorkerView:
    """What `strata.DatasetRegistry` offers the sampler, for one worker of `LocalShards`."""

    def __init__(self, shards: LocalShards, worker: str, hears_plan_changes: bool) -> None:
        self.shards = shards
        self.worker = worker
        self.hears_plan_changes = hears_plan_changes
        self.calls: Counter[str] = Counter()
        self.lease_expired = False
        self.lease_in_doubt = False
        self.superseded = False

    @property
    def worker_id(self) -> str:
        return self.worker

    @property
    def lease(self) -> Lease:
        return self.shards.leases[self.worker]

    def assignment(
        self,
        dataset_id: str,
        worker_id: str | None = None,
        epoch: int = 0,
        *,
        lease: Lease | None = None,
    ) -> ShardAssignment:
        self.calls["assignment"] += 1
        request = GetShardsRequest(
            job=JOB,
            dataset_id=dataset_id,
            worker_id=worker_id or self.worker,
            epoch=epoch,
            lease=lease or self.lease,
        )
        decision = domain.get_shards(self.shards.state, request, self.shards.now)
        if decision.error is not None:
            raise decision.error
        if request.lease == self.lease and self.lease_in_doubt:
            # As `strata.DatasetRegistry`: the service accepted the lease, which holds again.
            self.lease_in_doubt = self.lease_expired = False
        self.shards.apply(*decision.events)
        return domain.assignment(self.shards.state, request)

    def report_progress(
        self,
        dataset_id: str,
        epoch: int,
        completed: Iterable[int] = (),
        partial: Mapping[int, int] | None = None,
        *,
        lease: Lease | None = None,
    ) -> ProgressResult:
        self.calls["report"] += 1
        request = ReportProgressRequest(
            job=JOB,
            dataset_id=dataset_id,
            epoch=epoch,
            worker_id=self.worker,
            completed=list(completed),
            partial=[ShardOffset(shard_id=s, offset=o) for s, o in (partial or {}).items()],
            lease=lease or self.lease,
        )
        decision = domain.report_progress(self.shards.state, request, self.shards.now)
        if decision.error is not None:
            raise decision.error
        self.shards.apply(*decision.events)
        self.shards.reports.append(
            (
                self.worker,
                list(request.completed),
                [(p.shard_id, p.offset) for p in request.partial],
            )
        )
        return domain.progress_result(self.shards.state, request)

    def plan(self, dataset_id: str, epoch: int = 0) -> PlanSummary:
        return domain.plan_summary(self.shards.state, JOB, dataset_id, epoch)

    def plan_version_seen(self, dataset_id: str, epoch: int) -> int | None:
        if not self.hears_plan_changes:
            return None
        epoch_plan = self.shards.state.jobs[JOB].plans.get((dataset_id, epoch))
        return None if epoch_plan is None else epoch_plan.plan.version


def done_by(shards: LocalShards, worker: str) -> list[int]:
    return [s for w, completed, _ in shards.reports if w == worker for s in completed]
