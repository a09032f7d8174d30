"""The registry's pure rules of liveness: heartbeats observed into the state, silence judged
into failures (`detect_failures`), failures a heartbeat partition found confirmed by the leader,
and the one id a registration's end is recorded under (`failure_id`). Time is passed in; no I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final, NamedTuple

from strata.events import (
    Event,
    LiveState,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerStateChanged,
    subjects,
)
from strata.events.ids import event_id
from strata.services.domain import NS_PER_S
from strata.services.registry.state import (
    GONE,
    SOURCE,
    Member,
    Policy,
    RegistryState,
    host_of,
)


def failure_id(job: str, member: Member) -> str:
    """The id of the event that ends `member`'s registration with a failure, whoever decides it
    (a heartbeat timeout, a heartbeat partition's report, a restart superseding it): it names
    the registration, so a registration ends once and the first decision stored is the one that
    counts; a copy decided again is dropped as a duplicate."""
    return event_id("failed", job, member.worker_id, member.registered_epoch)


def suspect_failure(
    state: RegistryState, job_id: str, worker_id: str, instance: str, reason: str, now_ns: int
) -> WorkerFailed | None:
    """The failure of registration `instance` of `worker_id`, proven dead by a probe
    (`registry.suspect`), or None when that registration is not live any more (it ended, or the
    id registered again since the probe was sent). Same id as any other end of that
    registration (`failure_id`), so whichever decision is stored first counts."""
    job = state.jobs.get(job_id)
    member = job.members.get(worker_id) if job is not None else None
    if job is None or member is None or not member.live or member.instance != instance:
        return None
    return WorkerFailed(
        id=failure_id(job_id, member),
        job=job_id,
        source=SOURCE,
        ts=now_ns,
        worker_id=worker_id,
        rank=member.rank,
        reason=reason,
        last_heartbeat_ts=member.last_heartbeat_ts or 0,
        membership_epoch=job.membership_epoch + 1,
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
                    id=failure_id(job.job, member),
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
        if failure.id != failure_id(job.job, member):
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
            f"another process (on {host_of(member)}) after this one",
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
    member.last_beat_seq = beat.seq
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


def stream_contradicts(
    member: Member,
    stored: Beat | None,
    stored_seq: int,
    listening_from: int,
    decided_on: int | None,
) -> bool:
    """Whether the telemetry stream's record of `member`'s heartbeats contradicts the silence it
    is about to be failed for: the last heartbeat stored on its subject (`stored`, at stream
    sequence `stored_seq`) is one of this registration that the decision did not know of (newer
    than `decided_on`, the `seq` of the last heartbeat applied when the failure was decided),
    stored after the registry began to listen (past sequence `listening_from`; an older one it
    could not have heard).

    The proof of hearing shows that every heartbeat the registry's own NATS node routed to it was
    applied; a heartbeat a worker sent to another node, which the stream stored with its quorum
    but whose route to the registry's node is cut (a partial partition), it does not cover. The
    stream's leader does.

    `decided_on`, not the member's `last_beat_seq` now: when the cut heals, the heartbeats it
    held reach the registry in a burst, and one applied while the stream is read would make the
    stream's last heartbeat look known, and the failure decided without it confirmed.
    """
    if stored is None or stored_seq <= listening_from:
        return False
    if stored.worker_id != member.worker_id or stored.instance != member.instance:
        return False  # another process's heartbeat under this id, not this registration's
    return decided_on is None or stored.seq > decided_on


def heard_in_stream(member: Member, stored: Beat, seen_ns: int) -> None:
    """Count a heartbeat found in the stream (`stream_contradicts`) as a sign of life heard at
    `seen_ns` (liveness clock): a fresh timeout, after which a worker that fell silent since is
    failed, its last stored heartbeat then being one this registry knows."""
    if seen_ns > member.last_seen_ns:
        member.last_seen_ns = seen_ns
    if member.last_beat_seq is None or stored.seq > member.last_beat_seq:
        member.last_beat_seq = stored.seq
