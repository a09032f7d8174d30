"""The event catalogue: one frozen pydantic model per event, the single source of the schemas.

Every event carries the envelope (`type`, `v`, `id`, `job`, `ts`, `source`); `id` doubles as the
`Nats-Msg-Id`, so JetStream drops a re-sent copy. Validation is strict (no coercion, no unknown
fields) and every string, number and list is bounded, so a malformed message is refused at the edge.
Lists and maps stop at their first bad item (`fail_fast`): a message packed with bad items costs one
error to refuse, not one per item.
"""

from __future__ import annotations

import math
import re
import time
import uuid
from typing import Annotated, Final, Literal, TypeAlias

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, model_validator

ID_PATTERN: Final = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$"
METRIC_NAME_PATTERN: Final = r"^[a-z][a-z0-9_]{0,63}$"
CHECKSUM_PATTERN: Final = r"^(sha256|crc32c|xxh64|xxh128|blake2b):[0-9a-f]{8,128}$"

MAX_WORKERS: Final = 10_000
MAX_SHARDS: Final = 1_000_000
MAX_TOTAL_SAMPLES: Final = 10**12
MAX_STEP: Final = 2**62
MAX_EPOCH: Final = 2**31 - 1
MAX_RANK: Final = MAX_WORKERS - 1
MAX_BYTES: Final = 2**50  # 1 PiB: the largest single checkpoint shard we accept a record of
MAX_PROGRESS_ITEMS: Final = 10_000
MAX_LABELS: Final = 32
MAX_COUNT: Final = 2**62
"""Counters (a heartbeat's `seq`, an arrival count) and membership epochs."""
MAX_TS: Final = 2**63 - 1
"""The latest `ts` (ns since the epoch) an event may carry: a signed 64-bit integer."""
MAX_CPU_PERCENT: Final = 100_000
"""A heartbeat's `cpu_percent` bound: 100 per core, for up to 1000 cores."""
MAX_GPU_PERCENT: Final = 100
"""A heartbeat's `gpu_util_percent` bound."""

Id = Annotated[str, StringConstraints(pattern=ID_PATTERN)]
"""Jobs, workers, datasets, barriers, event ids: letters, digits, `_.-`, at most 128 characters."""

Text = Annotated[str, StringConstraints(max_length=1000)]
Uri = Annotated[str, StringConstraints(min_length=1, max_length=2048)]
Checksum = Annotated[str, StringConstraints(pattern=CHECKSUM_PATTERN)]
LabelKey = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./-]{0,62}$")]
LabelValue = Annotated[str, StringConstraints(max_length=256)]
Step = Annotated[int, Field(ge=0, le=MAX_STEP)]
Epoch = Annotated[int, Field(ge=0, le=MAX_EPOCH)]
Rank = Annotated[int, Field(ge=0, le=MAX_RANK)]
Count = Annotated[int, Field(ge=0, le=MAX_COUNT)]
ByteCount = Annotated[int, Field(ge=0, le=MAX_BYTES)]
Millis = Annotated[float, Field(ge=0, le=1e12, allow_inf_nan=False)]
Seconds = Annotated[float, Field(gt=0, le=86_400, allow_inf_nan=False)]
ShardId = Annotated[int, Field(ge=0, lt=MAX_SHARDS)]
MembershipEpoch = Annotated[int, Field(ge=0, le=MAX_COUNT)]
WorldSize = Annotated[int, Field(ge=1, le=MAX_WORKERS)]

WorkerState = Literal[
    "idle", "loading", "training", "checkpointing", "recovering", "failed", "left"
]
LiveState = Literal["idle", "loading", "training", "checkpointing", "recovering"]
LIVE_STATES: Final[tuple[LiveState, ...]] = (
    "idle",
    "loading",
    "training",
    "checkpointing",
    "recovering",
)


def new_event_id() -> str:
    """A fresh unique event id (uuid4, hex)."""
    return uuid.uuid4().hex


