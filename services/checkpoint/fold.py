"""`evolve`: the checkpoint domain's fold of the events it reads (its own and the registry's),
and the rule an ack must meet to count (`ack_problem`), which the fold and the ack decision share.
"""

from __future__ import annotations

from typing import Final

from strata.clock import TimeBase
from strata.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointShardStarted,
    CheckpointStarted,
    Event,
    LiveQuorumFormed,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
)
from strata.services.checkpoint.manifest import manifest
from strata.services.checkpoint.state import (
    CheckpointState,
    CommittedCheckpoint,
    Intent,
    OpenCheckpoint,
)
from strata.storage.base import shard_key

# -- evolve ---------------------------------------------------------------------------------------


FOLDS: Final[tuple[type[Event], ...]] = (
    WorkerRegistered,
    WorkerFailed,
    WorkerLeft,
    CheckpointStarted,
    CheckpointShardStarted,
    CheckpointShardSaved,
    CheckpointCommitted,
    CheckpointAborted,
    CheckpointPruned,
    LiveQuorumFormed,
)
"""The event types `evolve` folds; it ignores every other. The read model routes by this."""
REQUESTED: Final[tuple[type[Event], ...]] = (CheckpointShardSaved,)
"""Of those, the ones this service records in answer to a worker's request (the dashboard's
requests/s)."""


def evolve(state: CheckpointState, event: Event) -> CheckpointState:
    if isinstance(event, WorkerRegistered):
        job = state.job(event.job)
        job.live[event.worker_id] = event.rank
        job.instances[event.worker_id] = event.instance
        job.leases.fold(event)
        job.membership_epoch = max(job.membership_epoch, event.membership_epoch)
    elif isinstance(event, WorkerFailed | WorkerLeft):
        job = state.job(event.job)
        job.live.pop(event.worker_id, None)
        job.instances.pop(event.worker_id, None)
        job.leases.fold(event)
        job.membership_epoch = max(job.membership_epoch, event.membership_epoch)
    elif isinstance(event, LiveQuorumFormed):
        job = state.job(event.job)
        if job.quorum is None or event.membership_epoch >= job.quorum[0]:
            job.quorum = (event.membership_epoch, tuple(event.members))
    elif isinstance(event, CheckpointStarted):
        job = state.job(event.job)
        if job.root_uri is None:
            job.root_uri, job.keep_count = event.root_uri, event.keep_count
        if event.step not in job.open and event.step not in job.committed:
            job.open[event.step] = _opened(event, state.clock)
            job.aborted.pop(event.step, None)
            job.pruned.discard(event.step)
    elif isinstance(event, CheckpointShardStarted):
        opened = state.job(event.job).open.get(event.step)
        if opened is not None and opened.participants.get(event.worker_id) == event.rank:
            opened.intents.setdefault(
                event.rank, Intent(event.worker_id, event.instance, event.save_id)
            )
    elif isinstance(event, CheckpointShardSaved):
        opened = state.job(event.job).open.get(event.step)
        if opened is not None and ack_problem(opened, event) is None:
            opened.acks.setdefault(event.rank, event)
    elif isinstance(event, CheckpointCommitted):
        job = state.job(event.job)
        opened = job.open.pop(event.step, None)
        if opened is not None:
            job.committed[event.step] = CommittedCheckpoint(
                step=event.step,
                epoch=event.epoch,
                root_uri=opened.root_uri,
                manifest_uri=event.manifest_uri,
                total_bytes=event.total_bytes,
                committed_ns=event.ts,
                keep_count=opened.keep_count,
                participants=dict(opened.participants),
                manifest=manifest(opened, event.job, event.ts),
                attempt=opened.attempt,
            )
    elif isinstance(event, CheckpointAborted):
        job = state.job(event.job)
        dropped = job.open.pop(event.step, None)
        if dropped is not None:
            job.aborted[event.step] = (dropped, event.reason)
    elif isinstance(event, CheckpointPruned):
        job = state.job(event.job)
        job.committed.pop(event.step, None)
        job.pruned.add(event.step)
    return state


def _opened(event: CheckpointStarted, clock: TimeBase | None = None) -> OpenCheckpoint:
    timeout_ns = int(event.timeout_s * 1e9)
    deadline = event.ts + timeout_ns
    return OpenCheckpoint(
        step=event.step,
        epoch=event.epoch,
        root_uri=event.root_uri,
        keep_count=event.keep_count,
        started_ns=event.ts,
        deadline_ns=deadline if clock is None else clock.deadline(deadline, timeout_ns),
        timeout_s=event.timeout_s,
        participants={p.worker_id: p.rank for p in event.participants},
        world_size=event.world_size,
        membership_epoch=event.membership_epoch,
        attempt=event.attempt,
    )


def ack_problem(opened: OpenCheckpoint, ack: CheckpointShardSaved) -> str | None:
    """Why an ack cannot count, or None."""
    rank = opened.participants.get(ack.worker_id)
    if rank is None:
        return f"{ack.worker_id!r} is not a participant of step {ack.step}"
    if rank != ack.rank:
        return f"{ack.worker_id!r} has rank {rank} in step {ack.step}, not {ack.rank}"
    if ack.epoch != opened.epoch:
        return f"step {ack.step} is of epoch {opened.epoch}, not {ack.epoch}"
    expected_key = shard_key(ack.job, ack.step, ack.rank, opened.attempt)
    if ack.key != expected_key or ack.uri != f"{opened.root_uri.rstrip('/')}/{expected_key}":
        return (
            f"the shard of rank {ack.rank} must be stored as {expected_key} under "
            f"{opened.root_uri}, not at {ack.uri}"
        )
    first = opened.acks.get(ack.rank)
    if first is not None and (first.checksum, first.bytes) != (ack.checksum, ack.bytes):
        return (
            f"rank {ack.rank} of step {ack.step} was already acked with {first.checksum} "
            f"({first.bytes} bytes); a second ack ({ack.checksum}, {ack.bytes} bytes) never "
            "replaces it"
        )
    return None
