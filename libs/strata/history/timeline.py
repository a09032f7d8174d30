"""The timeline of a history: one line a person reads per event (`strata replay`, the event log)."""

from __future__ import annotations

from typing import Final

from strata.events import (
    BarrierArrived,
    BarrierBrokenEvent,
    BarrierOpened,
    BarrierReleased,
    BarrierTimedOut,
    BarrierWithdrawn,
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointShardStarted,
    CheckpointStarted,
    DatasetRegistered,
    Event,
    LiveHealed,
    LiveQuorumFormed,
    LiveStepDiscarded,
    MetricSampled,
    RequestRejected,
    ShardPlanChanged,
    ShardProgress,
    ShardProgressRestored,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
    WorkerStateChanged,
)

NAMED: Final = 8
"""Workers a line names before it counts the rest."""


def _names(workers: list[str]) -> str:
    shown = ", ".join(workers[:NAMED])
    return shown if len(workers) <= NAMED else f"{shown} and {len(workers) - NAMED} more"


def _live_line(event: LiveQuorumFormed | LiveHealed | LiveStepDiscarded) -> str:
    """A live group's change: who left or joined a quorum, who healed whom from which step, which
    step was dropped."""
    group = f"group of membership {event.membership_epoch}"
    if isinstance(event, LiveQuorumFormed):
        line = f"live {group} formed: {event.world_size} ({_names(event.members)})"
        if event.previous_epoch is None:
            return line
        before = event.world_size - len(event.joined) + len(event.left)
        changes = [f"{_names(event.left)} left"] if event.left else []
        if event.joined:
            changes.append(f"{_names(event.joined)} joined")
        changed = "; ".join(changes) or "the same members"
        return f"{line}, was {before} at membership {event.previous_epoch}: {changed}"
    if isinstance(event, LiveHealed):
        return (
            f"{event.worker_id} healed from {event.source_worker} in the live {group}: "
            f"step {event.from_step} -> {event.to_step}"
        )
    why = f" ({event.reason[:160]})" if event.reason else ""
    return (
        f"{event.worker_id} discarded step {event.step} in the live {group}{why}: no rank "
        f"committed it; the group trains it again after step {event.step - 1}"
    )


def _mb(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 100_000 else f"{count} B"


def summarize(event: Event) -> str:
    """One line a person reads in a timeline: who did what, with the figures that matter."""
    if isinstance(event, WorkerHeartbeat):
        return f"{event.worker_id} heartbeat #{event.seq}: {event.state}, step {event.step}"
    if isinstance(event, WorkerRegistered):
        host = f" on {event.hostname}" if event.hostname else ""
        return (
            f"{event.worker_id} registered as rank {event.rank} of {event.world_size}{host} "
            f"(membership {event.membership_epoch})"
        )
    if isinstance(event, WorkerStateChanged):
        was = f"{event.previous} -> " if event.previous else ""
        return f"{event.worker_id} {was}{event.state} (step {event.step}, epoch {event.epoch})"
    if isinstance(event, WorkerFailed):
        return f"{event.worker_id} (rank {event.rank}) failed: {event.reason}"
    if isinstance(event, WorkerLeft):
        return f"{event.worker_id} (rank {event.rank}) left"
    if isinstance(event, DatasetRegistered):
        return (
            f"dataset {event.dataset_id}: {event.total_samples} samples in {event.num_shards} "
            f"shards of {event.shard_size}" + (", shuffled" if event.shuffle else "")
        )
    if isinstance(event, ShardPlanChanged):
        return (
            f"{event.dataset_id} epoch {event.epoch}: plan v{event.plan_version} over "
            f"{len(event.members)} workers, {event.moved_shards} shards moved ({event.reason})"
        )
    if isinstance(event, ShardProgressRestored):
        return (
            f"{event.dataset_id} epoch {event.epoch}: progress restored from the checkpoint of "
            f"step {event.checkpoint_step} ({len(event.completed)} shards done, "
            f"{len(event.partial)} in progress)"
        )
    if isinstance(event, ShardProgress):
        partial = f", {len(event.partial)} in progress" if event.partial else ""
        return (
            f"{event.worker_id} finished {len(event.completed)} shards of {event.dataset_id} "
            f"epoch {event.epoch}{partial}"
        )
    if isinstance(event, BarrierOpened):
        return (
            f"barrier {event.name}#{event.generation} opened, expecting {event.expected_count} "
            f"within {event.timeout_s:g}s"
        )
    if isinstance(event, BarrierArrived):
        return f"{event.worker_id} arrived at {event.name}#{event.generation} ({event.arrived})"
    if isinstance(event, LiveQuorumFormed | LiveHealed | LiveStepDiscarded):
        return _live_line(event)
    if isinstance(event, BarrierWithdrawn):
        return (
            f"{event.worker_id} gave up waiting at {event.name}#{event.generation} and withdrew "
            f"its arrival {event.arrival}"
        )
    if isinstance(event, BarrierReleased):
        return (
            f"barrier {event.name}#{event.generation} released: {event.participants} "
            f"participants, {event.last_arrival_to_release_ms:.1f} ms after the last arrival"
        )
    if isinstance(event, BarrierBrokenEvent):
        return f"barrier {event.name}#{event.generation} broken: {event.reason}"
    if isinstance(event, BarrierTimedOut):
        return (
            f"barrier {event.name}#{event.generation} timed out after {event.timeout_s:g}s "
            f"with {event.arrived} arrived, {len(event.missing)} missing"
        )
    if isinstance(event, CheckpointStarted):
        world = "" if event.world_size is None else f" for a world of {event.world_size}"
        return (
            f"checkpoint of step {event.step} (epoch {event.epoch}) started{world} with "
            f"{len(event.participants)} participants"
        )
    if isinstance(event, CheckpointShardStarted):
        return f"rank {event.rank} ({event.worker_id}) began its shard of step {event.step}"
    if isinstance(event, CheckpointShardSaved):
        return (
            f"rank {event.rank} ({event.worker_id}) saved {_mb(event.bytes)} for step {event.step}"
        )
    if isinstance(event, CheckpointCommitted):
        return (
            f"checkpoint of step {event.step} committed: {_mb(event.total_bytes)} in "
            f"{event.shards} shards, {event.duration_ms:.0f} ms"
        )
    if isinstance(event, CheckpointAborted):
        return f"checkpoint of step {event.step} aborted: {event.reason}"
    if isinstance(event, CheckpointPruned):
        return f"checkpoint of step {event.step} pruned"
    if isinstance(event, RequestRejected):
        return f"{event.service} refused {event.subject}: {event.code}: {event.message}"
    if isinstance(event, MetricSampled):
        return f"{event.name} = {event.value:g}"
    return event.type
