"""Snapshots of a service's projection in a JetStream key-value bucket, so start-up stays fast.

A snapshot is the projection's plain data plus the stream sequence it covers; a service restores it
and replays only the events after that sequence. A missing or unreadable snapshot is never fatal:
the service replays the whole stream instead.
"""

from __future__ import annotations

from dataclasses import dataclass
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


# -- per job ---------------------------------------------------------------------------------------

SNAPSHOT_HEADROOM = 64 * 1024
"""Kept below the largest message for the headers and framing of a put."""


@dataclass
class JobSnapshots:
    """A projection's snapshot read back job by job (`load_job_snapshots`).

    `data` is what the projection's `restore` takes (its `jobs` list holding the jobs restored);
    `covered` is, for each job restored, the stream sequence its part was taken at; `replay` names
    the jobs whose part was left out (too large) or could not be read: their events are folded
    again from the stream's start. `last_seq` is the sequence the whole snapshot was taken at.
    """

    data: dict[str, Any]
    last_seq: int
    covered: dict[str, int]
    replay: set[str]

    def floor(self, job: str) -> int:
        """The last sequence of `job`'s events the restored state holds already."""
        if job in self.replay:
            return 0
        return self.covered.get(job, self.last_seq)

    @property
    def start_seq(self) -> int:
        """Where the stream must be read from for every job's events to be folded."""
        return 1 + min([self.last_seq, *self.covered.values(), *(0 for _ in self.replay)])


def job_key(key: str, job: str) -> str:
    return f"{key}.job.{job}"


async def save_job_snapshots(
    kv: KeyValue, key: str, data: dict[str, Any], last_seq: int, limit: int
) -> list[str]:
    """Store a snapshot whose `jobs` is a list of per-job parts (each a dict with `job`): each
    part under a key of its own, then an index of them under `key`. A part over `limit` bytes is
    left out, with an error in the log, and its job is replayed from the stream at the next
    start: one job's size never costs the other jobs their snapshot. Returns the jobs left out."""
    kept: list[str] = []
    left_out: list[str] = []
    for part in data.get("jobs", []):
        job = str(part["job"])
        blob = pack({"last_seq": last_seq, "part": part})
        if len(blob) > limit:
            left_out.append(job)
            log.error(
                "snapshot_part_too_large",
                service=key,
                job=job,
                bytes=len(blob),
                limit=limit,
                effect="the job's events are replayed from the stream at the next start",
            )
            continue
        await kv.put(job_key(key, job), blob)
        kept.append(job)
    index = {k: v for k, v in data.items() if k != "jobs"}
    index.update({"last_seq": last_seq, "job_parts": kept, "replay": left_out})
    await kv.put(key, pack(index))
    return left_out


async def load_job_snapshots(kv: KeyValue, key: str) -> JobSnapshots | None:
    """The snapshot `save_job_snapshots` stored, or None when there is none or its index cannot
    be read (a part that cannot be read puts its job among those replayed)."""
    index = await load_snapshot(kv, key)
    if index is None or "job_parts" not in index:
        return None
    last_seq = int(index.pop("last_seq"))
    names = [str(job) for job in index.pop("job_parts")]
    replay = {str(job) for job in index.pop("replay", [])}
    parts: list[dict[str, Any]] = []
    covered: dict[str, int] = {}
    for job in names:
        part = await load_snapshot(kv, job_key(key, job))
        if part is None or "part" not in part:
            replay.add(job)
            continue
        parts.append(part["part"])
        covered[job] = int(part["last_seq"])
    return JobSnapshots({**index, "jobs": parts}, last_seq, covered, replay)
