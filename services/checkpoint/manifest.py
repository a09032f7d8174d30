"""How a step ends, as data: its manifest (the commit marker), the check of its shards against
what storage holds, and its `checkpoint.committed` or `checkpoint.aborted` event.
"""

from __future__ import annotations

from collections.abc import Mapping

from strata.events import CheckpointAborted, CheckpointCommitted, Event
from strata.events.ids import event_id
from strata.events.requests import Manifest, ManifestShard
from strata.services.checkpoint.state import SOURCE, OpenCheckpoint, _participants


def manifest(opened: OpenCheckpoint, job: str, now_ns: int) -> Manifest:
    shards = [
        ManifestShard(
            rank=ack.rank,
            worker_id=ack.worker_id,
            key=ack.key,
            uri=ack.uri,
            bytes=ack.bytes,
            checksum=ack.checksum,
            cursors=ack.cursors,
        )
        for _, ack in sorted(opened.acks.items())
    ]
    return Manifest(
        job=job,
        step=opened.step,
        epoch=opened.epoch,
        root_uri=opened.root_uri,
        committed_ts=now_ns,
        participants=_participants(opened.participants),
        shards=shards,
        total_bytes=sum(s.bytes for s in shards),
        world_size=opened.world_size,
        membership_epoch=opened.membership_epoch,
    )


def storage_problem(opened: OpenCheckpoint, sizes: Mapping[int, int | None]) -> str | None:
    """Why the step cannot commit with its shards as storage holds them, or None.

    `sizes`: rank -> the size of the object under its acked key (None: no object). Each acked
    shard must still be there, exactly as long as acked; the manifest is the commit marker, so
    it is never written over a shard that was lost or cut short after its ack.
    """
    problems = []
    for rank, ack in sorted(opened.acks.items()):
        found = sizes.get(rank)
        if found is None:
            problems.append(f"the shard of rank {rank} ({ack.key}) is missing from storage")
        elif found != ack.bytes:
            problems.append(
                f"the shard of rank {rank} ({ack.key}) holds {found} bytes in storage, "
                f"{ack.bytes} were acked"
            )
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return problems[0] + more


def committed(job: str, opened: OpenCheckpoint, manifest_uri: str, now_ns: int) -> Event:
    return CheckpointCommitted(
        id=event_id("ckpt-committed", job, opened.step),
        job=job,
        source=SOURCE,
        ts=now_ns,
        step=opened.step,
        epoch=opened.epoch,
        manifest_uri=manifest_uri,
        total_bytes=sum(a.bytes for a in opened.acks.values()),
        shards=max(1, len(opened.acks)),
        duration_ms=max(0.0, (now_ns - opened.started_ns) / 1e6),
    )


def aborted(job: str, opened: OpenCheckpoint, reason: str, now_ns: int) -> Event:
    return CheckpointAborted(
        id=event_id("ckpt-aborted", job, opened.step, opened.started_ns),
        job=job,
        source=SOURCE,
        ts=now_ns,
        step=opened.step,
        epoch=opened.epoch,
        reason=reason,
        missing_ranks=opened.missing_ranks(),
    )
