"""The barrier service's pure core: generations of named barriers; arrive, release, break, time out.

A generation opens at its first arrival and expects the job's live members at that moment (or an
explicit count). It is released exactly when complete, broken at once when an expected participant
fails or leaves, and timed out at its deadline. Arrivals carry the worker's own arrival count, so a
retried arrival (after a lost reply or a service restart) counts once and gets the same answer.
`evolve` is idempotent: the service applies its decisions at once and folds them again, unchanged,
when they come back from the stream. Arrivals are not stored before a release: after a restart a
generation is rebuilt from the arrivals that were recorded and those the waiters re-send (a re-send
names its generation; `passed` proves an earlier release), and a conclusion decided again has the
same event id (docs/barriers.md, "Crash recovery"). A waiter that gives up withdraws its
arrival (`withdraw`): taken out of a generation still waiting, and never counted if it comes late.

No I/O; the clock is passed in. `now_ns` is this process's monotonic clock (deadlines and
durations) and `wall_ns` the wall clock (event stamps); a caller with one clock (tests, replay)
passes `now_ns` alone and it serves as both. Deadlines carried in events (wall time) are placed on
the monotonic clock by `state.clock`, clamped to the generation's timeout (strata.clock.TimeBase).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Final

from strata.clock import TimeBase
from strata.errors import (
    BarrierTimeout,
    ConflictError,
    Forbidden,
    NotFound,
    StrataError,
    WorkerSuperseded,
)
from strata.events import (
    BarrierArrived,
    BarrierBrokenEvent,
    BarrierOpened,
    BarrierReleased,
    BarrierTimedOut,
    BarrierWithdrawn,
    Event,
    LiveHealed,
    LiveQuorumFormed,
    LiveStepDiscarded,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
)
from strata.events.ids import event_id
from strata.events.requests import (
    ArriveRequest,
    BarrierOutcome,
    LiveReportRequest,
    LiveReportResult,
    WithdrawRequest,
    WithdrawResult,
    WithdrawStatus,
    live_barrier_epoch,
)
from strata.services.barrier.state import (
    KEEP_GENERATIONS,
    KEEP_QUORUMS,
    NEVER,
    SOURCE,
    BarrierState,
    Generation,
    JobBarriers,
    NamedBarrier,
    Status,
)
from strata.services.domain import Decision

__all__ = [
    "FOLDS",
    "KEEP_GENERATIONS",
    "NEVER",
    "REQUESTED",
    "SOURCE",
    "Arrival",
    "BarrierState",
    "Batch",
    "Generation",
    "JobBarriers",
    "NamedBarrier",
    "Status",
    "arrive",
    "conclude",
    "decide_arrivals",
    "due",
    "evolve",
    "member_gone",
    "outcome",
    "recover",
    "release_proven",
    "report_live",
    "withdraw",
]


# -- evolve ---------------------------------------------------------------------------------------


FOLDS: Final[tuple[type[Event], ...]] = (
    WorkerRegistered,
    WorkerFailed,
    WorkerLeft,
    BarrierOpened,
    BarrierArrived,
    BarrierReleased,
    BarrierBrokenEvent,
    BarrierTimedOut,
    BarrierWithdrawn,
    LiveQuorumFormed,
)
"""The event types `evolve` folds; it ignores every other. The read model routes by this."""
REQUESTED: Final[tuple[type[Event], ...]] = (BarrierArrived,)
"""Of those, the ones this service records in answer to a worker's request (the dashboard's
requests/s)."""


def evolve(state: BarrierState, event: Event) -> BarrierState:
    if isinstance(event, WorkerRegistered):
        job = state.job(event.job)
        job.registered(event.worker_id, event.instance, event.ts)
        job.leases.fold(event)
        job.ranks[event.worker_id] = event.rank
    elif isinstance(event, WorkerFailed | WorkerLeft):
        job = state.job(event.job)
        job.live.discard(event.worker_id)
        job.leases.fold(event)
    elif isinstance(event, BarrierOpened):
        named = state.job(event.job).named(event.name)
        if event.generation not in named.generations:
            named.generations[event.generation] = Generation(
                name=event.name,
                generation=event.generation,
                expected=set(event.expected),
                expected_count=event.expected_count,
                by_count=not event.expected,
                opened_ns=event.ts,
                deadline_ns=_deadline(state, event),
                timeout_s=event.timeout_s,
            )
            for old in sorted(named.generations)[:-KEEP_GENERATIONS]:
                del named.generations[old]
    elif isinstance(event, LiveQuorumFormed):
        job = state.job(event.job)
        key = (event.membership_epoch, event.generation)
        job.quorums[key] = list(event.members)
        if job.last_quorum is None or key > job.last_quorum:
            job.last_quorum = key
        for stale in sorted(job.quorums)[:-KEEP_QUORUMS]:
            del job.quorums[stale]
    elif isinstance(event, BarrierArrived):
        _count(state, event)
    elif isinstance(event, BarrierWithdrawn):
        _withdraw(state, event)
    elif isinstance(event, BarrierReleased | BarrierBrokenEvent | BarrierTimedOut):
        gen = state.job(event.job).named(event.name).generations.get(event.generation)
        if gen is not None and gen.status == "waiting":
            if isinstance(event, BarrierReleased):
                gen.status = "released"
            elif isinstance(event, BarrierBrokenEvent):
                gen.status, gen.missing, gen.reason = "broken", event.missing, event.reason
            else:
                gen.status, gen.missing = "timed_out", event.missing
                gen.reason = f"not complete within {event.timeout_s:g}s"
    return state


def _deadline(state: BarrierState, event: BarrierOpened) -> int:
    """The generation's deadline on the state's clock: the time its event left, at most its
    timeout (a wall clock stepped back between two processes cannot extend it)."""
    if state.clock is None:
        return event.deadline_ts
    return state.clock.deadline(event.deadline_ts, int(event.timeout_s * 1e9))


def _at(state: BarrierState, event: BarrierArrived | Arrival) -> int:
    """When an arrival came, on the state's clock."""
    if isinstance(event, Arrival):
        return event.at_ns
    return event.ts if state.clock is None else state.clock.mono(event.ts)


