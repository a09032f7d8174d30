"""Idempotent provisioning of Strata's JetStream streams and snapshot bucket.

Running it twice changes nothing; running it against a stream whose settings drifted updates what
JetStream allows to be updated and refuses, with a clear error, what it does not (storage type).

Workers write only to STRATA_TELEMETRY (their heartbeats and samples), and it is bounded every
way a sender could grow it: by age, by total bytes, by messages per subject (one subject per
worker), and by message size, discarding the oldest when full. Its byte bound is reserved from
JetStream's store when the stream is created, so however fast workers send, STRATA_EVENTS, where
the services record their decisions and nothing else is written, keeps the rest of the store.

The torchrun rendezvous bucket is provisioned here too, so that an agent with a worker credential,
which may not create streams, finds it; its settings are those that let such a credential be
confined to its own job's keys (`rendezvous_stream`). It is one stream per job, each with its own
quota of bytes, keys and value size (`RendezvousQuota`): JetStream bounds a stream, not a subject
prefix, so a stream per job is what lets one job fill its share and no more. Each stream's bytes
are reserved from the store when it is made, as the telemetry's are.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from strata.config import (
    RENDEZVOUS_MAX_BYTES,
    RENDEZVOUS_MAX_KEYS,
    RENDEZVOUS_MAX_VALUE_BYTES,
    Settings,
)
from strata.errors import ConfigError
from strata.events import subjects

log = structlog.get_logger("strata.bus.streams")

DUPLICATE_WINDOW_S = 120.0
MAX_MSG_SIZE = 8 * 1024 * 1024
TELEMETRY_MAX_AGE_S = 6 * 3600.0
TELEMETRY_MAX_BYTES = 1024**3
"""1 GiB, reserved from the JetStream store: well below the chart's 8 GB file store."""
TELEMETRY_MAX_MSGS_PER_SUBJECT = 50_000
"""Per worker's heartbeat subject (and per sampled figure): 6 hours at 2.3 beats a second."""
TELEMETRY_MAX_MSG_SIZE = 64 * 1024
"""A heartbeat is a few hundred bytes, a sample with every label at its longest some 10 KiB."""

RENDEZVOUS_MAX_AGE_S = 7 * 24 * 3600.0
"""How long a rendezvous key the agents stopped writing stays. A live job's state key is written
again at every keep-alive and each round's store keys are read when the round starts, so only
finished (or long abandoned) jobs' keys go; the bucket does not grow with every job ever run."""


@dataclass(frozen=True)
class RendezvousQuota:
    """What one job may keep in its rendezvous bucket (`STRATA_RENDEZVOUS_MAX_*`)."""

    max_bytes: int = RENDEZVOUS_MAX_BYTES
    max_keys: int = RENDEZVOUS_MAX_KEYS
    max_value_bytes: int = RENDEZVOUS_MAX_VALUE_BYTES

    @classmethod
    def of(cls, settings: Settings) -> RendezvousQuota:
        return cls(
            max_bytes=settings.rendezvous_max_bytes,
            max_keys=settings.rendezvous_max_keys,
            max_value_bytes=settings.rendezvous_max_value_bytes,
        )


Outcome = Literal["created", "updated", "unchanged", "removed", "refused"]


@dataclass(frozen=True)
class StreamSpec:
    name: str
    subjects: tuple[str, ...]
    replicas: int = 1
    storage: StorageType = StorageType.FILE
    max_age: float = 0.0
    duplicate_window: float = DUPLICATE_WINDOW_S
    max_msg_size: int = MAX_MSG_SIZE
    max_bytes: int = -1
    max_msgs: int = -1
    max_msgs_per_subject: int = -1
    description: str = ""
    discard: DiscardPolicy = DiscardPolicy.OLD
    allow_direct: bool = False
    allow_rollup_hdrs: bool = False
    deny_delete: bool = False
    deny_purge: bool = False
    allow_atomic: bool = False

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            description=self.description,
            subjects=list(self.subjects),
            retention=RetentionPolicy.LIMITS,
            discard=self.discard,
            storage=self.storage,
            num_replicas=self.replicas,
            max_age=self.max_age,
            duplicate_window=self.duplicate_window,
            max_msg_size=self.max_msg_size,
            max_bytes=self.max_bytes,
            max_msgs=self.max_msgs,
            max_msgs_per_subject=self.max_msgs_per_subject,
            allow_direct=self.allow_direct,
            allow_rollup_hdrs=self.allow_rollup_hdrs,
            deny_delete=self.deny_delete,
            deny_purge=self.deny_purge,
            allow_atomic=self.allow_atomic or None,
        )


