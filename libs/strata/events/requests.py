"""Request and result models of every service's RPC verbs, and the control notices to workers.

They live beside the events because both sides use them: the SDK builds requests, the services
validate them. Each verb is declared in the RPC catalogue, so the AsyncAPI document lists it.
"""

from __future__ import annotations

from typing import Annotated, Final, Literal

from pydantic import Field, StringConstraints

from strata.events.models import (
    MAX_LABELS,
    MAX_PROGRESS_ITEMS,
    MAX_SHARDS,
    MAX_TOTAL_SAMPLES,
    MAX_WORKERS,
    ByteCount,
    Checksum,
    DataCursor,
    Epoch,
    Id,
    LabelKey,
    LabelValue,
    MembershipEpoch,
    Participant,
    Rank,
    Seconds,
    ShardId,
    ShardOffset,
    Step,
    StrictModel,
    Text,
    Uri,
    WorkerState,
    WorldSize,
)
from strata.events.rpc import endpoint

Hostname = Annotated[str, StringConstraints(max_length=253)]
Labels = Annotated[dict[LabelKey, LabelValue], Field(max_length=MAX_LABELS, fail_fast=True)]

# -- registry -------------------------------------------------------------------------------------


class RegisterRequest(StrictModel):
    """Join a job. Without `worker_id` one is derived from `instance` (stable across retries).

    A live registration of the same `worker_id` by another `instance` is superseded: that process
    is recorded as failed and this one takes its place (a restart faster than the heartbeat
    timeout).
    """

    job: Id
    instance: Id = Field(description="Random per process: tells a retry from a second process.")
    worker_id: Id | None = None
    hostname: Hostname = ""
    gpus: Annotated[int, Field(ge=0, le=1024)] = 0
    labels: Labels = Field(default_factory=dict)
    rank: Rank | None = Field(
        default=None,
        description="The rank wanted (e.g. torch's RANK); refused while another live worker "
        "holds it. None: the lowest free rank, or the rank of the registration it supersedes.",
    )
    rejoin: bool = Field(
        default=False,
        description="Sent by a worker re-registering on its own after it was failed: refused "
        "(`superseded`) if another process registered the id since.",
    )
    replaces: Id | None = Field(
        default=None,
        description="With `rejoin`: the instance this process registered under before. A rejoin "
        "is a new instance (a new lease); it may take over the id only from that one.",
    )


class Registration(StrictModel):
    job: Id
    worker_id: Id
    instance: Id
    rank: Rank
    world_size: Annotated[int, Field(ge=1, le=MAX_WORKERS)]
    membership_epoch: MembershipEpoch
    heartbeat_interval: Seconds
    heartbeat_timeout: Seconds
    rejoined: bool = Field(
        description="The id had failed or left before this registration, or was live in "
        "another process, which this registration superseded."
    )
    lease_epoch: MembershipEpoch = Field(
        description="The membership epoch of this registration: with `instance`, the lease "
        "(fencing token) that requests changing sharding state carry."
    )


class Lease(StrictModel):
    """A worker's registration as a fencing token: the instance that registered and the
    membership epoch of that registration (`Registration.lease_epoch`). A service refuses a
    request whose lease is no longer the worker's current registration (`stale_lease`)."""

    worker_id: Id
    instance: Id
    epoch: MembershipEpoch


class LeaveRequest(StrictModel):
    job: Id
    worker_id: Id
    instance: Id


class LeaveResult(StrictModel):
    job: Id
    worker_id: Id
    membership_epoch: MembershipEpoch


class MembersRequest(StrictModel):
    job: Id
    include_gone: bool = Field(default=False, description="Also list failed and departed workers.")


class MemberInfo(StrictModel):
    worker_id: Id
    instance: Id
    rank: Rank
    status: WorkerState
    hostname: Hostname
    gpus: int
    step: Step
    epoch: Epoch
    last_heartbeat_ts: int | None = Field(description="Wall time (ns) the last heartbeat arrived.")


class MembersResult(StrictModel):
    job: Id
    membership_epoch: MembershipEpoch
    world_size: Annotated[int, Field(ge=0, le=MAX_WORKERS)]
    members: Annotated[list[MemberInfo], Field(max_length=MAX_WORKERS, fail_fast=True)]


REGISTER = endpoint(
    "registry",
    "register",
    RegisterRequest,
    Registration,
    "Join a job; get rank and world size.",
    scope="worker",
)
LEAVE = endpoint(
    "registry", "leave", LeaveRequest, LeaveResult, "Leave a job gracefully.", scope="worker"
)
MEMBERS = endpoint(
    "registry", "members", MembersRequest, MembersResult, "The membership of a job.", scope="job"
)


