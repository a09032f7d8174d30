"""Publishing events through `Bus` against a real nats-server: dedup, provisioning, optimistic
concurrency, deadlines, and riding through a server restart or a late server at connect time.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from uuid import uuid4

import nats.js.errors
import pytest
import strata
from nats.js.api import DiscardPolicy, StorageType
from strata.bus import Bus, ConnectOptions, EventFeed, PublishOptions, connect, ensure_stream
from strata.bus.server import NatsServer
from strata.bus.streams import (
    RENDEZVOUS_MAX_AGE_S,
    TELEMETRY_MAX_BYTES,
    TELEMETRY_MAX_MSG_SIZE,
    TELEMETRY_MAX_MSGS_PER_SUBJECT,
    strata_streams,
)
from strata.config import Env, load_settings
from strata.events import WorkerStateChanged, subject_for, subjects
from strata.procutil import free_port
from structlog.testing import capture_logs

pytestmark = pytest.mark.nats

EVENTS = subjects.EVENTS_STREAM
TELEMETRY = subjects.TELEMETRY_STREAM
RENDEZVOUS = subjects.SHARED_RENDEZVOUS_STREAM


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


async def read_job(bus: Bus, job: str, timeout: float = 10.0) -> dict[int, str]:
    """Event id by stream sequence of everything stored for `job`, read with an EventFeed."""
    feed = EventFeed(bus.js, EVENTS, subjects.job_events(job))
    await feed.start()
    ids: dict[int, str] = {}
    try:
        if not feed.caught_up.is_set():
            async with asyncio.timeout(timeout):
                async with contextlib.aclosing(feed.__aiter__()) as delivered:
                    async for d in delivered:
                        ids[d.seq] = d.event.id
                        if feed.caught_up.is_set():
                            break
    finally:
        await feed.stop()
    return ids


async def count_on_subject(bus: Bus, subject: str) -> int:
    info = await bus.js.stream_info(EVENTS, subjects_filter=subject)
    return (info.state.subjects or {}).get(subject, 0)


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    connected = await Bus.connect(nats_url, deadline=10)
    await connected.ensure_streams()
    try:
        yield connected
    finally:
        await connected.close()


@pytest.fixture
async def own_bus(own_nats_server: NatsServer) -> AsyncIterator[Bus]:
    connected = await Bus.connect(own_nats_server.url, deadline=10)
    try:
        yield connected
    finally:
        await connected.close()


async def test_same_event_published_twice_is_stored_once(bus: Bus) -> None:
    event = state_changed(new_job())

    first = await bus.publish(event)
    second = await bus.publish(event)

    assert first.stream == EVENTS
    assert not first.duplicate
    assert second.duplicate
    assert second.seq == first.seq
    assert await count_on_subject(bus, subject_for(event)) == 1
    assert await read_job(bus, event.job) == {first.seq: event.id}


async def test_provisioning_twice_changes_nothing(own_bus: Bus) -> None:
    assert await own_bus.ensure_streams() == {
        EVENTS: "created",
        TELEMETRY: "created",
    }
    before = {name: (await own_bus.js.stream_info(name)).config for name in (EVENTS, TELEMETRY)}

    assert await own_bus.ensure_streams() == {
        EVENTS: "unchanged",
        TELEMETRY: "unchanged",
    }
    after = {name: (await own_bus.js.stream_info(name)).config for name in (EVENTS, TELEMETRY)}

    assert after == before
    assert after[EVENTS].subjects == ["strata.evt.>"]
    assert sorted(after[TELEMETRY].subjects or []) == ["strata.hb.>", "strata.metric.>"]
    assert after[EVENTS].duplicate_window == pytest.approx(120.0)
    # What workers write to is bounded every way they could grow it, and drops its oldest.
    telemetry = after[TELEMETRY]
    assert telemetry.discard == DiscardPolicy.OLD
    assert telemetry.max_bytes == TELEMETRY_MAX_BYTES
    assert telemetry.max_msgs_per_subject == TELEMETRY_MAX_MSGS_PER_SUBJECT
    assert telemetry.max_msg_size == TELEMETRY_MAX_MSG_SIZE
    assert telemetry.max_age == pytest.approx(6 * 3600)
    assert telemetry.allow_direct  # the registry's read of a worker's last heartbeat
    assert (after[EVENTS].max_bytes, after[EVENTS].max_msgs_per_subject) == (-1, -1)


async def test_a_full_telemetry_stream_drops_old_messages_and_events_are_still_stored(
    own_bus: Bus,
) -> None:
    small = 64 * 1024
    for spec in strata_streams(telemetry_max_bytes=small):
        await ensure_stream(own_bus.js, spec)
    job = new_job()
    subject = subjects.heartbeat_subject(job, "w-0")
    flood = 2_000  # about 1 MB, sixteen times the bound, sent as workers send: no ack awaited
    for _ in range(flood):
        await own_bus.nc.publish(subject, b"x" * 512)
    await own_bus.nc.flush()

    async def took_all() -> bool:
        return (await own_bus.js.stream_info(TELEMETRY)).state.last_seq >= flood

    deadline = time.monotonic() + 10
    while not await took_all():
        assert time.monotonic() < deadline, "the telemetry stream never took the flood"
        await asyncio.sleep(0.01)
    state = (await own_bus.js.stream_info(TELEMETRY)).state
    assert state.bytes <= small
    assert 0 < state.messages < flood
    with pytest.raises(nats.js.errors.APIError):
        await own_bus.js.publish(subject, b"x" * (TELEMETRY_MAX_MSG_SIZE + 1))
    # The services' decisions go to the other stream, which the flood left its room.
    decision = state_changed(job)
    ack = await own_bus.publish(decision)
    assert ack.stream == EVENTS
    assert await read_job(own_bus, job) == {ack.seq: decision.id}


async def test_drifted_stream_is_brought_back(own_bus: Bus) -> None:
    await own_bus.ensure_streams()
    wanted = (await own_bus.js.stream_info(EVENTS)).config
    drifted = await own_bus.js.update_stream(wanted.evolve(duplicate_window=5.0))
    assert drifted.config.duplicate_window == pytest.approx(5.0)

    assert await own_bus.ensure_streams() == {
        EVENTS: "updated",
        TELEMETRY: "unchanged",
    }

    restored = (await own_bus.js.stream_info(EVENTS)).config
    assert restored.duplicate_window == pytest.approx(120.0)
    assert restored == wanted
    assert set((await own_bus.ensure_streams()).values()) == {"unchanged"}


async def test_the_one_rendezvous_bucket_of_an_earlier_release_gives_way_to_each_jobs_own(
    own_bus: Bus,
) -> None:
    # What the first release made: nats-py's defaults for a bucket, rollups and message TTLs on,
    # on the subjects of every job's keys.
    await own_bus.js.create_key_value(
        bucket=subjects.RENDEZVOUS_BUCKET, history=1, ttl=RENDEZVOUS_MAX_AGE_S
    )
    settings = load_settings(rendezvous_jobs="job-a,job.b")
    outcomes = await own_bus.ensure_streams(1, settings)
    assert outcomes[RENDEZVOUS] == "removed"
    for job in ("job-a", "job.b"):
        name = subjects.rendezvous_stream_name(job)
        assert outcomes[name] == "created"
        config = (await own_bus.js.stream_info(name)).config
        # A message on a job's key cannot roll the bucket up; reads by subject are served.
        assert (config.allow_rollup_hdrs, config.deny_purge, config.allow_direct) == (
            False,
            True,
            True,
        )
        assert config.subjects == [subjects.rendezvous_subjects(job)]
        assert (config.max_bytes, config.max_msg_size) == (
            settings.rendezvous_max_bytes,
            settings.rendezvous_max_value_bytes,
        )
    again = await own_bus.ensure_streams(1, settings)
    assert set(again.values()) == {"unchanged"}


async def test_stream_with_the_wrong_storage_is_refused_not_replaced(own_bus: Bus) -> None:
    await own_bus.js.add_stream(
        name=TELEMETRY, subjects=["strata.hb.>", "strata.metric.>"], storage=StorageType.MEMORY
    )

    with pytest.raises(strata.ConfigError, match="cannot convert"):
        await own_bus.ensure_streams()

    assert (await own_bus.js.stream_info(TELEMETRY)).config.storage == StorageType.MEMORY


async def test_publish_many_acks_in_input_order_and_republishing_stores_nothing(
    bus: Bus,
) -> None:
    job = new_job()
    events = [state_changed(job, step) for step in range(200)]

    acks = await bus.publish_many(events, window=32)

    assert len(acks) == len(events)
    assert not any(ack.duplicate for ack in acks)
    sequences = [ack.seq for ack in acks]
    assert sequences == sorted(sequences)
    assert len(set(sequences)) == len(sequences)
    stored = await read_job(bus, job)
    assert stored == {ack.seq: event.id for ack, event in zip(acks, events, strict=True)}

    again = await bus.publish_many(events, window=32)

    assert all(ack.duplicate for ack in again)
    assert [ack.seq for ack in again] == sequences
    assert await count_on_subject(bus, subject_for(events[0])) == len(events)


async def test_expected_last_subject_sequence_detects_a_concurrent_writer(bus: Bus) -> None:
    job = new_job()
    first = await bus.publish(state_changed(job, 1), expected_last_subject_seq=0)
    # Both writers read the subject at `first.seq`; the first to publish wins.
    winner = await bus.publish(state_changed(job, 2), expected_last_subject_seq=first.seq)
    assert winner.seq > first.seq

    started = time.monotonic()
    with pytest.raises(strata.ConflictError, match="another writer") as lost:
        await bus.publish(state_changed(job, 3), expected_last_subject_seq=first.seq)

    assert time.monotonic() - started < 1.0, "a lost race must not be retried"
    assert lost.value.code == "conflict"
    assert str(first.seq) in lost.value.message
    with pytest.raises(strata.ConflictError):
        await bus.publish(state_changed(job, 4), expected_last_subject_seq=0)
    assert list((await read_job(bus, job)).keys()) == [first.seq, winner.seq]
    after_reload = await bus.publish(state_changed(job, 5), expected_last_subject_seq=winner.seq)
    assert after_reload.seq > winner.seq


async def test_the_ack_journal_lists_every_acknowledged_event_and_nothing_else(
    nats_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    journal = tmp_path / "acked.journal"
    monkeypatch.setenv(Env.ACK_JOURNAL, str(journal))
    job = new_job()
    single, *many = [state_changed(job, step) for step in range(5)]
    async with await Bus.connect(nats_url, settings=load_settings(), deadline=10) as bus:
        await bus.ensure_streams()
        first = await bus.publish(single, expected_last_subject_seq=0)
        acks = await bus.publish_many([single, *many], window=2)
        with pytest.raises(strata.ConflictError):
            await bus.publish(state_changed(job, 9), expected_last_subject_seq=0)
        stored = await read_job(bus, job)

    lines = [line.split() for line in journal.read_text().splitlines()]
    assert [(msg_id, int(seq)) for msg_id, _, seq in lines] == [
        (single.id, first.seq),
        *((event.id, ack.seq) for event, ack in zip([single, *many], acks, strict=True)),
    ]
    assert {stream for _, stream, _ in lines} == {EVENTS}
    assert {msg_id for msg_id, _, _ in lines} == set(stored.values())


async def test_publish_without_a_stream_times_out_with_an_actionable_message(
    own_nats_server: NatsServer,
) -> None:
    nc = await connect(own_nats_server.url, ConnectOptions(deadline=5))
    bus = Bus(nc, publish_options=PublishOptions(deadline=1.0))
    event = state_changed(new_job())
    try:
        started = time.monotonic()
        with pytest.raises(strata.PublishTimeout) as timed_out:
            await bus.publish(event)
        elapsed = time.monotonic() - started
    finally:
        await bus.close()

    assert 1.0 <= elapsed < 3.0
    assert isinstance(timed_out.value, strata.BusError)
    message = timed_out.value.message
    assert subject_for(event) in message
    assert event.id in message
    assert "ensure_streams" in message
    assert "attempts" in message


async def test_publishing_rides_through_a_server_restart(own_nats_server: NatsServer) -> None:
    server = own_nats_server
    nc = await connect(server.url, ConnectOptions(deadline=5))
    bus = Bus(nc, publish_options=PublishOptions(deadline=20))
    job = new_job()
    events = [state_changed(job, step) for step in range(300)]
    acked: list[str] = []
    duplicates = 0

    async def publish_all() -> None:
        nonlocal duplicates
        for event in events:
            ack = await bus.publish(event)
            duplicates += bool(ack.duplicate)
            acked.append(event.id)

    try:
        await bus.ensure_streams()
        publisher = asyncio.create_task(publish_all())
        await poll_until(lambda: len(acked) >= 100 or publisher.done(), 10, "100 acks")
        assert not publisher.done()
        # Stopping happens off the loop so the publisher meets the outage; starting stays on
        # the loop's thread because the server dies with the thread that spawned it.
        await asyncio.to_thread(server.stop)
        await poll_until(lambda: not nc.is_connected, 10, "the client to notice the outage")
        acked_during_outage = len(acked)
        server.start()
        await asyncio.wait_for(publisher, 30)

        assert acked_during_outage < len(events)
        assert acked == [event.id for event in events]
        stored = await read_job(bus, job)
    finally:
        await bus.close()

    assert Counter(stored.values()) == Counter(acked)
    assert len(stored) == len(events)
    assert duplicates <= 1


async def test_connect_to_nothing_fails_after_the_deadline_naming_the_url() -> None:
    url = f"nats://127.0.0.1:{free_port()}"

    started = time.monotonic()
    with pytest.raises(strata.BusError) as failed:
        await Bus.connect(url, deadline=1.0)
    elapsed = time.monotonic() - started

    assert 1.0 <= elapsed < 3.0
    assert url in failed.value.message
    assert "STRATA_NATS_URL" in failed.value.message


async def test_connect_succeeds_when_the_server_comes_up_during_the_retry_window(
    own_nats_server: NatsServer,
) -> None:
    server = own_nats_server
    server.stop()
    with capture_logs() as logs:
        connecting = asyncio.create_task(Bus.connect(server.url, deadline=15))
        await poll_until(
            lambda: any(entry["event"] == "nats_error" for entry in logs) or connecting.done(),
            10,
            "a refused connection attempt",
        )
        assert not connecting.done()
        server.start()
        bus = await asyncio.wait_for(connecting, 15)
    try:
        assert bus.nc.is_connected
        assert set((await bus.ensure_streams()).values()) == {"created"}
        ack = await bus.publish(state_changed(new_job()))
        assert ack.seq == 1
    finally:
        await bus.close()