def strata_streams(
    replicas: int = 1,
    telemetry_max_age: float = TELEMETRY_MAX_AGE_S,
    telemetry_max_bytes: int = TELEMETRY_MAX_BYTES,
) -> list[StreamSpec]:
    """The streams every Strata deployment has."""
    return [
        StreamSpec(
            name=subjects.EVENTS_STREAM,
            subjects=(subjects.all_events(),),
            replicas=replicas,
            description="Every state change of every Strata job.",
        ),
        StreamSpec(
            name=subjects.TELEMETRY_STREAM,
            subjects=(subjects.all_heartbeats(), subjects.all_metrics()),
            replicas=replicas,
            max_age=telemetry_max_age,
            max_bytes=telemetry_max_bytes,
            max_msgs_per_subject=TELEMETRY_MAX_MSGS_PER_SUBJECT,
            max_msg_size=TELEMETRY_MAX_MSG_SIZE,
            description="Worker heartbeats and metric samples, kept for a limited age and size.",
            # The registry reads a worker's last heartbeat by subject before failing it, from
            # whichever replica answers first, with no JetStream API round through the cluster's
            # meta leader (which a registry cut off from it could not reach).
            allow_direct=True,
        ),
    ]


def rendezvous_stream(
    job: str, replicas: int = 1, quota: RendezvousQuota | None = None
) -> StreamSpec:
    """The stream of `job`'s keys in the key-value bucket of torchrun's rendezvous
    (`strata.torch.store`), one key per value, within the job's quota.

    A worker credential may write its job's keys and read them by subject only (direct gets),
    and what it sends in a message's headers no permission can check, so the stream itself
    refuses what would reach beyond one key: no rollup headers (a `Nats-Rollup: all` would purge
    the job's keys), and no purge or delete of messages by the API. A write past the quota is
    refused (discard new), never made room for by dropping another key. Atomic batches are
    allowed (a store's `multi_set` writes all its keys or none): each message of a batch is
    checked against the publisher's permissions like any other.
    """
    quota = quota or RendezvousQuota()
    return StreamSpec(
        name=subjects.rendezvous_stream_name(job),
        subjects=(subjects.rendezvous_subjects(job),),
        replicas=replicas,
        max_age=RENDEZVOUS_MAX_AGE_S,
        max_bytes=quota.max_bytes,
        max_msgs=quota.max_keys,
        max_msg_size=quota.max_value_bytes,
        max_msgs_per_subject=1,
        discard=DiscardPolicy.NEW,
        allow_direct=True,
        deny_delete=True,
        deny_purge=True,
        allow_atomic=True,
        description=f"torchrun rendezvous state and torch.distributed store keys of job {job}.",
    )


ATOMIC_BATCHES_SINCE = (2, 12)
"""The nats-server release that brought atomic batch publishes."""
_FLAGS = ("allow_direct", "allow_rollup_hdrs", "deny_delete", "deny_purge", "allow_atomic")
"""Settings the server reads back as absent when off."""