class SuspectRequest(StrictModel):
    """A worker's report that a peer of its job seems dead (a collective with it failed): the
    registry probes the peer's registration and records its failure only on proof that its
    connection is gone (`SuspectResult`)."""

    job: Id
    worker_id: Id = Field(description="The reporting worker (the caller).")
    suspect: Id = Field(description="The peer of the same job it suspects.")
    lease: Lease | None = Field(
        default=None,
        description="The reporting worker's lease; required (`lease_required` without it).",
    )


SuspectVerdict = Literal["failed", "alive", "unanswered", "not_live"]


class SuspectResult(StrictModel):
    """What the registry decided. `failed`: the probe found no responder (the suspect's
    connection is gone), so its failure is recorded now (or was, by a report just before).
    `alive`: the suspect answered; nothing changes. `unanswered`: no answer within the probe's
    timeout (a paused process, a slow network), or no responder but the evidence not confirmed
    (the telemetry stream holds heartbeats of it this registry has not heard, or the stream
    could not be read or written): nothing changes, and the heartbeat timeout decides as usual.
    `not_live`: the suspect holds no live registration (failed or left already, or never
    registered)."""

    job: Id
    suspect: Id
    verdict: SuspectVerdict
    membership_epoch: MembershipEpoch


SUSPECT = endpoint(
    "registry",
    "suspect",
    SuspectRequest,
    SuspectResult,
    "Report a peer suspected dead; its failure is recorded at once if its connection is gone.",
    scope="worker",
)


class WorkerNotice(StrictModel):
    """Sent by a service to one worker on `strata.ctl.<job>.<worker>` (core NATS, no stream).

    `reregister`: the worker is not a live member (failed, or unknown) and should register again.
    `superseded`: another process registered the worker id after this one, which must stop.
    """

    job: Id
    worker_id: Id
    kind: Literal["reregister", "superseded"]
    reason: Text
    instance: Id | None = Field(
        default=None,
        description="The process the notice is for; other processes using the id ignore it.",
    )


class WorldNotice(StrictModel):
    """A job's world as the registry sees it, on `strata.world.<job>` (core NATS, not stored).

    Published once for a burst of membership changes (coalesced over a few tens of
    milliseconds), and repeated every few seconds, so each worker hears a constant number of
    messages per change, not one per other worker; the member list is fetched on demand.
    """

    job: Id
    membership_epoch: MembershipEpoch
    world_size: Annotated[int, Field(ge=0, le=MAX_WORKERS)]


# -- sharding -------------------------------------------------------------------------------------

TotalSamples = Annotated[int, Field(ge=1, le=MAX_TOTAL_SAMPLES)]
ShardCount = Annotated[int, Field(ge=0, le=MAX_SHARDS)]


class RegisterDatasetRequest(StrictModel):
    job: Id
    dataset_id: Id
    total_samples: TotalSamples
    shard_size: TotalSamples
    shuffle: bool = True
    seed: Annotated[int, Field(ge=0, le=2**63 - 1)] = 0


class DatasetInfo(StrictModel):
    job: Id
    dataset_id: Id
    total_samples: TotalSamples
    shard_size: TotalSamples
    shuffle: bool
    seed: int
    num_shards: ShardCount
    created: bool = Field(description="False when the same dataset was already registered.")


SHARDS_PER_REPLY: Final = 10_000
"""The most shards one `get_shards` answer holds; a worker with more reads them in pages."""


class GetShardsRequest(StrictModel):
    """A worker's shards; `lease` is the requester's (it may ask for another member's)."""

    job: Id
    dataset_id: Id
    worker_id: Id
    epoch: Epoch
    lease: Lease | None = Field(
        default=None,
        description="The requesting worker's lease; required (`lease_required` without it).",
    )
    offset: Annotated[int, Field(ge=0, le=MAX_SHARDS)] = Field(
        default=0, description="Where in the worker's shards (reading order) the page starts."
    )
    limit: Annotated[int, Field(ge=1, le=SHARDS_PER_REPLY)] | None = Field(
        default=None, description=f"The most shards to answer with (at most {SHARDS_PER_REPLY})."
    )


