"""The registry's state: each job's members, their ranks and statuses, and the policy of
heartbeats. Plain data with the few operations that keep it consistent (ranks taken and freed,
the bounded memory of members gone); what changes it is `domain.evolve`. No I/O here.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from strata.events import WorkerState
from strata.events.requests import MemberInfo

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
    last_beat_seq: int | None = None
    """The `seq` of this registration's last heartbeat applied here (None: none since this
    registry started): what the stream's record of its heartbeats is checked against before it
    is failed (`liveness.stream_contradicts`)."""

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


def host_of(member: Member) -> str:
    return member.hostname or "an unknown host"
