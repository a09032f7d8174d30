"""Snapshots of a service's projection in a JetStream key-value bucket, so start-up stays fast.

A snapshot is the projection's plain data plus the stream sequence it covers; a service restores it
and replays only the events after that sequence. A missing or unreadable snapshot is never fatal:
the service replays the whole stream instead.
"""

from __future__ import annotations

from typing import Any

import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from strata.bus.streams import MAX_MSG_SIZE
from strata.errors import StrataError
from strata.events import subjects
from strata.events.codec import pack, unpack

log = structlog.get_logger("strata.bus")


async def snapshot_bucket(js: JetStreamContext, replicas: int = 1) -> KeyValue:
    """The snapshot bucket, created on first use (idempotent)."""
    try:
        return await js.key_value(subjects.SNAPSHOT_BUCKET)
    except nats.js.errors.BucketNotFoundError:
        pass
    try:
        return await js.create_key_value(
            bucket=subjects.SNAPSHOT_BUCKET,
            history=1,
            replicas=replicas,
            max_value_size=MAX_MSG_SIZE,
            description="Snapshots of the Strata services' projections.",
        )
    except nats.js.errors.BadRequestError:
        # Another service created it between our two calls.
        return await js.key_value(subjects.SNAPSHOT_BUCKET)


async def save_snapshot(kv: KeyValue, key: str, data: dict[str, Any]) -> int:
    """Store `data` under `key`; returns the bucket revision."""
    return await kv.put(key, pack(data))


async def load_snapshot(kv: KeyValue, key: str) -> dict[str, Any] | None:
    """The stored snapshot, or None when there is none or it cannot be read."""
    try:
        entry = await kv.get(key)
    except nats.js.errors.KeyNotFoundError:
        return None
    if entry.value is None:
        return None
    try:
        data = unpack(entry.value, bounded=False)
    except StrataError as exc:
        log.warning("snapshot_unreadable", key=key, error=str(exc))
        return None
    return data if isinstance(data, dict) else None