class ShardSpan(StrictModel):
    """Samples `[start, end)` of a shard; `offset` samples of it are already consumed."""

    shard_id: ShardId
    start: Annotated[int, Field(ge=0, le=MAX_TOTAL_SAMPLES)]
    end: Annotated[int, Field(ge=0, le=MAX_TOTAL_SAMPLES)]
    done: bool = False
    offset: Annotated[int, Field(ge=0, le=MAX_TOTAL_SAMPLES)] = 0


class ShardAssignment(StrictModel):
    job: Id
    dataset_id: Id
    epoch: Epoch
    worker_id: Id
    plan_version: Annotated[int, Field(ge=0)]
    world_size: Annotated[int, Field(ge=1, le=MAX_WORKERS)]
    # A reply holds at most SHARDS_PER_REPLY of them (the service pages); the SDK's assignment()
    # joins the pages into one.
    shards: Annotated[list[ShardSpan], Field(max_length=MAX_SHARDS, fail_fast=True)]
    offset: Annotated[int, Field(ge=0, le=MAX_SHARDS)] = 0
    total_shards: Annotated[int, Field(ge=0, le=MAX_SHARDS)] = Field(
        default=0, description="How many shards the worker has in all (every page together)."
    )
    next_offset: Annotated[int, Field(ge=0, le=MAX_SHARDS)] | None = Field(
        default=None, description="Where the next page starts; null on the last page."
    )


class ReportProgressRequest(StrictModel):
    job: Id
    dataset_id: Id
    epoch: Epoch
    worker_id: Id
    completed: Annotated[list[ShardId], Field(max_length=MAX_PROGRESS_ITEMS, fail_fast=True)] = (
        Field(default_factory=list)
    )
    partial: Annotated[list[ShardOffset], Field(max_length=MAX_PROGRESS_ITEMS, fail_fast=True)] = (
        Field(default_factory=list)
    )
    lease: Lease | None = Field(
        default=None,
        description="The requesting worker's lease; required (`lease_required` without it).",
    )


class ProgressResult(StrictModel):
    job: Id
    dataset_id: Id
    epoch: Epoch
    done_shards: ShardCount
    total_shards: ShardCount


class RestoreProgressRequest(StrictModel):
    """Reset an epoch's progress to a checkpoint's cursors; later epochs start afresh.

    Idempotent: every worker of a restarting job may send the same one. Sent again after progress
    was made since (the job failed again before its next checkpoint), it resets again.
    """

    job: Id
    dataset_id: Id
    epoch: Epoch
    worker_id: Id
    checkpoint_step: Step
    completed: Annotated[list[ShardId], Field(max_length=MAX_SHARDS, fail_fast=True)] = Field(
        default_factory=list
    )
    partial: Annotated[list[ShardOffset], Field(max_length=MAX_PROGRESS_ITEMS, fail_fast=True)] = (
        Field(default_factory=list)
    )
    lease: Lease | None = Field(
        default=None,
        description="The requesting worker's lease; required (`lease_required` without it).",
    )


class PlanRequest(StrictModel):
    job: Id
    dataset_id: Id
    epoch: Epoch


class PlanSummary(StrictModel):
    job: Id
    dataset_id: Id
    epoch: Epoch
    plan_version: Annotated[int, Field(ge=0)]
    loads: Annotated[dict[Id, ShardCount], Field(max_length=MAX_WORKERS, fail_fast=True)]
    done_shards: ShardCount
    total_shards: ShardCount


REGISTER_DATASET = endpoint(
    "sharding",
    "register_dataset",
    RegisterDatasetRequest,
    DatasetInfo,
    "Register a dataset's sharding (idempotent for the same parameters).",
    scope="job",
)
# `job`, not `worker`: the SDK's `get_shard_for_worker(dataset, worker_id)` reads any member's
# shards of its job, and what it records (the epoch's plan) is the job's, not a worker's.
GET_SHARDS = endpoint(
    "sharding",
    "get_shards",
    GetShardsRequest,
    ShardAssignment,
    "A worker's shards of an epoch.",
    scope="job",
)
REPORT_PROGRESS = endpoint(
    "sharding",
    "report_progress",
    ReportProgressRequest,
    ProgressResult,
    "Record shards (or parts of shards) a worker has consumed.",
    scope="worker",
)
PLAN = endpoint(
    "sharding", "plan", PlanRequest, PlanSummary, "Loads of an epoch's plan.", scope="job"
)
RESTORE_PROGRESS = endpoint(
    "sharding",
    "restore_progress",
    RestoreProgressRequest,
    ProgressResult,
    "Reset an epoch's progress to a committed checkpoint's cursors (idempotent).",
    scope="worker",
)


