"""Barriers under faults beyond crash-stop: a barrier service whose wall clock steps, one paused
(SIGSTOP) past a barrier's timeout, then resumed, one whose connection is black-holed (a proxy
that stops forwarding without closing), and a waiter whose withdrawal is held up.

Real registry and barrier processes on a real nats-server; the barrier service reaches it
through the fault suite's TCP proxy, and its wall clock is stepped through `strata.clock`'s
offset file. What must hold: a stepped wall clock neither ends nor extends a deadline (they run
on the monotonic clock); a waiter gets `BarrierTimeout` or `BarrierBroken` within its timeout +
1 s whatever the service does, never `RpcTimeout`; an arrival given up on and delivered after
the service resumes opens and releases nothing; and a release counts exactly its participants,
never a waiter that already raised `BarrierTimeout`, and never happens twice.
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
from strata.events.requests import ArriveRequest, BarrierOutcome, WithdrawRequest, WithdrawResult

from tests.faults.conftest import pause, resume
from tests.faults.netproxy import Proxy
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
TIMEOUT = 15.0
"""The registry's failure timeout: long enough that a loaded machine fails no worker here, and
that a worker whose connection is held for a few seconds is not failed either."""
LOAD_SLACK_S = 1.0
"""What a loaded 2-core machine may add to a measured wait (event loops late to wake): the
SDK's own deadline is the barrier's timeout + GRACE_S, and the assertions allow this on top."""
STEP_S = 120.0


@dataclass
class Stack:
    registry: ServiceProcess
    barrier: ServiceProcess
    offset_file: Path
    barrier_link: Proxy
    """The barrier service's connection to nats-server."""

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
    with Proxy(port_of(nats_url)) as link:
        barrier = ServiceProcess(
            "barrier",
            link.url,
            log_dir,
            heartbeat_interval=INTERVAL,
            heartbeat_timeout=TIMEOUT,
            env={clock.OFFSET_FILE_ENV: str(offset_file)},
        ).start()
        made = Stack(registry, barrier, offset_file, link)
        try:
            yield made
        finally:
            link.heal()
            if barrier.proc is not None and barrier.proc.poll() is None:
                barrier.proc.send_signal(signal.SIGCONT)
            barrier.stop()
            registry.stop()


def port_of(url: str) -> int:
    return int(url.rsplit(":", 1)[1])


@pytest.fixture
def unstepped(stack: Stack) -> Iterator[Stack]:
    stack.step_barrier_clock(0.0)
    yield stack
    stack.step_barrier_clock(0.0)
    stack.barrier_link.heal()


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


async def releases_of(bus: Bus, job: str, name: str) -> list[tuple[int, int]]:
    """(generation, participants) of every release of `name` stored, in stream order."""
    return [
        (e.generation, e.participants)
        for e in await job_events(bus, job)
        if isinstance(e, BarrierReleased) and e.name == name
    ]


async def assert_counted(
    bus: Bus, job: str, name: str, generation: int, expected: set[tuple[str, int]]
) -> None:
    """The arrivals (worker, arrival count) that stand in a generation, from the stream: those
    recorded (`barrier.arrived`, written just after its conclusion) less those withdrawn, given
    up on by their senders; they must become exactly `expected`."""
    standing: set[tuple[str, int]] = set()

    async def recorded() -> bool:
        nonlocal standing
        events = await job_events(bus, job)
        withdrawn = {
            (e.worker_id, e.arrival)
            for e in events
            if isinstance(e, BarrierWithdrawn) and e.name == name
        }
        standing = {
            (e.worker_id, e.arrival)
            for e in events
            if isinstance(e, BarrierArrived) and e.name == name and e.generation == generation
        } - withdrawn
        return standing >= expected

    await async_wait_until(recorded, 15, f"the arrivals of generation {generation}")
    assert standing == expected


