"""Every NATS subject, stream and queue-group name Strata uses is built here and nowhere else.

Layout: events on `strata.evt.<job>.<area>.<event>` (stream STRATA_EVENTS), heartbeats on
`strata.hb.<bucket>.<job>.<worker>` (the bucket a stable hash of the worker id, so heartbeat intake
can be split over registry processes by subject) and samples on
`strata.metric.<job>.<worker>.<name>` (stream STRATA_TELEMETRY), requests on
`strata.rpc.<service>.<verb>.<job>.<worker>`: the last two tokens are the caller, and NATS
permissions tie a worker's credential to its own, so the subject a request arrives on says who
sent it. (`strata.rpc.<service>.<verb>` without them is an operator's request, which only the
services' credential, or anyone on an unsecured NATS, may send.) The NATS server's subject mapping
moves a worker's request to `strata.rpcp.<partition>.<service>.<verb>.<job>.<worker>`, the partition
decided by the job (`rpc_partition_mapping`), so each service can take each partition on a
connection of its own. A worker's replies come to its
own inbox prefix, `_INBOX_strata.<job>.<worker>`, so no other worker may read them.
Ids may contain `.`, which separates subject tokens, so ids are encoded into tokens with `.` -> `~`
(ids never contain `~`, so the mapping is reversible). Where a function says a part may be `*`, it
also builds the wildcard pattern that NATS permissions are written in.
"""

from __future__ import annotations

import base64
import functools
import hashlib
import re
from typing import Final, Literal, NamedTuple

from strata.events.models import ID_PATTERN

EVENTS_STREAM: Final = "STRATA_EVENTS"
TELEMETRY_STREAM: Final = "STRATA_TELEMETRY"
SNAPSHOT_BUCKET: Final = "STRATA_SNAPSHOTS"
RENDEZVOUS_BUCKET: Final = "STRATA_RENDEZVOUS"
SHARED_RENDEZVOUS_STREAM: Final = f"KV_{RENDEZVOUS_BUCKET}"
"""The one rendezvous stream of every job that earlier releases kept; each job has its own now
(`rendezvous_stream_name`), on the same subjects."""

ROOT: Final = "strata"
EVENTS: Final = f"{ROOT}.evt"
HEARTBEATS: Final = f"{ROOT}.hb"
METRICS: Final = f"{ROOT}.metric"
RPC: Final = f"{ROOT}.rpc"
RPC_PARTITIONED: Final = f"{ROOT}.rpcp"
"""Where the NATS server moves a worker's request (`rpc_partition_mapping`): the same subject
after a partition number that the job token decides."""
MAX_RPC_PARTITIONS: Final = 256
DEFAULT_RPC_PARTITIONS: Final = 8
"""Request partitions (`STRATA_RPC_PARTITIONS`): two jobs share one with a chance of 1 in 8."""
CONTROL: Final = f"{ROOT}.ctl"
WORLD: Final = f"{ROOT}.world"
STATUS: Final = f"{ROOT}.status"
WORKER_INBOXES: Final = f"_INBOX_{ROOT}"
PROBES: Final = f"{ROOT}.probe"
PROBE_ANSWERS: Final = f"{ROOT}.probed"

EVENT_TYPE_PATTERN: Final = r"^[a-z][a-z_]*\.[a-z][a-z_]*$"
_EVENT_TYPE = re.compile(EVENT_TYPE_PATTERN)
_NAME = re.compile(r"^[a-z][a-z0-9_]{0,63}$")
_ID = re.compile(ID_PATTERN)


def token(identifier: str) -> str:
    """The subject token for a validated id (job, worker, dataset...); `*` stays a wildcard."""
    return identifier.replace(".", "~")


def untoken(subject_token: str) -> str:
    """The id a subject token stands for."""
    return subject_token.replace("~", ".")


def _check_event_type(event_type: str) -> str:
    if not _EVENT_TYPE.match(event_type):
        raise ValueError(f"event type {event_type!r} is not of the form <area>.<event>")
    return event_type


def _check_name(kind: str, name: str) -> str:
    if not _NAME.match(name):
        raise ValueError(f"{kind} {name!r} must match {_NAME.pattern}")
    return name


# -- events ---------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=4096)
def event_subject(job: str, event_type: str) -> str:
    """`strata.evt.<job>.<area>.<event>` for one event type of one job."""
    return f"{EVENTS}.{token(job)}.{_check_event_type(event_type)}"


def job_events(job: str) -> str:
    """Every event of one job."""
    return f"{EVENTS}.{token(job)}.>"


