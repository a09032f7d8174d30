"""Synthetic but real histories of a training job, as records at the stream positions they would
be stored at: `synthetic_history` (a short job with checkpoints and a failure) and `hour_history`
(an hour of a 1,000-worker job). Tests and benchmarks share them.
"""

from __future__ import annotations

import hashlib

from strata.events import (
    AnyEvent,
    BarrierArrived,
    BarrierOpened,
    BarrierReleased,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointStarted,
    DatasetRegistered,
    Participant,
    ShardPlanChanged,
    ShardProgress,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerRegistered,
    WorkerStateChanged,
)
from strata.history import Record
from strata.sharding import DatasetSpec, initial_plan
from strata.storage.base import shard_key

JOB = "bench"
START_NS = 1_795_000_000_000_000_000
STEP_NS = 500_000_000


class History:
    """Real events of a synthetic job, each with the stream position it would be stored at."""

    def __init__(self) -> None:
        self.records: list[Record] = []
        self._events_seq = 0
        self._telemetry_seq = 0
        self.now = START_NS

    def add(self, event: AnyEvent) -> None:
        telemetry = isinstance(event, WorkerHeartbeat)
        if telemetry:
            self._telemetry_seq += 1
            seq = self._telemetry_seq
        else:
            self._events_seq += 1
            seq = self._events_seq
        self.now += 1_000
        self.records.append(
            Record(seq, self.now + 200_000, event, "telemetry" if telemetry else "events")
        )