def _count(state: BarrierState, event: BarrierArrived | Arrival) -> None:
    """An arrival's change to the state, from its event or its record (the same fields)."""
    named = state.job(event.job).named(event.name)
    if event.arrival <= named.withdrawn.get(event.worker_id, -1):
        return  # its sender gave up on it: recorded late, it counts nowhere
    gen = named.generations.get(event.generation)
    if gen is not None:
        gen.arrived.setdefault(event.worker_id, _at(state, event))
        gen.pending.discard(event.worker_id)
        if isinstance(event, Arrival) and event.lapses_ns is not None:
            _lapse_by(gen, event.worker_id, event.arrival, event.lapses_ns)
        if not gen.by_count and event.worker_id not in gen.expected:
            gen.expected.add(event.worker_id)
            gen.expected_count = len(gen.expected)
    previous = named.by_worker.get(event.worker_id)
    from_old_process = event.generation <= named.restarted.get(event.worker_id, -1)
    if not from_old_process and (previous is None or previous[0] <= event.arrival):
        named.by_worker[event.worker_id] = (event.arrival, event.generation)


# -- decisions ------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Arrival:
    """An arrival as decided: the fields of its `barrier.arrived` event, which is built only when
    it is recorded (in a burst, building a thousand events would cost more than deciding)."""

    job: str
    name: str
    generation: int
    worker_id: str
    arrival: int
    arrived: int
    ts: int
    """Its event's stamp (wall clock)."""
    at_ns: int
    """When it was decided, on the deciding clock (`now_ns`)."""
    lapses_ns: int | None = None
    """When its sender gives up waiting, on the deciding clock (None: it did not say)."""

    def event(self) -> BarrierArrived:
        return BarrierArrived(
            # The arrival count is part of it: a worker whose arrival was withdrawn (given up
            # on, or lapsed) may arrive again in the same generation, and both are the record.
            id=event_id(
                "arrived", self.job, self.name, self.generation, self.worker_id, self.arrival
            ),
            job=self.job,
            source=SOURCE,
            ts=self.ts,
            name=self.name,
            generation=self.generation,
            worker_id=self.worker_id,
            arrival=self.arrival,
            arrived=self.arrived,
        )


def _reading(state: BarrierState, now_ns: int, wall_ns: int | None) -> TimeBase:
    """This decision's moment on both clocks, which the state's clock becomes (one clock when
    the caller has no other: `now_ns` serves as both)."""
    if wall_ns is None:
        return TimeBase(now_ns, now_ns)
    state.clock = TimeBase(now_ns, wall_ns)
    return state.clock


