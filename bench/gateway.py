"""Replay speed of the read model, and `/api/dashboard` latency with 1,000 workers.

A training job's history is generated as real event models (1,000 workers registering, a sharded
dataset, heartbeats every step, barriers, progress reports, two-phase checkpoints with retention,
a failure and its re-plan), encoded with the real codec, then rebuilt the ways Strata rebuilds it:
from msgpack bytes (the gateway's path from NATS) and from an export file (`strata replay --file`).
Plain msgpack decoding of the same bytes is the baseline, so the figures show where the time goes.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import os
import platform
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import msgpack
from strata.bus import Bus
from strata.bus.server import NatsServer
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
    decode_event,
    encode_event,
    subjects,
)
from strata.history import Record, Stream, job_history, record_from_json
from strata.services.gateway.app import GatewayState, create_app
from strata.services.gateway.live import LiveModel
from strata.services.readmodel import JobState, rebuild, render_dashboard
from strata.sharding import DatasetSpec, initial_plan
from strata.storage.base import shard_key

JOB = "bench"
AIM_EVENTS_PER_S = 100_000.0
AIM_TIME_TRAVEL_S = 1.0
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


# -- measurements ---------------------------------------------------------------------------------


def best_of(runs: int, work: Callable[[], Any]) -> float:
    """The fastest of `runs` timings (seconds): the least disturbed by a shared machine."""
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        work()
        times.append(time.perf_counter() - started)
    return min(times)


def replay_speed(records: list[Record], runs: int) -> list[tuple[str, float]]:
    frames: list[tuple[int, int, Stream, bytes]] = [
        (r.seq, r.stored_ns, r.stream, encode_event(r.event)) for r in records
    ]
    lines = [r.to_json() for r in records]
    count = len(records)

    def unpack_only() -> None:
        for _, _, _, data in frames:
            msgpack.unpackb(data, raw=False)

    def decode_only() -> None:
        for _, _, _, data in frames:
            decode_event(data)

    def rebuild_from_bytes() -> None:
        decoded = (
            Record(seq, stored_ns, decode_event(data), stream)
            for seq, stored_ns, stream, data in frames
        )
        rebuild(decoded, JOB)

    def rebuild_from_file() -> None:
        rebuild((record_from_json(line) for line in lines), JOB)

    def fold_only() -> None:
        rebuild(records, JOB)

    cases = [
        ("baseline: msgpack.unpackb only", unpack_only),
        ("decode_event (msgpack + model)", decode_only),
        ("rebuild from msgpack bytes", rebuild_from_bytes),
        ("rebuild from export lines (JSON)", rebuild_from_file),
        ("fold of decoded events", fold_only),
    ]
    # Rounds alternate the cases, so a burst of load on the shared machine hits all of them.
    best = dict.fromkeys((name for name, _ in cases), float("inf"))
    for _ in range(runs):
        for name, work in cases:
            best[name] = min(best[name], best_of(1, work))
    return [(name, count / best[name]) for name, _ in cases]


async def publish_history(bus: Bus, records: list[Record]) -> float:
    """Store `records` (events and heartbeats) on the server; seconds it took."""
    started = time.perf_counter()
    events = [r.event for r in records if r.stream == "events"]
    for first in range(0, len(events), 5000):
        await bus.publish_many(events[first : first + 5000], window=512)
    for record in records:
        if record.stream == "telemetry":
            await bus.publish_telemetry(record.event)
    await bus.nc.flush()
    stored = 0
    while stored < len(records):
        stored = 0
        for name in (subjects.EVENTS_STREAM, subjects.TELEMETRY_STREAM):
            stored += (await bus.js.stream_info(name)).state.messages
        await asyncio.sleep(0.05)
    return time.perf_counter() - started


async def ordered_consumer_count(bus: Bus, job: str, expected: int) -> float:
    """Seconds for a plain nats-py ordered consumer to receive the job's stored events and only
    count them: the baseline, what the Python NATS client costs before any decoding."""
    done = asyncio.Event()
    received = 0

    async def count(_: Any) -> None:
        nonlocal received
        received += 1
        if received == expected:
            done.set()

    started = time.perf_counter()
    sub = await bus.js.subscribe(
        subjects.job_events(job), stream=subjects.EVENTS_STREAM, ordered_consumer=True, cb=count
    )
    await asyncio.wait_for(done.wait(), 300)
    elapsed = time.perf_counter() - started
    await sub.unsubscribe()
    return elapsed


async def history_read(bus: Bus, job: str, expected: int, fold: bool) -> float:
    """Seconds for `job_history` (as `/api/replay` and `strata replay` read, heartbeats left
    out) to deliver the job's events decoded and checked; with `fold`, folded too."""
    started = time.perf_counter()
    state = JobState(job)
    count = 0
    async for record in job_history(bus.js, job, telemetry=False):
        count += 1
        if fold:
            state.apply(record)
    elapsed = time.perf_counter() - started
    if count != expected:
        raise SystemExit(f"read back {count} events of {expected}")
    return elapsed


