"""Idempotent provisioning of Strata's JetStream streams and snapshot bucket.

Running it twice changes nothing; running it against a stream whose settings drifted updates what
JetStream allows to be updated and refuses, with a clear error, what it does not (storage type).

Workers write only to STRATA_TELEMETRY (their heartbeats and samples), and it is bounded every
way a sender could grow it: by age, by total bytes, by messages per subject (one subject per
worker), and by message size, discarding the oldest when full. Its byte bound is reserved from
JetStream's store when the stream is created, so however fast workers send, STRATA_EVENTS, where
the services record their decisions and nothing else is written, keeps the rest of the store.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nats.js import JetStreamContext
from nats.js.api import DiscardPolicy, RetentionPolicy, StorageType, StreamConfig
from nats.js.errors import NotFoundError

from strata.errors import ConfigError
from strata.events import subjects

DUPLICATE_WINDOW_S = 120.0
MAX_MSG_SIZE = 8 * 1024 * 1024
TELEMETRY_MAX_AGE_S = 6 * 3600.0
TELEMETRY_MAX_BYTES = 1024**3
"""1 GiB, reserved from the JetStream store: well below the chart's 8 GB file store."""
TELEMETRY_MAX_MSGS_PER_SUBJECT = 50_000
"""Per worker's heartbeat subject (and per sampled figure): 6 hours at 2.3 beats a second."""
TELEMETRY_MAX_MSG_SIZE = 64 * 1024
"""A heartbeat is a few hundred bytes, a sample with every label at its longest some 10 KiB."""

Outcome = Literal["created", "updated", "unchanged"]


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
    max_msgs_per_subject: int = -1
    description: str = ""

    def config(self) -> StreamConfig:
        return StreamConfig(
            name=self.name,
            description=self.description,
            subjects=list(self.subjects),
            retention=RetentionPolicy.LIMITS,
            discard=DiscardPolicy.OLD,
            storage=self.storage,
            num_replicas=self.replicas,
            max_age=self.max_age,
            duplicate_window=self.duplicate_window,
            max_msg_size=self.max_msg_size,
            max_bytes=self.max_bytes,
            max_msgs_per_subject=self.max_msgs_per_subject,
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
        ),
    ]


def _differences(current: StreamConfig, wanted: StreamConfig) -> list[str]:
    fields = (
        "subjects",
        "num_replicas",
        "max_age",
        "duplicate_window",
        "max_msg_size",
        "max_bytes",
        "max_msgs_per_subject",
        "discard",
        "storage",
    )
    changed = []
    for name in fields:
        have, want = getattr(current, name), getattr(wanted, name)
        if name == "subjects":
            have, want = sorted(have or []), sorted(want or [])
        elif name in ("max_age", "duplicate_window"):
            have, want = round(float(have or 0), 3), round(float(want or 0), 3)
        elif name in ("max_bytes", "max_msgs_per_subject"):
            # The server reports "no limit" as -1; an unset field reads back as None.
            have, want = have if have is not None else -1, want if want is not None else -1
        if have != want:
            changed.append(name)
    return changed


async def ensure_stream(js: JetStreamContext, spec: StreamSpec) -> Outcome:
    """Create the stream, or bring an existing one in line with `spec`."""
    wanted = spec.config()
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
    await js.update_stream(wanted)
    return "updated"


async def ensure_streams(js: JetStreamContext, replicas: int = 1) -> dict[str, Outcome]:
    """Provision every Strata stream; returns what happened to each."""
    return {spec.name: await ensure_stream(js, spec) for spec in strata_streams(replicas)}
