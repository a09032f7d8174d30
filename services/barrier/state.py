"""The barrier domain's state: each job's named barriers and their generations, the job's live
members and leases, and the clock deadlines are placed on. Folded by `evolve`, decided on by the
rest of the domain (`services/barrier/domain.py`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from strata.clock import TimeBase
from strata.events.requests import BarrierOutcome
from strata.services.leases import Leases

SOURCE: Final = "barrier"
KEEP_GENERATIONS = 4
KEEP_QUORUMS: Final = 16
"""Live quorums a job keeps (the newest): a report names the quorum it happened in, which is one
of the last few unless the reporter lagged that far behind."""
NEVER: Final = 2**63
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
    """When it opened: its event's stamp (wall clock), compared only with other stamps."""
    deadline_ns: int
    """When it times out, on the deciding process's clock (`now_ns`: monotonic in a service)."""
    timeout_s: float
    arrived: dict[str, int] = field(default_factory=dict)
    """Worker id -> arrival time, on the same clock as `deadline_ns`."""
    status: Status = "waiting"
    missing: list[str] = field(default_factory=list)
    reason: str = ""
    pending: set[str] = field(default_factory=set)
    """Expected workers that have not arrived yet: completion is checked once per arrival."""
    lapses: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Worker id -> (when its waiter gives up, on the deciding clock; its arrival count), for
    arrivals decided by this process that said how long their sender waits (`remaining_s`).
    A release that would count a lapsed arrival withdraws it for its sender instead."""
    next_lapse_ns: int = NEVER
    """No arrival lapses before this (a lower bound): checked per decision in O(1)."""

    def __post_init__(self) -> None:
        if not self.by_count:
            self.pending = self.expected - set(self.arrived)

    def complete(self) -> bool:
        if self.by_count:
            return len(self.arrived) >= self.expected_count
        return not self.pending

    def completed_in_time(self) -> bool:
        """Complete, and the arrival that completed it came before the deadline."""
        return self.complete() and max(self.arrived.values(), default=0) < self.deadline_ns

    def still_missing(self) -> list[str]:
        return sorted(self.pending)

    def outcome(self, job: str) -> BarrierOutcome:
        """The answer to an arrival. `missing` is filled once the generation is broken or timed
        out: on every waiting answer it would cost O(participants) per arrival."""
        return BarrierOutcome(
            job=job,
            name=self.name,
            generation=self.generation,
            status=self.status,
            arrived=len(self.arrived),
            expected=self.expected_count,
            missing=self.missing,
            reason=self.reason,
        )


@dataclass
class NamedBarrier:
    generations: dict[int, Generation] = field(default_factory=dict)
    by_worker: dict[str, tuple[int, int]] = field(default_factory=dict)
    """Worker id -> (its arrival count, the generation that arrival joined)."""
    restarted: dict[str, int] = field(default_factory=dict)
    """Worker id -> the last generation its previous process joined: that process's arrivals, if
    folded again, no longer speak for the worker."""
    withdrawn: dict[str, int] = field(default_factory=dict)
    """Worker id -> its newest arrival count its process withdrew (gave up waiting): that
    arrival, and any older one, counts nowhere, however late it comes."""

    @property
    def current(self) -> Generation | None:
        return self.generations[max(self.generations)] if self.generations else None


@dataclass
class JobBarriers:
    job: str
    live: set[str] = field(default_factory=set)
    barriers: dict[str, NamedBarrier] = field(default_factory=dict)
    instances: dict[str, str] = field(default_factory=dict)
    """Worker id -> the process (instance) that registered it last."""
    since_ns: dict[str, int] = field(default_factory=dict)
    """Worker id -> when that process first registered it: only generations opened since can
    hold its arrivals."""
    leases: Leases = field(default_factory=Leases)
    """Each live worker's registration (lease): an arrival under an ended one is refused."""
    ranks: dict[str, int] = field(default_factory=dict)
    """Worker id -> its registry rank: a live quorum's members are listed in group-rank order."""
    quorums: dict[tuple[int, int], list[str]] = field(default_factory=dict)
    """(membership epoch, generation) -> the members of a live quorum, the newest KEEP_QUORUMS."""
    last_quorum: tuple[int, int] | None = None
    """The newest live quorum recorded: the one the next is compared with."""

    def registered(self, worker_id: str, instance: str, ts: int) -> None:
        self.live.add(worker_id)
        if self.instances.get(worker_id) != instance:
            self.since_ns[worker_id] = ts
        if self.instances.get(worker_id, instance) != instance:
            # A new process counts its arrivals from 0 again; the old process's are history.
            for named in self.barriers.values():
                previous = named.by_worker.pop(worker_id, None)
                if previous is not None:
                    named.restarted[worker_id] = previous[1]
        self.instances[worker_id] = instance

    def named(self, name: str) -> NamedBarrier:
        found = self.barriers.get(name)
        if found is None:
            found = self.barriers[name] = NamedBarrier()
        return found


@dataclass
class BarrierState:
    jobs: dict[str, JobBarriers] = field(default_factory=dict)
    recovered_ns: int = 0
    """When this instance took over (`recover`, wall clock): only a generation opened before it
    can have a release the stream lost, so only such a one can be proven released (`passed`)."""
    clock: TimeBase | None = None
    """Both clocks as last read by the adapter (it sets this before each fold and decision):
    places the wall-clock deadlines and stamps of folded events on the monotonic clock. None
    (a pure replay, the read model): stamps and deadlines are taken as they are."""

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
