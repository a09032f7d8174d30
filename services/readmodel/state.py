"""A job's state folded from its events: the read model behind the gateway and `strata replay`.

Events go through the services' own `evolve` functions (registry, sharding, barrier, checkpoint),
so the dashboard, a replay and the services agree on what every event means. Each event goes only
to the domains that declare its type beside their `evolve` (`FOLDS` in each `domain.py`): the
routing is built from those declarations, not kept as a table of its own. The state agrees with
the services on which events count too: read from NATS, an event must pass the provenance rule
(its own subject, a source that may emit it: `strata.events.provenance`); read from an exported
file, where subjects are not kept, its source must.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
from collections import OrderedDict, deque
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from types import ModuleType
from typing import Any, Final, NamedTuple

from strata.errors import DeadlineExceeded
from strata.events import (
    EVENT_MODELS,
    AnyEvent,
    BarrierArrived,
    BarrierReleased,
    CheckpointCommitted,
    CheckpointPruned,
    Event,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
    WorkerStateChanged,
    provenance,
)
from strata.history import Record, ReplayBudget, ReplayLimits, summarize
from strata.services.barrier import domain as barrier_domain
from strata.services.checkpoint import domain as checkpoint_domain
from strata.services.readmodel.live import LiveLog
from strata.services.readmodel.restarts import GoneStatus, Loss, RestartLog
from strata.services.readmodel.views import (
    BarrierView,
    CheckpointView,
    DatasetView,
    JobSummary,
    RecentEvent,
    WorkerView,
)
from strata.services.registry import domain as registry_domain
from strata.services.sharding import domain as sharding_domain

RECENT_EVENTS: Final = 200
RELEASES_KEPT: Final = 1000
UNCLAIMED_BEATS: Final = 4096
"""Beats kept per job of processes the registry has not recorded (yet): a heartbeat may be folded
before its worker's registration (the gateway reads the two streams apart). Past it, the oldest
goes: a flood of made-up instances costs the job a bounded amount."""
LISTED_CHECKPOINTS: Final = 100
LISTED_BARRIERS: Final = 100
GONE: Final = registry_domain.GONE

Evolve = Callable[[Any, Event], Any]

DOMAINS: Final[dict[str, ModuleType]] = {
    "registry": registry_domain,
    "sharding": sharding_domain,
    "barrier": barrier_domain,
    "checkpoint": checkpoint_domain,
}
"""The domains a job's state folds, by name; each declares `FOLDS` and `REQUESTED`."""


def event_type(model: type[Event]) -> str:
    """The `type` an event model's events carry."""
    return str(model.model_fields["type"].default)


ROUTES: Final[dict[str, tuple[str, ...]]] = {
    event_type(model): tuple(name for name, domain in DOMAINS.items() if model in domain.FOLDS)
    for model in EVENT_MODELS
}
"""Which domains each event type of the catalogue goes to, from the domains' declarations."""


def routes_for(event_type_name: str) -> tuple[str, ...]:
    """The domains whose `evolve` an event of this type goes through: those declaring it (none
    for a type no domain folds, such as `metric.sampled`)."""
    return ROUTES.get(event_type_name, ())


REQUEST_TYPES: Final = frozenset(
    event_type(model) for domain in DOMAINS.values() for model in domain.REQUESTED
)
"""Events caused by a worker's request: their rate is the dashboard's requests/s."""


class Beat(NamedTuple):
    """What the dashboard shows of a worker's latest heartbeat."""

    ts: int
    step: int
    epoch: int


class _Pruned(NamedTuple):
    epoch: int
    bytes: int
    committed_ns: int


class LiveRates(NamedTuple):
    """Rates only a running gateway knows (per second, over its last 10 s)."""

    events_per_s: float
    requests_per_s: float
    heartbeats_per_s: float