def _differences(current: StreamConfig, wanted: StreamConfig) -> list[str]:
    fields = (
        "subjects",
        "num_replicas",
        "max_age",
        "duplicate_window",
        "max_msg_size",
        "max_bytes",
        "max_msgs",
        "max_msgs_per_subject",
        "discard",
        "storage",
        "allow_direct",
        "allow_rollup_hdrs",
        "deny_delete",
        "deny_purge",
        "allow_atomic",
    )
    changed = []
    for name in fields:
        have, want = getattr(current, name), getattr(wanted, name)
        if name == "subjects":
            have, want = sorted(have or []), sorted(want or [])
        elif name in ("max_age", "duplicate_window"):
            have, want = round(float(have or 0), 3), round(float(want or 0), 3)
        elif name in ("max_bytes", "max_msgs", "max_msgs_per_subject"):
            # The server reports "no limit" as -1; an unset field reads back as None.
            have, want = have if have is not None else -1, want if want is not None else -1
        elif name in _FLAGS:
            have, want = bool(have), bool(want)
        if have != want:
            changed.append(name)
    return changed


def _has_atomic_batches(js: JetStreamContext) -> bool:
    version = js._nc.connected_server_version
    return (version.major, version.minor) >= ATOMIC_BATCHES_SINCE


async def ensure_stream(js: JetStreamContext, spec: StreamSpec) -> Outcome:
    """Create the stream, or bring an existing one in line with `spec`."""
    wanted = spec.config()
    if wanted.allow_atomic and not _has_atomic_batches(js):
        # A server before 2.12 knows no atomic batches and would read the setting back as
        # absent at every start; writes in a batch are then stored one by one.
        wanted.allow_atomic = None
    try:
        info = await js.stream_info(spec.name)
    except NotFoundError:
        await js.add_stream(wanted)
        return "created"
    changed = _differences(info.config, wanted)
    if not changed:
        return "unchanged"
    if "storage" in changed:
        raise ConfigError(
            f"stream {spec.name} exists with {info.config.storage} storage but "
            f"{spec.storage} is wanted; JetStream cannot convert it: back it up and recreate it"
        )
    # JetStream cannot turn per-message TTLs off once on (a rendezvous bucket made by an earlier
    # release had them): keep what cannot change.
    wanted.allow_msg_ttl = info.config.allow_msg_ttl or None
    await js.update_stream(wanted)
    return "updated"


async def remove_shared_rendezvous(js: JetStreamContext) -> bool:
    """Delete the one rendezvous stream of every job that earlier releases made: its subjects
    overlap each job's own stream's, which JetStream would refuse to make beside it."""
    try:
        # Looked up first: a reader (the gateway) may ask for a stream's info, not delete one.
        await js.stream_info(subjects.SHARED_RENDEZVOUS_STREAM)
        await js.delete_stream(subjects.SHARED_RENDEZVOUS_STREAM)
    except NotFoundError:
        return False
    log.warning(
        "shared_rendezvous_removed",
        stream=subjects.SHARED_RENDEZVOUS_STREAM,
        reason="each job has its own rendezvous stream now; a rendezvous open at the upgrade "
        "starts again",
    )
    return True


async def ensure_streams(
    js: JetStreamContext,
    replicas: int = 1,
    *,
    rendezvous_jobs: tuple[str, ...] = (),
    quota: RendezvousQuota | None = None,
) -> dict[str, Outcome]:
    """Provision every Strata stream and the rendezvous stream of each of `rendezvous_jobs`
    (those whose workers may not make their own: the jobs with a worker credential); returns
    what happened to each."""
    outcomes: dict[str, Outcome] = {
        spec.name: await ensure_stream(js, spec) for spec in strata_streams(replicas)
    }
    if await remove_shared_rendezvous(js):
        outcomes[subjects.SHARED_RENDEZVOUS_STREAM] = "removed"
    for job in rendezvous_jobs:
        spec = rendezvous_stream(job, replicas, quota)
        try:
            outcomes[spec.name] = await ensure_stream(js, spec)
        except nats.js.errors.APIError as exc:
            if "insufficient" not in (exc.description or "").lower():
                raise
            # One job's bucket that does not fit the store must not keep the services down.
            log.error(
                "rendezvous_bucket_refused",
                job=job,
                error=exc.description,
                fix="raise the JetStream store (nats.jetstream.maxFileStore, "
                "STRATA_JETSTREAM_MAX_FILE_STORE) or lower STRATA_RENDEZVOUS_MAX_BYTES",
            )
            outcomes[spec.name] = "refused"
    return outcomes
