"""The read model's documents, typed once: what `render_dashboard` and the rows of a `JobState` are.

Typed dicts rather than models: the read model builds plain dicts (a 1,000-worker dashboard is
rendered many times a second, and validating it each time would cost more than rendering it),
mypy holds every row built to its type, and pydantic reads the same types for the gateway's
OpenAPI document, from which `dashboard/src/api/types.ts` is generated (`scripts/gen_api_types.py`).
`extra="forbid"` makes a rendered document that strays from its type fail validation in the tests.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import ConfigDict, Field, with_config
from typing_extensions import TypedDict

_STRICT = ConfigDict(extra="forbid")


@with_config(_STRICT)
class WorkerView(TypedDict):
    id: str
    rank: int
    status: Literal["idle", "loading", "training", "checkpointing", "recovering", "failed", "left"]
    live: Annotated[bool, Field(description="Holds its rank: not failed and not left")]
    step: Annotated[
        int, Field(description="Its latest step: from set_state or log_metrics(step=...)")
    ]
    epoch: int
    last_heartbeat: Annotated[
        int | None, Field(description="ns; time the worker stamped its last beat")
    ]
    shards: Annotated[
        int, Field(description="Shards it holds in the latest epoch plan of every dataset")
    ]
    hostname: str


@with_config(_STRICT)
class DatasetView(TypedDict):
    id: str
    total_samples: int
    shard_size: int
    num_shards: int
    epoch: Annotated[int | None, Field(description="The latest epoch planned")]
    plan_version: int | None
    done_shards: int
    loads: Annotated[dict[str, int], Field(description="Shards per worker in the latest plan")]


@with_config(_STRICT)
class CheckpointView(TypedDict):
    step: int
    epoch: int
    status: Literal["open", "committed", "aborted", "pruned"]
    bytes: Annotated[
        int, Field(description="Committed: total; open or aborted: bytes acked so far")
    ]
    committed_at: Annotated[int | None, Field(description="ns")]
    duration_ms: Annotated[
        float | None, Field(description="From opening to the manifest being written")
    ]
    reason: str


@with_config(_STRICT)
class BarrierView(TypedDict):
    name: str
    generation: int
    arrived: int
    expected: int
    status: Literal["waiting", "released", "broken", "timed_out"]
    latency_ms: Annotated[
        float | None,
        Field(description="Last arrival to release, both as the events stream stored them"),
    ]


@with_config(_STRICT)
class ShardDistribution(TypedDict):
    max_over_mean: float | None
    min: int | None
    max: int | None


@with_config(_STRICT)
class Metrics(TypedDict):
    checkpoint_mb_s: Annotated[
        float | None,
        Field(
            description="Total bytes / duration of the checkpoint committed last (MB = 10^6 bytes)"
        ),
    ]
    requests_per_s: Annotated[
        float | None,
        Field(
            description="Events caused by worker requests (registered, left, dataset.registered, "
            "barrier.arrived, checkpoint.shard_saved, shard.progress) per second over the last "
            "10 s; null in a replay"
        ),
    ]
    heartbeats_per_s: Annotated[
        float | None, Field(description="Over the last 10 s; null in a replay")
    ]
    events_per_s: Annotated[float | None, Field(description="Over the last 10 s; null in a replay")]
    barrier_p99_ms: Annotated[
        float | None,
        Field(description="p99 of last-arrival-to-release latency over the last 1000 releases"),
    ]
    shard_distribution: ShardDistribution


@with_config(_STRICT)
class LossView(TypedDict):
    rank: int
    worker: str
    status: Annotated[
        Literal["failed", "left"],
        Field(description="failed: missed its heartbeats or was superseded; left: said so"),
    ]
    at: Annotated[int, Field(description="ns; when the registry recorded it")]
    step: Annotated[int, Field(description="The step it had reached")]


@with_config(_STRICT)
class RestartView(TypedDict):
    at: Annotated[int, Field(description="ns; when the first replacement registered")]
    ranks: Annotated[list[int], Field(description="The ranks new processes took")]
    replaced: Annotated[list[LossView], Field(description="The processes they replaced")]
    step_reached: Annotated[int, Field(description="The highest step the replaced ones reached")]
    resumed_step: Annotated[
        int | None,
        Field(
            description="The first step above 0 a replacement reported (null until one has): "
            "the steps from it to step_reached were trained twice"
        ),
    ]


LiveMarkerKind = Literal["shrink", "grow", "heal", "discard"]


@with_config(_STRICT)
class LiveMarkerView(TypedDict):
    kind: Annotated[
        LiveMarkerKind,
        Field(
            description="shrink: members left the live group; grow: members joined it; heal: "
            "a member took the state of a peer; discard: a step was dropped (a peer was lost)"
        ),
    ]
    at: Annotated[int, Field(description="ns; when the barrier service recorded it")]
    membership_epoch: Annotated[int, Field(description="Of the group it happened in")]
    step: Annotated[
        int | None,
        Field(
            description="The training step it is marked at: the step the group resumed from "
            "(shrink, grow), the step healed to, the step discarded; null while unknown"
        ),
    ]
    workers: Annotated[list[str], Field(description="Who left, joined, healed or discarded")]
    label: Annotated[str, Field(description="What happened, in a line")]


@with_config(_STRICT)
class WorldPointView(TypedDict):
    at: Annotated[int, Field(description="ns; when the group formed")]
    membership_epoch: int
    generation: int
    world_size: int
    step: Annotated[int | None, Field(description="The step it resumed from; null while unknown")]


@with_config(_STRICT)
class LiveView(TypedDict):
    """Live recovery (`strata.torch.live.LiveGroup`): the group's world size over time and its
    changes, from the barrier service's `live.*` events."""

    quorums: Annotated[int, Field(description="Groups formed since the job began")]
    heals: int
    discarded_steps: int
    world_size: Annotated[int | None, Field(description="The current group's size")]
    world: Annotated[
        list[WorldPointView], Field(description="Each group formed, the last 500, oldest first")
    ]
    markers: Annotated[
        list[LiveMarkerView], Field(description="The last 500 changes, oldest first")
    ]