def area_events(job: str, area: str) -> str:
    """Every event of one area (`worker`, `barrier`, ...) of one job; `*` for every job."""
    job_token = "*" if job == "*" else token(job)
    return f"{EVENTS}.{job_token}.{_check_name('area', area)}.*"


def all_events() -> str:
    return f"{EVENTS}.>"


def parse_event_subject(subject: str) -> tuple[str, str]:
    """(job, event type) of an event subject; ValueError for anything else."""
    parts = subject.split(".")
    if len(parts) != 5 or f"{parts[0]}.{parts[1]}" != EVENTS:
        raise ValueError(f"{subject!r} is not an event subject ({EVENTS}.<job>.<area>.<event>)")
    return untoken(parts[2]), _check_event_type(f"{parts[3]}.{parts[4]}")


# -- telemetry ------------------------------------------------------------------------------------


HEARTBEAT_BUCKETS: Final = 256
"""Heartbeat subjects carry one of this many bucket tokens; registry partitions own whole
buckets, so at most this many registry processes can share the heartbeat intake."""


@functools.lru_cache(maxsize=65_536)
def heartbeat_bucket(worker_id: str) -> str:
    """The bucket token of a worker's heartbeat subject: the first two hex digits of the SHA-256
    of its id, the same in every process and language (the Helm chart renders it with
    `sha256sum | trunc 2`); `*` stays a wildcard."""
    if worker_id == "*":
        return "*"
    return hashlib.sha256(worker_id.encode()).hexdigest()[:2]


def heartbeat_subject(job: str, worker_id: str) -> str:
    """Where one worker heartbeats; `worker_id` may be `*` (then so is the bucket)."""
    return f"{HEARTBEATS}.{heartbeat_bucket(worker_id)}.{token(job)}.{token(worker_id)}"


def job_heartbeats(job: str) -> str:
    """Heartbeats of every worker of one job; `*` for every job."""
    job_token = "*" if job == "*" else token(job)
    return f"{HEARTBEATS}.*.{job_token}.*"


def all_heartbeats() -> str:
    return f"{HEARTBEATS}.>"


def partition_of(worker_id: str, partitions: int) -> int:
    """The registry partition (0 to `partitions` - 1) that takes in `worker_id`'s heartbeats and
    watches it for silence."""
    return int(heartbeat_bucket(worker_id), 16) % _check_partitions(partitions)


def partition_heartbeats(partition: int, partitions: int) -> list[str]:
    """The subjects registry partition `partition` of `partitions` subscribes to: every bucket
    whose number modulo `partitions` is `partition` (one wildcard for a single partition)."""
    _check_partitions(partitions)
    if not 0 <= partition < partitions:
        raise ValueError(f"partition {partition} is not in 0..{partitions - 1}")
    if partitions == 1:
        return [f"{HEARTBEATS}.*.*.*"]
    return [
        f"{HEARTBEATS}.{bucket:02x}.*.*"
        for bucket in range(HEARTBEAT_BUCKETS)
        if bucket % partitions == partition
    ]


def _check_partitions(partitions: int) -> int:
    if not 1 <= partitions <= HEARTBEAT_BUCKETS:
        raise ValueError(
            f"registry partitions must be 1 to {HEARTBEAT_BUCKETS} (one heartbeat bucket at "
            f"least each), not {partitions}"
        )
    return partitions


def registry_silences() -> str:
    """Where a registry partition sends the workers it found silent to the registry leader, which
    alone decides membership (a core NATS request; no worker credential may publish here)."""
    return f"{ROOT}.registry.silent"


def registry_hearing(partition: int) -> str:
    """Where registry partition `partition` writes the markers that prove it hears (a key of the
    snapshot bucket, so proving needs a JetStream quorum and keeps one value, never a history)."""
    return kv_subject(SNAPSHOT_BUCKET, f"registry-hearing-{int(partition)}")


def registry_progress() -> str:
    """Where a registry partition sends the leader the last heartbeat, step and epoch of its
    workers, for the leader's `members` answers (core NATS; no worker credential may publish)."""
    return f"{ROOT}.registry.progress"


def parse_heartbeat_subject(subject: str) -> tuple[str, str]:
    """(job, worker id) of a heartbeat subject; ValueError for anything else."""
    parts = subject.split(".")
    if len(parts) != 5 or f"{parts[0]}.{parts[1]}" != HEARTBEATS:
        raise ValueError(
            f"{subject!r} is not a heartbeat subject ({HEARTBEATS}.<bucket>.<job>.<worker>)"
        )
    return untoken(parts[3]), untoken(parts[4])


