"""A worker's report of a suspected dead peer (`registry.suspect`) against real processes: a
killed peer is failed at once, long before its heartbeat timeout; a live or paused one is not;
a report without a live lease, or about another job, is refused."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import strata
from strata.bus import Bus
from strata.errors import Forbidden, LeaseRequired, StaleLease
from strata.events import WorkerFailed
from strata.events.requests import Lease, SuspectRequest, SuspectResult

from tests.faults.conftest import (
    Heartbeater,
    failed_within,
    failed_workers,
    pause,
    registry,
    resume,
)
from tests.support import ServiceProcess, job_events, new_job

pytestmark = [pytest.mark.nats, pytest.mark.slow]

TIMEOUT = 30.0
"""The heartbeat timeout: long, so that a failure recorded within `PROVEN_WITHIN` can only be the
report's doing, even on a loaded machine."""
PROVEN_WITHIN = 10.0


@pytest.fixture
def service(nats_url: str, tmp_path: Path) -> Iterator[ServiceProcess]:
    started = registry(nats_url, tmp_path, interval=1.0, timeout=TIMEOUT).start()
    try:
        yield started
    finally:
        started.stop()


async def reporter(job: str, nats_url: str) -> strata.aio.Worker:
    return await strata.aio.Worker(job, nats_url, worker_id="reporter").start()


async def test_a_killed_peer_reported_is_failed_long_before_its_timeout(
    nats_url: str, service: ServiceProcess
) -> None:
    job = new_job("suspect-killed")
    peer = Heartbeater(job, nats_url, "peer")
    try:
        peer.wait_line("registered")
        worker = await reporter(job, nats_url)
        try:
            peer.kill()
            killed = time.monotonic()
            result = await worker.report_suspect("peer")
            assert result.verdict == "failed", result
            async with await Bus.connect(nats_url, deadline=10) as bus:
                await failed_within(bus, job, "peer", PROVEN_WITHIN)
                assert time.monotonic() - killed < PROVEN_WITHIN < TIMEOUT
                failures = [e for e in await job_events(bus, job) if isinstance(e, WorkerFailed)]
            assert [e.worker_id for e in failures] == ["peer"]
            assert "reported by reporter" in failures[0].reason
            assert "no responder" in failures[0].reason
            # Reported again: the registration is over, nothing more is recorded.
            again = await worker.report_suspect("peer")
            assert again.verdict == "not_live"
        finally:
            await worker.stop()
    finally:
        peer.kill()


async def test_a_killed_peer_reported_by_two_survivors_at_once_is_failed_once_for_both(
    nats_url: str, service: ServiceProcess
) -> None:
    """Both survivors of a group report the dead peer at the same moment, as they do when their
    collectives fail together: each gets the failure, recorded once, long before the timeout."""
    job = new_job("suspect-twice")
    peer = Heartbeater(job, nats_url, "peer")
    try:
        peer.wait_line("registered")
        first = await strata.aio.Worker(job, nats_url, worker_id="first").start()
        second = await strata.aio.Worker(job, nats_url, worker_id="second").start()
        try:
            peer.kill()
            killed = time.monotonic()
            results = await asyncio.gather(
                first.report_suspect("peer"), second.report_suspect("peer")
            )
            assert [r.verdict for r in results] == ["failed", "failed"], results
            async with await Bus.connect(nats_url, deadline=10) as bus:
                await failed_within(bus, job, "peer", PROVEN_WITHIN)
                assert time.monotonic() - killed < PROVEN_WITHIN < TIMEOUT
                failures = [e for e in await job_events(bus, job) if isinstance(e, WorkerFailed)]
            assert [e.worker_id for e in failures] == ["peer"], failures
            assert "no responder" in failures[0].reason
        finally:
            await first.stop()
            await second.stop()
    finally:
        peer.kill()


async def test_a_live_peer_reported_is_not_failed(nats_url: str, service: ServiceProcess) -> None:
    job = new_job("suspect-live")
    peer = Heartbeater(job, nats_url, "peer")
    try:
        peer.wait_line("registered")
        worker = await reporter(job, nats_url)
        try:
            result = await worker.report_suspect("peer")
            assert result.verdict == "alive", result
            async with await Bus.connect(nats_url, deadline=10) as bus:
                assert await failed_workers(bus, job) == []
        finally:
            await worker.stop()
    finally:
        peer.stop()


async def test_a_paused_peer_reported_is_not_failed_early(
    nats_url: str, service: ServiceProcess
) -> None:
    job = new_job("suspect-paused")
    peer = Heartbeater(job, nats_url, "peer")
    try:
        peer.wait_line("registered")
        worker = await reporter(job, nats_url)
        try:
            pause(peer.proc.pid)
            try:
                result = await worker.report_suspect("peer")
                async with await Bus.connect(nats_url, deadline=10) as bus:
                    failed = await failed_workers(bus, job)
            finally:
                resume(peer.proc.pid)
            # Its connection is open, so the probe finds a subscriber that does not answer:
            # no evidence, and the heartbeat timeout (30 s) still decides.
            assert result.verdict == "unanswered", result
            assert failed == []
            # Resumed, it answers again.
            assert (await worker.report_suspect("peer")).verdict == "alive"
        finally:
            await worker.stop()
    finally:
        peer.stop()


async def test_a_report_without_a_live_lease_or_about_another_job_is_refused(
    nats_url: str, service: ServiceProcess
) -> None:
    job = new_job("suspect-refused")
    peer = Heartbeater(job, nats_url, "peer")
    try:
        peer.wait_line("registered")
        worker = await reporter(job, nats_url)
        try:
            lease = worker.lease
            stale = Lease(worker_id=lease.worker_id, instance="another-instance", epoch=lease.epoch)
            for given, refusal in ((stale, StaleLease), (None, LeaseRequired)):
                with pytest.raises(refusal):
                    await worker.bus.rpc.call(
                        "registry",
                        "suspect",
                        SuspectRequest(job=job, worker_id="reporter", suspect="peer", lease=given),
                        result=SuspectResult,
                        timeout=10,
                    )
            other = new_job("suspect-other")
            with pytest.raises(Forbidden):
                await worker.bus.rpc.call(
                    "registry",
                    "suspect",
                    SuspectRequest(job=other, worker_id="reporter", suspect="peer", lease=lease),
                    result=SuspectResult,
                    timeout=10,
                )
            # None of it touched the peer.
            assert (await worker.report_suspect("peer")).verdict == "alive"
            async with await Bus.connect(nats_url, deadline=10) as bus:
                assert await failed_workers(bus, job) == []
        finally:
            await worker.stop()
    finally:
        peer.stop()