async def test_a_release_never_counts_a_waiter_whose_timeout_passed(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str, unstepped: Stack
) -> None:
    """w0 arrives for 1 s and gives up; its withdrawal is held by its cut link while w2 comes
    and completes the generation: released then, it would count a waiter that raised
    BarrierTimeout a moment before."""
    job = new_job("lapsed")
    with Proxy(port_of(nats_url)) as link:
        [w0] = await start_workers(workers, job, link.url, ["w0"])
        w1, w2 = await start_workers(workers, job, nats_url, ["w1", "w2"])
        watch = await opened(bus, job)
        first = asyncio.create_task(barrier_result(w1, "b", 60.0))
        await watch.next_msg(timeout=15)
        await watch.unsubscribe()
        # w0's arrival as its SDK sends it, by hand so that the test can hold its withdrawal.
        arrive = ArriveRequest(
            job=job,
            name="b",
            worker_id=w0.id,
            arrival=0,
            timeout_s=1.0,
            remaining_s=1.0,
            instance=w0.instance,
            lease=w0.lease,
        )
        answer = await w0.bus.rpc.call(
            "barrier", "arrive", arrive, result=BarrierOutcome, timeout=15
        )
        assert (answer.status, answer.generation) == ("waiting", 0)
        gives_up_at = time.monotonic() + 1.0 + GRACE_S
        link.cut()
        withdraw = WithdrawRequest(
            job=job, name="b", worker_id=w0.id, arrival=0, instance=w0.instance
        )
        withdrawal = asyncio.create_task(
            w0.bus.rpc.call("barrier", "withdraw", withdraw, result=WithdrawResult, timeout=60)
        )
        # The scenario's own timing, not a wait for a condition: w0's SDK raises at this moment.
        await asyncio.sleep(max(0.0, gives_up_at - time.monotonic()))
        last = asyncio.create_task(barrier_result(w2, "b", 60.0))
        done, _ = await asyncio.wait({first, last}, timeout=3.0)
        assert not done, f"released with w0, which gave up: {[t.result() for t in done]}"
        link.heal()
        assert (await withdrawal).status == "withdrawn"
        # w0 at the barrier again (its next arrival): released once, with exactly the three.
        again = await w0.bus.rpc.call(
            "barrier",
            "arrive",
            arrive.model_copy(update={"arrival": 1, "timeout_s": 60.0, "remaining_s": 60.0}),
            result=BarrierOutcome,
            timeout=15,
        )
        assert again.generation == 0
        assert [(await first)[0], (await last)[0]] == [0, 0]
    assert await releases_of(bus, job, "b") == [(0, 3)]
    await assert_counted(bus, job, "b", 0, {(w0.id, 1), (w1.id, 0), (w2.id, 0)})


async def test_a_waiter_that_gave_up_at_a_paused_service_is_not_released_when_it_resumes(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str, unstepped: Stack
) -> None:
    """The service paused across w0's deadline: on resume it reads w2's arrival, which would
    complete the generation, together with w0's arrival and withdrawal, in whatever batches."""
    job = new_job("paused-race")
    w0, w1, w2 = await start_workers(workers, job, nats_url, numbered(3))
    watch = await opened(bus, job)
    first = asyncio.create_task(barrier_result(w1, "b", 60.0))
    await watch.next_msg(timeout=15)
    await watch.unsubscribe()
    proc = unstepped.barrier.proc
    assert proc is not None
    pause(proc.pid)
    try:
        short = asyncio.create_task(barrier_result(w0, "b", 1.0))
        last = asyncio.create_task(barrier_result(w2, "b", 60.0))
        outcome, took = await short
    finally:
        resume(proc.pid)
    assert isinstance(outcome, strata.BarrierTimeout), repr(outcome)
    assert took < 1.0 + GRACE_S + LOAD_SLACK_S, took
    await events_of(bus, job, BarrierWithdrawn, 1)
    done, _ = await asyncio.wait({first, last}, timeout=2.0)
    assert not done, f"released with w0, which gave up: {[t.result() for t in done]}"
    again, _ = await barrier_result(w0, "b", 60.0)
    assert [again, (await first)[0], (await last)[0]] == [0, 0, 0]
    assert await releases_of(bus, job, "b") == [(0, 3)]
    await assert_counted(bus, job, "b", 0, {(w0.id, 1), (w1.id, 0), (w2.id, 0)})


async def test_waiters_behind_a_black_holed_service_give_up_in_time_and_nothing_is_released_twice(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str, unstepped: Stack
) -> None:
    job = new_job("black-hole")
    w0, w1 = await start_workers(workers, job, nats_url, numbered(2))
    assert await asyncio.gather(w0.barrier("b", 30.0), w1.barrier("b", 30.0)) == [0, 0]
    unstepped.barrier_link.cut()
    try:
        given_up = await asyncio.gather(barrier_result(w0, "b", 2.0), barrier_result(w1, "b", 2.0))
    finally:
        unstepped.barrier_link.heal()
    for outcome, took in given_up:
        assert isinstance(outcome, strata.BarrierTimeout | strata.BarrierBroken), repr(outcome)
        assert took < 2.0 + GRACE_S + LOAD_SLACK_S, took
    again = await asyncio.gather(w0.barrier("b", 30.0), w1.barrier("b", 30.0))
    assert again[0] == again[1] >= 1
    generation = again[0]

    async def both_stored() -> bool:
        return len(await releases_of(bus, job, "b")) >= 2

    await async_wait_until(both_stored, 15, "the second release")
    releases = await releases_of(bus, job, "b")
    assert releases == [(0, 2), (generation, 2)], releases
    # Arrival 1 of each was given up on; only arrival 2 may stand in the release.
    await assert_counted(bus, job, "b", generation, {(w0.id, 2), (w1.id, 2)})
