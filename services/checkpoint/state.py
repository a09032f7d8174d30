"""The checkpoint domain's state: open, committed and aborted steps of each job, its live
members and their leases, and the storage root and retention its first checkpoint fixed.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from strata.clock import TimeBase
from strata.events import CheckpointShardSaved, Participant
from strata.events.requests import Manifest
from strata.services.leases import Leases

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
    quorum: tuple[int, tuple[str, ...]] | None = None
    """The newest live quorum (`live.quorum_formed`): membership epoch, members in group-rank
    order. A step saved by one of its members has that quorum as its world."""

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