@with_config(_STRICT)
class JobFigures(TypedDict):
    """The job at a glance, computed once here rather than by each reader."""

    workers: Annotated[int, Field(description="Every process that registered")]
    live: Annotated[int, Field(description="Processes holding a rank (the world size)")]
    failed: int
    left: int
    max_step: Annotated[int | None, Field(description="The furthest live worker's step")]
    min_step: Annotated[int | None, Field(description="The slowest live worker's step")]
    max_epoch: Annotated[int | None, Field(description="The furthest live worker's epoch")]
    ranks_lost: Annotated[int, Field(description="Processes failed since the job began")]
    last_loss_at: Annotated[int | None, Field(description="ns; the latest failure")]
    restarts: Annotated[
        int, Field(description="Times new processes took the ranks of failed or departed ones")
    ]
    last_restart_at: Annotated[int | None, Field(description="ns; the latest restart")]
    done_shards: Annotated[int, Field(description="Over every dataset's latest epoch")]
    total_shards: int
    last_committed_step: Annotated[
        int | None, Field(description="The newest committed checkpoint's step")
    ]
    open_checkpoints: int


@with_config(_STRICT)
class RecentEvent(TypedDict):
    seq: int
    ts: int
    type: str
    summary: str


@with_config(_STRICT)
class Dashboard(TypedDict):
    """`GET /api/dashboard`, a `dashboard` message of `GET /api/stream`, and `GET /api/replay`."""

    job: str
    seq: Annotated[int, Field(description="Stream sequence of the last event folded")]
    ts: Annotated[int, Field(description="ns; the last event's own time")]
    figures: JobFigures
    workers: list[WorkerView]
    losses: Annotated[list[LossView], Field(description="The last 100 failures, oldest first")]
    restarts: Annotated[list[RestartView], Field(description="The last 100, oldest first")]
    live: LiveView
    datasets: list[DatasetView]
    checkpoints: list[CheckpointView]
    barriers: list[BarrierView]
    metrics: Metrics
    recent_events: Annotated[
        list[RecentEvent], Field(description="The last 200 events, oldest first")
    ]


@with_config(_STRICT)
class JobSummary(TypedDict):
    job: str
    workers: int
    live: int
    running: Annotated[bool, Field(description="At least one worker holds a rank")]
    ranks_lost: int
    restarts: int
    last_event_ts: int
    events: int