# -- barrier --------------------------------------------------------------------------------------

BarrierStatus = Literal["waiting", "released", "broken", "timed_out"]


class ArriveRequest(StrictModel):
    """One worker reaching a named barrier; `arrival` counts this worker's arrivals at the name.

    A retried request (same worker, same `arrival`) is the same arrival: it counts once and gets the
    same generation and outcome back, also after a restart of the barrier service.
    """

    job: Id
    name: Id
    worker_id: Id
    arrival: Annotated[int, Field(ge=0, le=2**62)]
    timeout_s: Seconds = 300.0
    expected_count: Annotated[int, Field(ge=1, le=MAX_WORKERS)] | None = None
    instance: Id | None = Field(
        default=None,
        description="The arriving process (its registration's instance): refused "
        "(`superseded`) once another process registered the worker id.",
    )
    generation: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="On a re-sent arrival, the generation an earlier answer said it joined: "
        "a restarted barrier service that never stored the arrival answers that generation's "
        "outcome instead of counting the arrival again.",
    )
    passed: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="The last generation at this name this process was released from: proof, "
        "for a restarted barrier service, that it was released.",
    )
    concluded: Annotated[int, Field(ge=0)] | None = Field(
        default=None,
        description="The last generation at this name this process returned from (released, "
        "broken or timed out): an arrival is answered with the outcome of the first later "
        "generation that concluded expecting this worker, the one the arrival was for, rather "
        "than counted in a new one; a restarted barrier service that lost its arrivals reaches "
        "the same answer.",
    )
    remaining_s: Annotated[float, Field(ge=0, le=86_400)] | None = Field(
        default=None,
        description="How much longer the sender waits for this arrival's outcome, measured when "
        "it sent it (its timeout less the time it already waited, not counting its grace): "
        "once that has passed on the service's monotonic clock the arrival lapses (it is "
        "withdrawn for its sender, which has given up), so no release counts a waiter that "
        "already raised BarrierTimeout.",
    )
    lease: Lease | None = Field(
        default=None,
        description="The arriving worker's lease; checked if given (`stale_lease` once it ended).",
    )


class BarrierOutcome(StrictModel):
    job: Id
    name: Id
    generation: Annotated[int, Field(ge=0)]
    status: BarrierStatus
    arrived: Annotated[int, Field(ge=0, le=MAX_WORKERS)]
    expected: Annotated[int, Field(ge=0, le=MAX_WORKERS)]
    missing: Annotated[list[Id], Field(max_length=MAX_WORKERS, fail_fast=True)] = Field(
        default_factory=list
    )
    reason: Text = ""


ARRIVE = endpoint(
    "barrier",
    "arrive",
    ArriveRequest,
    BarrierOutcome,
    "Arrive at a barrier (idempotent); the answer says whether it is released already.",
    scope="worker",
)


class WithdrawRequest(StrictModel):
    """A waiter gives up on its arrival (no outcome within its timeout and grace): take it out of
    the generation it joined while that one still waits, and never count it if it comes later.
    Idempotent; a no-op for a generation that concluded."""

    job: Id
    name: Id
    worker_id: Id
    arrival: Annotated[int, Field(ge=0, le=2**62)]
    instance: Id | None = Field(
        default=None, description="The withdrawing process (its registration's instance)."
    )


WithdrawStatus = Literal["withdrawn", "released", "broken", "timed_out", "superseded"]


class WithdrawResult(StrictModel):
    job: Id
    name: Id
    worker_id: Id
    arrival: Annotated[int, Field(ge=0, le=2**62)]
    generation: Annotated[int, Field(ge=0)] | None = Field(
        default=None, description="The generation the arrival had joined, if it was counted."
    )
    status: WithdrawStatus = Field(
        description="withdrawn (it counts nowhere), the outcome of the generation it was part "
        "of (which stands), or superseded (a newer arrival or process counts instead)."
    )


WITHDRAW = endpoint(
    "barrier",
    "withdraw",
    WithdrawRequest,
    WithdrawResult,
    "Give up on an arrival (idempotent): it leaves a generation still waiting, or counts nowhere.",
    scope="worker",
)


# -- live recovery --------------------------------------------------------------------------------

LIVE_BARRIER_PREFIX: Final = "live-"
"""A live training group's members meet at the barrier `live-<membership epoch>`; the barrier
service records each release of one as the job's quorum (`live.quorum_formed`)."""