def _release(job: str, gen: Generation, now: TimeBase) -> BarrierReleased:
    # A release proven by a participant after a restart may rest on no arrival this state holds.
    first = min(gen.arrived.values(), default=now.mono_ns)
    last = max(gen.arrived.values(), default=now.mono_ns)
    now_ns = now.mono_ns
    return BarrierReleased(
        id=event_id("released", job, gen.name, gen.generation),
        job=job,
        source=SOURCE,
        ts=now.wall_ns,
        name=gen.name,
        generation=gen.generation,
        participants=max(1, len(gen.arrived)),
        first_arrival_to_release_ms=max(0.0, (now_ns - first) / 1e6),
        last_arrival_to_release_ms=max(0.0, (now_ns - last) / 1e6),
    )


def _released(state: BarrierState, job: str, gen: Generation, now: TimeBase) -> list[Event]:
    """A generation's release, and for a live group's meeting barrier the quorum it formed."""
    return [_release(job, gen, now), *_quorum(state, job, gen, now)]


def _quorum(state: BarrierState, job_id: str, gen: Generation, now: TimeBase) -> list[Event]:
    """`live.quorum_formed` for the release of `live-<epoch>`: its members are the arrivals this
    service counted (none when the release was proven by a re-send after a restart: then there
    is nothing to record them from), compared with the job's previous quorum."""
    epoch = live_barrier_epoch(gen.name)
    job = state.jobs.get(job_id)
    if epoch is None or job is None or not gen.arrived:
        return []
    key = (epoch, gen.generation)
    if key in job.quorums:
        return []  # recorded already (a release decided again)
    members = sorted(gen.arrived, key=lambda worker: (job.ranks.get(worker, NEVER), worker))
    previous = job.quorums.get(job.last_quorum) if job.last_quorum is not None else None
    return [
        LiveQuorumFormed(
            id=event_id("live-quorum", job_id, epoch, gen.generation),
            job=job_id,
            source=SOURCE,
            ts=now.wall_ns,
            membership_epoch=epoch,
            generation=gen.generation,
            members=members,
            world_size=len(members),
            previous_epoch=None if job.last_quorum is None else job.last_quorum[0],
            left=[] if previous is None else [w for w in previous if w not in gen.arrived],
            joined=[] if previous is None else [w for w in members if w not in previous],
        )
    ]


def report_live(
    state: BarrierState, request: LiveReportRequest, now_ns: int, wall_ns: int | None = None
) -> Decision[LiveReportResult]:
    """Record what a member of a live quorum did in it (`live.healed`, `live.step_discarded`).

    Refused: a worker with no live registration in the job (NotFound), a superseded process or
    an ended lease, a quorum this service has no record of (NotFound: it was never formed, or is
    older than the last KEEP_QUORUMS), a reporter that is not a member of the quorum it names,
    and a heal from a worker that is not (Forbidden): a worker speaks only for what it took part
    in. The event id is a function of the report, so a retried report is recorded once.
    """
    now = _reading(state, now_ns, wall_ns)
    job = state.jobs.get(request.job)
    if job is None or request.worker_id not in job.live:
        return Decision(
            error=NotFound(
                f"worker {request.worker_id!r} is not a live member of job {request.job!r}: "
                "only a registered worker reports what it did in a live group"
            )
        )
    holder = job.instances.get(request.worker_id)
    if request.instance is not None and holder not in (None, request.instance):
        return Decision(
            error=WorkerSuperseded(
                f"worker {request.worker_id!r} of job {request.job!r} was registered by another "
                "process after this one: its reports no longer count"
            )
        )
    if request.lease is not None:
        fenced = job.leases.check(request.job, request.lease, request.worker_id)
        if fenced is not None:
            return Decision(error=fenced)
    key = (request.membership_epoch, request.generation)
    members = job.quorums.get(key)
    named = f"quorum {request.membership_epoch}/{request.generation} of job {request.job!r}"
    if members is None:
        return Decision(
            error=NotFound(
                f"no live {named} is recorded (it never formed, or it is older than the last "
                f"{KEEP_QUORUMS}): report against the group this worker is in"
            )
        )
    if request.worker_id not in members:
        return Decision(
            error=Forbidden(
                f"worker {request.worker_id!r} is not a member of the live {named} "
                f"({len(members)} members): a worker reports only on a group it is part of"
            )
        )
    event: Event
    if request.action == "healed":
        source = request.source_worker
        if source is None or source not in members or source == request.worker_id:
            return Decision(
                error=Forbidden(
                    f"a heal of {request.worker_id!r} in the live {named} must name another "
                    f"member as its source, not {source!r}"
                )
            )
        event = LiveHealed(
            id=event_id("live-healed", request.job, *key, request.worker_id),
            job=request.job,
            source=SOURCE,
            ts=now.wall_ns,
            membership_epoch=request.membership_epoch,
            generation=request.generation,
            worker_id=request.worker_id,
            source_worker=source,
            from_step=request.from_step or 0,
            to_step=request.step,
        )
    else:
        event = LiveStepDiscarded(
            id=event_id("live-discarded", request.job, *key, request.worker_id, request.step),
            job=request.job,
            source=SOURCE,
            ts=now.wall_ns,
            membership_epoch=request.membership_epoch,
            generation=request.generation,
            worker_id=request.worker_id,
            step=request.step,
            reason=request.reason[:1000],
        )
    return Decision([event], result=LiveReportResult(event_id=event.id))