class StrictModel(BaseModel):
    """Frozen, strict, closed: the base of everything that travels on the bus."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, defer_build=True)


class Event(StrictModel):
    """The envelope every event carries."""

    type: str
    v: int = 1
    id: Id = Field(default_factory=new_event_id, description="Unique; the Nats-Msg-Id.")
    job: Id
    ts: int = Field(
        default_factory=time.time_ns, ge=0, le=MAX_TS, description="Unix time, nanoseconds."
    )
    source: Id = Field(description="Who emitted it: a service name or a worker id.")


# -- workers --------------------------------------------------------------------------------------


class WorkerRegistered(Event):
    """A worker joined a job and got its rank."""

    type: Literal["worker.registered"] = "worker.registered"
    v: Literal[1] = 1
    worker_id: Id
    instance: Id = Field(description="Identifies the process; a re-registration from another one.")
    rank: Rank
    world_size: Annotated[int, Field(ge=1, le=MAX_WORKERS)]
    membership_epoch: MembershipEpoch
    hostname: Annotated[str, StringConstraints(max_length=253)] = ""
    gpus: Annotated[int, Field(ge=0, le=1024)] = 0
    labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=MAX_LABELS, fail_fast=True)] = (
        Field(default_factory=dict)
    )
    heartbeat_interval: Seconds
    heartbeat_timeout: Seconds


class WorkerHeartbeat(Event):
    """A worker is alive; published on the telemetry stream without waiting for an ack."""

    type: Literal["worker.heartbeat"] = "worker.heartbeat"
    v: Literal[1] = 1
    worker_id: Id
    instance: Id
    seq: Count
    state: LiveState
    step: Step = 0
    epoch: Epoch = 0
    cpu_percent: Annotated[float, Field(ge=0, le=MAX_CPU_PERCENT, allow_inf_nan=False)] | None = (
        None
    )
    rss_bytes: ByteCount | None = None
    gpu_util_percent: (
        Annotated[float, Field(ge=0, le=MAX_GPU_PERCENT, allow_inf_nan=False)] | None
    ) = None
    gpu_mem_bytes: ByteCount | None = None


HeartbeatFacts: TypeAlias = tuple[str, str, str, int, LiveState, int, int]
"""What failure detection uses of a heartbeat: job, worker id, instance, seq, state, step, epoch."""

_HEARTBEAT_FIELD_COUNT: Final = len(WorkerHeartbeat.model_fields)
_LIVE: Final = frozenset(LIVE_STATES)
_ID_MATCH: Final = re.compile(ID_PATTERN.removeprefix("^").removesuffix("$")).fullmatch
_KNOWN_IDS_KEPT: Final = 65_536
_known_ids: set[str] = set()
"""Ids (jobs, workers, instances) already matched against the id pattern: every heartbeat of a
worker repeats them, and a set lookup is several times cheaper than the regular expression."""


def _new_valid_id(value: str) -> bool:
    if _ID_MATCH(value) is None:
        return False
    if len(_known_ids) >= _KNOWN_IDS_KEPT:
        _known_ids.clear()
    _known_ids.add(value)
    return True


def plain_heartbeat(obj: object) -> HeartbeatFacts | None:
    """The facts of a decoded heartbeat in the exact shape the SDK sends, or None for anything else.

    The fast path of `WorkerHeartbeat` (validating the whole pydantic model is most of a
    heartbeat's cost): it accepts only what the model accepts (same id pattern, same bounds, no
    coercion, no unknown fields), and only with every field present and floats as floats;
    whatever it does not accept goes through the model, which then accepts or refuses it with its
    own reason, so a verdict never depends on the path taken. A heartbeat's source is the worker
    it is of (the provenance rule), so this takes only those. Checks are written out inline
    (`type(x) is int`, since the models are strict and True is no int for them): this runs for
    every heartbeat.
    """
    if type(obj) is not dict or len(obj) != _HEARTBEAT_FIELD_COUNT:
        return None
    try:
        kind, v, ts = obj["type"], obj["v"], obj["ts"]
        event_id, job, source = obj["id"], obj["job"], obj["source"]
        worker_id, instance, seq = obj["worker_id"], obj["instance"], obj["seq"]
        state, step, epoch = obj["state"], obj["step"], obj["epoch"]
        cpu, rss = obj["cpu_percent"], obj["rss_bytes"]
        gpu, gpu_mem = obj["gpu_util_percent"], obj["gpu_mem_bytes"]
    except KeyError:
        return None
    known = _known_ids
    if not (
        kind == "worker.heartbeat"
        and type(kind) is str
        and v == 1
        and type(v) is int
        and type(ts) is int
        and 0 <= ts <= MAX_TS
        and type(seq) is int
        and 0 <= seq <= MAX_COUNT
        and type(step) is int
        and 0 <= step <= MAX_STEP
        and type(epoch) is int
        and 0 <= epoch <= MAX_EPOCH
        and type(state) is str
        and state in _LIVE
        and type(job) is str
        and (job in known or _new_valid_id(job))
        and type(worker_id) is str
        and (worker_id in known or _new_valid_id(worker_id))
        and type(instance) is str
        and (instance in known or _new_valid_id(instance))
        and source == worker_id
        and type(event_id) is str
        and _ID_MATCH(event_id) is not None
    ):
        return None
    if cpu is not None and not (type(cpu) is float and 0.0 <= cpu <= MAX_CPU_PERCENT):
        return None
    if rss is not None and not (type(rss) is int and 0 <= rss <= MAX_BYTES):
        return None
    if gpu is not None and not (type(gpu) is float and 0.0 <= gpu <= MAX_GPU_PERCENT):
        return None
    if gpu_mem is not None and not (type(gpu_mem) is int and 0 <= gpu_mem <= MAX_BYTES):
        return None
    return job, worker_id, instance, seq, state, step, epoch


class WorkerStateChanged(Event):
    """A worker moved between live states (idle, loading, training, ...)."""

    type: Literal["worker.state_changed"] = "worker.state_changed"
    v: Literal[1] = 1
    worker_id: Id
    state: LiveState
    previous: LiveState | None = None
    step: Step = 0
    epoch: Epoch = 0


SUPERSEDED_REASON: Final = "superseded by a new instance of the same worker id (a restart)"
"""How the `worker.failed` of a process replaced by a newer one under its worker id begins."""


class WorkerFailed(Event):
    """A worker missed its heartbeats for longer than the timeout, or a newer process registered
    its worker id (the reason then begins with `SUPERSEDED_REASON`)."""

    type: Literal["worker.failed"] = "worker.failed"
    v: Literal[1] = 1
    worker_id: Id
    rank: Rank
    reason: Text
    last_heartbeat_ts: Annotated[int, Field(ge=0, le=2**63 - 1)]
    membership_epoch: MembershipEpoch


class WorkerLeft(Event):
    """A worker stopped gracefully."""

    type: Literal["worker.left"] = "worker.left"
    v: Literal[1] = 1
    worker_id: Id
    rank: Rank
    membership_epoch: MembershipEpoch


# -- datasets and shards --------------------------------------------------------------------------


class DatasetRegistered(Event):
    """A dataset's sharding parameters.

    Shard `s` covers samples `[s*shard_size, min((s+1)*shard_size, total_samples))`.
    """

    type: Literal["dataset.registered"] = "dataset.registered"
    v: Literal[1] = 1
    dataset_id: Id
    total_samples: Annotated[int, Field(ge=1, le=MAX_TOTAL_SAMPLES)]
    shard_size: Annotated[int, Field(ge=1, le=MAX_TOTAL_SAMPLES)]
    shuffle: bool
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)]

    @property
    def num_shards(self) -> int:
        return math.ceil(self.total_samples / self.shard_size)

    @model_validator(mode="after")
    def _bounded_shard_count(self) -> DatasetRegistered:
        if self.num_shards > MAX_SHARDS:
            raise ValueError(
                f"{self.total_samples} samples in shards of {self.shard_size} make "
                f"{self.num_shards} shards; at most {MAX_SHARDS} are allowed: use larger shards"
            )
        return self


class ShardPlanChanged(Event):
    """The live members a dataset's epoch is planned over changed; the plan follows from them."""

    type: Literal["shard.plan_changed"] = "shard.plan_changed"
    v: Literal[1] = 1
    dataset_id: Id
    epoch: Epoch
    plan_version: Count
    members: Annotated[list[Id], Field(min_length=1, max_length=MAX_WORKERS, fail_fast=True)]
    membership_epoch: MembershipEpoch
    reason: Text
    moved_shards: Annotated[int, Field(ge=0, le=MAX_SHARDS)] = 0


