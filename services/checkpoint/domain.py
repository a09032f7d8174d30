"""The checkpoint service's pure core: worlds, intents, acks, commit, abort, retention.

A step opens for a world: ranks 0..world_size-1 as the first saving worker sees the membership,
each mapped to the live worker holding it; a rank of that world with no live worker aborts the
step at once, since it could never complete. Before writing, each rank's writer declares itself
(`checkpoint.shard_started`), so a second writer of the same rank is refused instead of
overwriting a shard. Phase one: each participant writes its shard and acknowledges it (the `ack`
request); the service records `checkpoint.shard_saved` with the key it derives itself. Phase two:
once every rank of the world has acked and the shards are verified in storage, the service writes
the manifest (the commit marker) and records `checkpoint.committed`. A participant that fails
before acking, a writer that reports its write failed (`fail`), or the deadline, aborts the
step. A job's storage root and retention are fixed by its first checkpoint, so no later request
can point the service's deletions elsewhere. No I/O here; the adapter does the storage work the
decisions call for, on keys derived here only.

Time: `now_ns` stamps events (wall clock), except in `timeouts`, the one function that reads a
deadline: it takes the monotonic clock as `now_ns` and the wall clock as `wall_ns`. A step's
deadline is placed on the monotonic clock when its `checkpoint.started` is folded, through
`state.clock` (strata.clock.TimeBase: the time its event left, clamped to its timeout).

This module is the domain's face, which the adapter, the read model and the tests import: the
batches of a group commit (`decide_all`) and a step's answer (`info`) are here; the rest lives
by concern beside it and is re-exported: the state (`state`), the fold (`fold`), the requests
(`steps`), the manifest and a step's ending events (`manifest`), retention and step files
(`retention`), and settling a step as one plan the adapter executes (`settle`).
"""

from __future__ import annotations

from collections.abc import Sequence

from strata.errors import NotFound
from strata.events.requests import (
    AckShardRequest,
    AckShardResult,
    BeginCheckpointRequest,
    CheckpointInfo,
    ShardFailedRequest,
)
from strata.services.checkpoint.fold import FOLDS, REQUESTED, ack_problem, evolve
from strata.services.checkpoint.manifest import aborted, committed, manifest, storage_problem
from strata.services.checkpoint.retention import (
    StepFiles,
    orphaned_by,
    pruned,
    step_files,
    storage_root,
    to_prune,
)
from strata.services.checkpoint.settle import (
    CommitCheck,
    ManifestWrite,
    StoragePlan,
    commit_check,
    member_gone,
    recording,
    settle_commit,
    timeouts,
)
from strata.services.checkpoint.state import (
    SOURCE,
    CheckpointState,
    CommittedCheckpoint,
    Intent,
    JobCheckpoints,
    OpenCheckpoint,
    _participants,
)
from strata.services.checkpoint.steps import (
    AckDecision,
    ack,
    begin,
    declared_world,
    fail,
    shard_saved_id,
)
from strata.services.domain import Decision

__all__ = [
    "FOLDS",
    "REQUESTED",
    "SOURCE",
    "AckDecision",
    "BatchDecision",
    "CheckpointState",
    "Command",
    "CommitCheck",
    "CommittedCheckpoint",
    "Intent",
    "JobCheckpoints",
    "ManifestWrite",
    "OpenCheckpoint",
    "StepFiles",
    "StoragePlan",
    "aborted",
    "ack",
    "ack_problem",
    "ack_result",
    "begin",
    "commit_check",
    "committed",
    "decide",
    "decide_all",
    "declared_world",
    "evolve",
    "fail",
    "info",
    "manifest",
    "member_gone",
    "orphaned_by",
    "pruned",
    "recording",
    "settle_commit",
    "shard_saved_id",
    "step_files",
    "storage_problem",
    "storage_root",
    "timeouts",
    "to_prune",
]


# -- batches (group commit) -----------------------------------------------------------------------

