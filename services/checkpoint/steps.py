"""A worker's requests about a step: `begin` (open the step for its world, or declare a rank's
writer), `ack` (a shard is stored) and `fail` (a shard could not be), each decided against the
state, refused with an error a person can act on, or recorded as events.
"""

from __future__ import annotations

from strata.errors import ConflictError, NotFound, WorkerSuperseded
from strata.events import CheckpointShardSaved, CheckpointShardStarted, CheckpointStarted, Event
from strata.events.ids import event_id
from strata.events.requests import (
    AckShardRequest,
    AckShardResult,
    BeginCheckpointRequest,
    ShardFailedRequest,
)
from strata.services.checkpoint.fold import _opened, ack_problem
from strata.services.checkpoint.manifest import aborted
from strata.services.checkpoint.state import (
    SOURCE,
    CheckpointState,
    CommittedCheckpoint,
    Intent,
    JobCheckpoints,
    OpenCheckpoint,
    _participants,
)
from strata.services.domain import Decision
from strata.storage.base import shard_key

# -- decisions ------------------------------------------------------------------------------------


def live_world(job: JobCheckpoints, request: BeginCheckpointRequest) -> dict[str, int] | None:
    """Worker id -> rank in the job's newest live quorum, when the saving worker is a member of
    it (`strata.torch.live.LiveGroup`), else None. A live group's step belongs to the group that
    trained it: after a shrink its world is the survivors, ranked as in the group, not the
    registry's ranks (which keep the dead rank's hole) nor a replacement registered since that has
    not joined the group yet."""
    if job.quorum is None or request.worker_id not in job.quorum[1]:
        return None
    return {worker: rank for rank, worker in enumerate(job.quorum[1])}


def declared_world(job: JobCheckpoints, request: BeginCheckpointRequest) -> tuple[int, int]:
    """The world (size, membership epoch) a step opens for, from the first begin's view.

    A worker's view of the membership trails the registry's a little. When the service has folded
    a newer membership than the worker saw, joins the worker has not heard of still count (they
    are members already), while failures it has not heard of do not shrink the world: the ranks
    it trained with are still ranks of that world, and a lost one makes the step incomplete.
    """
    live = len(job.live)
    if request.world_size is None:
        return live, job.membership_epoch
    if request.membership_epoch < job.membership_epoch and live > request.world_size:
        return live, job.membership_epoch
    return request.world_size, request.membership_epoch


def begin(state: CheckpointState, request: BeginCheckpointRequest, now_ns: int) -> Decision[None]:
    """A worker declares its shard of `request.step`: open the step, record the intent, or refuse.

    Refused (ConflictError): a save to another storage root or with another `keep_count` than the
    job's first checkpoint fixed, a committed (or pruned) step, a save that belonged to an aborted
    attempt of the step, a second save of a rank that already has a writer, a save that disagrees
    with the open step on its world, epoch or storage root, a save from a process whose worker id
    a newer process took (WorkerSuperseded), a save under a lease that has ended (StaleLease).
    A step whose world has a rank with no live worker is recorded as aborted at once.

    A new save of an aborted step opens it again, as its next attempt: a job that restarts from
    the checkpoint before it reaches the same step numbers again.
    """
    job = state.job(request.job)
    step = request.step
    fixed = _fixed_storage(job, request)
    if fixed is not None:
        return Decision(error=fixed)
    if step in job.committed or step in job.pruned:
        return Decision(
            error=ConflictError(
                f"checkpoint of step {step} is already committed; a committed shard is never "
                "overwritten: save under a later step"
            )
        )
    attempt = 0
    if step in job.aborted:
        dropped, reason = job.aborted[step]
        if _intent(request) in dropped.intents.values():
            return Decision(error=_aborted_at_open(step, reason))  # a retry of an aborted save
        attempt = dropped.attempt + 1
    if request.worker_id not in job.live:
        return Decision(
            error=NotFound(
                f"worker {request.worker_id!r} is not a live member of job {request.job!r}: "
                "register it (strata.Worker.start) before checkpointing"
            )
        )
    holder = job.instances.get(request.worker_id)
    if request.instance is not None and holder is not None and holder != request.instance:
        return Decision(
            error=WorkerSuperseded(
                f"worker {request.worker_id!r} of job {request.job!r} is now held by another "
                f"process (instance {holder}); this process's registration has ended, so it "
                "saves nothing"
            )
        )
    if request.lease is not None:
        fenced = job.leases.check(request.job, request.lease, request.worker_id)
        if fenced is not None:
            return Decision(error=fenced)
    opened = job.open.get(step)
    if opened is None:
        return _open(job, request, now_ns, attempt)
    return _declare(job, opened, request, now_ns)