def live_barrier(membership_epoch: int) -> str:
    """The name of the barrier a live group meets at to form at `membership_epoch`."""
    return f"{LIVE_BARRIER_PREFIX}{membership_epoch}"


def live_barrier_epoch(name: str) -> int | None:
    """The membership epoch a live group's meeting barrier is named after, or None for another
    barrier."""
    rest = name.removeprefix(LIVE_BARRIER_PREFIX)
    if rest == name or not rest.isdigit() or len(rest) > 19:
        return None
    return int(rest)


LiveAction = Literal["healed", "discarded"]


class LiveReportRequest(StrictModel):
    """What a member of a live group did in its quorum (`membership_epoch`, `generation`):
    `healed` (it received the state of `source_worker`, going from `from_step` to `step`) or
    `discarded` (it dropped the step `step`, a collective having failed). Accepted only from a
    member of that quorum (and, for a heal, from a peer of it), recorded as `live.healed` or
    `live.step_discarded`. Idempotent."""

    job: Id
    worker_id: Id
    membership_epoch: MembershipEpoch
    generation: Annotated[int, Field(ge=0, le=2**62)]
    action: LiveAction
    step: Step
    from_step: Step | None = Field(default=None, description="healed: the steps it had before.")
    source_worker: Id | None = Field(default=None, description="healed: the peer it healed from.")
    reason: Text = ""
    instance: Id | None = Field(default=None, description="The reporting process.")
    lease: Lease | None = Field(
        default=None,
        description="The reporting worker's lease; checked if given (`stale_lease` once it ended).",
    )


class LiveReportResult(StrictModel):
    event_id: Id = Field(description="The id of the event that records the report.")


LIVE_REPORT = endpoint(
    "barrier",
    "live",
    LiveReportRequest,
    LiveReportResult,
    "Report a heal or a discarded step of a live training group (idempotent); recorded as an "
    "event once checked against the quorum it names.",
    scope="worker",
)


# -- checkpoints ----------------------------------------------------------------------------------

CheckpointStatus = Literal["open", "committed", "aborted"]


class ManifestShard(StrictModel):
    rank: Rank
    worker_id: Id
    key: Uri
    uri: Uri
    bytes: ByteCount
    checksum: Checksum
    cursors: Annotated[list[DataCursor], Field(max_length=16, fail_fast=True)] = Field(
        default_factory=list
    )


class Manifest(StrictModel):
    """The commit marker of a checkpoint, written atomically beside its shards."""

    format: Literal["strata.checkpoint/1"] = "strata.checkpoint/1"
    job: Id
    step: Step
    epoch: Epoch
    root_uri: Uri
    committed_ts: Annotated[int, Field(ge=0)]
    participants: Annotated[list[Participant], Field(max_length=MAX_WORKERS, fail_fast=True)]
    shards: Annotated[list[ManifestShard], Field(max_length=MAX_WORKERS, fail_fast=True)]
    total_bytes: ByteCount
    world_size: WorldSize | None = Field(
        default=None,
        description="The world it belongs to: ranks 0..world_size-1. Absent from manifests "
        "written before worlds were recorded: then the participants are the world.",
    )
    membership_epoch: MembershipEpoch | None = Field(
        default=None, description="The membership epoch at which that world was seen."
    )

    def world(self) -> int:
        """The number of ranks the checkpoint must hold a shard of to be complete."""
        return self.world_size if self.world_size is not None else len(self.participants)

    def missing_ranks(self) -> list[int]:
        """Ranks of its world it has no shard of (empty for a complete checkpoint)."""
        held = {shard.rank for shard in self.shards}
        return [rank for rank in range(self.world()) if rank not in held]

    @property
    def complete(self) -> bool:
        """Whether it holds a shard of every rank of its world."""
        return not self.missing_ranks()


class BeginCheckpointRequest(StrictModel):
    """Declare this worker's shard of `step`, opening the step's checkpoint if it is the first.

    Sent once per save, before the shard is written; a retry carries the same `save_id` and gets
    the same answer. `world_size` and `membership_epoch` are the membership as the worker sees
    it: the first begin of a step fixes the step's world.
    """

    job: Id
    worker_id: Id
    step: Step
    epoch: Epoch
    root_uri: Uri
    keep_count: Annotated[int, Field(ge=1, le=10_000)] = 5
    timeout_s: Seconds = 300.0
    world_size: WorldSize | None = Field(
        default=None, description="The saving worker's world size; None: the live membership."
    )
    membership_epoch: MembershipEpoch = Field(
        default=0, description="The membership epoch the worker's world size is from."
    )
    instance: Id | None = Field(
        default=None, description="The saving process (its worker registration's instance)."
    )
    lease: Lease | None = Field(
        default=None,
        description="The saving worker's lease; checked if given (`stale_lease` once it ended).",
    )
    save_id: Id | None = Field(
        default=None, description="Unique per save call: tells a retry from a second save."
    )