def arrive(
    state: BarrierState, request: ArriveRequest, now_ns: int, wall_ns: int | None = None
) -> Decision[int]:
    """Join the current generation of the name, or open the next one; a retry changes nothing.

    Apply `conclude` first: a generation that is complete, or past its deadline, takes no more.
    An arrival naming a process (`instance`) other than the one that registered the worker last
    is refused: that process was superseded by a restart; so is one under a lease (`lease`)
    that has ended (the worker failed, or registered again since).
    """
    decision, arrival = _admit(state, request, _reading(state, now_ns, wall_ns))
    if arrival is not None:
        decision.events.append(arrival.event())
    return decision


def _admit(
    state: BarrierState, request: ArriveRequest, now: TimeBase, sent_after_ns: int | None = None
) -> tuple[Decision[int], Arrival | None]:
    """`arrive`, with the arrival as a record rather than an event (None for a retry).
    `sent_after_ns` (deciding clock): the earliest the request can have been sent, when the
    decider knows it was not listening for a while (paused); now by default."""
    job = state.jobs.get(request.job)
    if job is not None and request.lease is not None:
        holder = job.instances.get(request.worker_id)
        fenced = (
            None  # a superseded process: refused as such just below
            if request.instance is not None and holder not in (None, request.instance)
            else job.leases.check(request.job, request.lease, request.worker_id)
        )
        if fenced is not None:
            # A failed worker, or one registered again since: neither open nor join anything.
            return Decision(error=fenced), None
    if job is None or request.worker_id not in job.live:
        return Decision(
            error=NotFound(
                f"worker {request.worker_id!r} is not a live member of job {request.job!r}: "
                "register it (strata.Worker.start) before using barriers"
            )
        ), None
    registered = job.instances.get(request.worker_id)
    if request.instance is not None and registered not in (None, request.instance):
        # A process that a restart of the worker replaced: its arrivals, late or retried, would
        # otherwise count for the new process's generation.
        return Decision(
            error=WorkerSuperseded(
                f"worker {request.worker_id!r} of job {request.job!r} was registered by another "
                "process after this one: this process's arrivals no longer count"
            )
        ), None
    named = job.barriers.get(request.name) or NamedBarrier()
    if request.arrival <= named.withdrawn.get(request.worker_id, -1):
        # Its sender gave up waiting and withdrew it before it got here (a paused or
        # unreachable service), or its waiting time ran out here (it lapsed): it must not
        # open, join or complete anything now.
        return Decision(
            error=BarrierTimeout(
                f"arrival {request.arrival} of {request.worker_id!r} at {request.name!r} was "
                "withdrawn: its waiter's timeout passed before the barrier was released; it "
                "counts nowhere",
                name=request.name,
            )
        ), None
    lapses_ns = _lapses(request, now, sent_after_ns)
    previous = named.by_worker.get(request.worker_id)
    if previous is not None and previous[0] == request.arrival:
        joined = named.generations.get(previous[1])
        if lapses_ns is not None and joined is not None and joined.status == "waiting":
            # A re-send says how long its sender still waits: it can only shorten the wait.
            _lapse_by(joined, request.worker_id, request.arrival, lapses_ns)
        return Decision(result=previous[1]), None  # a retry: same generation, same answer
    if previous is not None and previous[0] > request.arrival:
        return Decision(
            error=ConflictError(
                f"arrival {request.arrival} of {request.worker_id!r} at {request.name!r} is older "
                f"than its arrival {previous[0]}; this process restarted its count"
            )
        ), None
    if request.generation is not None:
        hinted = named.generations.get(request.generation)
        if hinted is not None and hinted.status != "waiting":
            # A re-sent arrival that a restarted service never stored, for a generation that
            # ended meanwhile: it was part of it (an earlier answer said so), so it gets that
            # generation's outcome, not a seat in the next one.
            arrival = _arrived(request, hinted.generation, len(hinted.arrived) + 1, now, None)
            return Decision(result=hinted.generation), arrival
    else:
        bound = _bound(job, named, request, previous)
        if bound is not None:
            # The generation this arrival was for concluded without it (broken or timed out
            # while it was on its way, or its first send retried late): that generation's
            # outcome, not a seat in the next one, where it would stand for an arrival never
            # made. The same answer whether or not the service restarted in between.
            arrival = _arrived(request, bound.generation, len(bound.arrived) + 1, now, None)
            return Decision(result=bound.generation), arrival
    events: list[Event] = []
    current = named.current
    if current is None or current.status != "waiting":
        generation = 0 if current is None else current.generation + 1
        members = sorted(job.live)
        by_count = request.expected_count is not None
        opened = BarrierOpened(
            id=event_id("opened", request.job, request.name, generation),
            job=request.job,
            source=SOURCE,
            ts=now.wall_ns,
            name=request.name,
            generation=generation,
            expected=[] if by_count else members,
            expected_count=request.expected_count or max(1, len(members)),
            timeout_s=request.timeout_s,
            deadline_ts=now.wall_ns + int(request.timeout_s * 1e9),
        )
        events.append(opened)
        arrived_before = 0
    else:
        generation = current.generation
        if request.worker_id in current.arrived:
            return Decision(
                error=ConflictError(
                    f"{request.worker_id!r} already waits at {request.name!r} generation "
                    f"{generation} with an earlier arrival; wait for that one to finish"
                )
            ), None
        arrived_before = len(current.arrived)
    return Decision(events, result=generation), _arrived(
        request, generation, arrived_before + 1, now, lapses_ns
    )