def _open(
    job: JobCheckpoints, request: BeginCheckpointRequest, now_ns: int, attempt: int
) -> Decision[None]:
    group = live_world(job, request)
    if group is not None and job.quorum is not None:
        world_size, membership_epoch = len(group), job.quorum[0]
        holders = {rank: worker for worker, rank in group.items() if worker in job.live}
    else:
        world_size, membership_epoch = declared_world(job, request)
        holders = {rank: worker for worker, rank in job.live.items()}
    participants = {holders[r]: r for r in range(world_size) if r in holders}
    unheld = [rank for rank in range(world_size) if rank not in holders]
    doomed: str | None = None
    if unheld:
        doomed = f"rank {unheld[0]} of the world of {world_size} has no live worker"
        if len(unheld) > 1:
            doomed += f" (nor {_ranks(unheld[1:])})"
        if not participants or attempt:
            # Nothing to record: no participant, or a step already recorded as aborted.
            return Decision(error=_aborted_at_open(request.step, doomed))
    started = CheckpointStarted(
        id=event_id("ckpt-started", request.job, request.step, *([attempt] if attempt else [])),
        job=request.job,
        source=SOURCE,
        ts=now_ns,
        step=request.step,
        epoch=request.epoch,
        root_uri=request.root_uri,
        participants=_participants(participants),
        keep_count=request.keep_count,
        timeout_s=request.timeout_s,
        world_size=world_size,
        membership_epoch=membership_epoch,
        attempt=attempt,
    )
    opened = _opened(started)
    if doomed is not None:
        abort = aborted(request.job, opened, doomed, now_ns)
        return Decision([started, abort], _aborted_at_open(request.step, doomed))
    rank = participants.get(request.worker_id)
    if rank is None:
        return Decision([started], _not_a_participant(opened, request))
    return Decision([started, _shard_started(request, rank, attempt, now_ns)])


def _fixed_storage(job: JobCheckpoints, request: BeginCheckpointRequest) -> ConflictError | None:
    """Why a begin cannot change where the job's checkpoints live or how many are kept, or None.

    Retention deletes old steps under the job's root: were a later begin allowed to name another
    root or a smaller `keep_count`, it could point those deletions at checkpoints it does not own.
    """
    if job.root_uri is None:
        return None
    if (request.root_uri, request.keep_count) == (job.root_uri, job.keep_count):
        return None
    return ConflictError(
        f"job {job.job!r} keeps its checkpoints in {job.root_uri} with keep_count="
        f"{job.keep_count}, fixed by its first checkpoint; this save asks for {request.root_uri} "
        f"with keep_count={request.keep_count}: save with those, or under a new job name"
    )


def _aborted_at_open(step: int, reason: str) -> ConflictError:
    return ConflictError(
        f"checkpoint of step {step} was aborted ({reason}); save under a later step, or save "
        "this step again (a new attempt) once every rank of its world is live"
    )


def _declare(
    job: JobCheckpoints, opened: OpenCheckpoint, request: BeginCheckpointRequest, now_ns: int
) -> Decision[None]:
    """A begin for a step that is open already: this rank's intent, a retry, or a refusal."""
    step = request.step
    rank = opened.participants.get(request.worker_id)
    disagreement = _disagreement(opened, request, live_world(job, request) is not None)
    if disagreement is not None:
        # A participant refused here will not save into the step, which can then never
        # complete: end it now rather than at its deadline.
        doomed = rank is not None and rank not in opened.acks
        events = [aborted(job.job, opened, disagreement, now_ns)] if doomed else []
        return Decision(events, ConflictError(f"checkpoint of step {step} refused: {disagreement}"))
    if rank is None:
        return Decision(error=_not_a_participant(opened, request))
    mine = _intent(request)
    declared = opened.intents.get(rank)
    if declared == mine:
        return Decision()  # a retried begin: the same answer again
    if declared is not None and declared.instance != mine.instance:
        return Decision(
            error=ConflictError(
                f"rank {rank} of step {step} was already declared by another process of "
                f"worker {declared.worker_id!r} (instance {declared.instance}); a shard is "
                "written once: save under a later step"
            )
        )
    if declared is not None or rank in opened.acks:
        return Decision(
            error=ConflictError(
                f"step {step} was already saved by rank {rank}; save under a later step"
            )
        )
    return Decision([_shard_started(request, rank, opened.attempt, now_ns)])


