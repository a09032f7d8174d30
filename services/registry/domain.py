"""The registry's pure core: the fold of its events and the decisions on its state.

The state itself is in `state`, the rules of liveness (heartbeats observed, silence judged,
failures confirmed, `failure_id`) in `liveness`; both are re-exported here, so this module is the
registry's one domain face for the service, the read model and `strata replay`.

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
from dataclasses import dataclass, replace
from typing import Any, Final

from strata.errors import ConflictError, NotFound, WorkerSuperseded
from strata.events import (
    Event,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
    WorkerState,
    WorkerStateChanged,
)
from strata.events.ids import event_id
from strata.events.models import MAX_WORKERS, SUPERSEDED_REASON
from strata.events.requests import (
    LeaveRequest,
    LeaveResult,
    MembersResult,
    RegisterRequest,
    Registration,
)
from strata.services.domain import NS_PER_S, Decision
from strata.services.registry.liveness import (
    ALIVE,
    Beat,
    HeartbeatOutcome,
    Progress,
    apply_progress,
    begin_grace,
    confirm_failures,
    detect_failures,
    failure_id,
    heard_in_stream,
    observe_beat,
    observe_heartbeat,
    progress_since,
    stream_contradicts,
    suspect_failure,
)
from strata.services.registry.state import (
    GONE,
    MAX_GONE_PER_JOB,
    SOURCE,
    Job,
    Member,
    Policy,
    RegistryState,
    host_of,
)

__all__ = [
    "ALIVE",
    "FOLDS",
    "GONE",
    "MAX_GONE_PER_JOB",
    "REQUESTED",
    "SOURCE",
    "Beat",
    "Command",
    "DetectFailures",
    "HeartbeatOutcome",
    "Job",
    "Leave",
    "Member",
    "Policy",
    "Progress",
    "Register",
    "RegistryState",
    "apply_progress",
    "begin_grace",
    "confirm_failures",
    "decide",
    "decide_all",
    "detect_failures",
    "evolve",
    "failure_id",
    "heard_in_stream",
    "leave_result",
    "members",
    "observe_beat",
    "observe_heartbeat",
    "progress_since",
    "registration",
    "registration_reply",
    "restore",
    "snapshot",
    "stream_contradicts",
    "suspect_failure",
    "takes_over",
    "worker_id_for",
]


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
                f"process (on {host_of(existing)}) after this one, which therefore no longer "
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
                    f"{holder_id!r} on {host_of(holder)}; stop that worker (or wait until it is "
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
                id=failure_id(request.job, superseded),
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