def _arrived(
    request: ArriveRequest, generation: int, arrived: int, now: TimeBase, lapses_ns: int | None
) -> Arrival:
    return Arrival(
        request.job,
        request.name,
        generation,
        request.worker_id,
        request.arrival,
        arrived,
        now.wall_ns,
        now.mono_ns,
        lapses_ns,
    )


def _lapses(request: ArriveRequest, now: TimeBase, sent_after_ns: int | None) -> int | None:
    """When the arrival's sender gives up, on the deciding clock: its remaining wait counted
    from the earliest it can have been sent. Counted from when it is decided, a request that
    waited in a paused service's socket would seem to be waited on long after its sender gave
    up; the sender's grace (`strata._barrier.GRACE_S`) covers an ordinary network's delay."""
    if request.remaining_s is None:
        return None
    since = now.mono_ns if sent_after_ns is None else min(now.mono_ns, sent_after_ns)
    return since + int(request.remaining_s * 1e9)


def _lapse_by(gen: Generation, worker_id: str, arrival: int, lapses_ns: int) -> None:
    held = gen.lapses.get(worker_id)
    if held is None or held[1] != arrival or lapses_ns < held[0]:
        gen.lapses[worker_id] = (lapses_ns, arrival)
        gen.next_lapse_ns = min(gen.next_lapse_ns, lapses_ns)


def withdraw(
    state: BarrierState, request: WithdrawRequest, now_ns: int, wall_ns: int | None = None
) -> Decision[WithdrawResult]:
    """A waiter gave up on its arrival (no outcome within its timeout and grace): take it out of
    the generation it joined while that one still waits, and refuse it (`arrive`) if it comes
    later; a no-op for a generation that concluded, whose outcome stands. Idempotent.

    Without this, an arrival that reached a paused service after its sender gave up would open
    or complete a generation that its sender is not at."""
    now = _reading(state, now_ns, wall_ns)
    job = state.jobs.get(request.job)
    named = job.barriers.get(request.name) if job is not None else None
    if job is None or named is None:
        named = NamedBarrier()
    registered = job.instances.get(request.worker_id) if job is not None else None
    if request.instance is not None and registered not in (None, request.instance):
        # A superseded process's arrivals already count nowhere: nothing to take back.
        return Decision(result=_withdrawal(request, None, "superseded"))
    if request.arrival <= named.withdrawn.get(request.worker_id, -1):
        return Decision(result=_withdrawal(request, None, "withdrawn"))  # a retry
    previous = named.by_worker.get(request.worker_id)
    gen = None
    if previous is not None and previous[0] == request.arrival:
        gen = named.generations.get(previous[1])
    elif previous is not None and previous[0] > request.arrival:
        return Decision(result=_withdrawal(request, None, "superseded"))  # a newer one counts
    if gen is not None and gen.status != "waiting":
        # It was part of that generation's outcome: the outcome stands.
        return Decision(result=_withdrawal(request, gen.generation, gen.status))
    if gen is None:
        # Not counted yet (still on its way): it was for the waiting generation, or the next
        # to open. The worker's next arrival joins that one if it still waits, or a later one;
        # it is never answered with that generation's outcome, which it already gave up on.
        current = named.current
        number = 0 if current is None else current.generation + (current.status != "waiting")
    else:
        number = gen.generation
    withdrawn = BarrierWithdrawn(
        id=event_id("withdrawn", request.job, request.name, request.worker_id, request.arrival),
        job=request.job,
        source=SOURCE,
        ts=now.wall_ns,
        name=request.name,
        worker_id=request.worker_id,
        arrival=request.arrival,
        generation=number,
    )
    return Decision(
        [withdrawn],
        result=_withdrawal(request, withdrawn.generation, "withdrawn"),
    )