class ShardOffset(StrictModel):
    shard_id: ShardId
    offset: Annotated[int, Field(ge=0, le=MAX_TOTAL_SAMPLES)]


class ShardProgress(Event):
    """A worker's progress through its shards of an epoch: shards done, and partial offsets."""

    type: Literal["shard.progress"] = "shard.progress"
    v: Literal[1] = 1
    dataset_id: Id
    epoch: Epoch
    worker_id: Id
    completed: Annotated[list[ShardId], Field(max_length=MAX_PROGRESS_ITEMS, fail_fast=True)] = (
        Field(default_factory=list)
    )
    partial: Annotated[list[ShardOffset], Field(max_length=MAX_PROGRESS_ITEMS, fail_fast=True)] = (
        Field(default_factory=list)
    )
    lease_epoch: MembershipEpoch | None = Field(
        default=None,
        description="The membership epoch of the registration (lease) the progress was reported "
        "under. Stored after that registration ended (the worker failed, left or registered "
        "again), the progress counts nothing. None in events recorded before it was carried: "
        "then any live registration of the worker counts.",
    )


class ShardProgressRestored(Event):
    """An epoch's progress was reset to a committed checkpoint's cursors (the job restarted)."""

    type: Literal["shard.progress_restored"] = "shard.progress_restored"
    v: Literal[1] = 1
    dataset_id: Id
    epoch: Epoch
    checkpoint_step: Step
    completed: Annotated[list[ShardId], Field(max_length=MAX_SHARDS, fail_fast=True)] = Field(
        default_factory=list
    )
    partial: Annotated[list[ShardOffset], Field(max_length=MAX_PROGRESS_ITEMS, fail_fast=True)] = (
        Field(default_factory=list)
    )