def synthetic_history(workers: int = 1000, steps: int = 60) -> list[Record]:
    history = History()
    ids = [f"worker-{i:04d}" for i in range(workers)]
    instances = [hashlib.sha1(w.encode()).hexdigest()[:16] for w in ids]
    source = "registry"
    for rank, worker in enumerate(ids):
        history.add(
            WorkerRegistered(
                job=JOB,
                source=source,
                ts=history.now,
                worker_id=worker,
                instance=instances[rank],
                rank=rank,
                world_size=rank + 1,
                membership_epoch=rank + 1,
                hostname=f"node-{rank // 8:03d}",
                gpus=8,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
        )
    spec = DatasetSpec("imagenet-1k", 1_281_167, 1_000, True, 42)
    history.add(
        DatasetRegistered(
            job=JOB,
            source="sharding",
            ts=history.now,
            dataset_id=spec.dataset_id,
            total_samples=spec.total_samples,
            shard_size=spec.shard_size,
            shuffle=True,
            seed=42,
        )
    )
    members = sorted(ids)
    history.add(
        ShardPlanChanged(
            job=JOB,
            source="sharding",
            ts=history.now,
            dataset_id=spec.dataset_id,
            epoch=0,
            plan_version=0,
            members=members,
            membership_epoch=workers,
            reason="first request of the epoch",
        )
    )
    plan = initial_plan(spec, 0, members)
    shards_of = {worker: plan.shards_of(worker) for worker in members}
    for worker in ids:
        history.add(
            WorkerStateChanged(
                job=JOB,
                source=source,
                ts=history.now,
                worker_id=worker,
                state="training",
                previous="idle",
            )
        )
    live = list(range(workers))
    checkpoint = 0
    for step in range(1, steps + 1):
        history.now += STEP_NS
        for index in live:
            history.add(
                WorkerHeartbeat(
                    job=JOB,
                    source=ids[index],
                    ts=history.now,
                    worker_id=ids[index],
                    instance=instances[index],
                    seq=step,
                    state="training",
                    step=step * 10,
                    epoch=0,
                    cpu_percent=97.5,
                    rss_bytes=3_221_225_472,
                )
            )
        if step % 5 == 0:
            name, generation = "step", step // 5 - 1
            history.add(
                BarrierOpened(
                    job=JOB,
                    source="barrier",
                    ts=history.now,
                    name=name,
                    generation=generation,
                    expected=[ids[i] for i in live],
                    expected_count=len(live),
                    timeout_s=60.0,
                    deadline_ts=history.now + 60 * 10**9,
                )
            )
            for count, index in enumerate(live, start=1):
                history.add(
                    BarrierArrived(
                        job=JOB,
                        source="barrier",
                        ts=history.now,
                        name=name,
                        generation=generation,
                        worker_id=ids[index],
                        arrival=generation,
                        arrived=count,
                    )
                )
            history.add(
                BarrierReleased(
                    job=JOB,
                    source="barrier",
                    ts=history.now,
                    name=name,
                    generation=generation,
                    participants=len(live),
                    first_arrival_to_release_ms=40.0 + step,
                    last_arrival_to_release_ms=0.5 + step / 100,
                )
            )
            for index in live:
                mine = shards_of[ids[index]]
                done = mine[(step // 5 - 1) : step // 5]
                history.add(
                    ShardProgress(
                        job=JOB,
                        source="sharding",
                        ts=history.now,
                        dataset_id=spec.dataset_id,
                        epoch=0,
                        worker_id=ids[index],
                        completed=done,
                    )
                )
        if step % 20 == 0:
            checkpoint += 1
            ckpt_step = step * 10
            history.add(
                CheckpointStarted(
                    job=JOB,
                    source="checkpoint",
                    ts=history.now,
                    step=ckpt_step,
                    epoch=0,
                    root_uri="s3://bench/ckpt",
                    participants=[Participant(worker_id=ids[i], rank=i) for i in live],
                    keep_count=2,
                    timeout_s=300.0,
                )
            )
            for index in live:
                history.add(
                    CheckpointShardSaved(
                        job=JOB,
                        source="checkpoint",
                        ts=history.now,
                        step=ckpt_step,
                        epoch=0,
                        rank=index,
                        worker_id=ids[index],
                        uri=f"s3://bench/ckpt/{shard_key(JOB, ckpt_step, index)}",
                        key=shard_key(JOB, ckpt_step, index),
                        bytes=268_435_456,
                        checksum="sha256:" + "ab" * 32,
                    )
                )
            history.add(
                CheckpointCommitted(
                    job=JOB,
                    source="checkpoint",
                    ts=history.now + 4 * 10**9,
                    step=ckpt_step,
                    epoch=0,
                    manifest_uri=f"s3://bench/ckpt/{ckpt_step}/manifest.json",
                    total_bytes=268_435_456 * len(live),
                    shards=len(live),
                    duration_ms=4000.0,
                )
            )
            if checkpoint > 2:
                old = (step - 40) * 10
                history.add(
                    CheckpointPruned(
                        job=JOB,
                        source="checkpoint",
                        ts=history.now,
                        step=old,
                        manifest_uri=f"s3://bench/ckpt/{old}/manifest.json",
                    )
                )
        if step == steps // 2:
            victim = live.pop()
            history.add(
                WorkerFailed(
                    job=JOB,
                    source=source,
                    ts=history.now,
                    worker_id=ids[victim],
                    rank=victim,
                    reason="no heartbeat for 5.2s (timeout 5s)",
                    last_heartbeat_ts=history.now - 5 * 10**9,
                    membership_epoch=workers + 1,
                )
            )
            history.add(
                ShardPlanChanged(
                    job=JOB,
                    source="sharding",
                    ts=history.now,
                    dataset_id=spec.dataset_id,
                    epoch=0,
                    plan_version=1,
                    members=sorted(ids[i] for i in live),
                    membership_epoch=workers + 1,
                    reason="membership changed",
                )
            )
    return history.records


MINUTE_NS = 60 * 10**9


def hour_history(workers: int = 1000, minutes: int = 60, job: str = JOB) -> list[Record]:
    """An hour of a training job's events (STRATA_EVENTS only), as time travel walks through it.

    Heartbeats (a thousand a second here) and metric samples are telemetry, on the other stream,
    and a time travel leaves them out, so the hour is what changes the state: `workers` workers
    registering and starting to train; a dataset of 1,282 shards re-planned every two minutes
    (an epoch); every minute a barrier that every live worker arrives at, and a progress report
    from each; every ten minutes a two-phase checkpoint (each worker to `checkpointing`, its
    shard saved, the commit, back to `training`, the oldest pruned past two); and at minutes
    15, 35 and 50 a worker failing and the plan moving its shards. About 140,000 events for
    1,000 workers over 60 minutes.
    """
    history = History()
    history.now = START_NS
    ids = [f"worker-{i:04d}" for i in range(workers)]
    instances = [hashlib.sha1(w.encode()).hexdigest()[:16] for w in ids]

    def add(event: AnyEvent) -> None:
        history.add(event)

    for rank, worker in enumerate(ids):
        add(
            WorkerRegistered(
                job=job,
                source="registry",
                ts=history.now,
                worker_id=worker,
                instance=instances[rank],
                rank=rank,
                world_size=rank + 1,
                membership_epoch=rank + 1,
                hostname=f"node-{rank // 8:03d}",
                gpus=8,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
        )
    spec = DatasetSpec("imagenet-1k", 1_281_167, 1_000, True, 42)
    add(
        DatasetRegistered(
            job=job,
            source="sharding",
            ts=history.now,
            dataset_id=spec.dataset_id,
            total_samples=spec.total_samples,
            shard_size=spec.shard_size,
            shuffle=True,
            seed=42,
        )
    )
    for worker in ids:
        add(
            WorkerStateChanged(
                job=job,
                source="registry",
                ts=history.now,
                worker_id=worker,
                state="training",
                previous="idle",
            )
        )
    live = list(range(workers))
    membership = workers
    plan_version = 0
    shards_of: dict[str, list[int]] = {}
    committed: list[int] = []

    def replan(epoch: int, reason: str) -> None:
        nonlocal plan_version, shards_of
        members = sorted(ids[i] for i in live)
        add(
            ShardPlanChanged(
                job=job,
                source="sharding",
                ts=history.now,
                dataset_id=spec.dataset_id,
                epoch=epoch,
                plan_version=plan_version,
                members=members,
                membership_epoch=membership,
                reason=reason,
            )
        )
        plan_version += 1
        plan = initial_plan(spec, epoch, members)
        shards_of = {worker: plan.shards_of(worker) for worker in members}

    start = history.now
    for minute in range(minutes):
        history.now = start + minute * MINUTE_NS
        epoch = minute // 2
        if minute % 2 == 0:
            replan(epoch, "first request of the epoch")
        if minute in (15, 35, 50) and len(live) > 1:
            victim = live.pop(len(live) // 2)
            membership += 1
            add(
                WorkerFailed(
                    job=job,
                    source="registry",
                    ts=history.now,
                    worker_id=ids[victim],
                    rank=victim,
                    reason="no heartbeat for 5.2s (timeout 5s)",
                    last_heartbeat_ts=history.now - 5 * 10**9,
                    membership_epoch=membership,
                )
            )
            replan(epoch, "membership changed")
        history.now += 30 * 10**9
        name, generation = "sync", minute
        add(
            BarrierOpened(
                job=job,
                source="barrier",
                ts=history.now,
                name=name,
                generation=generation,
                expected=[ids[i] for i in live],
                expected_count=len(live),
                timeout_s=60.0,
                deadline_ts=history.now + 60 * 10**9,
            )
        )
        for count, index in enumerate(live, start=1):
            add(
                BarrierArrived(
                    job=job,
                    source="barrier",
                    ts=history.now,
                    name=name,
                    generation=generation,
                    worker_id=ids[index],
                    arrival=generation,
                    arrived=count,
                )
            )
        add(
            BarrierReleased(
                job=job,
                source="barrier",
                ts=history.now,
                name=name,
                generation=generation,
                participants=len(live),
                first_arrival_to_release_ms=40.0,
                last_arrival_to_release_ms=1.5,
            )
        )
        for index in live:
            mine = shards_of.get(ids[index], [])
            half = (len(mine) + 1) // 2
            done = mine[:half] if minute % 2 == 0 else mine[half:]
            add(
                ShardProgress(
                    job=job,
                    source="sharding",
                    ts=history.now,
                    dataset_id=spec.dataset_id,
                    epoch=epoch,
                    worker_id=ids[index],
                    completed=done,
                )
            )
        if minute % 10 == 9:
            step = (minute + 1) * 100
            add(
                CheckpointStarted(
                    job=job,
                    source="checkpoint",
                    ts=history.now,
                    step=step,
                    epoch=epoch,
                    root_uri="s3://bench/ckpt",
                    participants=[Participant(worker_id=ids[i], rank=i) for i in live],
                    keep_count=2,
                    timeout_s=300.0,
                )
            )
            for state, previous in (("checkpointing", "training"), ("training", "checkpointing")):
                for index in live:
                    add(
                        WorkerStateChanged(
                            job=job,
                            source="registry",
                            ts=history.now,
                            worker_id=ids[index],
                            state=state,
                            previous=previous,
                            step=step,
                            epoch=epoch,
                        )
                    )
                if state == "training":
                    break
                for index in live:
                    add(
                        CheckpointShardSaved(
                            job=job,
                            source="checkpoint",
                            ts=history.now,
                            step=step,
                            epoch=epoch,
                            rank=index,
                            worker_id=ids[index],
                            uri=f"s3://bench/ckpt/{shard_key(job, step, index)}",
                            key=shard_key(job, step, index),
                            bytes=268_435_456,
                            checksum="sha256:" + "ab" * 32,
                        )
                    )
                add(
                    CheckpointCommitted(
                        job=job,
                        source="checkpoint",
                        ts=history.now + 4 * 10**9,
                        step=step,
                        epoch=epoch,
                        manifest_uri=f"s3://bench/ckpt/{step}/manifest.json",
                        total_bytes=268_435_456 * len(live),
                        shards=len(live),
                        duration_ms=4000.0,
                    )
                )
            committed.append(step)
            if len(committed) > 2:
                old = committed.pop(0)
                add(
                    CheckpointPruned(
                        job=job,
                        source="checkpoint",
                        ts=history.now,
                        step=old,
                        manifest_uri=f"s3://bench/ckpt/{old}/manifest.json",
                    )
                )
    return history.records