def metric_subject(job: str, worker_id: str, name: str) -> str:
    """One figure sampled by one worker (or a service: then `worker_id` is its name)."""
    return f"{METRICS}.{token(job)}.{token(worker_id)}.{_check_name('metric', name)}"


def worker_metrics(job: str, worker_id: str) -> str:
    """Every figure one worker samples; `worker_id` may be `*`."""
    return f"{METRICS}.{token(job)}.{token(worker_id)}.*"


def all_metrics() -> str:
    return f"{METRICS}.>"


def control_subject(job: str, worker_id: str) -> str:
    """Notices from the services to one worker (core NATS, not stored); `worker_id` may be `*`."""
    return f"{CONTROL}.{token(job)}.{token(worker_id)}"


def world_subject(job: str) -> str:
    """The registry's compact notices of a job's world (core NATS, not stored)."""
    return f"{WORLD}.{token(job)}"


def probe_subject(job: str, worker_id: str, instance: str) -> str:
    """Where one registration of a worker (its process, `instance`) answers the registry's
    probes (core NATS request/reply); `worker_id` and `instance` may be `*`. The subscription
    lives as long as the process's connection: a request finding no subscriber there (NATS's
    "no responders") means that connection is gone (`registry.suspect`)."""
    return f"{PROBES}.{token(job)}.{token(worker_id)}.{token(instance)}"


def probe_answer_subject(job: str, worker_id: str, nonce: str) -> str:
    """The reply subject of one probe of a worker (`probe_subject`), where the registry takes its
    answer; `nonce` is fresh for each probe, and `worker_id` and `nonce` may be `*`. A worker
    credential may publish on its own worker's only (`strata.security`): it answers its own
    probes, and no one else's."""
    return f"{PROBE_ANSWERS}.{token(job)}.{token(worker_id)}.{nonce}"


def worker_inbox_prefix(job: str, worker_id: str) -> str:
    """The inbox prefix of one worker's connection: its replies come to subjects under it."""
    return f"{WORKER_INBOXES}.{token(job)}.{token(worker_id)}"


def worker_inboxes(job: str, worker_id: str) -> str:
    """Every subject under one worker's inbox prefix; `worker_id` may be `*`."""
    return f"{worker_inbox_prefix(job, worker_id)}.>"


# -- requests -------------------------------------------------------------------------------------


class RpcAddress(NamedTuple):
    """What a request subject says: the service and verb asked, and who asks (job and worker,
    both None for an operator's request)."""

    service: str
    verb: str
    job: str | None
    worker: str | None


@functools.lru_cache(maxsize=4096)
def rpc_subject(service: str, verb: str, job: str | None = None, worker: str | None = None) -> str:
    """`strata.rpc.<service>.<verb>.<job>.<worker>` for a request of one worker; without a job and
    worker, the operator's `strata.rpc.<service>.<verb>`."""
    base = f"{RPC}.{_check_name('service', service)}.{_check_name('verb', verb)}"
    if job is None and worker is None:
        return base
    if job is None or worker is None:
        raise ValueError("a request names both its job and its worker, or neither")
    return f"{base}.{token(job)}.{token(worker)}"


def caller_rpcs(job: str, worker_id: str) -> str:
    """Every request one worker may send: any service and verb, as itself; `worker_id` may be
    `*` (any worker of the job)."""
    return f"{RPC}.*.*.{token(job)}.{token(worker_id)}"


def service_rpcs(service: str) -> str:
    """Every request subject of one service, whoever sends it."""
    return f"{RPC}.{_check_name('service', service)}.>"


@functools.lru_cache(maxsize=16384)
def parse_rpc_subject(subject: str) -> RpcAddress:
    """The service, verb and caller of a request subject; ValueError for anything else."""
    parts = subject.split(".")
    if len(parts) == 7 and f"{parts[0]}.{parts[1]}" == RPC_PARTITIONED and parts[2].isdigit():
        del parts[2]  # moved to its job's partition by the server: the rest is the request's
        parts[1] = RPC.rsplit(".", 1)[1]
    if len(parts) not in (4, 6) or f"{parts[0]}.{parts[1]}" != RPC:
        raise ValueError(
            f"{subject[:200]!r} is not a request subject ({RPC}.<service>.<verb>.<job>.<worker>)"
        )
    service, verb = _check_name("service", parts[2]), _check_name("verb", parts[3])
    if len(parts) == 4:
        return RpcAddress(service, verb, None, None)
    job, worker = untoken(parts[4]), untoken(parts[5])
    for kind, identifier in (("job", job), ("worker", worker)):
        if not _ID.match(identifier) or "\n" in identifier:
            raise ValueError(f"the {kind} of request subject {subject[:200]!r} is not a valid id")
    return RpcAddress(service, verb, job, worker)


