"""The barrier service's pure core: generations of named barriers; arrive, release, break, time out.

A generation opens at its first arrival and expects the job's live members at that moment (or an
explicit count). It is released exactly when complete, broken at once when an expected participant
fails or leaves, and timed out at its deadline. Arrivals carry the worker's own arrival count, so a
retried arrival (after a lost reply or a service restart) counts once and gets the same answer.
`evolve` is idempotent: the service applies its decisions at once and folds them again, unchanged,
when they come back from the stream. No I/O; the clock is passed in (ns).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from strata.errors import ConflictError, NotFound, StrataError
from strata.events import (
    BarrierArrived,
    BarrierBrokenEvent,
    BarrierOpened,
    BarrierReleased,
    BarrierTimedOut,
    Event,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
)
from strata.events.requests import ArriveRequest, BarrierOutcome
from strata.services.registry.domain import event_id

SOURCE = "barrier"
KEEP_GENERATIONS = 4
Status = Literal["waiting", "released", "broken", "timed_out"]


@dataclass
class Generation:
    name: str
    generation: int
    expected: set[str]
    expected_count: int
    by_count: bool
    """True when the caller gave a count: the participants are whoever arrives."""
    opened_ns: int
    deadline_ns: int
    timeout_s: float
    arrived: dict[str, int] = field(default_factory=dict)
    """Worker id -> arrival time (ns)."""
    status: Status = "waiting"
    missing: list[str] = field(default_factory=list)
    reason: str = ""

    def complete(self) -> bool:
        if self.by_count:
            return len(self.arrived) >= self.expected_count
        return self.expected.issubset(self.arrived)

    def still_missing(self) -> list[str]:
        if self.by_count:
            return []
        return sorted(self.expected - set(self.arrived))

    def outcome(self, job: str) -> BarrierOutcome:
        return BarrierOutcome(
            job=job,
            name=self.name,
            generation=self.generation,
            status=self.status,
            arrived=len(self.arrived),
            expected=self.expected_count,
            missing=self.missing if self.status != "waiting" else self.still_missing(),
            reason=self.reason,
        )


@dataclass
class NamedBarrier:
    generations: dict[int, Generation] = field(default_factory=dict)
    by_worker: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Worker id -> (its arrival count, the generation that arrival joined)."""

    @property
    def current(self) -> Generation | None:
        return self.generations[max(self.generations)] if self.generations else None


@dataclass
class JobBarriers:
    job: str
    live: set[str] = field(default_factory=set)
    barriers: dict[str, NamedBarrier] = field(default_factory=dict)

    def named(self, name: str) -> NamedBarrier:
        found = self.barriers.get(name)
        if found is None:
            found = self.barriers[name] = NamedBarrier()
        return found


@dataclass
class BarrierState:
    jobs: dict[str, JobBarriers] = field(default_factory=dict)

    def job(self, job: str) -> JobBarriers:
        found = self.jobs.get(job)
        if found is None:
            found = self.jobs[job] = JobBarriers(job)
        return found

    def waiting(self) -> list[tuple[str, Generation]]:
        return [
            (job.job, gen)
            for job in self.jobs.values()
            for named in job.barriers.values()
            for gen in named.generations.values()
            if gen.status == "waiting"
        ]


# -- evolve ---------------------------------------------------------------------------------------


def evolve(state: BarrierState, event: Event) -> BarrierState:
    if isinstance(event, WorkerRegistered):
        state.job(event.job).live.add(event.worker_id)
    elif isinstance(event, WorkerFailed | WorkerLeft):
        state.job(event.job).live.discard(event.worker_id)
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
                deadline_ns=event.deadline_ts,
                timeout_s=event.timeout_s,
            )
            for old in sorted(named.generations)[:-KEEP_GENERATIONS]:
                del named.generations[old]
    elif isinstance(event, BarrierArrived):
        named = state.job(event.job).named(event.name)
        gen = named.generations.get(event.generation)
        if gen is not None:
            gen.arrived.setdefault(event.worker_id, event.ts)
            if not gen.by_count and event.worker_id not in gen.expected:
                gen.expected.add(event.worker_id)
                gen.expected_count = len(gen.expected)
        previous = named.by_worker.get(event.worker_id)
        if previous is None or previous[0] <= event.arrival:
            named.by_worker[event.worker_id] = (event.arrival, event.generation)
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


