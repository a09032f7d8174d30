"""Barriers under faults beyond crash-stop: a barrier service whose wall clock steps, and one
paused (SIGSTOP) past a barrier's timeout, then resumed.

Real registry and barrier processes on a real nats-server; the barrier service's wall clock is
stepped through `strata.clock`'s offset file. What must hold: a stepped wall clock neither ends
nor extends a deadline (they run on the monotonic clock); a waiter gets `BarrierTimeout` or
`BarrierBroken` within its timeout + 1 s whatever the service does, never `RpcTimeout`; and an
arrival given up on and delivered after the service resumes opens and releases nothing.
"""

from __future__ import annotations

import asyncio
import signal
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import strata
from nats.aio.subscription import Subscription
from strata import clock
from strata.aio._barrier import GRACE_S
from strata.bus import Bus
from strata.events import (
    AnyEvent,
    BarrierArrived,
    BarrierReleased,
    BarrierTimedOut,
    BarrierWithdrawn,
    subjects,
)

from tests.support import (
    ServiceProcess,
    async_wait_until,
    job_events,
    new_job,
    numbered,
    start_workers,
)

pytestmark = [pytest.mark.nats, pytest.mark.slow]

INTERVAL = 0.25
TIMEOUT = 3.0
"""The registry's failure timeout: long enough that a loaded machine fails no worker here."""
LOAD_SLACK_S = 1.0
"""What a loaded 2-core machine may add to a measured wait (event loops late to wake): the
SDK's own deadline is the barrier's timeout + GRACE_S, and the assertions allow this on top."""
STEP_S = 120.0


@dataclass
class Stack:
    registry: ServiceProcess
    barrier: ServiceProcess
    offset_file: Path

    def step_barrier_clock(self, seconds: float) -> None:
        """Step the barrier service's wall clock (it reads the file within 50 ms)."""
        self.offset_file.write_text(f"{seconds}\n", encoding="utf-8")


@pytest.fixture(scope="module")
def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("barrier-faults")
    offset_file = log_dir / "barrier-clock-offset"
    offset_file.write_text("0\n", encoding="utf-8")
    registry = ServiceProcess(
        "registry", nats_url, log_dir, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT
    ).start()
    barrier = ServiceProcess(
        "barrier",
        nats_url,
        log_dir,
        heartbeat_interval=INTERVAL,
        heartbeat_timeout=TIMEOUT,
        env={clock.OFFSET_FILE_ENV: str(offset_file)},
    ).start()
    made = Stack(registry, barrier, offset_file)
    try:
        yield made
    finally:
        if barrier.proc is not None and barrier.proc.poll() is None:
            barrier.proc.send_signal(signal.SIGCONT)
        barrier.stop()
        registry.stop()


@pytest.fixture
def unstepped(stack: Stack) -> Iterator[Stack]:
    stack.step_barrier_clock(0.0)
    yield stack
    stack.step_barrier_clock(0.0)


async def opened(bus: Bus, job: str) -> Subscription:
    """A watch on the job's `barrier.opened` events (the service's decision, published before
    any waiter is answered)."""
    return await bus.nc.subscribe(subjects.event_subject(job, "barrier.opened"))


async def barrier_result(
    worker: strata.aio.Worker, name: str, timeout: float
) -> tuple[int | BaseException, float]:
    """The generation (or the error) and how long the call took."""
    started = time.monotonic()
    try:
        outcome: int | BaseException = await worker.barrier(name, timeout)
    except Exception as exc:  # any error: the tests check its type
        outcome = exc
    return outcome, time.monotonic() - started


async def events_of(bus: Bus, job: str, kind: type[AnyEvent], count: int) -> list[AnyEvent]:
    found: list[AnyEvent] = []

    async def enough() -> bool:
        nonlocal found
        found = [e for e in await job_events(bus, job) if isinstance(e, kind)]
        return len(found) >= count

    await async_wait_until(enough, 15, f"{count} {kind.__name__} events")
    return found


async def test_a_wall_clock_stepped_forward_does_not_time_out_a_60s_barrier_early(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str, unstepped: Stack
) -> None:
    job = new_job("clock-fwd")
    w0, w1 = await start_workers(workers, job, nats_url, numbered(2))
    watch = await opened(bus, job)
    first = asyncio.create_task(barrier_result(w0, "step", 60.0))
    await watch.next_msg(timeout=15)
    await watch.unsubscribe()
    unstepped.step_barrier_clock(STEP_S)  # NTP steps the service's clock 2 minutes ahead
    # A wall-clock deadline would be 60 s behind now: timed out at the next check (50 ms).
    done, _ = await asyncio.wait({first}, timeout=3.0)
    assert not done, f"the 60 s barrier ended 3 s after a +{STEP_S:g} s step: {first.result()}"
    second = await barrier_result(w1, "step", 60.0)
    assert [second[0], (await first)[0]] == [0, 0]