def _fnv1a32(data: bytes) -> int:
    value = 0x811C9DC5
    for byte in data:
        value = ((value ^ byte) * 0x01000193) & 0xFFFFFFFF
    return value


def check_rpc_partitions(partitions: int) -> int:
    if not 1 <= partitions <= MAX_RPC_PARTITIONS:
        raise ValueError(f"request partitions must be 1 to {MAX_RPC_PARTITIONS}, not {partitions}")
    return partitions


@functools.lru_cache(maxsize=4096)
def rpc_partition_of(job: str, partitions: int) -> int:
    """The partition the NATS server moves `job`'s requests to: the FNV-1a hash of the job's
    subject token modulo `partitions`, as nats-server's `partition()` subject transform computes
    it (`rpc_partition_mapping`)."""
    return _fnv1a32(token(job).encode()) % check_rpc_partitions(partitions)


def rpc_partition_mapping(partitions: int) -> tuple[str, str]:
    """The subject mapping (source, destination) of a nats-server configuration that moves every
    worker's request, `strata.rpc.<service>.<verb>.<job>.<worker>`, to
    `strata.rpcp.<partition>.<service>.<verb>.<job>.<worker>`, the partition decided by the job
    alone, so each service can take each partition on a connection of its own."""
    check_rpc_partitions(partitions)
    wildcards = ".".join(f"{{{{wildcard({index})}}}}" for index in range(1, 5))
    return (
        f"{RPC}.*.*.*.*",
        f"{RPC_PARTITIONED}.{{{{partition({partitions},3)}}}}.{wildcards}",
    )


def partition_rpcs(service: str, partition: int | Literal["*"]) -> str:
    """Every request to `service` that the NATS server moved to `partition` (`*`: to any)."""
    return f"{RPC_PARTITIONED}.{partition}.{_check_name('service', service)}.>"


def caller_partition_rpcs(job: str, worker_id: str, partitions: int) -> str:
    """Every request one worker may send, once the NATS server moved it to its job's partition
    (nats-server checks a publish permission on the subject after the mapping); `worker_id` may
    be `*`."""
    partition = rpc_partition_of(job, partitions)
    return f"{RPC_PARTITIONED}.{partition}.*.*.{token(job)}.{token(worker_id)}"


def status_subject(service: str) -> str:
    """Where each replica of a service announces itself every few seconds (core NATS, not stored):
    readers that may not send requests (the gateway) learn from it who is up."""
    return f"{STATUS}.{_check_name('service', service)}"


def all_status() -> str:
    return f"{STATUS}.*"


def rpc_queue_group(service: str) -> str:
    """Replicas of one service share a queue group, so each request is answered once."""
    return f"{ROOT}-{_check_name('service', service)}"


# -- permissions ----------------------------------------------------------------------------------


def all_strata() -> str:
    """Every subject Strata uses (streams, requests, notices)."""
    return f"{ROOT}.>"


def all_control() -> str:
    """Every notice to any worker (`control_subject`)."""
    return f"{CONTROL}.>"


DEFAULT_INBOXES: Final = "_INBOX.>"
"""The inboxes of connections with the client's default inbox prefix (services, gateway)."""
JETSTREAM_API: Final = "$JS.>"
"""Every JetStream API subject (and flow control)."""
KV_API: Final = "$KV.>"
"""Every key-value bucket's subjects (the snapshot bucket among them)."""
JETSTREAM_MANAGE_API: Final = (
    "$JS.API.STREAM.>",
    "$JS.API.CONSUMER.>",
    "$JS.API.ACCOUNT.>",
    "$JS.API.META.>",
    "$JS.API.SERVER.>",
)
"""The JetStream API that looks at, makes, changes or removes streams and consumers (message
reads by subject, `$JS.API.DIRECT.GET.<stream>.<subject>`, are not in it)."""
JETSTREAM_READ_API: Final = (
    "$JS.API.INFO",
    "$JS.API.STREAM.INFO.>",
    "$JS.API.STREAM.NAMES",
    "$JS.API.STREAM.LIST",
    "$JS.API.STREAM.MSG.GET.>",
    "$JS.API.DIRECT.GET.>",
    "$JS.API.CONSUMER.CREATE.>",
    "$JS.API.CONSUMER.INFO.>",
    "$JS.API.CONSUMER.DELETE.>",
    "$JS.FC.>",
)
"""The JetStream API a reader of the streams needs: look streams up, read messages, and create
(and delete) its own consumers; nothing that writes to a stream."""