Command = BeginCheckpointRequest | AckShardRequest | ShardFailedRequest
"""The requests this service decides."""
BatchDecision = Decision[CheckpointInfo] | AckDecision
"""A request's decision in a batch: a begin's answer is the step as its own events left it."""


def decide(state: CheckpointState, command: Command, now_ns: int) -> BatchDecision:
    """One request decided on its own: a batch of one."""
    return decide_all(state, [command], now_ns)[0]


def decide_all(
    state: CheckpointState, commands: Sequence[Command], now_ns: int
) -> list[BatchDecision]:
    """Decide `commands` in order, each against the state the previous ones' events make: one
    batch of a group commit. `state` itself is left as it is (it changes only by folding what the
    stream stored): the batch works on forks of the jobs it touches. A begin's answer is the
    step's `info` once its events are in; an ack's is its `result`."""
    scratch = CheckpointState(dict(state.jobs), clock=state.clock)
    forked: set[str] = set()
    decisions: list[BatchDecision] = []
    for command in commands:
        if command.job not in forked:
            forked.add(command.job)
            if command.job in scratch.jobs:
                scratch.jobs[command.job] = scratch.jobs[command.job].fork()
        if isinstance(command, AckShardRequest):
            decision: BatchDecision = ack(scratch, command, now_ns)
            for event in decision.events:
                evolve(scratch, event)
        elif isinstance(command, ShardFailedRequest):
            failed = fail(scratch, command, now_ns)
            for event in failed.events:
                evolve(scratch, event)
            decision = (
                Decision(failed.events, failed.error)
                if failed.error is not None
                else Decision(failed.events, result=info(scratch, command.job, command.step))
            )
        else:
            begun = begin(scratch, command, now_ns)
            for event in begun.events:
                evolve(scratch, event)
            # Its answer is the step as its own events leave it, not as later ones in the batch
            # do (a later begin may abort the step and open it again as a new attempt).
            decision = (
                Decision(begun.events, begun.error)
                if begun.error is not None
                else Decision(begun.events, result=info(scratch, command.job, command.step))
            )
        decisions.append(decision)
    return decisions


def ack_result(
    state: CheckpointState, request: AckShardRequest, result: AckShardResult
) -> AckShardResult:
    """`result` with the step's status once the ack's events are folded in."""
    job = state.job(request.job)
    status = "committed" if request.step in job.committed else result.status
    if request.step in job.aborted and request.step not in job.open:
        status = "aborted"
    return result.model_copy(update={"status": status})


def info(state: CheckpointState, job_id: str, step: int) -> CheckpointInfo:
    job = state.job(job_id)
    opened = job.open.get(step)
    if opened is not None:
        return CheckpointInfo(
            job=job_id,
            step=step,
            epoch=opened.epoch,
            status="open",
            root_uri=opened.root_uri,
            participants=opened.roster(),
            acked_ranks=sorted(opened.acks),
            world_size=opened.world_size,
            membership_epoch=opened.membership_epoch,
            attempt=opened.attempt,
        )
    done = job.committed.get(step)
    if done is not None:
        return CheckpointInfo(
            job=job_id,
            step=step,
            epoch=done.epoch,
            status="committed",
            root_uri=done.root_uri,
            participants=_participants(done.participants),
            acked_ranks=sorted(shard.rank for shard in done.manifest.shards),
            manifest_uri=done.manifest_uri,
            total_bytes=done.total_bytes,
            world_size=done.manifest.world_size,
            membership_epoch=done.manifest.membership_epoch,
            attempt=done.attempt,
        )
    if step in job.aborted:
        dropped, reason = job.aborted[step]
        return CheckpointInfo(
            job=job_id,
            step=step,
            epoch=dropped.epoch,
            status="aborted",
            root_uri=dropped.root_uri,
            participants=_participants(dropped.participants),
            acked_ranks=sorted(dropped.acks),
            reason=reason,
            world_size=dropped.world_size,
            membership_epoch=dropped.membership_epoch,
            attempt=dropped.attempt,
        )
    raise NotFound(f"job {job_id!r} has no checkpoint of step {step}")
