"""The shapes of the gateway's JSON answers, as pydantic models for the OpenAPI document.

Handlers send JSON rendered by `strata.replay` straight out (validating a thousand workers on every
request would cost more than rendering them); these models describe it, and the unit tests check
that every rendered document fits them exactly (no field missing, none extra).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class WorkerView(_Shape):
    id: str
    rank: int
    status: Literal["idle", "loading", "training", "checkpointing", "recovering", "failed", "left"]
    step: int
    epoch: int
    last_heartbeat: int | None = Field(description="ns; time the worker stamped its last beat")
    shards: int = Field(description="Shards it holds in the latest epoch plan of every dataset")
    hostname: str


class DatasetView(_Shape):
    id: str
    total_samples: int
    shard_size: int
    num_shards: int
    epoch: int | None = Field(description="The latest epoch planned")
    plan_version: int | None
    done_shards: int
    loads: dict[str, int] = Field(description="Shards per worker in the latest plan")


class CheckpointView(_Shape):
    step: int
    epoch: int
    status: Literal["open", "committed", "aborted", "pruned"]
    bytes: int = Field(description="Committed: total; open or aborted: bytes acked so far")
    committed_at: int | None = Field(description="ns")
    duration_ms: float | None = Field(description="From opening to the manifest being written")
    reason: str


class BarrierView(_Shape):
    name: str
    generation: int
    arrived: int
    expected: int
    status: Literal["waiting", "released", "broken", "timed_out"]
    latency_ms: float | None = Field(
        description="Last arrival to release, both as the events stream stored them"
    )


class ShardDistribution(_Shape):
    max_over_mean: float | None
    min: int | None
    max: int | None


class Metrics(_Shape):
    checkpoint_mb_s: float | None = Field(
        description="Total bytes / duration of the checkpoint committed last (MB = 10^6 bytes)"
    )
    requests_per_s: float | None = Field(
        description="Events caused by worker requests (registered, left, dataset.registered, "
        "barrier.arrived, checkpoint.shard_saved, shard.progress) per second over the last 10 s; "
        "null in a replay"
    )
    heartbeats_per_s: float | None = Field(description="Over the last 10 s; null in a replay")
    events_per_s: float | None = Field(description="Over the last 10 s; null in a replay")
    barrier_p99_ms: float | None = Field(
        description="p99 of last-arrival-to-release latency over the last 1000 releases"
    )
    shard_distribution: ShardDistribution


class RecentEvent(_Shape):
    seq: int
    ts: int
    type: str
    summary: str


class Dashboard(_Shape):
    job: str
    seq: int = Field(description="Stream sequence of the last event folded")
    ts: int = Field(description="ns; the last event's own time")
    workers: list[WorkerView]
    datasets: list[DatasetView]
    checkpoints: list[CheckpointView]
    barriers: list[BarrierView]
    metrics: Metrics
    recent_events: list[RecentEvent] = Field(description="The last 200 events, oldest first")


class JobSummary(_Shape):
    job: str
    workers: int
    live: int
    last_event_ts: int
    events: int


class JobList(_Shape):
    jobs: list[JobSummary]


class WorkerPage(_Shape):
    total: int
    items: list[WorkerView]


class EventItem(_Shape):
    seq: int
    ts: int
    type: str
    summary: str
    event: dict[str, Any]


class EventPage(_Shape):
    items: list[EventItem]
    last_seq: int = Field(description="The last sequence examined: pass it as the next after_seq")
