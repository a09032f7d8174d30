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
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Final, NamedTuple

from strata.clock import TimeBase
from strata.errors import ConflictError, NotFound, WorkerSuperseded
from strata.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointShardStarted,
    CheckpointStarted,
    Event,
    Participant,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
)
from strata.events.ids import event_id
from strata.events.requests import (
    AckShardRequest,
    AckShardResult,
    BeginCheckpointRequest,
    CheckpointInfo,
    Manifest,
    ManifestShard,
    ShardFailedRequest,
)
from strata.services.domain import Decision
from strata.services.leases import Leases
from strata.storage.base import manifest_key, shard_key, step_prefix

SOURCE = "checkpoint"


@dataclass(frozen=True)
class Intent:
    """Who declared itself the writer of a rank's shard."""

    worker_id: str
    instance: str
    save_id: str


@dataclass
class OpenCheckpoint:
    step: int
    epoch: int
    root_uri: str
    keep_count: int
    started_ns: int
    """Its `checkpoint.started` stamp (wall clock)."""
    deadline_ns: int
    """When it times out, on the clock `timeouts` is given (monotonic in the service)."""
    participants: dict[str, int]
    """Worker id -> rank: the live holder of each rank of the world when the step opened."""
    world_size: int | None = None
    """Ranks 0..world_size-1 must ack; None for steps opened before worlds were recorded."""
    membership_epoch: int | None = None
    acks: dict[int, CheckpointShardSaved] = field(default_factory=dict)
    """Rank -> its ack."""
    intents: dict[int, Intent] = field(default_factory=dict)
    """Rank -> the writer that declared itself for it (the first one)."""
    attempt: int = 0
    """0, or how many times the step was opened before and aborted."""
    timeout_s: float = 0.0
    _roster: list[Participant] | None = field(default=None, init=False, repr=False, compare=False)

    def roster(self) -> list[Participant]:
        """The participants as the step's answers list them, built once: they never change after
        the step opens, and every rank's begin is answered with them."""
        if self._roster is None:
            self._roster = _participants(self.participants)
        return self._roster

    def required_ranks(self) -> set[int]:
        if self.world_size is None:
            return set(self.participants.values())
        return set(range(self.world_size))

    def complete(self) -> bool:
        return set(self.acks) >= self.required_ranks()

    def missing_ranks(self) -> list[int]:
        return sorted(self.required_ranks() - set(self.acks))

    def fork(self) -> OpenCheckpoint:
        """A copy that `evolve` may change without changing this one (it adds acks, intents)."""
        forked = replace(self, acks=dict(self.acks), intents=dict(self.intents))
        forked._roster = self.roster()  # the participants never change: built once per step
        return forked


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
    attempt: int = 0


@dataclass
class JobCheckpoints:
    job: str
    live: dict[str, int] = field(default_factory=dict)
    """Live worker id -> rank."""
    instances: dict[str, str] = field(default_factory=dict)
    """Live worker id -> the process (instance) its registration belongs to."""
    leases: Leases = field(default_factory=Leases)
    """Each live worker's registration (lease): a begin or an ack under an ended one is refused."""
    membership_epoch: int = 0
    """The newest membership epoch folded (registrations, failures, departures)."""
    open: dict[int, OpenCheckpoint] = field(default_factory=dict)
    committed: dict[int, CommittedCheckpoint] = field(default_factory=dict)
    aborted: dict[int, tuple[OpenCheckpoint, str]] = field(default_factory=dict)
    """Step -> the checkpoint as it was, and why it was aborted."""
    pruned: set[int] = field(default_factory=set)
    """Steps committed and since removed by retention: they stay taken."""
    root_uri: str | None = None
    """Where the job's checkpoints are stored: fixed by its first `checkpoint.started`."""
    keep_count: int | None = None
    """How many committed checkpoints retention keeps: fixed with the root."""

    def fork(self) -> JobCheckpoints:
        """A copy that `evolve` may change without changing this one. Committed and aborted
        checkpoints are never changed in place, so they are shared."""
        return replace(
            self,
            live=dict(self.live),
            instances=dict(self.instances),
            leases=self.leases.copy(),
            open={step: opened.fork() for step, opened in self.open.items()},
            committed=dict(self.committed),
            aborted=dict(self.aborted),
            pruned=set(self.pruned),
        )

    def latest(self, *, include_incomplete: bool = False) -> CommittedCheckpoint | None:
        """The newest committed checkpoint that holds every rank of its world (or any)."""
        for step in sorted(self.committed, reverse=True):
            found = self.committed[step]
            if include_incomplete or found.manifest.complete:
                return found
        return None