def _withdrawal(
    request: WithdrawRequest, generation: int | None, status: WithdrawStatus
) -> WithdrawResult:
    return WithdrawResult(
        job=request.job,
        name=request.name,
        worker_id=request.worker_id,
        arrival=request.arrival,
        generation=generation,
        status=status,
    )


def _withdraw(state: BarrierState, event: BarrierWithdrawn) -> None:
    """A withdrawal's change: the arrival leaves a generation still waiting; it and every older
    arrival of the worker at the name count nowhere from now on."""
    named = state.job(event.job).named(event.name)
    if event.arrival <= named.withdrawn.get(event.worker_id, -1):
        return
    named.withdrawn[event.worker_id] = event.arrival
    previous = named.by_worker.get(event.worker_id)
    if event.generation is not None and (previous is None or previous[0] <= event.arrival):
        # Where its next arrival is bound from (`_bound`): after the generation it gave up on.
        named.by_worker[event.worker_id] = (event.arrival, event.generation)
    gen = named.generations.get(event.generation) if event.generation is not None else None
    if gen is None or gen.status != "waiting" or event.worker_id not in gen.arrived:
        return
    del gen.arrived[event.worker_id]
    gen.lapses.pop(event.worker_id, None)
    if not gen.by_count and event.worker_id in gen.expected:
        gen.pending.add(event.worker_id)


def _bound(
    job: JobBarriers,
    named: NamedBarrier,
    request: ArriveRequest,
    previous: tuple[int, int] | None,
) -> Generation | None:
    """For a new arrival that names no generation, the generation it belongs to if that one has
    concluded: the first after the last this process returned from (`concluded`), the last its
    arrivals joined here and the last its previous process joined, opened since the process
    registered, that expected the worker. A waiting one on the way means none (the arrival
    joins it).

    Every arrival is bound this way, by a live service and by a restarted one alike, so the
    generation an arrival joins never depends on whether the service kept its arrivals: a
    restarted service that lost them reaches the same answer from `concluded` alone."""
    since = job.since_ns.get(request.worker_id, 0)
    after = max(
        -1 if request.concluded is None else request.concluded,
        -1 if previous is None else previous[1],
        named.restarted.get(request.worker_id, -1),
    )
    for number in sorted(named.generations):
        gen = named.generations[number]
        if number <= after or gen.opened_ns < since:
            continue
        if gen.status == "waiting":
            return None
        if request.worker_id in (gen.arrived if gen.by_count else gen.expected):
            return gen
    return None


def _proven(state: BarrierState, request: ArriveRequest) -> Generation | None:
    """The waiting generation that `request` proves released, if any: its sender says it passed
    it (`passed`), and only a release lets a participant pass. After a restart, a release that
    participants saw but the stream lost is known this way; in every other case the generation
    is released in the state already and nothing is proven.
    release (`release_proven`) before `arrive`."""
    if request.passed is None:
        return None
    if not state.recovered_ns:
        return None  # no restart yet: every release this state knows of is in it already
    job = state.jobs.get(request.job)
    if job is None or request.worker_id not in job.live:
        return None
    if request.instance is not None and job.instances.get(request.worker_id) != request.instance:
        return None
    named = job.barriers.get(request.name)
    gen = named.generations.get(request.passed) if named is not None else None
    if gen is None or gen.status != "waiting" or gen.opened_ns > state.recovered_ns:
        return None  # opened by this instance, which saw everything since: nothing was lost
    if not gen.by_count and request.worker_id not in gen.expected:
        return None  # only a participant can have passed it
    return gen


def release_proven(
    state: BarrierState, request: ArriveRequest, now_ns: int, wall_ns: int | None = None
) -> list[Event]:
    """The release `proven` finds, as an event (the same id as the one the stream lost)."""
    return _release_proven(state, request, _reading(state, now_ns, wall_ns))


