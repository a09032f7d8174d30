"""The acceptance test of the publish path: on a 3-node cluster, a publisher keeps going while the
leader of STRATA_EVENTS is SIGKILLed, and every acknowledged event ends up stored exactly once.
"""

from __future__ import annotations

import asyncio
import contextlib
import statistics
import time
from collections import Counter
from uuid import uuid4

import pytest
from nats.js.api import PubAck
from strata.bus import Bus, EventFeed, PublishOptions
from strata.bus.server import NatsCluster
from strata.events import WorkerStateChanged, subjects

pytestmark = [pytest.mark.nats, pytest.mark.cluster, pytest.mark.slow]

EVENTS = subjects.EVENTS_STREAM
TOTAL = 5_000
KILL_AFTER = 1_000
CHUNK = 100
WINDOW = 64


async def read_job(bus: Bus, job: str, expected: int, timeout: float = 20.0) -> dict[int, str]:
    """Event id by stream sequence for `job`, read with an EventFeed from the beginning."""
    ids: dict[int, str] = {}
    feed = EventFeed(bus.js, EVENTS, subjects.job_events(job))
    async with (
        feed,
        asyncio.timeout(timeout),
        contextlib.aclosing(feed.__aiter__()) as delivered,
    ):
        async for d in delivered:
            ids[d.seq] = d.event.id
            if feed.caught_up.is_set() and len(ids) >= expected:
                break
    return ids


def stored_on_node(cluster: NatsCluster, index: int, expected: int, timeout: float) -> int:
    """Messages of STRATA_EVENTS in node `index`'s own replica, once it holds `expected`."""
    deadline = time.monotonic() + timeout
    while True:
        report = cluster.nodes[index].jsz(streams=True)
        counts = [
            stream["state"]["messages"]
            for account in report.get("account_details") or []
            for stream in account.get("stream_detail") or []
            if stream["name"] == EVENTS
        ]
        if (counts and counts[0] >= expected) or time.monotonic() >= deadline:
            return counts[0] if counts else 0
        time.sleep(0.05)


async def test_publisher_rides_through_the_stream_leader_being_killed(
    nats_cluster: NatsCluster,
) -> None:
    cluster = nats_cluster
    connected = await Bus.connect(cluster.urls, deadline=10)
    bus = Bus(connected.nc, publish_options=PublishOptions(deadline=60))
    try:
        assert await bus.ensure_streams(replicas=3) == {
            EVENTS: "created",
            subjects.TELEMETRY_STREAM: "created",
        }
        leader = await asyncio.to_thread(cluster.wait_for_stream_leader, EVENTS, 10.0)
        killed = cluster.nodes.index(cluster.node_by_name(leader))

        job = f"job-{uuid4().hex[:8]}"
        events = [
            WorkerStateChanged(
                job=job, source="test", worker_id=f"w-{i % 8}", state="training", step=i
            )
            for i in range(TOTAL)
        ]
        acks: list[PubAck] = []
        chunk_seconds: list[float] = []

        async def publish_all() -> None:
            for start in range(0, TOTAL, CHUNK):
                began = time.monotonic()
                acks.extend(await bus.publish_many(events[start : start + CHUNK], window=WINDOW))
                chunk_seconds.append(time.monotonic() - began)

        publishing_since = time.monotonic()
        publisher = asyncio.create_task(publish_all())
        deadline = time.monotonic() + 20
        while len(acks) < KILL_AFTER and not publisher.done():
            assert time.monotonic() < deadline, f"only {len(acks)} acks after 20s"
            await asyncio.sleep(0.005)
        assert not publisher.done(), "the publisher finished before the leader could be killed"
        acked_at_kill = len(acks)
        cluster.kill(killed)
        await asyncio.wait_for(publisher, 60)
        publishing_took = time.monotonic() - publishing_since

        new_leader = await asyncio.to_thread(cluster.wait_for_stream_leader, EVENTS, 15.0)
        await asyncio.to_thread(cluster.wait_for_meta_leader, 15.0)
        stored = await read_job(bus, job, expected=TOTAL)
        info = await bus.js.stream_info(EVENTS)
    finally:
        await bus.close()

    # On the loop's thread: a node dies with the thread that started it.
    cluster.restart(killed)
    rejoined = await asyncio.to_thread(stored_on_node, cluster, killed, TOTAL, 15.0)

    normal = statistics.median(chunk_seconds)
    stall = max(chunk_seconds)
    print(
        f"\nkilled {leader} after {acked_at_kill} acks; new leader {new_leader}; publisher stalled "
        f"{stall:.2f}s in one chunk of {CHUNK} (median chunk {normal * 1000:.1f} ms); "
        f"{TOTAL} publishes took {publishing_took:.1f}s; "
        f"{sum(bool(a.duplicate) for a in acks)} retries answered as duplicates"
    )

    assert KILL_AFTER <= acked_at_kill < TOTAL
    assert len(acks) == TOTAL
    assert new_leader != leader
    assert stall > 10 * normal, "the kill should have been felt by the publisher"
    published_ids = [event.id for event in events]
    assert Counter(stored.values()) == Counter(published_ids)
    assert stored == {ack.seq: event_id for ack, event_id in zip(acks, published_ids, strict=True)}
    assert info.state.messages == TOTAL
    assert info.config.num_replicas == 3
    assert rejoined == TOTAL, "the killed node should catch up to exactly the acknowledged events"