def _disagreement(
    opened: OpenCheckpoint, request: BeginCheckpointRequest, in_group: bool = False
) -> str | None:
    """Why this begin cannot join the open step (world, epoch, storage root), or None. A member
    of the job's live group saves into its group's world, whatever size of the registry's
    membership it declares (`in_group`)."""
    declared, world = request.world_size, opened.world_size
    if not in_group and declared is not None and world is not None and declared != world:
        # A view older than the step's that misses joins counts the same world, only late.
        older_view = request.membership_epoch < (opened.membership_epoch or 0)
        if not (older_view and declared < world):
            return (
                f"the step is open for a world of {world} (membership epoch "
                f"{opened.membership_epoch}); this save declares a world of {declared} "
                f"(membership epoch {request.membership_epoch})"
            )
    if request.epoch != opened.epoch:
        return f"the step is of epoch {opened.epoch}; this save declares epoch {request.epoch}"
    if request.root_uri != opened.root_uri:
        return f"the step is saved under {opened.root_uri}; this save writes to {request.root_uri}"
    return None


def _not_a_participant(opened: OpenCheckpoint, request: BeginCheckpointRequest) -> ConflictError:
    world = opened.world_size if opened.world_size is not None else len(opened.participants)
    return ConflictError(
        f"worker {request.worker_id!r} is not a participant of step {request.step}'s checkpoint "
        f"(its world of {world} ranks was fixed when it opened, at membership epoch "
        f"{opened.membership_epoch}); save under a later step"
    )


def _intent(request: BeginCheckpointRequest) -> Intent:
    # A client that sends no instance or save id cannot tell a retry from a second save: every
    # begin of its rank counts as the same one, as all begins did before intents were recorded.
    return Intent(
        request.worker_id,
        request.instance or request.worker_id,
        request.save_id or f"step-{request.step}",
    )


def _shard_started(request: BeginCheckpointRequest, rank: int, attempt: int, now_ns: int) -> Event:
    intent = _intent(request)
    return CheckpointShardStarted(
        id=event_id(
            "ckpt-shard-started", request.job, request.step, rank, *([attempt] if attempt else [])
        ),
        job=request.job,
        source=SOURCE,
        ts=now_ns,
        step=request.step,
        epoch=request.epoch,
        rank=rank,
        worker_id=request.worker_id,
        instance=intent.instance,
        save_id=intent.save_id,
    )


def _ranks(ranks: list[int]) -> str:
    shown = ", ".join(str(r) for r in ranks[:8])
    more = f" and {len(ranks) - 8} more" if len(ranks) > 8 else ""
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{more}"


def shard_saved_id(job: str, step: int, rank: int, attempt: int) -> str:
    """The id of the `checkpoint.shard_saved` of a rank of a step's attempt: one per shard, so a
    retried ack is stored once."""
    return event_id("ckpt-shard-saved", job, step, rank, *([attempt] if attempt else []))


AckDecision = Decision[AckShardResult]
"""What an ack records (nothing for a retry), its answer, or the error its caller gets."""