class JobState:
    """Everything known about one job, folded from its events and heartbeats.

    Heartbeats keep the latest beat of each registered worker, from the process the registry
    recorded for it (its `instance`); the beats of a worker or process the registry does not know
    (yet) wait among at most `UNCLAIMED_BEATS`, so what heartbeats can make the gateway keep is
    bounded by the job's registrations, whatever a worker sends. They never change a worker's
    status
    (the registry announces every change as an event). So the state after a set of events and
    heartbeats does not depend on how the two streams interleaved, and a replay of the history
    gives exactly what the live gateway shows.
    """

    def __init__(self, job: str) -> None:
        self.job = job
        self.registry = registry_domain.RegistryState()
        self.sharding = sharding_domain.ShardingState()
        self.barriers = barrier_domain.BarrierState()
        self.checkpoints = checkpoint_domain.CheckpointState()
        self._evolvers: dict[str, tuple[Evolve, Any]] = {}
        self._routes: dict[str, list[tuple[Evolve, Any]]] = {}
        self._connect_domains()
        self.seq = 0
        """Stream sequence (STRATA_EVENTS) of the last event folded."""
        self.ts = 0
        """`ts` of the last event folded (ns)."""
        self.events = 0
        self.heartbeats = 0
        self.version = 0
        """Bumped by every change: caches and live pushes compare it."""
        self.fold_errors = 0
        """Events a domain's `evolve` raised on (the same in a live fold and in a replay)."""
        self.rejected = 0
        """Events left out because their source may not emit them (`strata.events.provenance`)."""
        self.last_fold_error = ""
        self.recent: deque[tuple[int, AnyEvent]] = deque(maxlen=RECENT_EVENTS)
        self._recent_rows: dict[int, RecentEvent] = {}
        """Rendered rows of `recent` by sequence: an event is summarised once, not per render."""
        self.beats: dict[str, tuple[str, Beat]] = {}
        """Worker id -> (its registered instance, its latest beat)."""
        self.unclaimed: OrderedDict[tuple[str, str], Beat] = OrderedDict()
        """(worker id, instance) -> latest beat, for processes not registered when it came."""
        self.beats_ignored = 0
        """Heartbeats of a worker or instance not registered when they were folded."""
        self.metric_steps: dict[str, int] = {}
        """Worker id -> the highest step its `log_metrics` samples carried (since it registered)."""
        self.release_ms: deque[float] = deque(maxlen=RELEASES_KEPT)
        self._latency: dict[str, tuple[int, float]] = {}
        """Barrier name -> (generation, release latency in ms) of its latest release."""
        self._last_arrival: dict[str, tuple[int, int]] = {}
        """Barrier name -> (generation, stored time) of the latest arrival the stream holds."""
        self._commit_ms: dict[int, float] = {}
        self._pruned: dict[int, _Pruned] = {}
        self._last_commit: tuple[int, float] | None = None
        """(total bytes, duration in ms) of the checkpoint committed last."""
        self.restart_log = RestartLog()
        self.live_log = LiveLog()

    def _connect_domains(self) -> None:
        """Each domain's `evolve` with the state it folds into (again after a restore)."""
        states = {
            "registry": self.registry,
            "sharding": self.sharding,
            "barrier": self.barriers,
            "checkpoint": self.checkpoints,
        }
        self._evolvers = {name: (domain.evolve, states[name]) for name, domain in DOMAINS.items()}
        self._routes = {}

    # -- folding ----------------------------------------------------------------------------------

    def apply(self, record: Record) -> None:
        if isinstance(record.event, WorkerHeartbeat):
            self.apply_heartbeat(record.event)
        else:
            self.apply_event(record.seq, record.event, record.stored_ns)

    def apply_event(self, seq: int, event: AnyEvent, stored_ns: int | None = None) -> None:
        """Fold one event of the STRATA_EVENTS stream (stream sequence `seq`, stored at
        `stored_ns` when known: barrier latencies are measured with the stream's clock), unless
        its source may not emit it (then it is counted in `rejected` and changes nothing else)."""
        if provenance.source_refusal(event) is not None:
            self.rejected += 1
            return
        if event.type.startswith("live."):
            self.live_log.fold(event)
        routes = self._routes.get(event.type)
        if routes is None:
            routes = self._routes[event.type] = [
                self._evolvers[name] for name in routes_for(event.type)
            ]
        if routes:
            if event.type.startswith("worker."):
                self._note_membership(event)
            elif event.type.startswith("checkpoint."):
                self._note_checkpoint(event)
            elif isinstance(event, BarrierArrived) and stored_ns is not None:
                self._last_arrival[event.name] = (event.generation, stored_ns)
            elif isinstance(event, BarrierReleased):
                latency = self._release_latency(event, stored_ns)
                self._latency[event.name] = (event.generation, latency)
                self.release_ms.append(latency)
            for evolve, state in routes:
                try:
                    evolve(state, event)
                except Exception as exc:  # one event a domain cannot take must not stop the fold
                    self.fold_errors += 1
                    self.last_fold_error = f"seq {seq} ({event.type}): {type(exc).__name__}: {exc}"
        self.seq = seq
        self.ts = event.ts
        self.events += 1
        self.version += 1
        self.recent.append((seq, event))

    def _release_latency(self, event: BarrierReleased, stored_ns: int | None) -> float:
        """Milliseconds from the completing arrival to the release, both as the stream stored
        them: what the barrier's own clock cannot see (it decides the release at the instant of
        that arrival, so its figure is ~0), the time to record the arrival and the release."""
        arrival = self._last_arrival.pop(event.name, None)
        if stored_ns is None or arrival is None or arrival[0] != event.generation:
            return event.last_arrival_to_release_ms
        return max(0.0, (stored_ns - arrival[1]) / 1e6)

    def apply_heartbeat(self, heartbeat: WorkerHeartbeat) -> bool:
        """Keep the beat if its worker is registered with its instance; False when it is not."""
        beat = Beat(heartbeat.ts, heartbeat.step, heartbeat.epoch)
        # Claimed or not (heard before its registration, or after its failure), its step counts
        # for the restart log.
        self.restart_log.progressed(heartbeat.worker_id, heartbeat.instance, heartbeat.step)
        member = self._registry_job().members.get(heartbeat.worker_id)
        if member is None or member.instance != heartbeat.instance:
            self.beats_ignored += 1
            key = (heartbeat.worker_id, heartbeat.instance)
            self.unclaimed[key] = beat
            self.unclaimed.move_to_end(key)
            if len(self.unclaimed) > UNCLAIMED_BEATS:
                self.unclaimed.popitem(last=False)
            return False
        self.beats[heartbeat.worker_id] = (heartbeat.instance, beat)
        self.heartbeats += 1
        self.version += 1
        return True

    def _note_membership(self, event: Event) -> None:
        """Keep the job's losses and restarts (`restarts.RestartLog`); runs before evolve."""
        log = self.restart_log
        if isinstance(event, WorkerRegistered):
            self.metric_steps.pop(event.worker_id, None)  # a new process counts from its own
            log.registered(event.worker_id, event.instance, event.rank, event.ts)
        elif isinstance(event, WorkerFailed | WorkerLeft):
            member = self._registry_job().members.get(event.worker_id)
            if member is None or not member.live:
                return
            kept = self.beats.get(member.worker_id)
            step = kept[1].step if kept is not None and kept[0] == member.instance else 0
            status: GoneStatus = "failed" if isinstance(event, WorkerFailed) else "left"
            log.gone(
                Loss(
                    member.rank,
                    member.worker_id,
                    member.instance,
                    status,
                    event.ts,
                    max(step, member.step, self.metric_steps.get(member.worker_id, 0)),
                )
            )
        elif isinstance(event, WorkerStateChanged):
            member = self._registry_job().members.get(event.worker_id)
            if member is not None and member.live:
                log.progressed(member.worker_id, member.instance, event.step)

    def apply_metric_step(self, worker_id: str, step: int) -> bool:
        """A registered worker logged a metric at `step`: its step advances to it (a loop that
        only calls `log_metrics(step=...)` shows its progress); True when that changed it."""
        member = self._registry_job().members.get(worker_id)
        if member is None or step <= self.metric_steps.get(worker_id, -1):
            return False
        self.metric_steps[worker_id] = step
        self.restart_log.progressed(worker_id, member.instance, step)
        self.version += 1
        return True

    def _note_checkpoint(self, event: Event) -> None:
        """Keep what the checkpoint domain forgets but the dashboard shows; runs before evolve."""
        job = self.checkpoints.jobs.get(self.job)
        if isinstance(event, CheckpointCommitted):
            self._commit_ms[event.step] = event.duration_ms
            self._last_commit = (event.total_bytes, event.duration_ms)
        elif isinstance(event, CheckpointPruned) and job is not None:
            done = job.committed.get(event.step)
            if done is not None:
                self._pruned[event.step] = _Pruned(done.epoch, done.total_bytes, done.committed_ns)

    # -- views ------------------------------------------------------------------------------------

    def _registry_job(self) -> registry_domain.Job:
        return self.registry.jobs.get(self.job) or registry_domain.Job(self.job)

    def _sharding_job(self) -> sharding_domain.JobSharding:
        return self.sharding.jobs.get(self.job) or sharding_domain.JobSharding(self.job)

    def live_workers(self) -> int:
        return self._registry_job().world_size

    def known_workers(self) -> int:
        return len(self._registry_job().members)

    def shards_per_worker(self) -> dict[str, int]:
        """Shards each worker holds in the latest epoch plan of every dataset, summed."""
        job = self._sharding_job()
        totals: dict[str, int] = {}
        for dataset_id in job.datasets:
            epoch = job.latest_epoch(dataset_id)
            if epoch is None:
                continue
            for worker, count in job.plans[(dataset_id, epoch)].plan.loads().items():
                totals[worker] = totals.get(worker, 0) + count
        return totals

    def workers(self, shards: dict[str, int] | None = None) -> list[WorkerView]:
        """Every worker ever registered, in rank order (a rank's live holder before gone ones)."""
        held = self.shards_per_worker() if shards is None else shards
        beats = self.beats
        logged = self.metric_steps
        rows: list[WorkerView] = []
        members = self._registry_job().members.values()
        for member in sorted(members, key=lambda m: (m.rank, m.status in GONE, m.worker_id)):
            kept = beats.get(member.worker_id)
            if kept is not None and kept[0] == member.instance:
                beat: Beat | None = kept[1]
            else:
                beat = self.unclaimed.get((member.worker_id, member.instance))
            rows.append(
                {
                    "id": member.worker_id,
                    "rank": member.rank,
                    "status": member.status,
                    "live": member.live,
                    "step": max(
                        member.step if beat is None else beat.step, logged.get(member.worker_id, 0)
                    ),
                    "epoch": member.epoch if beat is None else beat.epoch,
                    "last_heartbeat": None if beat is None else beat.ts,
                    "shards": held.get(member.worker_id, 0),
                    "hostname": member.hostname,
                }
            )
        return rows

    def datasets(self) -> list[DatasetView]:
        job = self._sharding_job()
        rows: list[DatasetView] = []
        for dataset_id in sorted(job.datasets):
            spec = job.datasets[dataset_id]
            epoch = job.latest_epoch(dataset_id)
            plan = None if epoch is None else job.plans[(dataset_id, epoch)].plan
            rows.append(
                {
                    "id": dataset_id,
                    "total_samples": spec.total_samples,
                    "shard_size": spec.shard_size,
                    "num_shards": spec.num_shards,
                    "epoch": epoch,
                    "plan_version": None if plan is None else plan.version,
                    "done_shards": 0 if plan is None else int(plan.done.sum()),
                    "loads": {} if plan is None else plan.loads(),
                }
            )
        return rows

    def checkpoint_rows(self) -> list[CheckpointView]:
        """The latest `LISTED_CHECKPOINTS` steps, oldest first."""
        job = self.checkpoints.jobs.get(self.job) or checkpoint_domain.JobCheckpoints(self.job)
        steps = set(job.open) | set(job.committed) | set(job.aborted) | set(self._pruned)
        rows: list[CheckpointView] = []
        for step in sorted(steps)[-LISTED_CHECKPOINTS:]:
            opened = job.open.get(step)
            done = job.committed.get(step)
            row: CheckpointView
            if opened is not None:
                row = {
                    "step": step,
                    "epoch": opened.epoch,
                    "status": "open",
                    "bytes": sum(ack.bytes for ack in opened.acks.values()),
                    "committed_at": None,
                    "duration_ms": None,
                    "reason": "",
                }
            elif done is not None:
                row = {
                    "step": step,
                    "epoch": done.epoch,
                    "status": "committed",
                    "bytes": done.total_bytes,
                    "committed_at": done.committed_ns,
                    "duration_ms": self._commit_ms.get(step),
                    "reason": "",
                }
            elif step in job.aborted:
                dropped, reason = job.aborted[step]
                row = {
                    "step": step,
                    "epoch": dropped.epoch,
                    "status": "aborted",
                    "bytes": sum(ack.bytes for ack in dropped.acks.values()),
                    "committed_at": None,
                    "duration_ms": None,
                    "reason": reason,
                }
            else:
                pruned = self._pruned[step]
                row = {
                    "step": step,
                    "epoch": pruned.epoch,
                    "status": "pruned",
                    "bytes": pruned.bytes,
                    "committed_at": pruned.committed_ns,
                    "duration_ms": self._commit_ms.get(step),
                    "reason": "",
                }
            rows.append(row)
        return rows

    def barrier_rows(self) -> list[BarrierView]:
        """The latest generation of the `LISTED_BARRIERS` names opened last, oldest first."""
        job = self.barriers.jobs.get(self.job)
        if job is None:
            return []
        current = [gen for named in job.barriers.values() if (gen := named.current) is not None]
        current.sort(key=lambda gen: (gen.opened_ns, gen.name))
        rows: list[BarrierView] = []
        for gen in current[-LISTED_BARRIERS:]:
            latency = self._latency.get(gen.name)
            released = gen.status == "released" and latency is not None
            rows.append(
                {
                    "name": gen.name,
                    "generation": gen.generation,
                    "arrived": len(gen.arrived),
                    "expected": gen.expected_count,
                    "status": gen.status,
                    "latency_ms": round(latency[1], 3)
                    if released and latency is not None and latency[0] == gen.generation
                    else None,
                }
            )
        return rows

    def recent_rows(self) -> list[RecentEvent]:
        known = self._recent_rows
        rows: list[RecentEvent] = []
        for seq, event in self.recent:
            row = known.get(seq)
            if row is None:
                row = {"seq": seq, "ts": event.ts, "type": event.type, "summary": summarize(event)}
            rows.append(row)
        self._recent_rows = {row["seq"]: row for row in rows}
        return rows

    def checkpoint_mb_s(self) -> float | None:
        """Bytes over duration of the checkpoint committed last (MB = 10^6 bytes)."""
        if self._last_commit is None:
            return None
        total, duration_ms = self._last_commit
        if duration_ms <= 0:
            return None
        return round(total / 1e6 / (duration_ms / 1e3), 3)

    def barrier_p99_ms(self) -> float | None:
        """p99 (nearest rank) of the release latency of the last `RELEASES_KEPT` releases."""
        if not self.release_ms:
            return None
        ordered = sorted(self.release_ms)
        return round(ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)], 3)

    def summary(self) -> JobSummary:
        """This job's line of `/api/jobs`."""
        live = self.live_workers()
        return {
            "job": self.job,
            "workers": self.known_workers(),
            "live": live,
            "running": live > 0,
            "ranks_lost": self.restart_log.lost,
            "restarts": self.restart_log.restarted,
            "last_event_ts": self.ts,
            "events": self.events,
        }