def spread(rates: list[float]) -> str:
    middle = statistics.median(rates)
    return f"median {middle:>9,.0f}/s  (min {min(rates):,.0f}, max {max(rates):,.0f})"


async def replay_from_jetstream(
    bus: Bus, job: str, expected: int, rounds: int
) -> dict[str, list[float]]:
    """Events/s of each way of reading the job's events, over `rounds` alternating rounds."""
    cases: dict[str, Callable[[], Any]] = {
        "baseline: nats-py ordered consumer, count only": lambda: ordered_consumer_count(
            bus, job, expected
        ),
        "job_history: read, decode, check": lambda: history_read(bus, job, expected, False),
        "job_history + fold (/api/replay from the start)": lambda: history_read(
            bus, job, expected, True
        ),
    }
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, case in cases.items():
            rates[name].append(expected / await case())
    return rates


async def time_travel(
    bus: Bus, job: str, records: list[Record], rounds: int, points: int, seed: int
) -> dict[str, Any]:
    """`GET /api/replay?seq=` at random points of the job through the ASGI app of a gateway that
    folded the stream live (snapshots), beside the same request folding from the first event."""
    live = LiveModel()
    await live.start(bus)
    last_seq = max(r.seq for r in records if r.stream == "events")
    caught_up_started = time.perf_counter()
    await asyncio.wait_for(live.caught_up.wait(), 600)
    caught_up = time.perf_counter() - caught_up_started
    state = live.job(job)
    if state is None or state.seq != last_seq:
        raise SystemExit(f"the gateway folded up to {state and state.seq}, not {last_seq}")
    with_snapshots = GatewayState()
    with_snapshots.bus, with_snapshots.live = bus, live
    from_start = GatewayState()
    from_start.bus, from_start.live = bus, LiveModel()  # no snapshots: folds from the first event
    rng = random.Random(seed)
    results: dict[str, Any] = {
        "caught_up_s": caught_up,
        "snapshots": live.snapshots.count(job),
        "snapshot_mb": live.snapshots.held / 1e6,
        "snapshot_ms": [],
        "scratch_ms": [],
        "round_medians": [],
    }
    try:
        async with (
            httpx.AsyncClient(
                transport=httpx.ASGITransport(create_app(with_snapshots, dashboard_dir=None)),
                base_url="http://gateway",
                timeout=120,
            ) as fast,
            httpx.AsyncClient(
                transport=httpx.ASGITransport(create_app(from_start, dashboard_dir=None)),
                base_url="http://gateway",
                timeout=120,
            ) as slow,
        ):

            async def timed(http: httpx.AsyncClient, seq: int) -> float:
                started = time.perf_counter()
                answer = await http.get("/api/replay", params={"job": job, "seq": seq})
                elapsed = (time.perf_counter() - started) * 1e3
                if answer.status_code != 200 or answer.json()["seq"] > seq:
                    raise SystemExit(f"/api/replay?seq={seq}: {answer.status_code} {answer.text}")
                return elapsed

            for _ in range(rounds):
                seqs = [rng.randint(1, last_seq) for _ in range(points)]
                times = [await timed(fast, seq) for seq in seqs]
                results["snapshot_ms"].extend(times)
                results["round_medians"].append(statistics.median(times))
                results["scratch_ms"].append(await timed(slow, seqs[0]))
    finally:
        await live.stop()
    return results


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[max(0, round(q * (len(ordered) - 1)))]