class CheckpointInfo(StrictModel):
    job: Id
    step: Step
    epoch: Epoch
    status: CheckpointStatus
    root_uri: Uri
    participants: Annotated[list[Participant], Field(max_length=MAX_WORKERS, fail_fast=True)]
    acked_ranks: Annotated[list[Rank], Field(max_length=MAX_WORKERS, fail_fast=True)] = Field(
        default_factory=list
    )
    manifest_uri: Uri | None = None
    total_bytes: ByteCount = 0
    reason: Text = ""
    world_size: WorldSize | None = None
    membership_epoch: MembershipEpoch | None = None
    attempt: Annotated[int, Field(ge=0)] = Field(
        default=0, description="The attempt of the step (0 unless an earlier one was aborted)."
    )


class CheckpointQuery(StrictModel):
    job: Id
    step: Step | None = Field(default=None, description="None: the latest committed one.")
    include_incomplete: bool = Field(
        default=False,
        description="With step None: the latest committed one even if it lacks a rank of its "
        "world (only checkpoints committed before worlds were recorded can).",
    )


class CheckpointAnswer(StrictModel):
    found: bool
    checkpoint: CheckpointInfo | None = None
    manifest: Manifest | None = None


class AckShardRequest(StrictModel):
    """A rank's shard of `step` is durable in storage (phase one of the commit).

    Sent by the worker that declared the rank (`begin`) once its write returned. The service checks
    it against the open step and records `checkpoint.shard_saved` itself, with the key it derives
    from the job, step, rank and attempt: a worker never names where a shard is. A retry carries
    the same fields and gets the same answer, also once the step has committed.
    """

    job: Id
    worker_id: Id
    step: Step
    epoch: Epoch
    rank: Rank
    bytes: ByteCount
    checksum: Checksum
    cursors: Annotated[list[DataCursor], Field(max_length=16, fail_fast=True)] = Field(
        default_factory=list
    )
    instance: Id | None = Field(
        default=None, description="The writing process (its begin's instance); checked if given."
    )
    lease: Lease | None = Field(
        default=None,
        description="The writing worker's lease; checked if given (`stale_lease` once it ended).",
    )


class AckShardResult(StrictModel):
    job: Id
    step: Step
    rank: Rank
    event_id: Id = Field(description="The checkpoint.shard_saved recorded for this shard.")
    key: Uri = Field(description="Where the shard is recorded to be, under the job's root.")
    status: CheckpointStatus = Field(description="The step's status after this ack.")


BEGIN_CHECKPOINT = endpoint(
    "checkpoint",
    "begin",
    BeginCheckpointRequest,
    CheckpointInfo,
    "Declare a rank's shard of a step before writing it; the first opens the step for its world.",
    scope="worker",
)
ACK_SHARD = endpoint(
    "checkpoint",
    "ack",
    AckShardRequest,
    AckShardResult,
    "A rank's shard is stored: the service records checkpoint.shard_saved (idempotent).",
    scope="worker",
)


class ShardFailedRequest(StrictModel):
    """A rank's writer could not store its shard of `step` (a full disk, an S3 error): the step
    can never complete, so the service aborts it at once instead of at its deadline. Sent by the
    process that declared the rank (`begin`); a no-op once the step committed or aborted."""

    job: Id
    worker_id: Id
    step: Step
    epoch: Epoch
    rank: Rank
    reason: Text = Field(description="The storage error, as the writer saw it.")
    instance: Id | None = Field(
        default=None, description="The writing process (its begin's instance); checked if given."
    )


SHARD_FAILED = endpoint(
    "checkpoint",
    "fail",
    ShardFailedRequest,
    CheckpointInfo,
    "A rank's shard could not be written: the step is aborted at once (idempotent).",
    scope="worker",
)
CHECKPOINT_STATUS = endpoint(
    "checkpoint",
    "status",
    CheckpointQuery,
    CheckpointAnswer,
    "A checkpoint's state, or the latest committed one with its manifest.",
    scope="job",
)
