"""Heartbeat intake split over two registry processes: each takes in and watches the workers of
its own buckets, and partition 0, the leader, alone records membership (the failures the other
partition finds included), so epochs, ranks and failure detection are those of one registry."""

from __future__ import annotations

import asyncio
import signal
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import strata
from nats.aio.msg import Msg
from strata.bus import Bus, connect
from strata.bus import intake as intake_module
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import (
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
    WorkerStateChanged,
    decode_event,
    encode_event,
    subjects,
)
from strata.events.codec import pack, unpack
from strata.services.registry.intake import IntakeClient

from tests.heartbeats import rejected_heartbeats
from tests.support import ServiceProcess, async_wait_until, job_events, new_job, start_workers

pytestmark = [pytest.mark.nats, pytest.mark.slow]

INTERVAL = 0.2
TIMEOUT = 1.0
DETECTION_BOUND = TIMEOUT + INTERVAL + 0.25
"""As in test_registry: timeout + one interval, plus scheduling slack on a shared machine; the
report from partition 1 to the leader is one more NATS round trip inside that slack."""
PARTITIONS = 2


@pytest.fixture
def partitions(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[list[ServiceProcess]]:
    started: list[ServiceProcess] = []
    try:
        for partition in range(PARTITIONS):
            process = ServiceProcess(
                "registry",
                own_nats_server.url,
                tmp_path,
                heartbeat_interval=INTERVAL,
                heartbeat_timeout=TIMEOUT,
                env={
                    Env.REGISTRY_PARTITIONS: str(PARTITIONS),
                    Env.REGISTRY_PARTITION: str(partition),
                },
            )
            started.append(process.start())
        yield started
    finally:
        for process in started:
            process.stop()


def heartbeats_received(port: int) -> float:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        for line in response.read().decode().splitlines():
            if line.startswith("strata_registry_heartbeats_received_total "):
                return float(line.split()[1])
    return 0.0


async def test_each_partition_takes_its_workers_and_the_leader_fails_the_silent_ones(
    own_nats_server: NatsServer,
    partitions: list[ServiceProcess],
    workers: list[strata.aio.Worker],
) -> None:
    url = own_nats_server.url
    job = new_job("parts")
    ids = [f"w{i:02d}" for i in range(24)]
    owner = {w: subjects.partition_of(w, PARTITIONS) for w in ids}
    assert set(owner.values()) == {0, 1}
    failed_at: dict[str, float] = {}
    last_heartbeat: dict[str, float] = {}
    victims = [next(w for w in ids if owner[w] == p) for p in (0, 1)]
    async with await Bus.connect(url, name="test-partitions") as bus:

        async def on_failed(msg: Msg) -> None:
            event = decode_event(msg.data)
            assert isinstance(event, WorkerFailed)
            failed_at.setdefault(event.worker_id, time.monotonic())

        async def on_heartbeat(msg: Msg) -> None:
            last_heartbeat[subjects.parse_heartbeat_subject(msg.subject)[1]] = time.monotonic()

        await bus.nc.subscribe(subjects.event_subject(job, "worker.failed"), cb=on_failed)
        for worker_id in victims:
            await bus.nc.subscribe(subjects.heartbeat_subject(job, worker_id), cb=on_heartbeat)
        await bus.nc.flush()

        started = await start_workers(workers, job, url, ids)
        assert sorted(w.rank for w in started) == list(range(len(ids)))
        by_id = {w.id: w for w in started}

        # Each partition takes in heartbeats, and only its own workers' (every one of them
        # beats every interval: both counters grow).
        leader, other = partitions
        before = [heartbeats_received(p.health_port) for p in partitions]

        async def both_take_heartbeats() -> bool:
            now = [heartbeats_received(p.health_port) for p in partitions]
            return all(n > b + 10 for n, b in zip(now, before, strict=True))

        await async_wait_until(both_take_heartbeats, 10, "heartbeats on both partitions")

        # The leader hears none of partition 1's heartbeats, and still lists when each worker
        # last heartbeated (partition 1 reports it every interval).
        async def leader_lists_every_heartbeat() -> bool:
            listed = await started[0].members()
            return all(m.last_heartbeat_ts is not None for m in listed.members)

        await async_wait_until(leader_lists_every_heartbeat, 10, "every worker's last heartbeat")

        # A state change of a worker of partition 1 is recorded from its heartbeat.
        mover = next(w for w in ids if owner[w] == 1 and w not in victims)
        await by_id[mover].set_state("training", step=3)

        async def mover_training() -> bool:
            return any(
                isinstance(e, WorkerStateChanged) and e.worker_id == mover
                for e in await job_events(bus, job)
            )

        await async_wait_until(mover_training, 10, "the state change of a partition-1 worker")

        async def victims_heartbeat() -> bool:
            return set(victims) <= set(last_heartbeat)

        await async_wait_until(victims_heartbeat, 5, "heartbeats of the workers to silence")
        for worker_id in victims:
            by_id[worker_id]._suspend_heartbeats(True)

        async def victims_failed() -> bool:
            return set(victims) <= set(failed_at)

        await async_wait_until(victims_failed, 10 * TIMEOUT, "the silenced workers to be failed")
        for worker_id in victims:
            since_last = failed_at[worker_id] - last_heartbeat[worker_id]
            assert since_last <= DETECTION_BOUND, (worker_id, since_last)

        # Nobody else fails (watching for a fixed window, on purpose).
        await asyncio.sleep(2 * TIMEOUT)
        events = await job_events(bus, job)
        failures = [e for e in events if isinstance(e, WorkerFailed)]
        assert sorted(e.worker_id for e in failures) == sorted(victims)
        for failure in failures:
            assert failure.source == "registry"
            silent = (failure.ts - failure.last_heartbeat_ts) / 1e9
            assert TIMEOUT < silent <= DETECTION_BOUND, (failure.worker_id, silent)
        # One writer of membership: every change has its own epoch, one more than the last.
        changes = [e for e in events if isinstance(e, WorkerRegistered | WorkerFailed | WorkerLeft)]
        assert [e.membership_epoch for e in changes] == list(range(1, len(changes) + 1))
        listed = await started[0].members(include_gone=True)
        assert listed.world_size == len(ids) - 2
        assert {m.worker_id for m in listed.members if m.status == "failed"} == set(victims)

        # A stranger's heartbeat is refused by the partition that owns its bucket, not the other.
        stranger = next(f"s{i}" for i in range(100) if subjects.partition_of(f"s{i}", 2) == 1)
        beat = WorkerHeartbeat(
            job=job, source=stranger, worker_id=stranger, instance="i-s", seq=1, state="idle"
        )
        refused_before = [rejected_heartbeats(p.health_port) for p in partitions]
        await bus.nc.publish(subjects.heartbeat_subject(job, stranger), encode_event(beat))
        await bus.nc.flush()

        async def refused_by_partition_1() -> bool:
            now = rejected_heartbeats(other.health_port).get("not_registered", 0.0)
            return now > refused_before[1].get("not_registered", 0.0)

        await async_wait_until(refused_by_partition_1, 10, "partition 1 to refuse the stranger")
        assert rejected_heartbeats(leader.health_port) == refused_before[0]

        # The leader ignores a failure report for a registration that is not live (here one
        # already failed), so a late or forged report changes nothing.
        epoch_before = (await started[0].members()).membership_epoch
        stale = next(f for f in failures if f.worker_id == victims[1])
        reply = await bus.nc.request(
            subjects.registry_silences(), pack([encode_event(stale)]), timeout=5
        )
        assert unpack(reply.data) == 0
        assert (await started[0].members()).membership_epoch == epoch_before


@pytest.mark.parametrize("fast_lane", [True, False], ids=["fast-lane", "plain-subscription"])
async def test_the_intake_takes_every_message_of_a_flood_once_and_in_order(
    own_nats_server: NatsServer, fast_lane: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Through a real server, as reads of whatever size the socket gives: the fast lane of
    `IntakeClient` loses, repeats and reorders nothing (headers and all); nor does the plain
    subscription it falls back to on a nats-py release it is not written for."""
    monkeypatch.setattr(intake_module, "FAST_LANE", fast_lane)
    count = 50_000 if fast_lane else 10_000
    taken: list[bytes] = []
    intake = await connect(own_nats_server.url, client=IntakeClient)
    sender = await connect(own_nats_server.url)
    try:
        assert isinstance(intake, IntakeClient)
        await intake.subscribe_direct(
            subjects.all_heartbeats(), lambda _subject, _reply, data: taken.append(data)
        )
        await intake.flush()
        for n in range(count):
            subject = subjects.heartbeat_subject("flood", f"w{n % 300}")
            await sender.publish(subject, b"%d" % n, headers={"Nats-Msg-Id": f"m{n}"})
        await sender.flush()

        async def all_taken() -> bool:
            return len(taken) >= count

        await async_wait_until(all_taken, 60, "the flood to be taken in")
        await intake.flush()
        assert [int(data) for data in taken] == list(range(count))
        assert intake.handler_errors == 0
    finally:
        await sender.close()
        await intake.close()


async def test_a_partition_behind_the_leader_tells_no_new_or_restarted_worker_to_go(
    own_nats_server: NatsServer,
    partitions: list[ServiceProcess],
    workers: list[strata.aio.Worker],
) -> None:
    """Partition 1 folds the stream at its own pace: frozen while the leader registers its
    workers (and a restart of one), it reads their heartbeats before it knows of them. It must
    tell none of them to register again, nor the restarted one that it was superseded."""
    url = own_nats_server.url
    job = new_job("lag")
    mine = [w for w in (f"w{i:02d}" for i in range(80)) if subjects.partition_of(w, 2) == 1]
    restarted_id, fresh_ids = mine[0], mine[1:6]
    (earlier,) = await start_workers(workers, job, url, [restarted_id])
    other = partitions[1].proc
    assert other is not None
    other.send_signal(signal.SIGSTOP)
    try:
        fresh = await start_workers(workers, job, url, fresh_ids)
        restart = strata.aio.Worker(job, url, worker_id=restarted_id)
        workers.append(restart)
        await restart.start()
        # Their heartbeats wait in the frozen partition's socket (a fixed pause, on purpose).
        await asyncio.sleep(4 * INTERVAL)
    finally:
        other.send_signal(signal.SIGCONT)

    async def earlier_superseded() -> bool:
        return earlier.superseded

    await async_wait_until(earlier_superseded, 10, "the first process to learn it was replaced")
    # Watching for notices that must not come (a fixed window, on purpose).
    await asyncio.sleep(2 * TIMEOUT)
    assert [w.rejoin_count for w in fresh] == [0] * len(fresh)
    assert not any(w.superseded for w in fresh)
    assert not restart.superseded
    assert restart.rejoin_count == 0
    async with await Bus.connect(url, name="test-partitions") as bus:
        events = await job_events(bus, job)
    registered = [e.worker_id for e in events if isinstance(e, WorkerRegistered)]
    assert sorted(registered) == sorted([restarted_id, *fresh_ids, restarted_id])
    failed = [(e.worker_id, e.reason) for e in events if isinstance(e, WorkerFailed)]
    assert [w for w, _ in failed] == [restarted_id]  # the superseded first process, only
    assert "superseded" in failed[0][1]