# -- addresses (the documented shape of each subject) ---------------------------------------------
# The subjects above with `{parameter}` in place of an id: the channel addresses of the AsyncAPI
# document (`strata.events.schemagen`), and what people read.


def event_address(event_type: str) -> str:
    """`strata.evt.{job}.<area>.<event>`."""
    return event_subject("{job}", event_type)


def heartbeat_address() -> str:
    return f"{HEARTBEATS}.{{bucket}}.{{job}}.{{worker}}"


def metric_address() -> str:
    return f"{METRICS}.{{job}}.{{worker}}.{{metric}}"


def control_address() -> str:
    return control_subject("{job}", "{worker}")


def world_address() -> str:
    return world_subject("{job}")


def status_address() -> str:
    return f"{STATUS}.{{service}}"


def rpc_address(service: str, verb: str) -> str:
    """`strata.rpc.<service>.<verb>.{job}.{worker}`: a worker's request."""
    return rpc_subject(service, verb, "{job}", "{worker}")


def rpc_layout() -> str:
    """The shape of every request subject, for people: `strata.rpc.<service>.<verb>.<job>.<worker>`
    (the gateway's subject layout)."""
    return f"{RPC}.<service>.<verb>.<job>.<worker>"


# -- durable names --------------------------------------------------------------------------------


def durable_name(*parts: str) -> str:
    """A JetStream consumer or KV key name from ids (no `.`, `*`, `>` or whitespace allowed)."""
    return "_".join(token(part) for part in parts)


# -- torchrun rendezvous keys ---------------------------------------------------------------------


def _rendezvous_prefix(job: str) -> str:
    # KV keys allow `=` but ids never hold it, so `.` -> `=` keeps one job's keys apart from
    # another's whose id is this one's with more dot-separated parts.
    if not _ID.match(job):
        raise ValueError(f"invalid rendezvous id {job!r}: it must match {ID_PATTERN}")
    return job.replace(".", "=")


def rendezvous_state_key(job: str) -> str:
    """The key of a job's torchrun rendezvous state in the rendezvous bucket."""
    return f"{_rendezvous_prefix(job)}.state"


def rendezvous_store_key(job: str, key: str) -> str:
    """The bucket key of one key of a job's torch.distributed store (any string: it is encoded)."""
    encoded = base64.urlsafe_b64encode(key.encode()).decode().rstrip("=")
    return f"{_rendezvous_prefix(job)}.store.k{encoded}"


def kv_subject(bucket: str, key: str) -> str:
    """The subject JetStream stores a key-value bucket's `key` on (puts can be listened to)."""
    return f"$KV.{bucket}.{key}"


def rendezvous_store_keys(job: str) -> str:
    """The pattern of every key of a job's torch.distributed store."""
    return f"{_rendezvous_prefix(job)}.store.>"


def rendezvous_keys(job: str) -> str:
    """The pattern of every key of a job in the rendezvous bucket: its state and its store keys
    all start with the job's own prefix."""
    return f"{_rendezvous_prefix(job)}.>"


def rendezvous_subjects(job: str) -> str:
    """The subjects of a job's rendezvous keys: writing one is a put (or delete) of that key."""
    return kv_subject(RENDEZVOUS_BUCKET, rendezvous_keys(job))


def rendezvous_stream_name(job: str) -> str:
    """The stream that keeps `job`'s rendezvous keys, and only them: one per job, so that each
    job's bytes and keys are bounded by its own stream's limits. Its subjects are the job's keys
    in the `STRATA_RENDEZVOUS` bucket (`rendezvous_subjects`)."""
    return f"{SHARED_RENDEZVOUS_STREAM}_{_rendezvous_prefix(job)}"


def rendezvous_read(job: str, key: str) -> str:
    """The JetStream direct get of a rendezvous key of `job`, by subject (`key` may be a
    pattern): the only read of the bucket whose permission can be bound to the keys read (the
    others name them in the request's body)."""
    stream = rendezvous_stream_name(job)
    return f"$JS.API.DIRECT.GET.{stream}.{kv_subject(RENDEZVOUS_BUCKET, key)}"


def rendezvous_reads(job: str) -> str:
    """The direct gets of every rendezvous key of a job."""
    return rendezvous_read(job, rendezvous_keys(job))