def _release_proven(state: BarrierState, request: ArriveRequest, now: TimeBase) -> list[Event]:
    gen = _proven(state, request)
    return [] if gen is None else _released(state, request.job, gen, now)


def _timed_out(job: str, gen: Generation, now: TimeBase) -> BarrierTimedOut:
    return BarrierTimedOut(
        id=event_id("timed_out", job, gen.name, gen.generation),
        job=job,
        source=SOURCE,
        ts=now.wall_ns,
        name=gen.name,
        generation=gen.generation,
        timeout_s=gen.timeout_s,
        missing=gen.still_missing(),
        arrived=len(gen.arrived),
    )


def _lapsed(job: str, gen: Generation, now: TimeBase) -> list[Event]:
    """Withdrawals, for their senders, of the arrivals whose waiters have given up by now."""
    if gen.next_lapse_ns > now.mono_ns:
        return []
    gen.next_lapse_ns = min(
        (at for worker_id, (at, _) in gen.lapses.items() if worker_id in gen.arrived),
        default=NEVER,
    )
    if gen.next_lapse_ns > now.mono_ns:
        return []
    return [
        BarrierWithdrawn(
            id=event_id("withdrawn", job, gen.name, worker_id, arrival),
            job=job,
            source=SOURCE,
            ts=now.wall_ns,
            name=gen.name,
            worker_id=worker_id,
            arrival=arrival,
            generation=gen.generation,
        )
        for worker_id, (lapses_ns, arrival) in sorted(gen.lapses.items())
        if lapses_ns <= now.mono_ns and worker_id in gen.arrived
    ]


def _conclusion(state: BarrierState, job: str, gen: Generation, now: TimeBase) -> list[Event]:
    if gen.status != "waiting":
        return []
    if gen.completed_in_time():
        lapsed = _lapsed(job, gen, now)
        if lapsed:
            # Released with these, the barrier would count waiters that already raised
            # BarrierTimeout: withdrawn for them instead, and it waits on (or times out).
            return lapsed
        return _released(state, job, gen, now)
    if now.mono_ns >= gen.deadline_ns:
        return [_timed_out(job, gen, now)]
    return []


def conclude(
    state: BarrierState, job: str, name: str, now_ns: int, wall_ns: int | None = None
) -> list[Event]:
    """The release (complete before its deadline) or time-out (past it) of the current generation
    of `name`, if either is due; call it before and after every arrival."""
    return _conclude(state, job, name, _reading(state, now_ns, wall_ns))


def _conclude(state: BarrierState, job: str, name: str, now: TimeBase) -> list[Event]:
    found = state.jobs.get(job)
    named = found.barriers.get(name) if found is not None else None
    gen = named.current if named is not None else None
    return [] if gen is None else _conclusion(state, job, gen, now)


def due(state: BarrierState, now_ns: int, wall_ns: int | None = None) -> list[Event]:
    """Every conclusion due now: time-outs, and releases decided but never stored (a restart)."""
    now = _reading(state, now_ns, wall_ns)
    return [event for job, gen in state.waiting() for event in _conclusion(state, job, gen, now)]


def recover(state: BarrierState, now_ns: int, wall_ns: int | None = None) -> list[Event]:
    """What a restarted service owes every waiting generation: its release if it completed in
    time, its break if a participant failed or left meanwhile (a break decided but never stored),
    else its time-out if the deadline has passed. From now on the state is this instance's:
    generations opened before now are the only ones a `passed` claim may prove released."""
    now = _reading(state, now_ns, wall_ns)
    state.recovered_ns = now.wall_ns
    events: list[Event] = []
    for job_id, gen in state.waiting():
        # A barrier counted by arrivals that a departure left out of reach is not told apart
        # from one waiting for workers yet to join: it runs into its deadline instead.
        live = state.jobs[job_id].live
        gone = sorted((set(gen.arrived) if gen.by_count else gen.expected) - live)
        if gen.completed_in_time():
            events.extend(_released(state, job_id, gen, now))
        elif gone:
            reason = f"participants {', '.join(map(repr, gone))} failed or left"
            events.append(_broken(job_id, gen, gone, reason, now))
        elif now.mono_ns >= gen.deadline_ns:
            events.append(_timed_out(job_id, gen, now))
    return events


