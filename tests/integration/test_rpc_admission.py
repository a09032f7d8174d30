"""Admission control in `RpcServer` against a real nats-server: budgets refused with an answer
before any work, a job's backlog served round robin with another job's requests, bounded queues
answered with `busy`, requests nobody can receive an answer for dropped unseen."""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from uuid import uuid4

import nats
import pytest
from nats.aio.client import Client as NATS
from prometheus_client import REGISTRY
from strata.admission import AdmissionLimits
from strata.bus import Bus, Caller, RpcClient, RpcServer
from strata.bus.rpc import STARTS_PER_TURN
from strata.errors import Busy, RateLimited
from strata.events import StrictModel, pack, subjects

from tests.support import async_wait_until

pytestmark = pytest.mark.nats

TIMEOUT = 5.0


class JobRequest(StrictModel):
    job: str


@dataclass
class Peers:
    server_nc: NATS
    client_nc: NATS


@pytest.fixture
async def peers(nats_url: str) -> AsyncIterator[Peers]:
    server_nc = await nats.connect(nats_url)
    client_nc = await nats.connect(nats_url)
    try:
        yield Peers(server_nc, client_nc)
    finally:
        await client_nc.close()
        await server_nc.close()


def new_service() -> str:
    return f"adm_{uuid4().hex[:8]}"


async def serving(
    nc: NATS,
    limits: AdmissionLimits,
    handler: Callable[[JobRequest], Awaitable[dict[str, str]]],
    concurrency: int = 1,
) -> RpcServer:
    server = RpcServer(nc, new_service(), concurrency=concurrency, admission=limits)
    server.route("work", JobRequest, handler, scope="job")
    return await server.start()


def as_worker(nc: NATS, job: str, worker: str) -> RpcClient:
    return RpcClient(nc, timeout=TIMEOUT, caller=Caller(job, worker))


async def test_a_caller_over_its_budget_is_refused_before_its_handler_runs(peers: Peers) -> None:
    handled: list[str] = []

    async def work(request: JobRequest) -> dict[str, str]:
        handled.append(request.job)
        return {"job": request.job}

    # A budget that refills once a minute: nothing refills while the test runs.
    limits = AdmissionLimits(worker_rate=1 / 60, worker_burst=2)
    server = await serving(peers.server_nc, limits, work)
    try:
        client = as_worker(peers.client_nc, "ja", "w0")
        for _ in range(2):
            await client.call(server.service, "work", {"job": "ja"})
        with pytest.raises(RateLimited, match="STRATA_RPC_WORKER_RATE") as refused:
            await client.call(server.service, "work", {"job": "ja"})
        # Another worker of the same job has a budget of its own.
        await as_worker(peers.client_nc, "ja", "w1").call(server.service, "work", {"job": "ja"})
    finally:
        await server.stop()

    assert isinstance(refused.value, Busy)  # a client that retries on busy retries this too
    assert handled == ["ja", "ja", "ja"]
    assert server.rejected["rate_limited"] == 1


async def test_a_refused_call_with_retry_for_goes_through_once_the_budget_refills(
    peers: Peers,
) -> None:
    async def work(request: JobRequest) -> dict[str, str]:
        return {"job": request.job}

    limits = AdmissionLimits(worker_rate=0.5, worker_burst=1)
    server = await serving(peers.server_nc, limits, work)
    try:
        client = as_worker(peers.client_nc, "ja", "w0")
        await client.call(server.service, "work", {"job": "ja"})
        # Refused at first (the one token is spent), answered once it refills (2 s).
        answer = await client.call(server.service, "work", {"job": "ja"}, retry_for=30.0)
    finally:
        await server.stop()

    assert answer == {"job": "ja"}
    assert server.rejected["rate_limited"] >= 1