# -- barriers -------------------------------------------------------------------------------------


class BarrierOpened(Event):
    """The first arrival opened a generation of a named barrier."""

    type: Literal["barrier.opened"] = "barrier.opened"
    v: Literal[1] = 1
    name: Id
    generation: Count
    expected: Annotated[list[Id], Field(max_length=MAX_WORKERS, fail_fast=True)] = Field(
        description="Worker ids expected (the live membership), empty with an explicit count.",
        default_factory=list,
    )
    expected_count: Annotated[int, Field(ge=1, le=MAX_WORKERS)]
    timeout_s: Seconds
    deadline_ts: Annotated[int, Field(ge=0, le=2**63 - 1)]


class BarrierArrived(Event):
    type: Literal["barrier.arrived"] = "barrier.arrived"
    v: Literal[1] = 1
    name: Id
    generation: Count
    worker_id: Id
    arrival: Count = Field(default=0, description="The worker's own count of arrivals at the name.")
    arrived: Annotated[int, Field(ge=1, le=MAX_WORKERS)]


class BarrierWithdrawn(Event):
    """A waiter gave up on its arrival (no outcome within its timeout and grace): it leaves the
    generation it joined if that one still waits, and counts nowhere if it comes later."""

    type: Literal["barrier.withdrawn"] = "barrier.withdrawn"
    v: Literal[1] = 1
    name: Id
    worker_id: Id
    arrival: Count = Field(description="The worker's own count of arrivals at the name.")
    generation: Count | None = Field(
        default=None,
        description="The generation it was for: the waiting one it is taken out of, or, when "
        "it had not been counted yet (it is refused if it comes), the waiting one or the next "
        "to open. The worker's next arrival is never answered with that one's outcome.",
    )


class BarrierReleased(Event):
    """Everyone arrived; latencies let the gateway show barrier latency percentiles."""

    type: Literal["barrier.released"] = "barrier.released"
    v: Literal[1] = 1
    name: Id
    generation: Count
    participants: Annotated[int, Field(ge=1, le=MAX_WORKERS)]
    first_arrival_to_release_ms: Millis
    last_arrival_to_release_ms: Millis


class BarrierBrokenEvent(Event):
    """An expected participant failed or left: every waiter is told, nobody hangs."""

    type: Literal["barrier.broken"] = "barrier.broken"
    v: Literal[1] = 1
    name: Id
    generation: Count
    reason: Text
    culprits: Annotated[list[Id], Field(max_length=MAX_WORKERS, fail_fast=True)]
    missing: Annotated[list[Id], Field(max_length=MAX_WORKERS, fail_fast=True)]


class BarrierTimedOut(Event):
    type: Literal["barrier.timed_out"] = "barrier.timed_out"
    v: Literal[1] = 1
    name: Id
    generation: Count
    timeout_s: Seconds
    missing: Annotated[list[Id], Field(max_length=MAX_WORKERS, fail_fast=True)]
    arrived: Annotated[int, Field(ge=0, le=MAX_WORKERS)]


# -- live recovery --------------------------------------------------------------------------------