# -- decisions ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Decision:
    events: list[Event] = field(default_factory=list)
    error: StrataError | None = None
    generation: int | None = None


def _release(job: str, gen: Generation, now_ns: int) -> BarrierReleased:
    first = min(gen.arrived.values())
    last = max(gen.arrived.values())
    return BarrierReleased(
        id=event_id("released", job, gen.name, gen.generation),
        job=job,
        source=SOURCE,
        ts=now_ns,
        name=gen.name,
        generation=gen.generation,
        participants=max(1, len(gen.arrived)),
        first_arrival_to_release_ms=max(0.0, (now_ns - first) / 1e6),
        last_arrival_to_release_ms=max(0.0, (now_ns - last) / 1e6),
    )


def arrive(state: BarrierState, request: ArriveRequest, now_ns: int) -> Decision:
    job = state.jobs.get(request.job)
    if job is None or request.worker_id not in job.live:
        return Decision(
            error=NotFound(
                f"worker {request.worker_id!r} is not a live member of job {request.job!r}: "
                "register it (strata.Worker.start) before using barriers"
            )
        )
    named = job.barriers.get(request.name) or NamedBarrier()
    previous = named.by_worker.get(request.worker_id)
    if previous is not None and previous[0] == request.arrival:
        return Decision(generation=previous[1])  # a retry: same generation, same answer
    if previous is not None and previous[0] > request.arrival:
        return Decision(
            error=ConflictError(
                f"arrival {request.arrival} of {request.worker_id!r} at {request.name!r} is older "
                f"than its arrival {previous[0]}; this process restarted its count"
            )
        )
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
            ts=now_ns,
            name=request.name,
            generation=generation,
            expected=[] if by_count else members,
            expected_count=request.expected_count or max(1, len(members)),
            timeout_s=request.timeout_s,
            deadline_ts=now_ns + int(request.timeout_s * 1e9),
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
            )
        arrived_before = len(current.arrived)
    events.append(
        BarrierArrived(
            id=event_id("arrived", request.job, request.name, generation, request.worker_id),
            job=request.job,
            source=SOURCE,
            ts=now_ns,
            name=request.name,
            generation=generation,
            worker_id=request.worker_id,
            arrival=request.arrival,
            arrived=arrived_before + 1,
        )
    )
    return Decision(events, generation=generation)


def release_if_complete(state: BarrierState, job: str, name: str, now_ns: int) -> list[Event]:
    gen = state.job(job).named(name).current
    if gen is not None and gen.status == "waiting" and gen.complete():
        return [_release(job, gen, now_ns)]
    return []


def member_gone(
    state: BarrierState, job_id: str, worker_id: str, why: str, now_ns: int
) -> list[Event]:
    """Break every waiting generation of the job that the departed worker was part of."""
    job = state.jobs.get(job_id)
    if job is None:
        return []
    events: list[Event] = []
    for named in job.barriers.values():
        gen = named.current
        if gen is None or gen.status != "waiting":
            continue
        if gen.by_count:
            reachable = len(gen.arrived) + len(job.live - set(gen.arrived))
            involved = worker_id in gen.arrived or reachable < gen.expected_count
        else:
            involved = worker_id in gen.expected
        if not involved:
            continue
        events.append(
            BarrierBrokenEvent(
                id=event_id("broken", job_id, gen.name, gen.generation),
                job=job_id,
                source=SOURCE,
                ts=now_ns,
                name=gen.name,
                generation=gen.generation,
                reason=f"participant {worker_id!r} {why}",
                culprits=[worker_id],
                missing=gen.still_missing(),
            )
        )
    return events


def timeouts(state: BarrierState, now_ns: int) -> list[Event]:
    return [
        BarrierTimedOut(
            id=event_id("timed_out", job, gen.name, gen.generation),
            job=job,
            source=SOURCE,
            ts=now_ns,
            name=gen.name,
            generation=gen.generation,
            timeout_s=gen.timeout_s,
            missing=gen.still_missing(),
            arrived=len(gen.arrived),
        )
        for job, gen in state.waiting()
        if now_ns >= gen.deadline_ns
    ]


def outcome(state: BarrierState, job: str, name: str, generation: int) -> BarrierOutcome:
    gen = state.job(job).named(name).generations.get(generation)
    if gen is None:
        raise NotFound(f"generation {generation} of barrier {name!r} is no longer kept")
    return gen.outcome(job)