async def dashboard_latency(state: JobState, requests: int) -> dict[str, tuple[float, float]]:
    """p50 and p99 (ms) through the ASGI app: /healthz (the HTTP stack alone, the baseline),
    /api/dashboard unchanged between requests (cached), and changed by a heartbeat before each."""
    live = LiveModel()
    live.model.jobs[JOB] = state
    gateway = GatewayState()
    gateway.live = live
    app = create_app(gateway, dashboard_dir=None)
    beat_worker = next(iter(state.beats))
    results: dict[str, tuple[float, float]] = {}
    async with httpx.AsyncClient(
        transport=httpx.ASGITransport(app), base_url="http://gateway"
    ) as http:

        async def measure(path: str, before: Callable[[], None] | None = None) -> list[float]:
            times = []
            for index in range(requests):
                if before is not None:
                    before()
                started = time.perf_counter()
                answer = await http.get(path)
                times.append((time.perf_counter() - started) * 1e3)
                if answer.status_code != 200:
                    raise SystemExit(f"{path} answered {answer.status_code}: {answer.text[:200]}")
                if index == 0 and path.startswith("/api/dashboard"):
                    workers = len(answer.json()["workers"])
                    results["_workers"] = (workers, len(answer.content) / 1024)
            return times

        def heartbeat() -> None:
            worker, instance = beat_worker
            state.apply_heartbeat(
                WorkerHeartbeat(
                    job=JOB,
                    source=worker,
                    worker_id=worker,
                    instance=instance,
                    seq=state.heartbeats + 1,
                    state="training",
                    step=state.heartbeats,
                )
            )

        path = f"/api/dashboard?job={JOB}"
        for name, url, before in (
            ("GET /healthz (baseline)", "/healthz", None),
            ("GET /api/dashboard, unchanged", path, None),
            ("GET /api/dashboard, a heartbeat before each", path, heartbeat),
        ):
            await measure(url, before)  # warm-up
            times = await measure(url, before)
            results[name] = (percentile(times, 0.5), percentile(times, 0.99))
    return results


def render_time(state: JobState, runs: int) -> float:
    return best_of(runs, lambda: render_dashboard(state)) * 1e3


