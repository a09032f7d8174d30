"""Evidence behind a failure: a registry whose heartbeat reader died reads again on a new
connection and fails nobody for the time it could not hear; failures are stored with a
conditional write, which a refused message on the job's worker subjects does not block; and
the stream's record of a worker's heartbeats is checked against what the decision knew, not
against heartbeats applied while the stream was read."""

from __future__ import annotations

import asyncio

import pytest
import strata.aio
from strata.bus import Bus
from strata.bus.publish import MSG_ID
from strata.bus.server import NatsServer
from strata.config import Settings
from strata.errors import ConflictError
from strata.events import WorkerHeartbeat, WorkerStateChanged, encode_event, subjects
from strata.events.requests import RegisterRequest
from strata.events.routing import subject_for
from strata.services.registry import domain
from strata.services.registry.service import Registry

from tests.faults.conftest import DETECTION_BOUND, failed_within, failed_workers, no_failures_for
from tests.support import async_wait_until, new_job

pytestmark = [pytest.mark.nats, pytest.mark.slow]

TIMEOUT = 2.0


async def test_a_dead_heartbeat_reader_is_replaced_and_fails_nobody(
    own_nats_server: NatsServer, workers: list[strata.aio.Worker]
) -> None:
    url = own_nats_server.url
    job = new_job("dead-reader")
    settings = Settings(nats_url=url, heartbeat_interval=0.5, heartbeat_timeout=TIMEOUT)
    async with await Bus.connect(url, deadline=10) as bus:
        await bus.ensure_streams()
        registry = Registry()
        await registry.start(bus, settings)
        try:
            for worker_id in ("w0", "w1"):
                worker = strata.aio.Worker(job, url, worker_id=worker_id)
                workers.append(worker)
                await worker.start()
            old = registry._hb_nc
            assert old is not None
            assert old.reader_alive
            # The read loop ends (as nats-py's does on a late PONG): the client still says it
            # is connected, and hears nothing.
            assert old._reading_task is not None
            old._reading_task.cancel()

            async def replaced() -> bool:
                now = registry._hb_nc
                return now is not None and now is not old and now.reader_alive

            await async_wait_until(replaced, 10, "a new heartbeat connection")
            await no_failures_for(bus, job, 2 * TIMEOUT)
            # And the new reader is the one that hears: a worker gone silent is failed.
            workers[1]._suspend_heartbeats(True)
            await failed_within(bus, job, "w1", TIMEOUT + DETECTION_BOUND)
            assert await failed_workers(bus, job) == ["w1"]
        finally:
            await registry.stop()


async def test_a_write_expecting_a_stale_sequence_over_a_wildcard_is_refused(
    own_nats_server: NatsServer,
) -> None:
    job = new_job("expected")
    async with await Bus.connect(own_nats_server.url, deadline=10) as bus:
        await bus.ensure_streams()

        def change(seq: int) -> WorkerStateChanged:
            return WorkerStateChanged(
                job=job,
                source="registry",
                worker_id="w0",
                state="training",
                previous="idle",
                step=seq,
                epoch=0,
            )

        worker_events = subjects.area_events(job, "worker")
        first = await bus.publish(
            change(1), expected_last_subject_seq=0, expected_subject=worker_events
        )
        with pytest.raises(ConflictError):
            await bus.publish(
                change(2), expected_last_subject_seq=0, expected_subject=worker_events
            )
        second = await bus.publish(
            change(3), expected_last_subject_seq=first.seq, expected_subject=worker_events
        )
        assert second.seq > first.seq


async def test_a_malformed_message_on_the_worker_subjects_does_not_block_failures(
    own_nats_server: NatsServer, workers: list[strata.aio.Worker]
) -> None:
    url = own_nats_server.url
    job = new_job("forged")
    settings = Settings(nats_url=url, heartbeat_interval=0.5, heartbeat_timeout=TIMEOUT)
    async with await Bus.connect(url, deadline=10) as bus:
        await bus.ensure_streams()
        registry = Registry()
        await registry.start(bus, settings)
        try:
            for worker_id in ("w0", "w1"):
                worker = strata.aio.Worker(job, url, worker_id=worker_id)
                workers.append(worker)
                await worker.start()
            # Stored on the job's worker subjects (anyone may publish on an unsecured NATS),
            # refused by every service: still the last message there, which a failure's
            # conditional write must expect.
            await bus.js.publish(subjects.event_subject(job, "worker.failed"), b"\x00garbage")
            workers[1]._suspend_heartbeats(True)
            await failed_within(bus, job, "w1", TIMEOUT + DETECTION_BOUND)
            assert await failed_workers(bus, job) == ["w1"]
        finally:
            await registry.stop()


