"""The registry's pure core: membership state, the decisions on it, and failure detection.

`evolve(state, event)` folds an event into the state (in place, returning it: a projector over
thousands of workers must not copy per heartbeat). `decide(state, command, now_ns, policy)`
returns the events a command causes, or the error refusing it (a `Decision`, the contract of
every domain: `strata.services.domain`). Time is always passed in, so tests drive the clock
instead of sleeping: wall-clock ns to stamp events, and for liveness the ns of a clock that only
moves forward (the service passes `time.monotonic_ns`; a step of the wall clock must neither fail
a live worker nor keep a dead one alive). No I/O here.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, NamedTuple

from strata.errors import ConflictError, NotFound, WorkerSuperseded
from strata.events import (
    Event,
    LiveState,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
    WorkerState,
    WorkerStateChanged,
    subjects,
)
from strata.events.ids import event_id
from strata.events.models import MAX_WORKERS, SUPERSEDED_REASON
from strata.events.requests import (
    LeaveRequest,
    LeaveResult,
    MemberInfo,
    MembersResult,
    RegisterRequest,
    Registration,
)
from strata.services.domain import NS_PER_S, Decision

SOURCE = "registry"
MAX_GONE_PER_JOB = 1_000
"""Failed and departed members a job remembers (`members(include_gone=True)` lists them)."""
GONE: frozenset[WorkerState] = frozenset({"failed", "left"})


@dataclass(frozen=True)
class Policy:
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0


@dataclass
class Member:
    worker_id: str
    instance: str
    rank: int
    status: WorkerState
    hostname: str = ""
    gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)
    registered_epoch: int = 0
    step: int = 0
    epoch: int = 0
    last_seen_ns: int = 0
    """Liveness-clock ns of the last sign of life: registration, then each heartbeat's arrival.
    Folded from a registration it is the event's wall-clock stamp; the live service overwrites
    it with its monotonic clock (`begin_grace`, and each registration folded once live)."""
    last_heartbeat_ts: int | None = None

    @property
    def live(self) -> bool:
        return self.status not in GONE

    def info(self) -> MemberInfo:
        return MemberInfo(
            worker_id=self.worker_id,
            instance=self.instance,
            rank=self.rank,
            status=self.status,
            hostname=self.hostname,
            gpus=self.gpus,
            step=self.step,
            epoch=self.epoch,
            last_heartbeat_ts=self.last_heartbeat_ts,
        )


@dataclass
class Job:
    job: str
    membership_epoch: int = 0
    members: dict[str, Member] = field(default_factory=dict)
    ranks: dict[int, str] = field(default_factory=dict)
    """Live rank -> worker id; changed only through `take_rank` and `free_rank`."""
    gone: dict[str, None] = field(default_factory=dict)
    """Failed and departed members, oldest first; past `MAX_GONE_PER_JOB` the oldest is forgotten,
    so a job with churn (preemptions, autoscaling) does not grow the state without bound."""
    _free_from: int = field(default=0, repr=False, compare=False)
    """Every rank below this one is taken: the search for a free rank starts here, so filling a
    job of N workers costs O(N) in all, not O(N^2)."""

    @property
    def world_size(self) -> int:
        return len(self.ranks)

    def lowest_free_rank(self) -> int:
        rank = self._free_from
        while rank in self.ranks:
            rank += 1
        self._free_from = rank
        return rank

    def take_rank(self, rank: int, worker_id: str) -> None:
        self.ranks[rank] = worker_id

    def free_rank(self, rank: int) -> None:
        self.ranks.pop(rank, None)
        self._free_from = min(self._free_from, rank)

    def fork(self) -> Job:
        """A copy to decide on without changing this job: its maps are copied, its members
        shared (the events a decision folds, registrations, leaves and failures, replace a
        member rather than change it)."""
        return replace(
            self, members=dict(self.members), ranks=dict(self.ranks), gone=dict(self.gone)
        )

    def live_members(self) -> list[Member]:
        return [self.members[w] for _, w in sorted(self.ranks.items())]

    def mark_gone(self, worker_id: str) -> None:
        self.gone.pop(worker_id, None)
        self.gone[worker_id] = None
        while len(self.gone) > MAX_GONE_PER_JOB:
            oldest = next(iter(self.gone))
            del self.gone[oldest]
            del self.members[oldest]


@dataclass
class RegistryState:
    jobs: dict[str, Job] = field(default_factory=dict)

    def job(self, job: str) -> Job:
        found = self.jobs.get(job)
        if found is None:
            found = self.jobs[job] = Job(job)
        return found


# -- evolve ---------------------------------------------------------------------------------------


FOLDS: Final[tuple[type[Event], ...]] = (
    WorkerRegistered,
    WorkerFailed,
    WorkerLeft,
    WorkerStateChanged,
)
"""The event types `evolve` folds; it ignores every other. The read model routes by this."""
REQUESTED: Final[tuple[type[Event], ...]] = (WorkerRegistered, WorkerLeft)
"""Of those, the ones this service records in answer to a worker's request (the dashboard's
requests/s)."""


def evolve(state: RegistryState, event: Event) -> RegistryState:
    """Fold one event into the state; events this projection does not use are ignored."""
    if isinstance(event, WorkerRegistered):
        job = state.job(event.job)
        previous = job.members.get(event.worker_id)
        if previous is not None and previous.live:
            job.free_rank(previous.rank)
        job.gone.pop(event.worker_id, None)
        job.members[event.worker_id] = Member(
            worker_id=event.worker_id,
            instance=event.instance,
            rank=event.rank,
            status="idle",
            hostname=event.hostname,
            gpus=event.gpus,
            labels=dict(event.labels),
            registered_epoch=event.membership_epoch,
            last_seen_ns=event.ts,
        )
        job.take_rank(event.rank, event.worker_id)
        job.membership_epoch = event.membership_epoch
    elif isinstance(event, WorkerFailed | WorkerLeft):
        job = state.job(event.job)
        member = job.members.get(event.worker_id)
        if member is not None and member.live:
            # A new member, not a change to the old one: a fork of the job (`decide_all`)
            # shares its members with the state it was forked from.
            status: WorkerState = "failed" if isinstance(event, WorkerFailed) else "left"
            member = job.members[event.worker_id] = replace(member, status=status)
            if job.ranks.get(member.rank) == event.worker_id:
                job.free_rank(member.rank)
            job.mark_gone(event.worker_id)
        job.membership_epoch = max(job.membership_epoch, event.membership_epoch)
    elif isinstance(event, WorkerStateChanged):
        member = state.job(event.job).members.get(event.worker_id)
        if member is not None and member.live:
            member.status = event.state
            member.step, member.epoch = event.step, event.epoch
    return state


# -- commands -------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Register:
    request: RegisterRequest


@dataclass(frozen=True)
class Leave:
    request: LeaveRequest


@dataclass(frozen=True)
class DetectFailures:
    """Fail every live worker whose last sign of life is older than the timeout: of those whose
    heartbeats registry partition `partition` of `partitions` takes in (all, by default)."""

    partition: int = 0
    partitions: int = 1
    liveness_ns: int | None = None
    """The liveness clock at which silence is measured (the clock `last_seen_ns` is on); None:
    the `now_ns` the decision is stamped with."""


Command = Register | Leave | DetectFailures


def decide(state: RegistryState, command: Command, now_ns: int, policy: Policy) -> Decision[bool]:
    """The events of `command`, or its error. A registration's `result` says whether it rejoined:
    took over a worker id that another registration held before (`takes_over`)."""
    if isinstance(command, Register):
        decision = _register(state, command.request, now_ns, policy)
        return Decision(decision.events, decision.error, takes_over(state, command.request))
    if isinstance(command, Leave):
        return _leave(state, command.request, now_ns)
    return Decision(
        detect_failures(
            state,
            now_ns,
            policy,
            command.partition,
            command.partitions,
            liveness_ns=command.liveness_ns,
        )
    )


def decide_all(
    state: RegistryState, commands: Sequence[Register | Leave], now_ns: int, policy: Policy
) -> list[Decision[bool]]:
    """Decide `commands` in order, each against the state the previous ones' events make: one
    batch of a group commit. `state` itself is left as it is (it changes only by folding what
    the stream stored): the batch works on forks of the jobs it touches."""
    scratch = RegistryState(dict(state.jobs))
    forked: set[str] = set()
    decisions: list[Decision[bool]] = []
    for command in commands:
        name = command.request.job
        if name not in forked:
            forked.add(name)
            if name in scratch.jobs:
                scratch.jobs[name] = scratch.jobs[name].fork()
        decision = decide(scratch, command, now_ns, policy)
        for event in decision.events:
            evolve(scratch, event)
        decisions.append(decision)
    return decisions


def worker_id_for(request: RegisterRequest) -> str:
    return request.worker_id or f"w-{request.instance[:24]}"


def takes_over(state: RegistryState, request: RegisterRequest) -> bool:
    """Whether registering `request` takes over an id that another registration held before: one
    that failed or left, or a live one of another process (which it supersedes)."""
    job = state.jobs.get(request.job)
    existing = job.members.get(worker_id_for(request)) if job is not None else None
    return existing is not None and (not existing.live or existing.instance != request.instance)


def _host(member: Member) -> str:
    return member.hostname or "an unknown host"


def _register(
    state: RegistryState, request: RegisterRequest, now_ns: int, policy: Policy
) -> Decision[None]:
    job = state.jobs.get(request.job) or Job(request.job)
    worker_id = worker_id_for(request)
    existing = job.members.get(worker_id)
    if existing is not None and existing.live and existing.instance == request.instance:
        if request.rank is not None and request.rank != existing.rank:
            return Decision(
                error=ConflictError(
                    f"worker {worker_id!r} of job {request.job!r} is registered with rank "
                    f"{existing.rank}, not {request.rank}; a registration keeps its rank: stop "
                    "the worker and start a new one to change it"
                )
            )
        return Decision()  # a retry of a registration that already happened
    if (
        request.rejoin
        and existing is not None
        and existing.instance
        not in (
            request.instance,
            request.replaces,
        )
    ):
        # The SDK re-registers on its own after being failed, as a new instance replacing the
        # one it was. Another process has registered the id since: the newer one holds it, and
        # taking it back would make the two processes take the id from each other in turn.
        return Decision(
            error=WorkerSuperseded(
                f"worker id {worker_id!r} of job {request.job!r} was registered by another "
                f"process (on {_host(existing)}) after this one, which therefore no longer "
                "counts as that worker and must not register again; stop this process"
            )
        )
    superseded = existing if existing is not None and existing.live else None
    if superseded is None and job.world_size >= MAX_WORKERS:
        return Decision(
            error=ConflictError(f"job {request.job!r} already has {MAX_WORKERS} live workers")
        )
    if request.rank is not None:
        holder_id = job.ranks.get(request.rank)
        if holder_id is not None and holder_id != worker_id:
            holder = job.members[holder_id]
            return Decision(
                error=ConflictError(
                    f"rank {request.rank} of job {request.job!r} is held by live worker "
                    f"{holder_id!r} on {_host(holder)}; stop that worker (or wait until it is "
                    "failed), or ask for a free rank, or for none to get the lowest free one",
                    rank=request.rank,
                    holder=holder_id,
                    host=holder.hostname,
                )
            )
        rank = request.rank
    elif superseded is not None:
        rank = superseded.rank
    else:
        rank = job.lowest_free_rank()
    events: list[Event] = []
    epoch = job.membership_epoch
    world_size = job.world_size
    if superseded is not None:
        # The same id as a heartbeat timeout of that registration would get: a registration ends
        # once, and whichever decision of its end is stored first is the one that counts.
        epoch += 1
        world_size -= 1
        events.append(
            WorkerFailed(
                id=event_id("failed", request.job, worker_id, superseded.registered_epoch),
                job=request.job,
                source=SOURCE,
                ts=now_ns,
                worker_id=worker_id,
                rank=superseded.rank,
                reason=f"{SUPERSEDED_REASON}, on {request.hostname or 'an unknown host'}",
                last_heartbeat_ts=superseded.last_heartbeat_ts or 0,
                membership_epoch=epoch,
            )
        )
    epoch += 1
    events.append(
        WorkerRegistered(
            id=event_id("registered", request.job, worker_id, request.instance, epoch),
            job=request.job,
            source=SOURCE,
            ts=now_ns,
            worker_id=worker_id,
            instance=request.instance,
            rank=rank,
            world_size=world_size + 1,
            membership_epoch=epoch,
            hostname=request.hostname,
            gpus=request.gpus,
            labels=request.labels,
            heartbeat_interval=policy.heartbeat_interval,
            heartbeat_timeout=policy.heartbeat_timeout,
        )
    )
    return Decision(events)


def _leave(state: RegistryState, request: LeaveRequest, now_ns: int) -> Decision[bool]:
    job = state.jobs.get(request.job)
    member = job.members.get(request.worker_id) if job else None
    if job is None or member is None:
        return Decision(
            error=NotFound(f"worker {request.worker_id!r} never registered in job {request.job!r}")
        )
    if member.instance != request.instance and member.live:
        return Decision(
            error=WorkerSuperseded(
                f"worker {request.worker_id!r} of job {request.job!r} is now another process; "
                "this process's registration ended earlier"
            )
        )
    if not member.live:
        return Decision()  # leaving twice, or after being failed: nothing left to do
    epoch = job.membership_epoch + 1
    return Decision(
        [
            WorkerLeft(
                id=event_id("left", request.job, request.worker_id, member.registered_epoch),
                job=request.job,
                source=SOURCE,
                ts=now_ns,
                worker_id=request.worker_id,
                rank=member.rank,
                membership_epoch=epoch,
            )
        ]
    )


def detect_failures(
    state: RegistryState,
    now_ns: int,
    policy: Policy,
    partition: int = 0,
    partitions: int = 1,
    *,
    liveness_ns: int | None = None,
) -> list[Event]:
    """The failures of the live workers silent for longer than the timeout, of those whose
    heartbeats partition `partition` of `partitions` takes in (`subjects.partition_of`): a
    partition has heard nothing of the others, so their silence is no evidence to it.

    Silence is measured at `liveness_ns` (the clock of `Member.last_seen_ns`; `now_ns` when
    None); the failures are stamped `now_ns`."""
    failed: list[Event] = []
    stamp_ns = now_ns
    if liveness_ns is not None:
        now_ns = liveness_ns
    timeout = policy.heartbeat_timeout
    timeout_ns = round(timeout * NS_PER_S)
    for job in state.jobs.values():
        # Runs several times a heartbeat interval over every member: a plain scan, and only the
        # few late members are put in rank order.
        members = job.members
        late = [
            member
            for member in (members[worker_id] for worker_id in job.ranks.values())
            if now_ns - member.last_seen_ns > timeout_ns
        ]
        if partitions > 1:
            late = [
                member
                for member in late
                if subjects.partition_of(member.worker_id, partitions) == partition
            ]
        if not late:
            continue
        late.sort(key=lambda member: member.rank)
        epoch = job.membership_epoch
        for member in late:
            silent = (now_ns - member.last_seen_ns) / NS_PER_S
            epoch += 1
            failed.append(
                WorkerFailed(
                    id=event_id("failed", job.job, member.worker_id, member.registered_epoch),
                    job=job.job,
                    source=SOURCE,
                    ts=stamp_ns,
                    worker_id=member.worker_id,
                    rank=member.rank,
                    reason=f"no heartbeat for {silent:.1f}s (timeout {timeout:g}s)",
                    last_heartbeat_ts=member.last_heartbeat_ts or 0,
                    membership_epoch=epoch,
                )
            )
    return failed


def confirm_failures(state: RegistryState, found: Sequence[WorkerFailed]) -> list[Event]:
    """The failures a heartbeat partition found (`detect_failures` on its own state), as the
    leader records them: only those of registrations still live here, the very ones the partition
    judged (a failure's id names the registration), with the rank and the membership epochs of
    the leader's state, so epochs still grow by one per change whoever noticed the silence."""
    confirmed: list[Event] = []
    epochs: dict[str, int] = {}
    seen: set[str] = set()
    for failure in found:
        job = state.jobs.get(failure.job)
        member = job.members.get(failure.worker_id) if job is not None else None
        if job is None or member is None or not member.live or failure.id in seen:
            continue
        if failure.id != event_id("failed", job.job, member.worker_id, member.registered_epoch):
            continue  # judged on another registration of this worker id than the live one
        seen.add(failure.id)
        epoch = epochs[job.job] = epochs.get(job.job, job.membership_epoch) + 1
        confirmed.append(
            failure.model_copy(update={"rank": member.rank, "membership_epoch": epoch})
        )
    return confirmed


# -- heartbeats -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class HeartbeatOutcome:
    events: list[Event] = field(default_factory=list)
    reregister: str | None = None
    """Set when the sender is not a live member: why it must register again."""
    superseded: str | None = None
    """Set when another process registered the sender's worker id after it: why it must stop
    (never told to register again, or the two processes would take the id from each other)."""
    rejected: str | None = None
    """Set when the heartbeat is ignored (also for a sender told to re-register): the reason."""


ALIVE: Final = HeartbeatOutcome()
"""The outcome of almost every heartbeat: shared, so never change its `events`."""


class Beat(NamedTuple):
    """What the registry uses of a heartbeat: the wire fields failure detection needs."""

    job: str
    worker_id: str
    instance: str
    seq: int
    state: LiveState
    step: int
    epoch: int


def observe_heartbeat(state: RegistryState, hb: WorkerHeartbeat, now_ns: int) -> HeartbeatOutcome:
    """Record a sign of life; a state change becomes an event, a stranger is told to re-register.

    Liveness itself is not an event (it would flood the stream): it is kept in memory, and after a
    restart every member gets a fresh grace period instead (`begin_grace`).
    """
    beat = Beat(hb.job, hb.worker_id, hb.instance, hb.seq, hb.state, hb.step, hb.epoch)
    return observe_beat(state, beat, now_ns)


def observe_beat(
    state: RegistryState, beat: Beat, now_ns: int, seen_ns: int | None = None
) -> HeartbeatOutcome:
    """`observe_heartbeat` for a heartbeat already reduced to its `Beat`: `now_ns` is the wall
    clock (what the member's last heartbeat is stamped with), `seen_ns` the liveness clock
    (`Member.last_seen_ns`; `now_ns` when None)."""
    job = state.jobs.get(beat.job)
    member = job.members.get(beat.worker_id) if job is not None else None
    if member is None:
        return HeartbeatOutcome(
            reregister=f"worker {beat.worker_id!r} is not registered", rejected="not_registered"
        )
    status = member.status
    if member.instance != beat.instance:
        # The SDK heartbeats only after registering, so the sender held this id once and a
        # later registration (a restart of the worker) replaced it, whatever became of that one.
        return HeartbeatOutcome(
            superseded=f"worker id {beat.worker_id!r} of job {beat.job!r} was registered by "
            f"another process (on {_host(member)}) after this one",
            rejected="instance_mismatch",
        )
    if status in GONE:
        return HeartbeatOutcome(
            reregister=f"worker {beat.worker_id!r} was marked {status}", rejected="not_live"
        )
    seen = now_ns if seen_ns is None else seen_ns
    if seen > member.last_seen_ns:
        member.last_seen_ns = seen
    member.last_heartbeat_ts = now_ns
    member.step, member.epoch = beat.step, beat.epoch
    if beat.state == status:
        return ALIVE
    changed = WorkerStateChanged(
        id=event_id("state", beat.job, beat.worker_id, beat.instance, beat.seq, beat.state),
        job=beat.job,
        source=SOURCE,
        ts=now_ns,
        worker_id=beat.worker_id,
        state=beat.state,
        previous=status,  # type: ignore[arg-type]  # live here, so a LiveState
        step=beat.step,
        epoch=beat.epoch,
    )
    # Applied at once, not when the event comes back from the stream: the heartbeats that follow
    # must not announce the same change again. Folding the event later sets the same value.
    member.status = beat.state
    return HeartbeatOutcome([changed])


Progress = tuple[str, str, str, int, int, int]
"""What a heartbeat partition tells the leader of one worker: job, worker id, instance, the time
its last heartbeat arrived (ns), step, epoch."""


def progress_since(
    state: RegistryState, since_ns: int, partition: int, partitions: int
) -> list[Progress]:
    """The live workers of partition `partition` heard from after `since_ns`."""
    found: list[Progress] = []
    for job in state.jobs.values():
        for worker_id in job.ranks.values():
            member = job.members[worker_id]
            heard = member.last_heartbeat_ts
            if heard is None or heard <= since_ns:
                continue
            if partitions == 1 or subjects.partition_of(worker_id, partitions) == partition:
                entry = (job.job, worker_id, member.instance, heard, member.step, member.epoch)
                found.append(entry)
    return found


def apply_progress(state: RegistryState, progress: Sequence[Progress]) -> int:
    """The leader's side of `progress_since`: the last heartbeat, step and epoch of workers
    whose heartbeats another partition takes in, for `members`. Liveness stays with that
    partition (it judges silence); only live members of the same registration are updated.
    Returns how many were."""
    updated = 0
    for job_id, worker_id, instance, heard, step, epoch in progress:
        job = state.jobs.get(job_id)
        member = job.members.get(worker_id) if job is not None else None
        if member is None or not member.live or member.instance != instance:
            continue
        if member.last_heartbeat_ts is None or heard > member.last_heartbeat_ts:
            member.last_heartbeat_ts = heard
            member.step, member.epoch = step, epoch
            updated += 1
    return updated


def begin_grace(state: RegistryState, now_ns: int) -> None:
    """After a (re)start, or once hearing is proven again, count every live member as seen at
    `now_ns` (liveness clock): a restart, or a time the registry could not hear, fails nobody.

    Set, not raised to: signs of life folded from events carry wall-clock stamps, which may lie
    ahead of the liveness clock (a wall clock stepped forward) and would keep a dead worker alive.
    """
    for job in state.jobs.values():
        for member in job.live_members():
            member.last_seen_ns = now_ns


# -- views ----------------------------------------------------------------------------------------


def registration(job: Job, worker_id: str, policy: Policy, rejoined: bool) -> Registration:
    return Registration.model_validate(registration_reply(job, worker_id, policy, rejoined))


def registration_reply(job: Job, worker_id: str, policy: Policy, rejoined: bool) -> dict[str, Any]:
    """`registration(...)` as the plain data of the RPC reply, built without the model: a job
    start answers thousands of these at once (a test holds the two to the same content)."""
    member = job.members[worker_id]
    return {
        "job": job.job,
        "worker_id": worker_id,
        "instance": member.instance,
        "rank": member.rank,
        "world_size": job.world_size,
        "membership_epoch": job.membership_epoch,
        "heartbeat_interval": policy.heartbeat_interval,
        "heartbeat_timeout": policy.heartbeat_timeout,
        "rejoined": rejoined,
        "lease_epoch": member.registered_epoch,
    }


def leave_result(job: Job, worker_id: str) -> LeaveResult:
    return LeaveResult(job=job.job, worker_id=worker_id, membership_epoch=job.membership_epoch)


def members(state: RegistryState, job_id: str, include_gone: bool = False) -> MembersResult:
    job = state.jobs.get(job_id) or Job(job_id)
    listed = (
        sorted(job.members.values(), key=lambda m: (not m.live, m.rank, m.worker_id))
        if include_gone
        else job.live_members()
    )
    return MembersResult(
        job=job_id,
        membership_epoch=job.membership_epoch,
        world_size=job.world_size,
        members=[m.info() for m in listed],
    )


# -- snapshots ------------------------------------------------------------------------------------


def snapshot(state: RegistryState) -> dict[str, Any]:
    """Plain data of the whole state (msgpack-able), for the snapshot bucket."""
    return {
        "v": 2,
        "jobs": [
            {
                "job": job.job,
                "membership_epoch": job.membership_epoch,
                "members": [
                    [
                        m.worker_id,
                        m.instance,
                        m.rank,
                        m.status,
                        m.hostname,
                        m.gpus,
                        m.labels,
                        m.registered_epoch,
                        m.step,
                        m.epoch,
                        m.last_seen_ns,
                    ]
                    for m in job.members.values()
                ],
                "gone": list(job.gone),
            }
            for job in state.jobs.values()
        ],
    }


def restore(data: dict[str, Any]) -> RegistryState:
    version = data.get("v")
    if version not in (1, 2):
        raise ValueError(f"unknown registry snapshot version {version!r}")
    # Version 1 kept the last sign of life in wall seconds, version 2 in ns like every event.
    seen_ns = NS_PER_S if version == 1 else 1
    state = RegistryState()
    for raw in data["jobs"]:
        job = state.job(raw["job"])
        job.membership_epoch = raw["membership_epoch"]
        for row in raw["members"]:
            member = Member(
                worker_id=row[0],
                instance=row[1],
                rank=row[2],
                status=row[3],
                hostname=row[4],
                gpus=row[5],
                labels=dict(row[6]),
                registered_epoch=row[7],
                step=row[8],
                epoch=row[9],
                last_seen_ns=int(row[10] * seen_ns),
            )
            job.members[member.worker_id] = member
            if member.live:
                job.take_rank(member.rank, member.worker_id)
        gone = raw.get("gone")
        if gone is None:  # written before the order was kept: the order of the members
            gone = [w for w, m in job.members.items() if not m.live]
        job.gone = dict.fromkeys(gone)
    return state