@dataclass
class CheckpointState:
    jobs: dict[str, JobCheckpoints] = field(default_factory=dict)
    clock: TimeBase | None = None
    """Both clocks as the adapter last read them (before each fold): places a started step's
    wall-clock deadline on the monotonic clock. None (a pure replay, the read model): the
    deadline is the event's stamp plus its timeout."""

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


# -- decisions ------------------------------------------------------------------------------------


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
    disagreement = _disagreement(opened, request)
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


def _disagreement(opened: OpenCheckpoint, request: BeginCheckpointRequest) -> str | None:
    """Why this begin cannot join the open step (world, epoch, storage root), or None."""
    declared, world = request.world_size, opened.world_size
    if declared is not None and world is not None and declared != world:
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
        world_size=opened.world_size,
        membership_epoch=opened.membership_epoch,
    )


def storage_problem(opened: OpenCheckpoint, sizes: Mapping[int, int | None]) -> str | None:
    """Why the step cannot commit with its shards as storage holds them, or None.

    `sizes`: rank -> the size of the object under its acked key (None: no object). Each acked
    shard must still be there, exactly as long as acked; the manifest is the commit marker, so
    it is never written over a shard that was lost or cut short after its ack.
    """
    problems = []
    for rank, ack in sorted(opened.acks.items()):
        found = sizes.get(rank)
        if found is None:
            problems.append(f"the shard of rank {rank} ({ack.key}) is missing from storage")
        elif found != ack.bytes:
            problems.append(
                f"the shard of rank {rank} ({ack.key}) holds {found} bytes in storage, "
                f"{ack.bytes} were acked"
            )
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


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


def timeouts(state: CheckpointState, now_ns: int, wall_ns: int | None = None) -> list[Event]:
    """The aborts of steps past their deadline: `now_ns` on the deadlines' clock (monotonic in
    the service), `wall_ns` to stamp the events (`now_ns` when not given)."""
    stamp = now_ns if wall_ns is None else wall_ns
    expired = []
    for job in state.jobs.values():
        for opened in job.open.values():
            if now_ns >= opened.deadline_ns:
                limit = opened.timeout_s or (opened.deadline_ns - opened.started_ns) / 1e9
                reason = f"not every participant saved within {limit:g}s"
                expired.append(aborted(job.job, opened, reason, stamp))
    return expired


def to_prune(job: JobCheckpoints) -> list[CommittedCheckpoint]:
    """Committed checkpoints beyond the job's `keep_count` newest, never the latest one nor the
    newest complete one (the checkpoint a restart resumes from)."""
    latest = job.latest(include_incomplete=True)
    if latest is None:
        return []
    resume_from = job.latest()
    kept = None if resume_from is None else resume_from.step
    keep = job.keep_count if job.keep_count is not None else latest.keep_count
    newest_first = sorted(job.committed.values(), key=lambda c: c.step, reverse=True)
    return [c for c in newest_first[max(1, keep) :] if c.step != kept]


def storage_root(job: JobCheckpoints, fallback: str) -> str:
    """The root the service writes and deletes under for `job`: the one its first checkpoint
    recorded (`fallback` only for a job none was folded for, which has nothing to delete)."""
    return job.root_uri if job.root_uri is not None else fallback


class StepFiles(NamedTuple):
    """Where the files of one step lie: a storage root and the step's key prefix under it."""

    root_uri: str
    prefix: str


def step_files(job: JobCheckpoints, step: int, fallback_root: str) -> StepFiles:
    """The files of `step`, under the job's recorded root (`storage_root`)."""
    return StepFiles(storage_root(job, fallback_root), step_prefix(job.job, step))


def orphaned_by(state: CheckpointState, abort: Event) -> StepFiles | None:
    """The files an abort leaves that no checkpoint will reference: its step's, under the job's
    root. Asked before the abort is folded, while the step is open; None when it was not open
    (an abort recorded at a begin, before anyone wrote): then nothing was written for it."""
    job = state.job(abort.job)
    opened = job.open.get(getattr(abort, "step", -1))
    return None if opened is None else step_files(job, opened.step, opened.root_uri)