def _broken(
    job: str, gen: Generation, culprits: list[str], reason: str, now: TimeBase
) -> BarrierBrokenEvent:
    return BarrierBrokenEvent(
        id=event_id("broken", job, gen.name, gen.generation),
        job=job,
        source=SOURCE,
        ts=now.wall_ns,
        name=gen.name,
        generation=gen.generation,
        reason=reason,
        culprits=culprits,
        missing=gen.still_missing(),
    )


def member_gone(
    state: BarrierState,
    job_id: str,
    worker_id: str,
    why: str,
    now_ns: int,
    wall_ns: int | None = None,
) -> list[Event]:
    """Break every waiting generation of the job that the departed worker was part of."""
    now = _reading(state, now_ns, wall_ns)
    job = state.jobs.get(job_id)
    if job is None:
        return []
    events: list[Event] = []
    for named in job.barriers.values():
        gen = named.current
        # A complete generation is released, whoever leaves after completing it.
        if gen is None or gen.status != "waiting" or gen.completed_in_time():
            continue
        if gen.by_count:
            reachable = len(gen.arrived) + len(job.live - set(gen.arrived))
            involved = worker_id in gen.arrived or reachable < gen.expected_count
        else:
            involved = worker_id in gen.expected
        if involved:
            events.append(
                _broken(job_id, gen, [worker_id], f"participant {worker_id!r} {why}", now)
            )
    return events


Joined = tuple[str, str, int]
"""(job, name, generation): where an arrival was counted."""


@dataclass
class Batch:
    """What a batch of arrivals decided, already folded into the state."""

    told: list[Event] = field(default_factory=list)
    """Openings and conclusions, in order: stored before anyone is told an outcome."""
    record: list[Arrival] = field(default_factory=list)
    """The arrivals, a record for the dashboard and replay (`Arrival.event()`): no outcome rests
    on them."""
    joined: list[Joined | WithdrawResult | StrataError] = field(default_factory=list)
    """Per request, in order: where it was counted, a withdrawal's answer, or the error to
    answer with."""


def decide_arrivals(
    state: BarrierState,
    requests: Sequence[ArriveRequest | WithdrawRequest],
    now_ns: int,
    wall_ns: int | None = None,
    sent_after_ns: int | None = None,
) -> Batch:
    """Decide `requests` in order (withdrawals first), each against the state the previous ones
    left, folding every decision into `state` at once (`evolve` is idempotent: folding them
    again when the stream returns them changes nothing). For each: the release it proves
    (`passed`), the conclusion already due, the arrival, and the conclusion it completes.
    Answer each caller with `outcome(state, *joined)` once `told` is stored: the whole batch is
    then decided, so an arrival decided early hears of a release that a later one completed.
    `sent_after_ns`: the earliest the requests can have been sent (`_admit`)."""
    batch = Batch()
    now = _reading(state, now_ns, wall_ns)

    def fold(events: Sequence[Event]) -> None:
        for event in events:
            evolve(state, event)

    # Withdrawals first: an arrival its sender gave up on and the withdrawal right behind it
    # (both held up in a paused service) are read together; decided in order, the arrival could
    # complete a generation with another worker's arrival before the withdrawal took it back.
    answers: dict[int, WithdrawResult] = {}
    for index, request in enumerate(requests):
        if isinstance(request, WithdrawRequest):
            withdrawn = withdraw(state, request, now_ns, wall_ns)
            fold(withdrawn.events)
            batch.told.extend(withdrawn.events)
            assert withdrawn.result is not None
            answers[index] = withdrawn.result
    for index, request in enumerate(requests):
        if isinstance(request, WithdrawRequest):
            batch.joined.append(answers[index])
            continue
        for events in (
            _release_proven(state, request, now),
            _conclude(state, request.job, request.name, now),
        ):
            fold(events)
            batch.told.extend(events)
        decision, arrival = _admit(state, request, now, sent_after_ns)
        if decision.error is not None:
            batch.joined.append(decision.error)
            continue
        assert decision.result is not None
        fold(decision.events)
        batch.told.extend(decision.events)
        if arrival is not None:
            _count(state, arrival)
            batch.record.append(arrival)
        after = _conclude(state, request.job, request.name, now)
        fold(after)
        batch.told.extend(after)
        batch.joined.append((request.job, request.name, decision.result))
    return batch


def outcome(state: BarrierState, job: str, name: str, generation: int) -> BarrierOutcome:
    found = state.jobs.get(job)
    named = found.barriers.get(name) if found is not None else None
    gen = named.generations.get(generation) if named is not None else None
    if gen is None:
        raise NotFound(f"generation {generation} of barrier {name!r} is no longer kept")
    return gen.outcome(job)
