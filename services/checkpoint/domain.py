"""The checkpoint service's pure core: open checkpoints, acks, commit, abort, retention.

Phase one: each participant writes its shard to storage and publishes `checkpoint.shard_saved`.
Phase two: once every participant has acked, the service writes the manifest (the commit marker)
and records `checkpoint.committed`. A participant that fails before acking, or the deadline,
aborts the step. Participants are frozen when the step opens: the job's live members with their
ranks. No I/O here; the adapter does the storage work the decisions call for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import ConflictError, NotFound, StrataError
from strata.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointStarted,
    Event,
    Participant,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
)
from strata.events.requests import (
    BeginCheckpointRequest,
    CheckpointInfo,
    Manifest,
    ManifestShard,
)
from strata.services.registry.domain import event_id
from strata.storage.base import shard_key

SOURCE = "checkpoint"


@dataclass
class OpenCheckpoint:
    step: int
    epoch: int
    root_uri: str
    keep_count: int
    started_ns: int
    deadline_ns: int
    participants: dict[str, int]
    """Worker id -> rank."""
    acks: dict[int, CheckpointShardSaved] = field(default_factory=dict)
    """Rank -> its ack."""

    def complete(self) -> bool:
        return set(self.acks) >= set(self.participants.values())

    def missing_ranks(self) -> list[int]:
        return sorted(set(self.participants.values()) - set(self.acks))


@dataclass
class CommittedCheckpoint:
    step: int
    epoch: int
    root_uri: str
    manifest_uri: str
    total_bytes: int
    committed_ns: int
    keep_count: int
    participants: dict[str, int]
    manifest: Manifest


@dataclass
class JobCheckpoints:
    job: str
    live: dict[str, int] = field(default_factory=dict)
    """Live worker id -> rank."""
    open: dict[int, OpenCheckpoint] = field(default_factory=dict)
    committed: dict[int, CommittedCheckpoint] = field(default_factory=dict)
    aborted: dict[int, tuple[OpenCheckpoint, str]] = field(default_factory=dict)
    """Step -> the checkpoint as it was, and why it was aborted."""

    def latest(self) -> CommittedCheckpoint | None:
        return self.committed[max(self.committed)] if self.committed else None


@dataclass
class CheckpointState:
    jobs: dict[str, JobCheckpoints] = field(default_factory=dict)

    def job(self, job: str) -> JobCheckpoints:
        found = self.jobs.get(job)
        if found is None:
            found = self.jobs[job] = JobCheckpoints(job)
        return found


def _participants(mapping: dict[str, int]) -> list[Participant]:
    return [
        Participant(worker_id=w, rank=r) for w, r in sorted(mapping.items(), key=lambda i: i[1])
    ]


# -- evolve ---------------------------------------------------------------------------------------


def evolve(state: CheckpointState, event: Event) -> CheckpointState:
    if isinstance(event, WorkerRegistered):
        state.job(event.job).live[event.worker_id] = event.rank
    elif isinstance(event, WorkerFailed | WorkerLeft):
        state.job(event.job).live.pop(event.worker_id, None)
    elif isinstance(event, CheckpointStarted):
        job = state.job(event.job)
        if event.step not in job.open and event.step not in job.committed:
            job.open[event.step] = OpenCheckpoint(
                step=event.step,
                epoch=event.epoch,
                root_uri=event.root_uri,
                keep_count=event.keep_count,
                started_ns=event.ts,
                deadline_ns=event.ts + int(event.timeout_s * 1e9),
                participants={p.worker_id: p.rank for p in event.participants},
            )
            job.aborted.pop(event.step, None)
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
            )
    elif isinstance(event, CheckpointAborted):
        job = state.job(event.job)
        dropped = job.open.pop(event.step, None)
        if dropped is not None:
            job.aborted[event.step] = (dropped, event.reason)
    elif isinstance(event, CheckpointPruned):
        state.job(event.job).committed.pop(event.step, None)
    return state


def ack_problem(opened: OpenCheckpoint, ack: CheckpointShardSaved) -> str | None:
    """Why an ack cannot count, or None."""
    rank = opened.participants.get(ack.worker_id)
    if rank is None:
        return f"{ack.worker_id!r} is not a participant of step {ack.step}"
    if rank != ack.rank:
        return f"{ack.worker_id!r} has rank {rank} in step {ack.step}, not {ack.rank}"
    if ack.epoch != opened.epoch:
        return f"step {ack.step} is of epoch {opened.epoch}, not {ack.epoch}"
    expected_key = shard_key(ack.job, ack.step, ack.rank)
    if ack.key != expected_key or ack.uri != f"{opened.root_uri.rstrip('/')}/{expected_key}":
        return (
            f"the shard of rank {ack.rank} must be stored as {expected_key} under "
            f"{opened.root_uri}, not at {ack.uri}"
        )
    return None


# -- decisions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    events: list[Event] = field(default_factory=list)
    error: StrataError | None = None


def begin(state: CheckpointState, request: BeginCheckpointRequest, now_ns: int) -> Decision:
    job = state.job(request.job)
    if request.step in job.committed or request.step in job.open:
        return Decision()
    if request.step in job.aborted:
        return Decision(
            error=ConflictError(
                f"checkpoint of step {request.step} was aborted ({job.aborted[request.step][1]}); "
                "save under a later step"
            )
        )
    if request.worker_id not in job.live:
        return Decision(
            error=NotFound(
                f"worker {request.worker_id!r} is not a live member of job {request.job!r}: "
                "register it (strata.Worker.start) before checkpointing"
            )
        )
    return Decision(
        [
            CheckpointStarted(
                id=event_id("ckpt-started", request.job, request.step),
                job=request.job,
                source=SOURCE,
                ts=now_ns,
                step=request.step,
                epoch=request.epoch,
                root_uri=request.root_uri,
                participants=_participants(job.live),
                keep_count=request.keep_count,
                timeout_s=request.timeout_s,
            )
        ]
    )


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
            participants=_participants(opened.participants),
            acked_ranks=sorted(opened.acks),
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
            acked_ranks=sorted(done.participants.values()),
            manifest_uri=done.manifest_uri,
            total_bytes=done.total_bytes,
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
        )
    raise NotFound(f"job {job_id!r} has no checkpoint of step {step}")


def manifest(opened: OpenCheckpoint, job: str, now_ns: int) -> Manifest:
    shards = [
        ManifestShard(
            rank=ack.rank,
            worker_id=ack.worker_id,
            key=ack.key,
            uri=ack.uri,
            bytes=ack.bytes,
            checksum=ack.checksum,
            cursors=ack.cursors,
        )
        for _, ack in sorted(opened.acks.items())
    ]
    return Manifest(
        job=job,
        step=opened.step,
        epoch=opened.epoch,
        root_uri=opened.root_uri,
        committed_ts=now_ns,
        participants=_participants(opened.participants),
        shards=shards,
        total_bytes=sum(s.bytes for s in shards),
    )


def committed(job: str, opened: OpenCheckpoint, manifest_uri: str, now_ns: int) -> Event:
    return CheckpointCommitted(
        id=event_id("ckpt-committed", job, opened.step),
        job=job,
        source=SOURCE,
        ts=now_ns,
        step=opened.step,
        epoch=opened.epoch,
        manifest_uri=manifest_uri,
        total_bytes=sum(a.bytes for a in opened.acks.values()),
        shards=max(1, len(opened.acks)),
        duration_ms=max(0.0, (now_ns - opened.started_ns) / 1e6),
    )


def aborted(job: str, opened: OpenCheckpoint, reason: str, now_ns: int) -> Event:
    return CheckpointAborted(
        id=event_id("ckpt-aborted", job, opened.step, opened.started_ns),
        job=job,
        source=SOURCE,
        ts=now_ns,
        step=opened.step,
        epoch=opened.epoch,
        reason=reason,
        missing_ranks=opened.missing_ranks(),
    )


def member_gone(
    state: CheckpointState, job_id: str, worker_id: str, why: str, now_ns: int
) -> list[Event]:
    """Abort every open checkpoint the departed worker had not acked yet."""
    job = state.jobs.get(job_id)
    if job is None:
        return []
    events: list[Event] = []
    for opened in job.open.values():
        rank = opened.participants.get(worker_id)
        if rank is not None and rank not in opened.acks:
            reason = f"participant {worker_id!r} (rank {rank}) {why} before saving its shard"
            events.append(aborted(job_id, opened, reason, now_ns))
    return events


def timeouts(state: CheckpointState, now_ns: int) -> list[Event]:
    expired = []
    for job in state.jobs.values():
        for opened in job.open.values():
            if now_ns >= opened.deadline_ns:
                limit = (opened.deadline_ns - opened.started_ns) / 1e9
                reason = f"not every participant saved within {limit:g}s"
                expired.append(aborted(job.job, opened, reason, now_ns))
    return expired


def to_prune(job: JobCheckpoints) -> list[CommittedCheckpoint]:
    """Committed checkpoints beyond the newest `keep_count` (never the latest one)."""
    latest = job.latest()
    if latest is None:
        return []
    newest_first = sorted(job.committed.values(), key=lambda c: c.step, reverse=True)
    return newest_first[max(1, latest.keep_count) :]


def pruned(job: str, old: CommittedCheckpoint, now_ns: int) -> Event:
    return CheckpointPruned(
        id=event_id("ckpt-pruned", job, old.step),
        job=job,
        source=SOURCE,
        ts=now_ns,
        step=old.step,
        manifest_uri=old.manifest_uri,
    )