class ReadModel:
    """The states of every job seen, for a reader that follows all of them (the gateway)."""

    def __init__(self) -> None:
        self.jobs: dict[str, JobState] = {}

    def job(self, job: str) -> JobState:
        found = self.jobs.get(job)
        if found is None:
            found = self.jobs[job] = JobState(job)
        return found

    def apply(self, record: Record) -> JobState:
        state = self.job(record.event.job)
        state.apply(record)
        return state


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    # A fold allocates objects for every event and frees few of them: the cycle collector would
    # scan the growing state again and again (a third of a rebuild's time) to find nothing.
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def rebuild(records: Iterable[Record], job: str, until_seq: int | None = None) -> JobState:
    """One job's state after `records` (in stored order), or after its events up to stream
    sequence `until_seq` and the heartbeats stored before the last of those."""
    state = JobState(job)
    after_last: list[Record] = []
    with collector_paused():
        for record in records:
            if record.event.job != job:
                continue
            if until_seq is not None:
                if record.stream == "telemetry":
                    after_last.append(record)
                    continue
                if record.seq > until_seq:
                    break
                for beat in after_last:
                    state.apply(beat)
                after_last.clear()
            state.apply(record)
    return state


async def fold_history(
    history: AsyncGenerator[Record, None],
    state: JobState,
    limits: ReplayLimits,
    narrow: str,
) -> JobState:
    """Fold `history` into `state` within `limits`, closing it in every case.

    Raises `TooLarge` on the first record past a bound of `limits` (records, planned shards)
    and `DeadlineExceeded` once `limits.timeout_s` have passed; `narrow` ends both messages,
    saying how to ask for less.
    """
    budget = ReplayBudget(limits, f"job {state.job!r} to that point", narrow)
    try:
        # The collector paused as in `rebuild`; a replay is bounded in time, so it is not for long.
        async with contextlib.aclosing(history), asyncio.timeout(limits.timeout_s):
            with collector_paused():
                async for record in history:
                    # Also between records: one record can take long to fold (a big re-plan).
                    budget.charge(record)
                    state.apply(record)
    except TimeoutError:
        raise DeadlineExceeded(
            f"replaying job {state.job!r} took more than {limits.timeout_s:g}s "
            f"({budget.records:,} events and heartbeats folded by then); {narrow}",
            folded=budget.records,
        ) from None
    return state