async def test_one_jobs_backlog_does_not_hold_another_jobs_request_behind_it(
    peers: Peers,
) -> None:
    release = asyncio.Event()
    served: list[str] = []

    async def work(request: JobRequest) -> dict[str, str]:
        await release.wait()
        served.append(request.job)
        return {"job": request.job}

    limits = AdmissionLimits(worker_rate=1_000, worker_burst=1_000)
    server = await serving(peers.server_nc, limits, work)  # one request at a time
    try:
        noisy = as_worker(peers.client_nc, "noisy", "w0")
        backlog = [
            asyncio.ensure_future(noisy.call(server.service, "work", {"job": "noisy"}))
            for _ in range(30)
        ]

        async def queued() -> bool:
            return len(server._queue) == 29  # one in its handler, the rest waiting

        await async_wait_until(queued, 10, "the noisy job's backlog to be queued")
        quiet = asyncio.ensure_future(
            as_worker(peers.client_nc, "quiet", "w0").call(server.service, "work", {"job": "quiet"})
        )

        async def quiet_queued() -> bool:
            return len(server._queue) == 30

        await async_wait_until(quiet_queued, 10, "the quiet job's request to be queued")
        release.set()
        await asyncio.gather(quiet, *backlog)
    finally:
        await server.stop()

    # Round robin: the quiet job's one request comes after at most one more of the noisy job's,
    # not after all 29.
    assert served.index("quiet") <= 2, served
    assert served.count("noisy") == 30


async def test_an_admitted_burst_starts_a_few_handlers_a_turn_and_another_job_in_the_next(
    peers: Peers,
) -> None:
    """A burst that one job's budget admits at once (as one read of the request intake sorts it)
    starts `STARTS_PER_TURN` handlers before the event loop turns; the rest wait in the job's
    queue, and another job's request sorted after the burst starts with the next few."""
    turn = 0
    started: list[tuple[str, int]] = []

    async def work(request: JobRequest) -> dict[str, str]:
        started.append((request.job, turn))
        return {"job": request.job}

    async def count_turns() -> None:
        nonlocal turn
        while True:
            turn += 1
            await asyncio.sleep(0)

    limits = AdmissionLimits(worker_rate=1_000, worker_burst=1_000)
    server = await serving(peers.server_nc, limits, work, concurrency=4_096)
    ticker = asyncio.create_task(count_turns())
    try:
        burst = 128  # four turns of starts
        inbox = peers.server_nc.new_inbox()
        for n in range(burst):
            subject = subjects.rpc_subject(server.service, "work", "noisy", "w0")
            assert (
                server._sort(peers.server_nc, subject, f"{inbox}.{n}", pack({"job": "noisy"}), None)
                is None
            )
        quiet = subjects.rpc_subject(server.service, "work", "quiet", "w0")
        assert (
            server._sort(peers.server_nc, quiet, f"{inbox}.q", pack({"job": "quiet"}), None) is None
        )

        async def all_started() -> bool:
            return len(started) == burst + 1

        await async_wait_until(all_started, 10, "every admitted request to start")
    finally:
        ticker.cancel()
        await server.stop()

    per_turn = Counter(at for _, at in started)
    assert max(per_turn.values()) <= STARTS_PER_TURN, per_turn
    assert len(per_turn) > burst // STARTS_PER_TURN, per_turn
    quiet_turn = next(at for job, at in started if job == "quiet")
    # Round robin between the jobs' queues: the quiet job's request is among the second turn's
    # starts, not behind the burst's three more turns.
    assert quiet_turn <= sorted(per_turn)[1], (quiet_turn, per_turn)
    assert [job for job, _ in started].count("noisy") == burst


