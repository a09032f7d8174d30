"""A job's state rebuilt from its events: the read model behind the gateway and `strata replay`.

Events go through the services' own `evolve` functions (registry, sharding, barrier, checkpoint),
so the dashboard, a replay and the services agree on what every event means; `render_dashboard`
turns the folded state into the JSON of `/api/dashboard`, live or at any point of the history.
They agree on which events count too: read from NATS, an event must pass the provenance rule (its
own subject, a source that may emit it: `strata.events.provenance`); read from an exported file,
where subjects are not kept, its source must.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import gc
import json
import math
from collections import deque
from collections.abc import AsyncGenerator, Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

import pydantic
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from strata.errors import CodecError, DeadlineExceeded, StrataError, TooLarge
from strata.events import (
    AnyEvent,
    BarrierArrived,
    BarrierBrokenEvent,
    BarrierOpened,
    BarrierReleased,
    BarrierTimedOut,
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointShardStarted,
    CheckpointStarted,
    DatasetRegistered,
    Event,
    MetricSampled,
    RequestRejected,
    ShardPlanChanged,
    ShardProgress,
    ShardProgressRestored,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
    WorkerStateChanged,
    decode_event,
    provenance,
    subjects,
)
from strata.events.codec import validation_error
from strata.metrics import MESSAGES_REJECTED
from strata.services.barrier import domain as barrier_domain
from strata.services.checkpoint import domain as checkpoint_domain
from strata.services.registry import domain as registry_domain
from strata.services.sharding import domain as sharding_domain

RECENT_EVENTS: Final = 200
RELEASES_KEPT: Final = 1000
LISTED_CHECKPOINTS: Final = 100
LISTED_BARRIERS: Final = 100
GONE: Final = registry_domain.GONE

Stream = Literal["events", "telemetry"]

REQUEST_TYPES: Final = frozenset(
    {
        "worker.registered",
        "worker.left",
        "dataset.registered",
        "barrier.arrived",
        "checkpoint.shard_saved",
        "shard.progress",
    }
)
"""Events caused by a worker's request: their rate is the dashboard's requests/s."""

Evolve = Callable[[Any, Event], Any]

DOMAINS: Final = ("registry", "sharding", "barrier", "checkpoint")
ROUTES: Final[dict[str, tuple[str, ...]]] = {
    "worker.registered": DOMAINS,
    "worker.failed": DOMAINS,
    "worker.left": DOMAINS,
    "worker.state_changed": ("registry",),
    "dataset.registered": ("sharding",),
    "shard.plan_changed": ("sharding",),
    "shard.progress": ("sharding",),
    "shard.progress_restored": ("sharding",),
    "barrier.opened": ("barrier",),
    "barrier.arrived": ("barrier",),
    "barrier.released": ("barrier",),
    "barrier.broken": ("barrier",),
    "barrier.timed_out": ("barrier",),
    "checkpoint.started": ("checkpoint",),
    "checkpoint.shard_started": ("checkpoint",),
    "checkpoint.shard_saved": ("checkpoint",),
    "checkpoint.committed": ("checkpoint",),
    "checkpoint.aborted": ("checkpoint",),
    "checkpoint.pruned": ("checkpoint",),
    "request.rejected": (),
    "metric.sampled": (),
}
"""Which domains an event type concerns. Each `evolve` ignores the others anyway: the table only
spares the fold four isinstance chains per event. A type missing from it goes to every domain, so
a new event type is folded correctly before anyone updates the table (a unit test checks the
table against handing every event to all four)."""


def routes_for(event_type: str) -> tuple[str, ...]:
    """The domains whose `evolve` an event of `event_type` goes through."""
    return ROUTES.get(event_type, DOMAINS)


# -- records: one event with where it was stored --------------------------------------------------


@dataclass(frozen=True, slots=True)
class Record:
    """An event as read from a stream (or an exported line): its stream sequence and stored time."""

    seq: int
    stored_ns: int
    event: AnyEvent
    stream: Stream = "events"

    def to_json(self) -> str:
        """One line of an export file."""
        return (
            f'{{"seq":{self.seq},"stored_ns":{self.stored_ns},"stream":"{self.stream}",'
            f'"event":{self.event.model_dump_json()}}}'
        )


class _Line(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    seq: int = pydantic.Field(ge=0)
    stored_ns: int = pydantic.Field(ge=0)
    stream: Stream = "events"
    event: AnyEvent


def record_from_json(line: str | bytes, where: str = "line") -> Record:
    """A `Record` from one export line; `ValidationError` or `CodecError` naming `where`."""
    try:
        parsed = _Line.model_validate_json(line)
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise CodecError(f"{where} is not valid JSON: {first['msg']}") from None
        raise validation_error(exc, where) from None
    return Record(parsed.seq, parsed.stored_ns, parsed.event, parsed.stream)


def read_records(path: Path) -> Iterator[Record]:
    """Every record of an export file, in file order; blank lines are skipped."""
    with path.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            if line.strip():
                yield record_from_json(line, f"line {number} of {path}")


# -- summaries ------------------------------------------------------------------------------------


def _mb(count: int) -> str:
    return f"{count / 1e6:.1f} MB" if count >= 100_000 else f"{count} B"


def summarize(event: Event) -> str:
    """One line a person reads in a timeline: who did what, with the figures that matter."""
    if isinstance(event, WorkerHeartbeat):
        return f"{event.worker_id} heartbeat #{event.seq}: {event.state}, step {event.step}"
    if isinstance(event, WorkerRegistered):
        host = f" on {event.hostname}" if event.hostname else ""
        return (
            f"{event.worker_id} registered as rank {event.rank} of {event.world_size}{host} "
            f"(membership {event.membership_epoch})"
        )
    if isinstance(event, WorkerStateChanged):
        was = f"{event.previous} -> " if event.previous else ""
        return f"{event.worker_id} {was}{event.state} (step {event.step}, epoch {event.epoch})"
    if isinstance(event, WorkerFailed):
        return f"{event.worker_id} (rank {event.rank}) failed: {event.reason}"
    if isinstance(event, WorkerLeft):
        return f"{event.worker_id} (rank {event.rank}) left"
    if isinstance(event, DatasetRegistered):
        return (
            f"dataset {event.dataset_id}: {event.total_samples} samples in {event.num_shards} "
            f"shards of {event.shard_size}" + (", shuffled" if event.shuffle else "")
        )
    if isinstance(event, ShardPlanChanged):
        return (
            f"{event.dataset_id} epoch {event.epoch}: plan v{event.plan_version} over "
            f"{len(event.members)} workers, {event.moved_shards} shards moved ({event.reason})"
        )
    if isinstance(event, ShardProgressRestored):
        return (
            f"{event.dataset_id} epoch {event.epoch}: progress restored from the checkpoint of "
            f"step {event.checkpoint_step} ({len(event.completed)} shards done, "
            f"{len(event.partial)} in progress)"
        )
    if isinstance(event, ShardProgress):
        partial = f", {len(event.partial)} in progress" if event.partial else ""
        return (
            f"{event.worker_id} finished {len(event.completed)} shards of {event.dataset_id} "
            f"epoch {event.epoch}{partial}"
        )
    if isinstance(event, BarrierOpened):
        return (
            f"barrier {event.name}#{event.generation} opened, expecting {event.expected_count} "
            f"within {event.timeout_s:g}s"
        )
    if isinstance(event, BarrierArrived):
        return f"{event.worker_id} arrived at {event.name}#{event.generation} ({event.arrived})"
    if isinstance(event, BarrierReleased):
        return (
            f"barrier {event.name}#{event.generation} released: {event.participants} "
            f"participants, {event.last_arrival_to_release_ms:.1f} ms after the last arrival"
        )
    if isinstance(event, BarrierBrokenEvent):
        return f"barrier {event.name}#{event.generation} broken: {event.reason}"
    if isinstance(event, BarrierTimedOut):
        return (
            f"barrier {event.name}#{event.generation} timed out after {event.timeout_s:g}s "
            f"with {event.arrived} arrived, {len(event.missing)} missing"
        )
    if isinstance(event, CheckpointStarted):
        world = "" if event.world_size is None else f" for a world of {event.world_size}"
        return (
            f"checkpoint of step {event.step} (epoch {event.epoch}) started{world} with "
            f"{len(event.participants)} participants"
        )
    if isinstance(event, CheckpointShardStarted):
        return f"rank {event.rank} ({event.worker_id}) began its shard of step {event.step}"
    if isinstance(event, CheckpointShardSaved):
        return (
            f"rank {event.rank} ({event.worker_id}) saved {_mb(event.bytes)} for step {event.step}"
        )
    if isinstance(event, CheckpointCommitted):
        return (
            f"checkpoint of step {event.step} committed: {_mb(event.total_bytes)} in "
            f"{event.shards} shards, {event.duration_ms:.0f} ms"
        )
    if isinstance(event, CheckpointAborted):
        return f"checkpoint of step {event.step} aborted: {event.reason}"
    if isinstance(event, CheckpointPruned):
        return f"checkpoint of step {event.step} pruned"
    if isinstance(event, RequestRejected):
        return f"{event.service} refused {event.subject}: {event.code}: {event.message}"
    if isinstance(event, MetricSampled):
        return f"{event.name} = {event.value:g}"
    return event.type


# -- the fold -------------------------------------------------------------------------------------


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

    Heartbeats keep the latest beat of each (worker, instance); they never change a worker's status
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
        self._evolvers: dict[str, tuple[Evolve, Any]] = {
            "registry": (registry_domain.evolve, self.registry),
            "sharding": (sharding_domain.evolve, self.sharding),
            "barrier": (barrier_domain.evolve, self.barriers),
            "checkpoint": (checkpoint_domain.evolve, self.checkpoints),
        }
        self._routes: dict[str, list[tuple[Evolve, Any]]] = {}
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
        self._recent_rows: dict[int, dict[str, Any]] = {}
        """Rendered rows of `recent` by sequence: an event is summarised once, not per render."""
        self.beats: dict[tuple[str, str], Beat] = {}
        self.release_ms: deque[float] = deque(maxlen=RELEASES_KEPT)
        self._latency: dict[str, tuple[int, float]] = {}
        """Barrier name -> (generation, release latency in ms) of its latest release."""
        self._last_arrival: dict[str, tuple[int, int]] = {}
        """Barrier name -> (generation, stored time) of the latest arrival the stream holds."""
        self._commit_ms: dict[int, float] = {}
        self._pruned: dict[int, _Pruned] = {}
        self._last_commit: tuple[int, float] | None = None
        """(total bytes, duration in ms) of the checkpoint committed last."""

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
        routes = self._routes.get(event.type)
        if routes is None:
            routes = self._routes[event.type] = [
                self._evolvers[name] for name in routes_for(event.type)
            ]
        if routes:
            if event.type.startswith("checkpoint."):
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

    def apply_heartbeat(self, heartbeat: WorkerHeartbeat) -> None:
        self.beats[(heartbeat.worker_id, heartbeat.instance)] = Beat(
            heartbeat.ts, heartbeat.step, heartbeat.epoch
        )
        self.heartbeats += 1
        self.version += 1

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

    def workers(self, shards: dict[str, int] | None = None) -> list[dict[str, Any]]:
        """Every worker ever registered, in rank order (a rank's live holder before gone ones)."""
        held = self.shards_per_worker() if shards is None else shards
        beats = self.beats
        rows = []
        members = self._registry_job().members.values()
        for member in sorted(members, key=lambda m: (m.rank, m.status in GONE, m.worker_id)):
            beat = beats.get((member.worker_id, member.instance))
            rows.append(
                {
                    "id": member.worker_id,
                    "rank": member.rank,
                    "status": member.status,
                    "step": member.step if beat is None else beat.step,
                    "epoch": member.epoch if beat is None else beat.epoch,
                    "last_heartbeat": None if beat is None else beat.ts,
                    "shards": held.get(member.worker_id, 0),
                    "hostname": member.hostname,
                }
            )
        return rows

    def datasets(self) -> list[dict[str, Any]]:
        job = self._sharding_job()
        rows = []
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

    def checkpoint_rows(self) -> list[dict[str, Any]]:
        """The latest `LISTED_CHECKPOINTS` steps, oldest first."""
        job = self.checkpoints.jobs.get(self.job) or checkpoint_domain.JobCheckpoints(self.job)
        steps = set(job.open) | set(job.committed) | set(job.aborted) | set(self._pruned)
        rows = []
        for step in sorted(steps)[-LISTED_CHECKPOINTS:]:
            opened = job.open.get(step)
            done = job.committed.get(step)
            row: dict[str, Any]
            if opened is not None:
                row = {
                    "epoch": opened.epoch,
                    "status": "open",
                    "bytes": sum(ack.bytes for ack in opened.acks.values()),
                    "committed_at": None,
                    "duration_ms": None,
                    "reason": "",
                }
            elif done is not None:
                row = {
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
                    "epoch": pruned.epoch,
                    "status": "pruned",
                    "bytes": pruned.bytes,
                    "committed_at": pruned.committed_ns,
                    "duration_ms": self._commit_ms.get(step),
                    "reason": "",
                }
            rows.append({"step": step, **row})
        return rows

    def barrier_rows(self) -> list[dict[str, Any]]:
        """The latest generation of the `LISTED_BARRIERS` names opened last, oldest first."""
        job = self.barriers.jobs.get(self.job)
        if job is None:
            return []
        current = [gen for named in job.barriers.values() if (gen := named.current) is not None]
        current.sort(key=lambda gen: (gen.opened_ns, gen.name))
        rows = []
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

    def recent_rows(self) -> list[dict[str, Any]]:
        known = self._recent_rows
        rows = []
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

    def summary(self) -> dict[str, Any]:
        """This job's line of `/api/jobs`."""
        return {
            "job": self.job,
            "workers": self.known_workers(),
            "live": self.live_workers(),
            "last_event_ts": self.ts,
            "events": self.events,
        }


def shard_distribution(shards: dict[str, int]) -> dict[str, float | int | None]:
    if not shards:
        return {"max_over_mean": None, "min": None, "max": None}
    counts = list(shards.values())
    mean = sum(counts) / len(counts)
    return {
        "max_over_mean": round(max(counts) / mean, 4) if mean > 0 else None,
        "min": min(counts),
        "max": max(counts),
    }


def render_dashboard(state: JobState, rates: LiveRates | None = None) -> dict[str, Any]:
    """The `/api/dashboard` document; without `rates` (a replay) the live rates are null."""
    shards = state.shards_per_worker()
    return {
        "job": state.job,
        "seq": state.seq,
        "ts": state.ts,
        "workers": state.workers(shards),
        "datasets": state.datasets(),
        "checkpoints": state.checkpoint_rows(),
        "barriers": state.barrier_rows(),
        "metrics": {
            "checkpoint_mb_s": state.checkpoint_mb_s(),
            "requests_per_s": None if rates is None else rates.requests_per_s,
            "heartbeats_per_s": None if rates is None else rates.heartbeats_per_s,
            "events_per_s": None if rates is None else rates.events_per_s,
            "barrier_p99_ms": state.barrier_p99_ms(),
            "shard_distribution": shard_distribution(shards),
        },
        "recent_events": state.recent_rows(),
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
def _collector_paused() -> Iterator[None]:
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
    with _collector_paused():
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


# -- reading history from NATS --------------------------------------------------------------------

READ_AHEAD_MSGS: Final = 8192
READ_BUFFER_MSGS: Final = 65_536
STALLED_S: Final = 10.0


REPLAY_CONSUMER: Final = "replay"
"""How reads of history name themselves in `strata_messages_rejected_total`."""


def heartbeat_belongs(subject: str, heartbeat: WorkerHeartbeat) -> bool:
    """A heartbeat counts only on its own subject and from its own worker (the registry applies
    the same rule)."""
    return provenance.refusal(subject, heartbeat) is None


async def stream_records(
    js: JetStreamContext,
    stream: Stream,
    filter_subject: str,
    *,
    start_seq: int | None = None,
    start_ns: int | None = None,
    until_seq: int | None = None,
    until_ns: int | None = None,
) -> AsyncGenerator[Record, None]:
    """Records of one stream matching `filter_subject`, oldest first, up to the bounds or to what
    is stored when the read catches up. Malformed messages are skipped (a live feed drops them
    too). An ordered push consumer feeding a callback: nats-py's pull `fetch` and its message
    iterator both cost a task per message, which made reading slower than folding."""
    name = subjects.EVENTS_STREAM if stream == "events" else subjects.TELEMETRY_STREAM
    config = ConsumerConfig()
    if start_seq is not None and start_seq > 1:
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start_seq
    elif start_ns is not None:
        config.deliver_policy = DeliverPolicy.BY_START_TIME
        config.opt_start_time = datetime.datetime.fromtimestamp(start_ns / 1e9, datetime.UTC)
    inbox: asyncio.Queue[Msg] = asyncio.Queue(maxsize=READ_AHEAD_MSGS)
    sub = await js.subscribe(
        filter_subject,
        stream=name,
        ordered_consumer=True,
        config=config,
        cb=inbox.put,
        idle_heartbeat=2.0,
        pending_msgs_limit=READ_BUFFER_MSGS,
    )
    try:
        info = await sub.consumer_info()
        # Nothing pending may also mean "all of it is already in our buffer": only a consumer
        # that has delivered nothing at all has nothing to read.
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        if (info.num_pending or 0) == 0 and not delivered:
            return
        while True:
            try:
                msg = inbox.get_nowait()
            except asyncio.QueueEmpty:
                # Only when the read ran dry: one timer per batch the server sends, not per message.
                try:
                    msg = await asyncio.wait_for(inbox.get(), STALLED_S)
                except TimeoutError:
                    return  # a message deleted while it was being read, say: end, don't hang
            meta = msg.metadata
            seq = meta.sequence.stream
            stored_ns = int(meta.timestamp.timestamp() * 1e9)
            if (until_seq is not None and seq > until_seq) or (
                until_ns is not None and stored_ns > until_ns
            ):
                return
            try:
                event: AnyEvent | None = decode_event(msg.data)
            except StrataError as exc:
                MESSAGES_REJECTED.labels(REPLAY_CONSUMER, exc.code).inc()
                event = None
            if event is not None:
                if stream == "telemetry" and not isinstance(event, WorkerHeartbeat | MetricSampled):
                    refused: provenance.Refusal | None = provenance.Refusal("not_a_heartbeat", "")
                else:
                    refused = provenance.refusal(msg.subject, event)
                if refused is None:
                    yield Record(seq, stored_ns, event, stream)
                else:
                    MESSAGES_REJECTED.labels(REPLAY_CONSUMER, refused.code).inc()
            if meta.num_pending == 0 or seq == until_seq:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def job_history(
    js: JetStreamContext,
    job: str,
    *,
    from_seq: int | None = None,
    since_ns: int | None = None,
    until_seq: int | None = None,
    until_ns: int | None = None,
    telemetry: bool = True,
) -> AsyncGenerator[Record, None]:
    """A job's events (and heartbeats, with `telemetry`) merged in stored order, within bounds.

    Bounds are events-stream sequences or stored times. Heartbeats start with the first event
    read, and with `until_seq` they stop at the last one, so the two streams stay one consistent
    cut of the history.
    """
    events = stream_records(
        js,
        "events",
        subjects.job_events(job),
        start_seq=from_seq,
        start_ns=since_ns,
        until_seq=until_seq,
        until_ns=until_ns,
    )
    async with contextlib.aclosing(events):
        head = await anext(events, None)
        if head is None:
            return
        if not telemetry:
            yield head
            async for record in events:
                yield record
            return
        beats = stream_records(
            js,
            "telemetry",
            subjects.job_heartbeats(job),
            start_ns=head.stored_ns if from_seq is not None else since_ns,
            until_ns=until_ns,
        )
        last_event_ns = head.stored_ns
        async with contextlib.aclosing(beats):
            async for beat in beats:
                while head is not None and head.stored_ns <= beat.stored_ns:
                    yield head
                    last_event_ns = head.stored_ns
                    head = await anext(events, None)
                if head is None and until_seq is not None and beat.stored_ns > last_event_ns:
                    break
                yield beat
        while head is not None:
            yield head
            head = await anext(events, None)


@dataclass(frozen=True)
class ReplayLimits:
    """How much one replay from NATS may take: a replay reads a job's whole history up to the
    point asked for, so without bounds one request could hold a reader for as long as the
    history is long. Defaults as in `strata.config.Settings`."""

    max_records: int = 250_000
    """Events, plus heartbeats when they are asked for."""
    timeout_s: float = 30.0


async def fold_history(
    history: AsyncGenerator[Record, None],
    state: JobState,
    limits: ReplayLimits,
    narrow: str,
) -> JobState:
    """Fold `history` into `state` within `limits`, closing it in every case.

    Raises `TooLarge` on the first record past `limits.max_records` and `DeadlineExceeded` once
    `limits.timeout_s` have passed; `narrow` ends both messages, saying how to ask for less.
    """
    folded = 0
    try:
        async with contextlib.aclosing(history), asyncio.timeout(limits.timeout_s):
            async for record in history:
                if folded == limits.max_records:
                    raise TooLarge(
                        f"replaying job {state.job!r} to that point folds more than "
                        f"{limits.max_records:,} events and heartbeats, the most one replay "
                        f"may fold; {narrow}",
                        limit=limits.max_records,
                    )
                state.apply(record)
                folded += 1
    except TimeoutError:
        raise DeadlineExceeded(
            f"replaying job {state.job!r} took more than {limits.timeout_s:g}s "
            f"({folded:,} events and heartbeats folded by then); {narrow}",
            folded=folded,
        ) from None
    return state


def dumps(document: Any) -> str:
    """Compact JSON, as the gateway and `strata replay --state` write it."""
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False)
