"""The checkpoint domain's shared cases: a job, its workers' registrations and failures,
requests, and the fold of events into a state.
"""

from __future__ import annotations

from strata.events import (
    Event,
    WorkerFailed,
    WorkerRegistered,
)
from strata.events.requests import BeginCheckpointRequest
from strata.services.checkpoint import domain
from strata.services.checkpoint.domain import CheckpointState

JOB = "job-c"
ROOT = "/tmp/ckpt"
SECOND = 1_000_000_000


def fold(state: CheckpointState, events: list[Event]) -> None:
    for event in events:
        domain.evolve(state, event)


def registered(
    rank: int, epoch: int, worker: str | None = None, instance: str | None = None
) -> WorkerRegistered:
    return WorkerRegistered(
        job=JOB,
        source="registry",
        worker_id=worker or f"w{rank}",
        instance=instance or f"proc-w{rank}",
        rank=rank,
        world_size=rank + 1,
        membership_epoch=epoch,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )


def failed(rank: int, epoch: int) -> WorkerFailed:
    return WorkerFailed(
        job=JOB,
        source="registry",
        worker_id=f"w{rank}",
        rank=rank,
        reason="gone",
        last_heartbeat_ts=0,
        membership_epoch=epoch,
    )


def with_workers(n: int) -> CheckpointState:
    """`n` live workers, w<i> holding rank i; the membership epoch is `n`."""
    state = CheckpointState()
    fold(state, [registered(i, i + 1) for i in range(n)])
    return state


def request(
    step: int,
    worker: str = "w0",
    *,
    world: tuple[int, int] | None = None,
    keep: int = 2,
    save_id: str | None = None,
    instance: str | None = None,
    epoch: int = 0,
) -> BeginCheckpointRequest:
    """A begin; `world` is the worker's view (world size, membership epoch)."""
    return BeginCheckpointRequest(
        job=JOB,
        worker_id=worker,
        step=step,
        epoch=epoch,
        root_uri=ROOT,
        keep_count=keep,
        world_size=None if world is None else world[0],
        membership_epoch=0 if world is None else world[1],
        instance=instance or f"proc-{worker}",
        save_id=save_id or f"save-{worker}-{step}",
    )
