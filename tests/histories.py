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
    LiveState,
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
    """Real events of a synthetic job, each with the stream position it would be stored at.

    Its methods add the events of one happening each (workers registering, a barrier, a
    checkpoint), as the services would record them.
    """

    def __init__(self, job: str = JOB) -> None:
        self.job = job
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

    def register(self, workers: int) -> tuple[list[str], list[str]]:
        """`workers` workers registering one after another: their ids and instances."""
        ids = [f"worker-{i:04d}" for i in range(workers)]
        instances = [hashlib.sha1(w.encode()).hexdigest()[:16] for w in ids]
        for rank, worker in enumerate(ids):
            self.add(
                WorkerRegistered(
                    job=self.job,
                    source="registry",
                    ts=self.now,
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
        return ids, instances

    def dataset(self) -> DatasetSpec:
        """An ImageNet-sized dataset registered: 1,282 shards of 1,000 samples."""
        spec = DatasetSpec("imagenet-1k", 1_281_167, 1_000, True, 42)
        self.add(
            DatasetRegistered(
                job=self.job,
                source="sharding",
                ts=self.now,
                dataset_id=spec.dataset_id,
                total_samples=spec.total_samples,
                shard_size=spec.shard_size,
                shuffle=True,
                seed=42,
            )
        )
        return spec

    def plan(
        self,
        spec: DatasetSpec,
        epoch: int,
        version: int,
        members: list[str],
        membership: int,
        reason: str,
    ) -> dict[str, list[int]]:
        """The plan of `epoch` changed to `members`: each member's shards in it."""
        self.add(
            ShardPlanChanged(
                job=self.job,
                source="sharding",
                ts=self.now,
                dataset_id=spec.dataset_id,
                epoch=epoch,
                plan_version=version,
                members=members,
                membership_epoch=membership,
                reason=reason,
            )
        )
        plan = initial_plan(spec, epoch, members)
        return {worker: plan.shards_of(worker) for worker in members}

    def states(
        self,
        workers: list[str],
        state: LiveState,
        previous: LiveState,
        step: int = 0,
        epoch: int = 0,
    ) -> None:
        for worker in workers:
            self.add(
                WorkerStateChanged(
                    job=self.job,
                    source="registry",
                    ts=self.now,
                    worker_id=worker,
                    state=state,
                    previous=previous,
                    step=step,
                    epoch=epoch,
                )
            )

    def barrier(
        self, name: str, generation: int, workers: list[str], first_ms: float, last_ms: float
    ) -> None:
        """A barrier generation opened, every one of `workers` arriving, and its release."""
        self.add(
            BarrierOpened(
                job=self.job,
                source="barrier",
                ts=self.now,
                name=name,
                generation=generation,
                expected=workers,
                expected_count=len(workers),
                timeout_s=60.0,
                deadline_ts=self.now + 60 * 10**9,
            )
        )
        for count, worker in enumerate(workers, start=1):
            self.add(
                BarrierArrived(
                    job=self.job,
                    source="barrier",
                    ts=self.now,
                    name=name,
                    generation=generation,
                    worker_id=worker,
                    arrival=generation,
                    arrived=count,
                )
            )
        self.add(
            BarrierReleased(
                job=self.job,
                source="barrier",
                ts=self.now,
                name=name,
                generation=generation,
                participants=len(workers),
                first_arrival_to_release_ms=first_ms,
                last_arrival_to_release_ms=last_ms,
            )
        )

    def progress(self, spec: DatasetSpec, epoch: int, worker: str, completed: list[int]) -> None:
        self.add(
            ShardProgress(
                job=self.job,
                source="sharding",
                ts=self.now,
                dataset_id=spec.dataset_id,
                epoch=epoch,
                worker_id=worker,
                completed=completed,
            )
        )

    def checkpoint_started(self, step: int, epoch: int, ranks: dict[int, str]) -> None:
        self.add(
            CheckpointStarted(
                job=self.job,
                source="checkpoint",
                ts=self.now,
                step=step,
                epoch=epoch,
                root_uri="s3://bench/ckpt",
                participants=[Participant(worker_id=w, rank=r) for r, w in ranks.items()],
                keep_count=2,
                timeout_s=300.0,
            )
        )

    def checkpoint_saved(self, step: int, epoch: int, ranks: dict[int, str]) -> None:
        """Every rank's shard of a checkpoint saved (256 MiB each) and the commit, 4 s later."""
        for rank, worker in ranks.items():
            self.add(
                CheckpointShardSaved(
                    job=self.job,
                    source="checkpoint",
                    ts=self.now,
                    step=step,
                    epoch=epoch,
                    rank=rank,
                    worker_id=worker,
                    uri=f"s3://bench/ckpt/{shard_key(self.job, step, rank)}",
                    key=shard_key(self.job, step, rank),
                    bytes=268_435_456,
                    checksum="sha256:" + "ab" * 32,
                )
            )
        self.add(
            CheckpointCommitted(
                job=self.job,
                source="checkpoint",
                ts=self.now + 4 * 10**9,
                step=step,
                epoch=epoch,
                manifest_uri=f"s3://bench/ckpt/{step}/manifest.json",
                total_bytes=268_435_456 * len(ranks),
                shards=len(ranks),
                duration_ms=4000.0,
            )
        )

    def pruned(self, step: int) -> None:
        self.add(
            CheckpointPruned(
                job=self.job,
                source="checkpoint",
                ts=self.now,
                step=step,
                manifest_uri=f"s3://bench/ckpt/{step}/manifest.json",
            )
        )

    def failed(self, worker: str, rank: int, membership: int) -> None:
        self.add(
            WorkerFailed(
                job=self.job,
                source="registry",
                ts=self.now,
                worker_id=worker,
                rank=rank,
                reason="no heartbeat for 5.2s (timeout 5s)",
                last_heartbeat_ts=self.now - 5 * 10**9,
                membership_epoch=membership,
            )
        )


def synthetic_history(workers: int = 1000, steps: int = 60) -> list[Record]:
    history = History()
    ids, instances = history.register(workers)
    spec = history.dataset()
    shards_of = history.plan(spec, 0, 0, sorted(ids), workers, "first request of the epoch")
    history.states(ids, "training", "idle")
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
            generation = step // 5 - 1
            history.barrier(
                "step", generation, [ids[i] for i in live], 40.0 + step, 0.5 + step / 100
            )
            for index in live:
                history.progress(spec, 0, ids[index], shards_of[ids[index]][generation : step // 5])
        if step % 20 == 0:
            checkpoint += 1
            ranks = {i: ids[i] for i in live}
            history.checkpoint_started(step * 10, 0, ranks)
            history.checkpoint_saved(step * 10, 0, ranks)
            if checkpoint > 2:
                history.pruned((step - 40) * 10)
        if step == steps // 2:
            victim = live.pop()
            history.failed(ids[victim], victim, workers + 1)
            history.plan(
                spec, 0, 1, sorted(ids[i] for i in live), workers + 1, "membership changed"
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
    history = History(job)
    ids, _ = history.register(workers)
    spec = history.dataset()
    history.states(ids, "training", "idle")
    live = list(range(workers))
    membership = workers
    plan_version = 0
    shards_of: dict[str, list[int]] = {}
    committed: list[int] = []

    def replan(epoch: int, reason: str) -> None:
        nonlocal plan_version, shards_of
        members = sorted(ids[i] for i in live)
        shards_of = history.plan(spec, epoch, plan_version, members, membership, reason)
        plan_version += 1

    start = history.now
    for minute in range(minutes):
        history.now = start + minute * MINUTE_NS
        epoch = minute // 2
        if minute % 2 == 0:
            replan(epoch, "first request of the epoch")
        if minute in (15, 35, 50) and len(live) > 1:
            victim = live.pop(len(live) // 2)
            membership += 1
            history.failed(ids[victim], victim, membership)
            replan(epoch, "membership changed")
        history.now += 30 * 10**9
        history.barrier("sync", minute, [ids[i] for i in live], 40.0, 1.5)
        for index in live:
            mine = shards_of.get(ids[index], [])
            half = (len(mine) + 1) // 2
            history.progress(
                spec, epoch, ids[index], mine[:half] if minute % 2 == 0 else mine[half:]
            )
        if minute % 10 == 9:
            step = (minute + 1) * 100
            ranks = {i: ids[i] for i in live}
            history.checkpoint_started(step, epoch, ranks)
            history.states(list(ranks.values()), "checkpointing", "training", step, epoch)
            history.checkpoint_saved(step, epoch, ranks)
            history.states(list(ranks.values()), "training", "checkpointing", step, epoch)
            committed.append(step)
            if len(committed) > 2:
                history.pruned(committed.pop(0))
    return history.records