def pruned(job: str, old: CommittedCheckpoint, now_ns: int) -> Event:
    return CheckpointPruned(
        id=event_id("ckpt-pruned", job, old.step),
        job=job,
        source=SOURCE,
        ts=now_ns,
        step=old.step,
        manifest_uri=old.manifest_uri,
    )


# -- settling a step: one plan, executed by the adapter --------------------------------------------


class ManifestWrite(NamedTuple):
    """The commit marker to write: `manifest` under `key` of the storage root `root_uri`."""

    root_uri: str
    key: str
    manifest: Manifest


@dataclass(frozen=True)
class StoragePlan:
    """Everything settling a step takes, decided at once; the adapter executes it in this order:

    1. write the manifest (`write`), the commit marker, before anything is recorded: a crash
       after it only writes it again;
    2. record `record` (a commit, or aborts) and wait until it is folded in;
    3. remove `delete` (an aborted step's files, pruned steps' files): a failure is logged, never
       fatal, since nothing references those files any more;
    4. record `record_after` (the prunes): files first, then the record, so a crash in between
       leaves a step that is pruned again.
    """

    write: ManifestWrite | None = None
    record: tuple[Event, ...] = ()
    delete: tuple[StepFiles, ...] = ()
    record_after: tuple[Event, ...] = ()


class CommitCheck(NamedTuple):
    """What storage must answer before a complete step commits: the size of each acked shard."""

    job: str
    step: int
    root_uri: str
    """The job's storage root (`storage_root`), where the shards and the manifest lie."""
    keys: dict[int, str]
    """Rank -> the key its shard was acked under."""


def commit_check(state: CheckpointState, job_id: str, step: int) -> CommitCheck | None:
    """The shards to look up in storage before `step` can commit; None when the step is not open
    or not every rank of its world has acked (nothing to commit yet, or settled already)."""
    job = state.jobs.get(job_id)
    opened = job.open.get(step) if job is not None else None
    if job is None or opened is None or not opened.complete():
        return None
    keys = {rank: saved.key for rank, saved in sorted(opened.acks.items())}
    return CommitCheck(job_id, step, storage_root(job, opened.root_uri), keys)


def settle_commit(
    state: CheckpointState,
    check: CommitCheck,
    sizes: Mapping[int, int | None],
    stored_root_uri: str,
    now_ns: int,
) -> StoragePlan:
    """The whole commit of a complete step, once storage has answered `check` (`sizes`: rank ->
    the size under its acked key, None for no object).

    Every acked shard whole in storage: write the manifest, record `checkpoint.committed`, then
    remove the files of the committed checkpoints retention no longer keeps (`to_prune`, as the
    job stands once the commit is folded) and record their `checkpoint.pruned`. A shard missing
    or cut short: record the step's abort and remove its files. `stored_root_uri` is the root as
    the storage backend names it (`StorageBackend.root_uri`: a local path becomes a `file://`
    URI), under which the manifest's URI is written. A step no longer open or complete (settled
    meanwhile) needs nothing.
    """
    job = state.jobs.get(check.job)
    opened = job.open.get(check.step) if job is not None else None
    if job is None or opened is None or not opened.complete():
        return StoragePlan()
    problem = storage_problem(opened, sizes)
    if problem is not None:
        return recording(state, [aborted(check.job, opened, problem, now_ns)])
    key = manifest_key(check.job, check.step)
    written = manifest(opened, check.job, now_ns)
    done = committed(check.job, opened, f"{stored_root_uri.rstrip('/')}/{key}", now_ns)
    after = CheckpointState({check.job: job.fork()}, clock=state.clock)
    evolve(after, done)
    old = to_prune(after.job(check.job))
    return StoragePlan(
        write=ManifestWrite(check.root_uri, key, written),
        record=(done,),
        delete=tuple(step_files(after.job(check.job), c.step, check.root_uri) for c in old),
        record_after=tuple(pruned(check.job, c, now_ns) for c in old),
    )


def recording(state: CheckpointState, events: Sequence[Event]) -> StoragePlan:
    """Record `events` (a batch's decisions, aborts of the service's own), then remove the files
    of the steps they abort, found while those steps are still open (`orphaned_by`)."""
    orphans = {
        files: None
        for event in events
        if isinstance(event, CheckpointAborted) and (files := orphaned_by(state, event)) is not None
    }
    return StoragePlan(record=tuple(events), delete=tuple(orphans))
