"""Reading events back against a real nats-server: the ordered `EventFeed` (replay, catch up,
follow) and the acked `DurableConsumer`, both of which skip malformed messages without stopping.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import Callable
from uuid import uuid4

import pytest
from strata.bus import Bus, Delivered, DurableConsumer, EventFeed
from strata.events import WorkerStateChanged, pack, subject_for, subjects

pytestmark = pytest.mark.nats

EVENTS = subjects.EVENTS_STREAM


def new_job() -> str:
    return f"job-{uuid4().hex[:8]}"


def state_changed(job: str, step: int = 0) -> WorkerStateChanged:
    return WorkerStateChanged(job=job, source="test", worker_id="w-0", state="training", step=step)


async def poll_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(0.01)


async def read_until_caught_up(feed: EventFeed, timeout: float = 10.0) -> list[str]:
    """Ids of the events `feed` delivers up to and including the one that catches it up."""
    ids: list[str] = []
    if feed.caught_up.is_set():
        return ids
    async with asyncio.timeout(timeout), contextlib.aclosing(feed.__aiter__()) as delivered:
        async for d in delivered:
            ids.append(d.event.id)
            if feed.caught_up.is_set():
                break
    return ids


async def test_feed_replays_in_order_then_catches_up_then_follows_live_events(bus: Bus) -> None:
    job = new_job()
    stored = [state_changed(job, step) for step in range(25)]
    stored_acks = await bus.publish_many(stored)
    live = [state_changed(job, step) for step in range(100, 105)]

    received: list[Delivered] = []
    caught_up_when: list[bool] = []
    async with EventFeed(bus.js, EVENTS, subjects.job_events(job), name="test-feed") as feed:
        assert not feed.caught_up.is_set()
        async with asyncio.timeout(10), contextlib.aclosing(feed.__aiter__()) as delivered:
            async for d in delivered:
                received.append(d)
                caught_up_when.append(feed.caught_up.is_set())
                if len(received) == len(stored):
                    await bus.publish_many(live)
                if len(received) == len(stored) + len(live):
                    break

    assert [d.event.id for d in received] == [e.id for e in stored + live]
    assert [d.seq for d in received[: len(stored)]] == [ack.seq for ack in stored_acks]
    seqs = [d.seq for d in received]
    assert seqs == sorted(seqs)
    assert caught_up_when == [False] * (len(stored) - 1) + [True] * (len(live) + 1)
    assert all(d.subject == subject_for(stored[0]) for d in received)
    assert all(isinstance(d.event, WorkerStateChanged) for d in received)
    assert feed.last_seq == seqs[-1]
    assert not feed.rejected


async def test_feed_on_a_job_with_no_events_is_caught_up_at_once(bus: Bus) -> None:
    async with EventFeed(bus.js, EVENTS, subjects.job_events(new_job())) as feed:
        assert feed.caught_up.is_set()


async def test_feed_from_a_start_sequence_skips_what_came_before(bus: Bus) -> None:
    job = new_job()
    events = [state_changed(job, step) for step in range(6)]
    acks = await bus.publish_many(events)

    feed = EventFeed(bus.js, EVENTS, subjects.job_events(job), start_seq=acks[3].seq)
    async with feed:
        ids = await read_until_caught_up(feed)

    assert ids == [e.id for e in events[3:]]


async def test_feed_skips_malformed_messages_counts_them_and_keeps_going(bus: Bus) -> None:
    job = new_job()
    subject = subject_for(state_changed(job))
    before = [state_changed(job, step) for step in range(3)]
    after = [state_changed(job, step) for step in range(3, 6)]
    await bus.publish_many(before)
    await bus.js.publish(subject, b"\xc1 not msgpack at all")
    await bus.js.publish(subject, pack({"type": "worker.no_such_event", "job": job}))
    await bus.js.publish(subject, pack(["a", "list", "not", "a", "map"]))
    await bus.publish_many(after)

    async with EventFeed(bus.js, EVENTS, subjects.job_events(job)) as feed:
        ids = await read_until_caught_up(feed)

    assert ids == [e.id for e in before + after]
    assert feed.rejected == Counter({"malformed": 2, "invalid_field": 1})


async def test_feed_reaches_caught_up_when_the_last_stored_message_is_malformed(bus: Bus) -> None:
    job = new_job()
    event = state_changed(job)
    await bus.publish(event)
    await bus.js.publish(subject_for(event), b"\xff\xff")

    feed = EventFeed(bus.js, EVENTS, subjects.job_events(job))
    async with feed, contextlib.aclosing(feed.__aiter__()) as delivered:
        first = await asyncio.wait_for(anext(delivered), 10)
        assert not feed.caught_up.is_set()
        # Asking for the next event reads the garbage, which is the last stored message.
        waiting = asyncio.ensure_future(anext(delivered))
        await asyncio.wait_for(feed.caught_up.wait(), 10)
        assert not waiting.done()
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting

    assert first.event.id == event.id
    assert feed.rejected == Counter({"malformed": 1})


async def test_durable_consumer_handles_each_event_once_retries_failures_terms_garbage(
    bus: Bus,
) -> None:
    job = new_job()
    events = [state_changed(job, step) for step in range(10)]
    flaky = events[4].id
    attempts: Counter[str] = Counter()
    handled: list[str] = []

    async def handler(d: Delivered) -> None:
        attempts[d.event.id] += 1
        if d.event.id == flaky and attempts[d.event.id] == 1:
            raise RuntimeError("transient failure in the handler")
        handled.append(d.event.id)

    durable = subjects.durable_name("test", job)
    consumer = DurableConsumer(
        bus.js,
        EVENTS,
        durable,
        [subjects.job_events(job)],
        handler,
        ack_wait=5.0,
        retry_delay=0.1,
    )
    await bus.publish_many(events[:5])
    await bus.js.publish(subject_for(events[0]), b"\xc1garbage")
    await bus.publish_many(events[5:])
    await consumer.start()
    try:
        await poll_until(
            lambda: len(handled) == len(events) and consumer.rejected.total() == 1,
            10,
            "every event handled and the garbage terminated",
        )
        late = state_changed(job, 99)
        await bus.publish(late)
        await poll_until(lambda: late.id in handled, 10, "an event published after a failure")

        async def settled() -> bool:
            info = await bus.js.consumer_info(EVENTS, durable)
            return bool(info.num_ack_pending == 0 and info.num_pending == 0)

        deadline = time.monotonic() + 10
        while not await settled():
            assert time.monotonic() < deadline, "acks and the term never settled"
            await asyncio.sleep(0.02)
    finally:
        await consumer.stop()
        await bus.js.delete_consumer(EVENTS, durable)
    # A stopped consumer leaves nothing behind that would hold up draining the connection
    # (nats-py's drain swallows cancellation, so a timeout around it would not show a hang).
    closing = time.monotonic()
    await bus.close()
    assert time.monotonic() - closing < 2.0

    assert sorted(handled) == sorted(e.id for e in [*events, late])
    assert len(handled) == len(set(handled))
    assert attempts[flaky] == 2
    assert all(count == 1 for event_id, count in attempts.items() if event_id != flaky)
    assert consumer.handled == len(events) + 1
    assert consumer.rejected == Counter({"malformed": 1})