class LiveQuorumFormed(Event):
    """A live training group (`strata.torch.LiveGroup`) formed: its meeting barrier (`live-<epoch>`)
    was released. Recorded by the barrier service from the arrivals it counted, not from any
    worker's say; `left` and `joined` compare it with the job's previous quorum."""

    type: Literal["live.quorum_formed"] = "live.quorum_formed"
    v: Literal[1] = 1
    membership_epoch: MembershipEpoch
    generation: Count = Field(description="The generation of the meeting barrier that formed it.")
    members: Annotated[list[Id], Field(max_length=MAX_WORKERS, fail_fast=True)] = Field(
        description="Worker ids in group-rank order (their registry rank, then id)."
    )
    world_size: WorldSize
    previous_epoch: MembershipEpoch | None = Field(
        default=None, description="The membership epoch of the job's previous quorum, if any."
    )
    left: Annotated[list[Id], Field(max_length=MAX_WORKERS, fail_fast=True)] = Field(
        default_factory=list, description="Members of the previous quorum not in this one."
    )
    joined: Annotated[list[Id], Field(max_length=MAX_WORKERS, fail_fast=True)] = Field(
        default_factory=list, description="Members of this quorum not in the previous one."
    )


class LiveHealed(Event):
    """A member of a quorum received the training state from a peer of it (a joiner, or a
    survivor that missed a step), as it reported and the barrier service checked."""

    type: Literal["live.healed"] = "live.healed"
    v: Literal[1] = 1
    membership_epoch: MembershipEpoch
    generation: Count
    worker_id: Id
    source_worker: Id = Field(description="The peer the state came from.")
    from_step: Step = Field(description="The committed steps the worker had before.")
    to_step: Step = Field(description="The committed steps of the state it received.")


class LiveStepDiscarded(Event):
    """A member of a quorum discarded the step it was training (a collective failed: a peer was
    lost; or the step's vote showed a shard read by two ranks); its samples are trained again.
    Reported by the worker, checked and recorded by the barrier service."""

    type: Literal["live.step_discarded"] = "live.step_discarded"
    v: Literal[1] = 1
    membership_epoch: MembershipEpoch
    generation: Count
    worker_id: Id
    step: Step = Field(description="The step discarded (committed steps so far, plus one).")
    reason: Text = ""


# -- checkpoints ----------------------------------------------------------------------------------


class Participant(StrictModel):
    worker_id: Id
    rank: Rank


class CheckpointStarted(Event):
    """A step's checkpoint opened for a world: every rank of it must save for it to commit."""

    type: Literal["checkpoint.started"] = "checkpoint.started"
    v: Literal[1] = 1
    step: Step
    epoch: Epoch
    root_uri: Uri
    participants: Annotated[
        list[Participant], Field(min_length=1, max_length=MAX_WORKERS, fail_fast=True)
    ]
    keep_count: Annotated[int, Field(ge=1, le=10_000)]
    timeout_s: Seconds
    world_size: WorldSize | None = Field(
        default=None,
        description="The world the checkpoint belongs to: ranks 0..world_size-1. Absent from "
        "events recorded before worlds were: then the participants are the world.",
    )
    membership_epoch: MembershipEpoch | None = Field(
        default=None, description="The membership epoch at which that world was seen."
    )
    attempt: Annotated[int, Field(ge=0, le=MAX_STEP)] = Field(
        default=0,
        description="How many times the step was opened before and aborted: a job that restarts "
        "from an earlier checkpoint saves the same step numbers again, as a new attempt whose "
        "shards are stored under keys of their own.",
    )


class CheckpointShardStarted(Event):
    """A rank's writer declared itself before writing its shard: no other may write that rank."""

    type: Literal["checkpoint.shard_started"] = "checkpoint.shard_started"
    v: Literal[1] = 1
    step: Step
    epoch: Epoch
    rank: Rank
    worker_id: Id
    instance: Id = Field(description="The writing process (its worker registration's instance).")
    save_id: Id = Field(description="One save call; a retried begin carries the same one.")


class DataCursor(StrictModel):
    """Where a worker is in a dataset's epoch: shards done and offsets into shards begun."""

    dataset_id: Id
    epoch: Epoch
    completed: Annotated[list[ShardId], Field(max_length=MAX_PROGRESS_ITEMS, fail_fast=True)] = (
        Field(default_factory=list)
    )
    partial: Annotated[list[ShardOffset], Field(max_length=MAX_PROGRESS_ITEMS, fail_fast=True)] = (
        Field(default_factory=list)
    )