async def from_jetstream(args: argparse.Namespace) -> list[str]:
    """The hour of a job stored on a real nats-server: reading it back, and time travel into
    it. Returns the aims missed."""
    started = time.perf_counter()
    records = hour_history(args.workers, args.minutes)
    events = len(records)
    print()
    print(
        f"one hour of a {args.workers}-worker job (`hour_history`): {events:,} events "
        f"(heartbeats and metric samples are telemetry, left out), generated in "
        f"{time.perf_counter() - started:.1f}s"
    )
    missed: list[str] = []
    with tempfile.TemporaryDirectory() as scratch, NatsServer(store_dir=Path(scratch)) as server:
        async with await Bus.connect(server.url, name="bench-gateway") as bus:
            await bus.ensure_streams()
            published = await publish_history(bus, records)
            print(f"stored in {published:.1f}s on a local nats-server")
            print()
            print(f"replay from JetStream, events/s ({args.rounds} alternating rounds)")
            rates = await replay_from_jetstream(bus, JOB, events, args.rounds)
            names = list(rates)
            baseline = statistics.median(rates[names[0]])
            for name, figures in rates.items():
                ratio = statistics.median(figures) / baseline
                print(f"  {name:<50} {spread(figures)}  {ratio:5.2f}x baseline")
            read = statistics.median(rates[names[1]])
            verdict = "meets" if read >= AIM_EVENTS_PER_S else "misses"
            print(f"  aim {AIM_EVENTS_PER_S:,.0f} events/s read (median): {verdict} it")
            if read < AIM_EVENTS_PER_S:
                missed.append(f"replay read {read:,.0f} events/s < {AIM_EVENTS_PER_S:,.0f}")

            travel = await time_travel(bus, JOB, records, args.rounds, args.points, args.seed)
            print()
            print(
                f"time travel: GET /api/replay?seq= at {args.points} random points a round, "
                f"{args.rounds} rounds (gateway caught up in {travel['caught_up_s']:.1f}s, "
                f"{travel['snapshots']} snapshots, {travel['snapshot_mb']:.1f} MB)"
            )
            fast, slow = travel["snapshot_ms"], travel["scratch_ms"]
            medians = travel["round_medians"]
            print(
                f"  {'baseline: fold from the first event':<38} median "
                f"{statistics.median(slow):8.1f} ms  (min {min(slow):.1f}, max {max(slow):.1f})"
            )
            print(
                f"  {'from the nearest snapshot':<38} median {statistics.median(fast):8.1f} ms  "
                f"(round medians {min(medians):.1f} to {max(medians):.1f}, max {max(fast):.1f})  "
                f"{statistics.median(slow) / statistics.median(fast):6.1f}x faster"
            )
            worst = max(fast) / 1e3
            verdict = "meets" if worst <= AIM_TIME_TRAVEL_S else "misses"
            print(f"  aim {AIM_TIME_TRAVEL_S:g} s at any point (the slowest request): {verdict} it")
            if worst > AIM_TIME_TRAVEL_S:
                missed.append(f"time travel took {worst:.2f}s > {AIM_TIME_TRAVEL_S:g}s")
    return missed


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workers", type=int, default=1000)
    parser.add_argument("--steps", type=int, default=60, help="steps of the in-memory history")
    parser.add_argument("--minutes", type=int, default=60, help="length of the stored history")
    parser.add_argument("--runs", type=int, default=3, help="timings per case (best is kept)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds from JetStream")
    parser.add_argument("--points", type=int, default=10, help="time travel points per round")
    parser.add_argument("--seed", type=int, default=16)
    parser.add_argument("--requests", type=int, default=200, help="HTTP requests per case")
    parser.add_argument(
        "--only",
        choices=("memory", "jetstream", "dashboard"),
        action="append",
        help="run only these parts (repeatable; default: all)",
    )
    parser.add_argument(
        "--check", action="store_true", help="exit 1 when an aim (replay, time travel) is missed"
    )
    args = parser.parse_args()
    parts = set(args.only or ("memory", "jetstream", "dashboard"))

    load = ", ".join(f"{figure:.1f}" for figure in os.getloadavg())
    print(
        f"Strata gateway benchmark: python {platform.python_version()}, {os.cpu_count()} CPUs, "
        f"{platform.machine()}, load average {load}"
    )
    started = time.perf_counter()
    records = synthetic_history(args.workers, args.steps)
    heartbeats = sum(1 for r in records if r.stream == "telemetry")
    if parts & {"memory", "dashboard"}:
        print(
            f"history: {args.workers} workers, {args.steps} steps: {len(records):,} messages "
            f"({len(records) - heartbeats:,} events, {heartbeats:,} heartbeats), "
            f"generated in {time.perf_counter() - started:.1f}s"
        )
    if "memory" in parts:
        print()
        print(f"replay speed in memory (whole history, best of {args.runs} alternating rounds)")
        speeds = replay_speed(records, args.runs)
        baseline = speeds[0][1]
        for name, rate in speeds:
            print(f"  {name:<36} {rate:>12,.0f} msg/s   {rate / baseline:5.2f}x baseline")

    missed: list[str] = []
    if "jetstream" in parts:
        missed = asyncio.run(from_jetstream(args))

    if "dashboard" in parts:
        state = rebuild(records, JOB)
        print()
        print(f"render_dashboard alone: {render_time(state, args.runs * 5):.2f} ms")
        latency = asyncio.run(dashboard_latency(state, args.requests))
        workers, size_kib = latency.pop("_workers")
        print(
            f"HTTP latency through the ASGI app, {args.requests} requests each "
            f"({int(workers)} workers, {size_kib:.0f} KiB per dashboard)"
        )
        health_p50 = latency["GET /healthz (baseline)"][0]
        for name, (p50, p99) in latency.items():
            print(f"  {name:<46} p50 {p50:7.2f} ms  p99 {p99:7.2f} ms  {p50 / health_p50:6.1f}x")

    load = ", ".join(f"{figure:.1f}" for figure in os.getloadavg())
    print()
    print(f"load average at the end: {load}")
    if args.check and missed:
        print("aims missed: " + "; ".join(missed), file=sys.stderr)
        sys.exit(1)


if __name__ == "__main__":
    main()
