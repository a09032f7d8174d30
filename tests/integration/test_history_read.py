"""Reading history from a real nats-server: `stream_records`, `follow_records` and `RawInbox`.

A read delivers every stored message of its filter once, in stored order, within its bounds; it
goes on from where it was when its consumer disappears; a following read that is slower than
the server loses nothing; and the raw inbox hands over the same bytes with or without the
client's private dispatch.
"""

from __future__ import annotations

import asyncio
import random
from typing import Any

import pytest
from strata.bus import Bus
from strata.events import WorkerStateChanged, subjects
from strata.history import Record, follow_records, job_history, stream_records
from strata.history.inbox import RAW_DISPATCH, RawInbox

from tests import support

pytestmark = pytest.mark.nats


def state_changes(job: str, count: int) -> list[WorkerStateChanged]:
    return [
        WorkerStateChanged(
            job=job, source="registry", worker_id=f"w{i % 50}", state="training", step=i
        )
        for i in range(count)
    ]


async def stored(bus: Bus, job: str, count: int) -> list[int]:
    """Publish `count` events of `job`; their stream sequences."""
    acks = []
    events = state_changes(job, count)
    for first in range(0, count, 2000):
        acks += await bus.publish_many(events[first : first + 2000], window=512)
    return [ack.seq for ack in acks]


async def plain_read(bus: Bus, job: str, count: int) -> list[int]:
    """The same events through nats-py's own ordered consumer: the reference."""
    seqs: list[int] = []
    done = asyncio.Event()

    async def take(msg: Any) -> None:
        seqs.append(msg.metadata.sequence.stream)
        if len(seqs) == count:
            done.set()

    sub = await bus.js.subscribe(
        subjects.job_events(job), stream=subjects.EVENTS_STREAM, ordered_consumer=True, cb=take
    )
    await asyncio.wait_for(done.wait(), 30)
    await sub.unsubscribe()
    return seqs


async def test_a_read_delivers_every_stored_event_once_in_order_within_its_bounds(
    bus: Bus,
) -> None:
    job = support.new_job("read")
    seqs = await stored(bus, job, 3000)
    records = [r async for r in job_history(bus.js, job, telemetry=False)]
    assert [r.seq for r in records] == seqs == await plain_read(bus, job, 3000)
    assert [r.event.step for r in records] == list(range(3000))  # type: ignore[union-attr]
    assert all(r.stored_ns > 0 and r.stream == "events" for r in records)
    assert records == sorted(records, key=lambda r: r.stored_ns)

    middle = job_history(bus.js, job, from_seq=seqs[100], until_seq=seqs[200])
    assert [r.seq async for r in middle] == seqs[100:201]
    cut = records[1500].stored_ns
    until = [r async for r in job_history(bus.js, job, until_ns=cut, telemetry=False)]
    assert until == [r for r in records if r.stored_ns <= cut]
    since = [r async for r in job_history(bus.js, job, since_ns=cut, telemetry=False)]
    assert since == [r for r in records if r.stored_ns >= cut]
    assert [r async for r in job_history(bus.js, support.new_job("none"))] == []
    # Past the last event: nothing, at once.
    assert [
        r
        async for r in stream_records(
            bus.js, "events", subjects.job_events(job), start_seq=seqs[-1] + 1
        )
    ] == []


async def test_a_read_goes_on_from_where_it_was_when_its_consumer_is_deleted(bus: Bus) -> None:
    job = support.new_job("read")
    seqs = await stored(bus, job, 4000)
    taken: list[int] = []
    records = stream_records(bus.js, "events", subjects.job_events(job))
    deleted = False
    async for record in records:
        taken.append(record.seq)
        if len(taken) == 500 and not deleted:
            infos = await bus.js.consumers_info(subjects.EVENTS_STREAM)
            ours = [
                info.name
                for info in infos
                if info.config.filter_subject == subjects.job_events(job)
            ]
            assert len(ours) == 1
            await bus.js.delete_consumer(subjects.EVENTS_STREAM, ours[0])
            deleted = True
    assert deleted
    assert taken == seqs


async def test_a_slow_follower_loses_nothing_and_hears_of_new_events(bus: Bus) -> None:
    job = support.new_job("follow")
    seqs = await stored(bus, job, 20_000)
    caught_up = asyncio.Event()
    follower = follow_records(
        bus.js, "events", subjects.job_events(job), start_seq=1, caught_up=caught_up
    )
    taken: list[Record] = []
    rng = random.Random(7)
    async for record in follower:
        taken.append(record)
        if rng.random() < 0.01:
            await asyncio.sleep(0.002)  # a reader slower than the server: flow control holds it
        if len(taken) == len(seqs):
            break
    assert [r.seq for r in taken] == seqs
    await asyncio.sleep(0)  # the batch that ended the catch-up is taken: caught up now
    more = await stored(bus, job, 3)
    async for record in follower:
        taken.append(record)
        if len(taken) == len(seqs) + 3:
            break
    await follower.aclose()
    assert caught_up.is_set()
    assert [r.seq for r in taken[-3:]] == more


@pytest.mark.parametrize("raw", [True, False], ids=["raw", "parsed"])
async def test_the_raw_inbox_hands_over_what_was_sent_either_way(bus: Bus, raw: bool) -> None:
    if raw and not RAW_DISPATCH:
        pytest.skip("this nats-py has no _process_msg(sid, subject, reply, data, headers)")
    got: list[tuple[str, str, bytes, bytes | None]] = []

    def deliver(subject: str, reply: str, data: bytes, headers: bytes | None) -> None:
        got.append((subject, reply, data, headers))

    inbox = RawInbox(bus.nc, deliver, raw=raw)
    async with inbox:
        await bus.nc.publish(inbox.subject, b"plain", reply="back")
        await bus.nc.publish(inbox.subject, b"with", headers={"Nats-Msg-Id": "x1"})
        await bus.nc.flush()
        await support.async_wait_until(lambda: _count(got, 2), 5, "two messages")
    assert got[0] == (inbox.subject, "back", b"plain", None)
    assert got[1][:3] == (inbox.subject, "", b"with")
    assert got[1][3] is not None
    assert b"Nats-Msg-Id: x1" in got[1][3]
    # Closed: the client's own dispatch is back, and other subscriptions never noticed.
    assert "_process_msg" not in vars(bus.nc)


async def _count(got: list[Any], wanted: int) -> bool:
    return len(got) >= wanted


@pytest.mark.slow
async def test_a_follower_goes_on_after_the_server_restarts(own_nats_server: Any) -> None:
    async with await Bus.connect(own_nats_server.url, deadline=10) as bus:
        await bus.ensure_streams()
        job = support.new_job("follow")
        before = await stored(bus, job, 50)
        follower = follow_records(bus.js, "events", subjects.job_events(job), start_seq=1)
        taken: list[int] = []
        async for record in follower:
            taken.append(record.seq)
            if len(taken) == len(before):
                break
        await asyncio.to_thread(own_nats_server.restart)
        after: list[int] = []

        async def publish_after_restart() -> bool:
            try:
                after.extend(await stored(bus, job, 5))
            except Exception:
                return False
            return True

        await support.async_wait_until(publish_after_restart, 20, "publishing after the restart")
        # A publish cut off by the restart may have stored some events: the stream says which.
        expected = [r.seq async for r in job_history(bus.js, job)]
        assert expected[: len(before)] == before
        assert expected[-len(after) :] == after
        async with asyncio.timeout(30):
            async for record in follower:
                taken.append(record.seq)
                if len(taken) == len(expected):
                    break
        await follower.aclose()
    assert taken == expected
