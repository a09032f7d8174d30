"""Histories of real event models for the read model's tests: `History` builds one event by
event, `histories` draws them for hypothesis, and `GOLDEN` holds those recorded from a real job.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from strata.events import (
    AnyEvent,
    BarrierArrived,
    BarrierBrokenEvent,
    BarrierOpened,
    BarrierReleased,
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointStarted,
    DatasetRegistered,
    Event,
    LiveState,
    Participant,
    ShardOffset,
    ShardPlanChanged,
    ShardProgress,
    ShardProgressRestored,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
    WorkerStateChanged,
)
from strata.events.provenance import AREA_OWNERS
from strata.history import Record
from strata.services.readmodel import (
    JobState,
    rebuild,
)
from strata.storage.base import shard_key

JOB = "job-r"
SECOND = 1_000_000_000


T0 = 1_795_000_000 * SECOND


GOLDEN = Path(__file__).resolve().parent / "golden"
WORKERS = ("w0", "w1", "w2", "w3")


class History:
    """Events of one job with increasing times and stream sequences, as a stream would hold."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self.now = T0
        self.seq = 0
        self.telemetry_seq = 0

    def add(self, event: AnyEvent) -> AnyEvent:
        self.now += SECOND // 10
        if isinstance(event, WorkerHeartbeat):
            self.telemetry_seq += 1
            self.records.append(Record(self.telemetry_seq, self.now, event, "telemetry"))
        else:
            self.seq += 1
            self.records.append(Record(self.seq, self.now, event))
        return event

    def register(self, worker: str, rank: int, instance: str | None = None) -> None:
        self.add(
            WorkerRegistered(
                job=JOB,
                source="registry",
                ts=self.now,
                worker_id=worker,
                instance=instance or f"{worker}-a",
                rank=rank,
                world_size=rank + 1,
                membership_epoch=self.seq + 1,
                hostname=f"host-{worker}",
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
        )

    def beat(self, worker: str, step: int, instance: str | None = None, epoch: int = 0) -> None:
        self.add(
            WorkerHeartbeat(
                job=JOB,
                source=worker,
                ts=self.now,
                worker_id=worker,
                instance=instance or f"{worker}-a",
                seq=step,
                state="training",
                step=step,
                epoch=epoch,
            )
        )

    def state(self, worker: str, state: LiveState, step: int = 0) -> None:
        self.add(
            WorkerStateChanged(
                job=JOB, source="registry", ts=self.now, worker_id=worker, state=state, step=step
            )
        )

    def fold(self) -> JobState:
        return rebuild(self.records, JOB)


worker_ids = st.sampled_from(WORKERS)


instances = st.sampled_from(("a", "b"))


@st.composite
def histories(draw: st.DrawFn) -> list[Event]:
    """Arbitrary sequences of real events over four workers (not only orders services make)."""
    events: list[Event] = [
        DatasetRegistered(
            job=JOB,
            source="sharding",
            dataset_id="ds",
            total_samples=200,
            shard_size=10,
            shuffle=True,
            seed=1,
        )
    ]
    ts = T0
    for kind in draw(st.lists(st.integers(0, 15), max_size=60)):
        ts += SECOND
        worker = draw(worker_ids)
        base: dict[str, Any] = {"job": JOB, "source": "test", "ts": ts}
        step = draw(st.integers(0, 3)) * 100
        if kind == 0:
            rank = WORKERS.index(worker)
            events.append(
                WorkerRegistered(
                    **base,
                    worker_id=worker,
                    instance=draw(instances),
                    rank=rank,
                    world_size=4,
                    membership_epoch=len(events),
                    heartbeat_interval=1.0,
                    heartbeat_timeout=5.0,
                )
            )
        elif kind == 1:
            events.append(
                WorkerStateChanged(
                    **base, worker_id=worker, state=draw(st.sampled_from(("loading", "training")))
                )
            )
        elif kind == 2:
            events.append(
                WorkerFailed(
                    **base,
                    worker_id=worker,
                    rank=WORKERS.index(worker),
                    reason="silent",
                    last_heartbeat_ts=ts,
                    membership_epoch=len(events),
                )
            )
        elif kind == 3:
            events.append(
                WorkerLeft(
                    **base,
                    worker_id=worker,
                    rank=WORKERS.index(worker),
                    membership_epoch=len(events),
                )
            )
        elif kind == 4:
            members = draw(st.lists(worker_ids, min_size=1, max_size=4, unique=True))
            events.append(
                ShardPlanChanged(
                    **base,
                    dataset_id="ds",
                    epoch=draw(st.integers(0, 1)),
                    plan_version=len(events),
                    members=members,
                    membership_epoch=len(events),
                    reason="test",
                )
            )
        elif kind == 5:
            events.append(
                ShardProgress(
                    **base,
                    dataset_id="ds",
                    epoch=draw(st.integers(0, 1)),
                    worker_id=worker,
                    completed=draw(st.lists(st.integers(0, 19), max_size=3)),
                )
            )
        elif kind == 6:
            events.append(
                BarrierOpened(
                    **base,
                    name="b",
                    generation=draw(st.integers(0, 2)),
                    expected=draw(st.lists(worker_ids, min_size=1, max_size=4, unique=True)),
                    expected_count=2,
                    timeout_s=10.0,
                    deadline_ts=ts + 10 * SECOND,
                )
            )
        elif kind == 7:
            events.append(
                BarrierArrived(
                    **base,
                    name="b",
                    generation=draw(st.integers(0, 2)),
                    worker_id=worker,
                    arrived=1,
                )
            )
        elif kind == 8:
            events.append(
                BarrierReleased(
                    **base,
                    name="b",
                    generation=draw(st.integers(0, 2)),
                    participants=2,
                    first_arrival_to_release_ms=3.0,
                    last_arrival_to_release_ms=float(draw(st.integers(0, 50))),
                )
            )
        elif kind == 9:
            events.append(
                BarrierBrokenEvent(
                    **base,
                    name="b",
                    generation=draw(st.integers(0, 2)),
                    reason="test",
                    culprits=[worker],
                    missing=[],
                )
            )
        elif kind == 10:
            events.append(
                CheckpointStarted(
                    **base,
                    step=step,
                    epoch=0,
                    root_uri="file:///c",
                    participants=[Participant(worker_id=w, rank=r) for r, w in enumerate(WORKERS)],
                    keep_count=2,
                    timeout_s=5.0,
                )
            )
        elif kind == 11:
            events.append(
                CheckpointShardSaved(
                    **base,
                    step=step,
                    epoch=0,
                    rank=WORKERS.index(worker),
                    worker_id=worker,
                    uri=f"file:///c/{shard_key(JOB, step, WORKERS.index(worker))}",
                    key=shard_key(JOB, step, WORKERS.index(worker)),
                    bytes=draw(st.integers(0, 10**9)),
                    checksum="sha256:" + "1" * 64,
                )
            )
        elif kind == 12:
            events.append(
                CheckpointCommitted(
                    **base,
                    step=step,
                    epoch=0,
                    manifest_uri="file:///c/m",
                    total_bytes=draw(st.integers(0, 10**9)),
                    shards=4,
                    duration_ms=float(draw(st.integers(0, 5000))),
                )
            )
        elif kind == 13:
            events.append(CheckpointAborted(**base, step=step, epoch=0, reason="test"))
        elif kind == 15:
            events.append(
                ShardProgressRestored(
                    **base,
                    dataset_id="ds",
                    epoch=draw(st.integers(0, 1)),
                    checkpoint_step=step,
                    completed=draw(st.lists(st.integers(0, 19), max_size=3, unique=True)),
                    partial=[ShardOffset(shard_id=draw(st.integers(0, 19)), offset=3)],
                )
            )
        else:
            events.append(CheckpointPruned(**base, step=step, manifest_uri="file:///c/m"))
    # Each event as its owner records it: the fold leaves out any other source.
    return [
        event.model_copy(update={"source": AREA_OWNERS[event.type.split(".")[0]][0]})
        for event in events
    ]