async def test_a_registry_restored_from_a_snapshot_fails_a_silent_worker_of_a_quiet_job(
    own_nats_server: NatsServer, workers: list[strata.aio.Worker]
) -> None:
    """The conditional write expects the last sequence on the job's worker subjects; a registry
    restored from a snapshot has folded none of the job's worker events (they are all older than
    the snapshot), and must learn it rather than expect an empty subject for ever."""
    url = own_nats_server.url
    job = new_job("restored")
    settings = Settings(nats_url=url, heartbeat_interval=0.5, heartbeat_timeout=TIMEOUT)
    async with await Bus.connect(url, deadline=10) as bus:
        await bus.ensure_streams()
        first = Registry()
        await first.start(bus, settings)
        try:
            for worker_id in ("w0", "w1"):
                worker = strata.aio.Worker(job, url, worker_id=worker_id)
                workers.append(worker)
                await worker.start()
            await first.save_snapshot()
        finally:
            await first.stop()
        restored = Registry()
        await restored.start(bus, settings)
        try:
            # Nothing of the job folded from the stream: all of it came from the snapshot.
            assert job in restored.state.jobs
            assert job not in restored._worker_seqs
            workers[1]._suspend_heartbeats(True)
            await failed_within(bus, job, "w1", TIMEOUT + DETECTION_BOUND)
            assert await failed_workers(bus, job) == ["w1"]
        finally:
            await restored.stop()


async def test_heartbeats_applied_while_the_stream_is_read_still_contradict_the_failure(
    own_nats_server: NatsServer,
) -> None:
    """The heal of a partial partition, step by step. The registry has applied w0's heartbeat 1;
    heartbeats 2 to 4 were stored by the stream but held on their way to the registry (its
    node's route to w0's node cut). It decides w0's failure on heartbeat 1 and reads the
    stream's last heartbeat of w0; while that read is in flight the route heals and the held
    heartbeats arrive and are applied. The stream's last heartbeat (4) is then one the registry
    has applied, but not one the decision knew of: the failure is contradicted, not stored."""
    job = new_job("healed")
    liveness = [0]
    policy = domain.Policy(heartbeat_interval=1.0, heartbeat_timeout=3.0)
    async with await Bus.connect(own_nats_server.url, deadline=10) as bus:
        await bus.ensure_streams()
        registry = Registry(liveness_ns=lambda: liveness[0])
        registry.bus_, registry.policy = bus, policy
        request = RegisterRequest(job=job, worker_id="w0", instance="p-w0")
        for event in domain.decide(
            registry.state, domain.Register(request), registry.now_ns(), policy
        ).events:
            domain.evolve(registry.state, event)
        domain.begin_grace(registry.state, liveness[0])

        def beat(seq: int) -> WorkerHeartbeat:
            return WorkerHeartbeat(
                job=job, source="w0", worker_id="w0", instance="p-w0", seq=seq, state="idle"
            )

        def take(heartbeat: WorkerHeartbeat) -> None:
            registry._take_heartbeat(subject_for(heartbeat).encode(), b"", encode_event(heartbeat))

        take(beat(1))  # heard: applied as the intake applies it
        held = [beat(seq) for seq in (2, 3, 4)]
        for heartbeat in held:  # stored by the stream's quorum, not heard
            await bus.js.publish(
                subject_for(heartbeat), encode_event(heartbeat), headers={MSG_ID: heartbeat.id}
            )

        liveness[0] = round((policy.heartbeat_timeout + 1) * 1e9)
        judged = domain.DetectFailures(liveness_ns=liveness[0])
        found = domain.decide(registry.state, judged, registry.now_ns(), policy).events
        assert [event.type for event in found] == ["worker.failed"]

        def heal() -> None:
            for heartbeat in held:
                take(heartbeat)

        # Runs at the check's first wait: the stream read is then in flight.
        asyncio.get_running_loop().call_soon(heal)
        contradicted = await registry._contradicted_by_stream(found)
        member = registry.state.jobs[job].members["w0"]
        assert member.last_beat_seq == 4  # the held heartbeats were applied during the check
        assert contradicted is True
        # Decided again, as the detector does on a contradiction: nobody is late.
        assert domain.decide(registry.state, judged, registry.now_ns(), policy).events == []
