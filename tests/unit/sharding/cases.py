"""The sharding domain's shared cases: a started job over one dataset, its plan, leases, reports
and the registry's events.
"""

from __future__ import annotations

from strata.events import (
    DatasetRegistered,
    Event,
    WorkerFailed,
    WorkerRegistered,
)
from strata.events.requests import (
    GetShardsRequest,
    Lease,
    ReportProgressRequest,
    ShardOffset,
)
from strata.services.domain import Decision
from strata.services.sharding import domain
from strata.services.sharding.domain import ShardingState

JOB = "job-a"
DATASET = "ds"
WORKERS = ("w0", "w1")
NOW = 1_000_000_000_000


def apply(state: ShardingState, decision: Decision) -> list[Event]:
    assert decision.error is None, decision.error
    for event in decision.events:
        domain.evolve(state, event)
    return decision.events


def started_job() -> ShardingState:
    """Two workers, a dataset of 8 shards, epoch 0 planned."""
    state = ShardingState()
    for rank, worker in enumerate(WORKERS):
        domain.evolve(
            state,
            WorkerRegistered(
                job=JOB,
                source="registry",
                worker_id=worker,
                instance=f"p-{worker}",
                rank=rank,
                world_size=rank + 1,
                membership_epoch=rank + 1,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            ),
        )
    domain.evolve(
        state,
        DatasetRegistered(
            job=JOB,
            source="sharding",
            dataset_id=DATASET,
            total_samples=80,
            shard_size=10,
            shuffle=True,
            seed=1,
        ),
    )
    plan(state, epoch=0)
    return state


def plan(state: ShardingState, epoch: int) -> list[Event]:
    request = GetShardsRequest(
        job=JOB,
        dataset_id=DATASET,
        worker_id="w0",
        epoch=epoch,
        lease=domain.current_lease(state, JOB, "w0"),
    )
    return apply(state, domain.get_shards(state, request, NOW))


EPOCH_OF = {"w0": 1, "w1": 2}


def lease(worker: str, instance: str | None = None, epoch: int | None = None) -> Lease:
    return Lease(
        worker_id=worker,
        instance=instance or f"p-{worker}",
        epoch=EPOCH_OF[worker] if epoch is None else epoch,
    )


def registered(worker: str, instance: str, epoch: int) -> WorkerRegistered:
    return WorkerRegistered(
        job=JOB,
        source="registry",
        worker_id=worker,
        instance=instance,
        rank=0,
        world_size=1,
        membership_epoch=epoch,
        heartbeat_interval=1.0,
        heartbeat_timeout=3.0,
    )


def failed(worker: str, epoch: int) -> WorkerFailed:
    return WorkerFailed(
        job=JOB,
        source="registry",
        worker_id=worker,
        rank=0,
        reason="no heartbeat for 3.0s",
        last_heartbeat_ts=0,
        membership_epoch=epoch,
    )


def report(
    worker: str,
    held: Lease | None,
    completed: list[int] | None = None,
    partial: dict[int, int] | None = None,
) -> ReportProgressRequest:
    return ReportProgressRequest(
        job=JOB,
        dataset_id=DATASET,
        epoch=0,
        worker_id=worker,
        completed=completed or [],
        partial=[ShardOffset(shard_id=s, offset=o) for s, o in (partial or {}).items()],
        lease=held,
    )


def shards_of(state: ShardingState, worker: str) -> list[int]:
    return state.jobs[JOB].plans[(DATASET, 0)].plan.shards_of(worker)