class CheckpointShardSaved(Event):
    """A rank's shard is durable in storage (phase one of the commit)."""

    type: Literal["checkpoint.shard_saved"] = "checkpoint.shard_saved"
    v: Literal[1] = 1
    step: Step
    epoch: Epoch
    rank: Rank
    worker_id: Id
    uri: Uri
    key: Uri
    bytes: ByteCount
    checksum: Checksum
    cursors: Annotated[list[DataCursor], Field(max_length=16, fail_fast=True)] = Field(
        default_factory=list
    )


class CheckpointCommitted(Event):
    """The manifest is written: the checkpoint exists (phase two)."""

    type: Literal["checkpoint.committed"] = "checkpoint.committed"
    v: Literal[1] = 1
    step: Step
    epoch: Epoch
    manifest_uri: Uri
    total_bytes: ByteCount
    shards: Annotated[int, Field(ge=1, le=MAX_WORKERS)]
    duration_ms: Millis


class CheckpointAborted(Event):
    type: Literal["checkpoint.aborted"] = "checkpoint.aborted"
    v: Literal[1] = 1
    step: Step
    epoch: Epoch
    reason: Text
    missing_ranks: Annotated[list[Rank], Field(max_length=MAX_WORKERS, fail_fast=True)] = Field(
        default_factory=list
    )


class CheckpointPruned(Event):
    """Retention removed an old committed checkpoint."""

    type: Literal["checkpoint.pruned"] = "checkpoint.pruned"
    v: Literal[1] = 1
    step: Step
    manifest_uri: Uri


# -- requests and telemetry -----------------------------------------------------------------------


class RequestRejected(Event):
    """A service refused a request or dropped a malformed message, with the reason."""

    type: Literal["request.rejected"] = "request.rejected"
    v: Literal[1] = 1
    service: Id
    subject: Annotated[str, StringConstraints(max_length=512)]
    code: Annotated[str, StringConstraints(pattern=r"^[a-z][a-z_]{0,63}$")]
    message: Text
    worker_id: Id | None = None


class MetricSampled(Event):
    """One sample of a named figure (telemetry stream)."""

    type: Literal["metric.sampled"] = "metric.sampled"
    v: Literal[1] = 1
    name: Annotated[str, StringConstraints(pattern=METRIC_NAME_PATTERN)]
    value: Annotated[float, Field(allow_inf_nan=False)]
    worker_id: Id | None = None
    step: Step | None = Field(
        default=None, description="The training step the figure is of (`log_metrics(step=...)`)."
    )
    labels: Annotated[dict[LabelKey, LabelValue], Field(max_length=MAX_LABELS, fail_fast=True)] = (
        Field(default_factory=dict)
    )


AnyEvent: TypeAlias = Annotated[
    WorkerRegistered
    | WorkerHeartbeat
    | WorkerStateChanged
    | WorkerFailed
    | WorkerLeft
    | DatasetRegistered
    | ShardPlanChanged
    | ShardProgress
    | ShardProgressRestored
    | BarrierOpened
    | BarrierArrived
    | BarrierReleased
    | BarrierBrokenEvent
    | BarrierTimedOut
    | BarrierWithdrawn
    | LiveQuorumFormed
    | LiveHealed
    | LiveStepDiscarded
    | CheckpointStarted
    | CheckpointShardStarted
    | CheckpointShardSaved
    | CheckpointCommitted
    | CheckpointAborted
    | CheckpointPruned
    | RequestRejected
    | MetricSampled,
    Field(discriminator="type"),
]

EVENT_MODELS: Final[tuple[type[Event], ...]] = (
    WorkerRegistered,
    WorkerHeartbeat,
    WorkerStateChanged,
    WorkerFailed,
    WorkerLeft,
    DatasetRegistered,
    ShardPlanChanged,
    ShardProgress,
    ShardProgressRestored,
    BarrierOpened,
    BarrierArrived,
    BarrierReleased,
    BarrierBrokenEvent,
    BarrierTimedOut,
    BarrierWithdrawn,
    LiveQuorumFormed,
    LiveHealed,
    LiveStepDiscarded,
    CheckpointStarted,
    CheckpointShardStarted,
    CheckpointShardSaved,
    CheckpointCommitted,
    CheckpointAborted,
    CheckpointPruned,
    RequestRejected,
    MetricSampled,
)

EVENT_TYPES: Final[dict[str, type[Event]]] = {
    model.model_fields["type"].default: model for model in EVENT_MODELS
}

TELEMETRY_TYPES: Final = frozenset({"worker.heartbeat", "metric.sampled"})
"""Event types that travel on the telemetry stream, published without waiting for an ack."""