async def test_a_full_queue_is_answered_with_busy_and_other_jobs_still_get_in(
    peers: Peers,
) -> None:
    release = asyncio.Event()

    async def work(request: JobRequest) -> dict[str, str]:
        await release.wait()
        return {"job": request.job}

    limits = AdmissionLimits(worker_rate=1_000, worker_burst=1_000, job_pending=5)
    server = await serving(peers.server_nc, limits, work)
    try:
        noisy = as_worker(peers.client_nc, "noisy", "w0")
        calls = [
            asyncio.ensure_future(noisy.call(server.service, "work", {"job": "noisy"}))
            for _ in range(10)
        ]
        # One in its handler, five waiting: the other four are refused at once.
        done, _ = await asyncio.wait(calls, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
        quiet = asyncio.ensure_future(
            as_worker(peers.client_nc, "quiet", "w0").call(server.service, "work", {"job": "quiet"})
        )

        async def quiet_queued() -> bool:
            return server._queue.queued("quiet") == 1

        await async_wait_until(quiet_queued, 10, "the quiet job's request to be taken")
        release.set()
        results = await asyncio.gather(*calls, return_exceptions=True)
        assert await quiet == {"job": "quiet"}
    finally:
        await server.stop()

    assert done
    refused = [r for r in results if isinstance(r, Busy)]
    assert len(refused) == 4, results
    assert all(not isinstance(r, RateLimited) for r in refused)
    assert "STRATA_RPC_JOB_PENDING" in str(refused[0])
    assert server.rejected["busy"] == 4


async def test_a_request_without_a_reply_subject_is_dropped_before_any_work(
    peers: Peers,
) -> None:
    handled: list[str] = []

    async def work(request: JobRequest) -> dict[str, str]:
        handled.append(request.job)
        return {"job": request.job}

    server = await serving(peers.server_nc, AdmissionLimits(), work)
    try:
        subject = subjects.rpc_subject(server.service, "work", "ja", "w0")
        for _ in range(100):
            await peers.client_nc.publish(subject, pack({"job": "ja"}))
        # Requests on one subscription are taken in order: once this one is answered, the
        # hundred before it were looked at.
        await as_worker(peers.client_nc, "ja", "w0").call(server.service, "work", {"job": "ja"})
    finally:
        await server.stop()

    assert handled == ["ja"]
    assert server.rejected["no_reply_subject"] == 100


async def test_past_the_subscriptions_pending_bound_requests_are_dropped_and_counted(
    nats_url: str, peers: Peers
) -> None:
    release = asyncio.Event()

    async def work(request: JobRequest) -> dict[str, str]:
        await release.wait()
        return {"job": request.job}

    bus = await Bus.connect(nats_url, name="strata-pending-test")
    # No admission and one handler: the subscription's own bound is all that holds requests back.
    server = RpcServer(bus.nc, new_service(), pending_msgs=5)
    server.route("work", JobRequest, work, scope="job")
    await server.start()

    def dropped() -> float:
        labels = {"service": server.service, "reason": "slow_consumer"}
        return REGISTRY.get_sample_value("strata_rpc_dropped_total", labels) or 0.0

    try:
        subject = subjects.rpc_subject(server.service, "work", "ja", "w0")
        for i in range(50):
            await peers.client_nc.publish(subject, pack({"job": "ja"}), reply=f"_INBOX.x.{i}")
        await peers.client_nc.flush()

        async def counted() -> bool:
            return dropped() >= 40  # 1 in its handler, at most 5 held, the rest dropped

        await async_wait_until(counted, 10, "the dropped requests to be counted")
        release.set()
        # Still serving: nothing was cut off.
        answer = await as_worker(peers.client_nc, "ja", "w1").call(
            server.service, "work", {"job": "ja"}
        )
    finally:
        await server.stop()
        await bus.close()

    assert answer == {"job": "ja"}
    assert dropped() <= 50


async def test_busy_is_retried_for_an_idempotent_call_only(peers: Peers) -> None:
    release = asyncio.Event()

    async def work(request: JobRequest) -> dict[str, str]:
        await release.wait()
        return {"job": request.job}

    limits = AdmissionLimits(worker_rate=1_000, worker_burst=1_000, job_pending=1)
    server = await serving(peers.server_nc, limits, work)
    try:
        client = as_worker(peers.client_nc, "ja", "w0")
        held = [
            asyncio.ensure_future(client.call(server.service, "work", {"job": "ja"}))
            for _ in range(2)
        ]

        async def full() -> bool:  # one in its handler, one waiting: the job's queue is full
            return server._queue.queued("ja") == 1

        await async_wait_until(full, 10, "the job's queue to fill")
        with pytest.raises(Busy):
            await client.call(server.service, "work", {"job": "ja"}, retry_for=30.0)
        retried = asyncio.ensure_future(
            client.call(server.service, "work", {"job": "ja"}, retry_for=30.0, idempotent=True)
        )

        async def refused_again() -> bool:
            return server.rejected["busy"] >= 2

        await async_wait_until(refused_again, 10, "the idempotent call to be refused once")
        release.set()
        assert await retried == {"job": "ja"}
        await asyncio.gather(*held)
    finally:
        await server.stop()