async def test_a_wall_clock_stepped_back_still_times_out_a_3s_barrier_in_time(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str, unstepped: Stack
) -> None:
    job = new_job("clock-back")
    w0, w1 = await start_workers(workers, job, nats_url, numbered(2))
    watch = await opened(bus, job)
    waiting = asyncio.create_task(barrier_result(w0, "step", 3.0))
    await watch.next_msg(timeout=15)
    await watch.unsubscribe()
    unstepped.step_barrier_clock(-STEP_S)
    outcome, took = await waiting
    assert isinstance(outcome, strata.BarrierTimeout), outcome
    assert took < 3.0 + GRACE_S + LOAD_SLACK_S
    # The service's time-out (it names who is missing), not the SDK giving up on a silent one.
    assert outcome.details.get("missing") == [w1.id], outcome.message
    [timed_out] = await events_of(bus, job, BarrierTimedOut, 1)
    assert isinstance(timed_out, BarrierTimedOut)
    assert timed_out.ts < time.time_ns() - 60 * 10**9  # stamped by the stepped clock


async def test_waiters_at_a_paused_service_time_out_and_their_late_arrivals_release_nothing(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str, unstepped: Stack
) -> None:
    job = new_job("paused")
    w0, w1, w2 = await start_workers(workers, job, nats_url, numbered(3))
    assert await asyncio.gather(*(w.barrier("b", 30.0) for w in (w0, w1, w2))) == [0, 0, 0]
    proc = unstepped.barrier.proc
    assert proc is not None
    proc.send_signal(signal.SIGSTOP)
    try:
        given_up = await asyncio.gather(barrier_result(w0, "b", 2.0), barrier_result(w1, "b", 2.0))
    finally:
        proc.send_signal(signal.SIGCONT)
    for outcome, took in given_up:
        # Never RpcTimeout, never later than the timeout + GRACE_S (plus the machine's slack).
        assert isinstance(outcome, strata.BarrierTimeout), repr(outcome)
        assert took < 2.0 + GRACE_S + LOAD_SLACK_S, took
    # The service resumes with w0's and w1's arrivals (and their withdrawals) in its inbox; w2
    # arrives after: with those arrivals counted, generation 1 would release without w0 and w1.
    alone, _ = await barrier_result(w2, "b", 3.0)
    assert isinstance(alone, strata.BarrierTimeout), repr(alone)
    assert sorted(alone.details.get("missing") or []) == sorted([w0.id, w1.id])
    # All three at the barrier again: released once, with exactly them.
    again = await asyncio.gather(*(w.barrier("b", 30.0) for w in (w0, w1, w2)))
    assert len(set(again)) == 1
    generation = again[0]
    assert generation >= 2

    releases = [
        (e.generation, e.participants)
        for e in await events_of(bus, job, BarrierReleased, 2)
        if isinstance(e, BarrierReleased)
    ]
    assert releases == [(0, 3), (generation, 3)]
    withdrawn = {
        (e.worker_id, e.arrival)
        for e in await events_of(bus, job, BarrierWithdrawn, 2)
        if isinstance(e, BarrierWithdrawn)
    }
    assert {worker for worker, _ in withdrawn} == {w0.id, w1.id}
    counted: list[BarrierArrived] = []

    async def recorded() -> bool:
        # Arrivals are recorded just after their generation's conclusion, not before.
        nonlocal counted
        counted = [
            e
            for e in await job_events(bus, job)
            if isinstance(e, BarrierArrived) and e.name == "b" and e.generation == generation
        ]
        return len(counted) >= 3

    await async_wait_until(recorded, 15, f"the arrivals of generation {generation}")
    assert sorted(e.worker_id for e in counted) == sorted(w.id for w in (w0, w1, w2))
    assert not {(e.worker_id, e.arrival) for e in counted} & withdrawn


async def test_a_waiter_at_a_dead_service_raises_barrier_timeout_in_time(
    workers: list[strata.aio.Worker], nats_url: str, unstepped: Stack
) -> None:
    job = new_job("dead")
    [w0] = await start_workers(workers, job, nats_url, numbered(1))
    unstepped.barrier.kill()
    try:
        outcome, took = await barrier_result(w0, "b", 2.0)
    finally:
        unstepped.barrier.start()  # for the module's other tests
    assert isinstance(outcome, strata.BarrierTimeout), repr(outcome)
    assert took < 2.0 + GRACE_S + LOAD_SLACK_S, took