def ack(state: CheckpointState, request: AckShardRequest, now_ns: int) -> AckDecision:
    """A rank's writer says its shard is stored: record `checkpoint.shard_saved`, or refuse.

    The shard's key is derived here (job, step, rank, attempt), never taken from the request.
    Refused: a step not open (`NotFound`; `ConflictError` once aborted or committed without this
    very shard), an ack from a worker that is not the rank's participant, of another epoch, from
    another process than the one that declared the rank (`WorkerSuperseded`), under a lease that
    has ended (`StaleLease`), of a rank nobody declared, or one that contradicts the rank's first
    ack. A retry gets the first answer again.
    """
    job = state.job(request.job)
    step, rank = request.step, request.rank
    done = job.committed.get(step)
    if done is not None:
        return _ack_after_commit(job, done, request)
    opened = job.open.get(step)
    if opened is None:
        if step in job.aborted:
            return AckDecision(error=_aborted_at_open(step, job.aborted[step][1]))
        return AckDecision(
            error=NotFound(
                f"job {request.job!r} has no open checkpoint of step {step}: declare the shard "
                "(CheckpointManager.save does) before acknowledging it"
            )
        )
    root = opened.root_uri.rstrip("/")
    key = shard_key(request.job, step, rank, opened.attempt)
    saved = CheckpointShardSaved(
        id=shard_saved_id(request.job, step, rank, opened.attempt),
        job=request.job,
        source=SOURCE,
        ts=now_ns,
        step=step,
        epoch=request.epoch,
        rank=rank,
        worker_id=request.worker_id,
        uri=f"{root}/{key}",
        key=key,
        bytes=request.bytes,
        checksum=request.checksum,
        cursors=request.cursors,
    )
    answer = AckShardResult(
        job=request.job, step=step, rank=rank, event_id=saved.id, key=key, status="open"
    )
    first = opened.acks.get(rank)
    if first is not None and _same_shard(first, saved):
        return AckDecision(result=answer)  # a retry: recorded already
    problem = ack_problem(opened, saved)
    if problem is not None:
        return AckDecision(error=ConflictError(f"ack of step {step} refused: {problem}"))
    declared = opened.intents.get(rank)
    if declared is None:
        return AckDecision(
            error=ConflictError(
                f"rank {rank} of step {step} was never declared: declare the shard "
                "(CheckpointManager.save does) before writing and acknowledging it"
            )
        )
    if request.instance is not None and declared.instance != request.instance:
        return AckDecision(
            error=WorkerSuperseded(
                f"rank {rank} of step {step} was declared by another process of worker "
                f"{declared.worker_id!r} (instance {declared.instance}); this process's shard "
                "does not count"
            )
        )
    if request.lease is not None:
        fenced = job.leases.check(request.job, request.lease, request.worker_id)
        if fenced is not None:
            return AckDecision(error=fenced)
    return AckDecision([saved], result=answer)


def _same_shard(first: CheckpointShardSaved, again: CheckpointShardSaved) -> bool:
    return (first.worker_id, first.epoch, first.bytes, first.checksum) == (
        again.worker_id,
        again.epoch,
        again.bytes,
        again.checksum,
    )


def _ack_after_commit(
    job: JobCheckpoints, done: CommittedCheckpoint, request: AckShardRequest
) -> AckDecision:
    """A retried ack whose step committed meanwhile gets its answer; any other is refused."""
    shard = next((s for s in done.manifest.shards if s.rank == request.rank), None)
    if shard is not None and (shard.worker_id, shard.bytes, shard.checksum) == (
        request.worker_id,
        request.bytes,
        request.checksum,
    ):
        return AckDecision(
            result=AckShardResult(
                job=job.job,
                step=request.step,
                rank=request.rank,
                event_id=shard_saved_id(job.job, request.step, request.rank, done.attempt),
                key=shard.key,
                status="committed",
            )
        )
    return AckDecision(
        error=ConflictError(
            f"checkpoint of step {request.step} is already committed without this shard; a "
            "committed checkpoint never changes: save under a later step"
        )
    )


def fail(state: CheckpointState, request: ShardFailedRequest, now_ns: int) -> Decision[None]:
    """A rank's writer says it could not store its shard: abort the step now, since it can never
    complete (rather than at its deadline, while every other rank waits). Only the process that
    declared the rank can say so, and only before the rank acked; a step that already committed
    or aborted is left as it is (the answer says which)."""
    job = state.job(request.job)
    opened = job.open.get(request.step)
    if opened is None:
        if request.step in job.committed or request.step in job.aborted:
            return Decision()  # settled already: a retry, or a report that came too late
        return Decision(
            error=NotFound(f"job {request.job!r} has no checkpoint of step {request.step}")
        )
    rank = opened.participants.get(request.worker_id)
    declared = opened.intents.get(request.rank)
    if rank != request.rank or declared is None or declared.worker_id != request.worker_id:
        return Decision(
            error=ConflictError(
                f"{request.worker_id!r} is not the declared writer of rank {request.rank} of "
                f"step {request.step}: only that writer can report its shard failed"
            )
        )
    if request.instance is not None and declared.instance != request.instance:
        return Decision(
            error=WorkerSuperseded(
                f"rank {request.rank} of step {request.step} was declared by another process "
                f"(instance {declared.instance}); this process's failure does not end the step"
            )
        )
    if request.rank in opened.acks:
        return Decision()  # its shard is stored: this report is about another write
    reason = f"rank {request.rank} could not write its shard: {request.reason}"
    return Decision([aborted(request.job, opened, reason[:1000], now_ns)])
