"""Barriers against real registry and barrier processes and a real nats-server: 100 participants
released together and never before the last arrives, a SIGKILLed participant breaking the barrier
for the other 99 within the failure timeout, the barrier service SIGKILLed mid-barrier and
restarted (with the arrivals stored, and with none stored: rebuilt from re-sends), a name reused
for 50 generations, explicit counts, timeouts, graceful leaves, a worker process restarted under
the same id, and a restart superseding a waiting participant.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import strata
from nats.aio.subscription import Subscription
from strata import procutil
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import (
    AnyEvent,
    BarrierArrived,
    BarrierBrokenEvent,
    BarrierOpened,
    BarrierReleased,
    BarrierTimedOut,
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

pytestmark = pytest.mark.nats

E = TypeVar("E", bound=AnyEvent)

INTERVAL = 0.25
TIMEOUT = 1.5
BREAK_ALLOWANCE = 1.5
"""Slack on top of the failure timeout for a break to reach every waiter on this loaded 2-core
machine: the detector's wake-up, three events published and delivered, and 99 waiters woken by
event loops that also run 100 workers' heartbeats."""
ARRIVALS_TIMEOUT = 30.0

CHILD = """
import sys, time
import strata
worker = strata.Worker(job=sys.argv[1], nats_url=sys.argv[2]).start()
print("registered-as", worker.id, flush=True)
while True:
    time.sleep(3600)
"""


def start_child(job: str, nats_url: str) -> subprocess.Popen[bytes]:
    """A participant in a process of its own, which prints its worker id once registered."""
    return subprocess.Popen(
        [sys.executable, "-c", CHILD, job, nats_url],
        # Quiet, so that nobody needs to read its output after the id.
        env={**os.environ, Env.LOG_LEVEL: "warning"},
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        preexec_fn=procutil.child_preexec,
    )


def registered_id(child: subprocess.Popen[bytes]) -> str:
    assert child.stdout is not None
    for line in child.stdout:  # any log line comes first
        if line.startswith(b"registered-as "):
            return line.split()[1].decode()
    raise AssertionError(f"the child participant exited with {child.wait()} before registering")


def start_service(name: str, nats_url: str, log_dir: Path) -> ServiceProcess:
    process = ServiceProcess(
        name, nats_url, log_dir, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT
    )
    return process.start()


@pytest.fixture(scope="module")
def services(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A registry and a barrier service on the shared server for the tests that kill neither."""
    log_dir = tmp_path_factory.mktemp("barrier")
    registry = start_service("registry", nats_url, log_dir)
    barrier = start_service("barrier", nats_url, log_dir)
    yield
    barrier.stop()
    registry.stop()


async def watch_arrivals(bus: Bus, job: str) -> Subscription:
    return await bus.nc.subscribe(subjects.event_subject(job, "barrier.arrived"))


async def arrivals(watch: Subscription, count: int) -> None:
    """Wait until the service has taken `count` arrivals (it announces each one), then stop
    watching."""
    deadline = time.monotonic() + ARRIVALS_TIMEOUT
    try:
        for _ in range(count):
            await watch.next_msg(timeout=max(0.01, deadline - time.monotonic()))
    finally:
        await watch.unsubscribe()


async def timed_barrier(
    worker: strata.aio.Worker, name: str, timeout: float = 60.0, expected: int | None = None
) -> tuple[int | BaseException, float]:
    """The generation (or the error) and when the call returned (monotonic)."""
    try:
        outcome: int | BaseException = await worker.barrier(name, timeout, expected=expected)
    except strata.StrataError as exc:
        outcome = exc
    return outcome, time.monotonic()


async def meet(group: list[strata.aio.Worker], name: str, expected: int | None = None) -> list[int]:
    return list(await asyncio.gather(*(w.barrier(name, 30, expected=expected) for w in group)))


def of_type(events: list[AnyEvent], kind: type[E]) -> list[E]:
    return [e for e in events if isinstance(e, kind)]


async def recorded(bus: Bus, job: str, arrivals: int) -> list[AnyEvent]:
    """The job's events once `arrivals` barrier.arrived events are among them: the service
    records arrivals just after each conclusion (or once the barrier is quiet), not before."""
    found: list[AnyEvent] = []

    async def enough() -> bool:
        nonlocal found
        found = await job_events(bus, job)
        return len(of_type(found, BarrierArrived)) >= arrivals

    await async_wait_until(enough, 10, f"{arrivals} arrivals to be recorded")
    return found


# -- release --------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.usefixtures("services")
async def test_a_hundred_participants_are_released_together_never_before_the_last_arrives(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str
) -> None:
    job = new_job("barrier")
    group = await start_workers(workers, job, nats_url, numbered(100))
    # Met by count first, as at any start-up: then every worker is a member the service knows.
    assert await meet(group, "started", expected=100) == [0] * 100
    await recorded(bus, job, 100)  # before watching for the next ones
    watch = await watch_arrivals(bus, job)
    first = [asyncio.create_task(timed_barrier(w, "sync")) for w in group[:-1]]
    await arrivals(watch, 99)
    assert not any(task.done() for task in first), "released before the last participant came"
    last_called = time.monotonic()
    results = await asyncio.gather(*first, timed_barrier(group[-1], "sync"))

    assert [outcome for outcome, _ in results] == [0] * 100
    returned = [at for _, at in results]
    assert min(returned) >= last_called
    assert max(returned) - last_called < 5.0
    events = [e for e in await recorded(bus, job, 200) if getattr(e, "name", "") == "sync"]
    [opened] = of_type(events, BarrierOpened)
    assert (opened.generation, opened.expected_count) == (0, 100)
    assert sorted(opened.expected) == sorted(w.id for w in group)
    assert sorted(e.worker_id for e in of_type(events, BarrierArrived)) == sorted(opened.expected)
    [released] = of_type(events, BarrierReleased)
    assert (released.name, released.generation, released.participants) == ("sync", 0, 100)
    assert released.last_arrival_to_release_ms < released.first_arrival_to_release_ms


@pytest.mark.slow
@pytest.mark.usefixtures("services")
async def test_a_participant_killed_mid_barrier_breaks_it_for_the_other_99_quickly(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str
) -> None:
    job = new_job("barrier")
    child = start_child(job, nats_url)
    try:
        killed_id = await asyncio.wait_for(asyncio.to_thread(registered_id, child), 60)
        group = await start_workers(workers, job, nats_url, numbered(99))
        watch = await watch_arrivals(bus, job)
        waiting = [asyncio.create_task(timed_barrier(w, "step")) for w in group]
        await arrivals(watch, 99)
        killed_at = time.monotonic()
        os.kill(child.pid, signal.SIGKILL)
        results = await asyncio.gather(*waiting)
    finally:
        child.kill()
        child.wait()

    for outcome, returned in results:
        assert isinstance(outcome, strata.BarrierBroken), outcome
        assert killed_id in outcome.details["missing"]
        assert killed_id in str(outcome)
        assert returned - killed_at < TIMEOUT + INTERVAL + BREAK_ALLOWANCE
    events = await job_events(bus, job)
    [broken] = of_type(events, BarrierBrokenEvent)
    assert (broken.generation, broken.culprits, broken.missing) == (0, [killed_id], [killed_id])
    assert not of_type(events, BarrierReleased)


async def test_the_barrier_service_killed_mid_barrier_releases_exactly_once_after_restart(
    own_nats_server: NatsServer, tmp_path: Path, workers: list[strata.aio.Worker]
) -> None:
    url = own_nats_server.url
    registry = start_service("registry", url, tmp_path)
    barrier = start_service("barrier", url, tmp_path)
    bus = await Bus.connect(url, name="test-barrier-restart")
    try:
        job = new_job("barrier")
        group = await start_workers(workers, job, url, numbered(5))
        watch = await watch_arrivals(bus, job)
        waiting = [asyncio.create_task(timed_barrier(w, "step")) for w in group[:4]]
        await arrivals(watch, 4)
        barrier.kill()
        waiting.append(asyncio.create_task(timed_barrier(group[4], "step")))
        # Off the event loop: the workers' heartbeats must go on while it starts.
        await asyncio.to_thread(barrier.start)
        results = await asyncio.gather(*waiting)
        assert [outcome for outcome, _ in results] == [0] * 5

        async def released_stored() -> bool:
            return bool(of_type(await job_events(bus, job), BarrierReleased))

        await async_wait_until(released_stored, 10, "the release to be stored")
        events = await recorded(bus, job, 5)
        [released] = of_type(events, BarrierReleased)
        assert (released.generation, released.participants) == (0, 5)
        arrived = of_type(events, BarrierArrived)
        assert sorted(e.worker_id for e in arrived) == sorted(w.id for w in group)
        # the name goes on from there, with the restarted service
        assert await meet(group, "step") == [1] * 5
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        await bus.close()
        barrier.stop()
        registry.stop()


async def test_a_generation_whose_arrivals_died_with_the_service_is_rebuilt_from_the_re_sends(
    own_nats_server: NatsServer, tmp_path: Path, workers: list[strata.aio.Worker]
) -> None:
    """The service keeps arrivals in memory only: SIGKILLed while two participants that passed
    generation 0 wait at generation 1 (none of their arrivals stored), the restarted one learns
    of them from their re-sends alone, and the third participant's first arrival completes it."""
    url = own_nats_server.url
    registry = start_service("registry", url, tmp_path)
    # Arrivals are recorded only at a conclusion: at the kill, none of generation 1's is stored.
    quiet = {Env.BARRIER_RECORD_ARRIVALS_S: "3600"}
    barrier = ServiceProcess(
        "barrier", url, tmp_path, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT, env=quiet
    ).start()
    bus = await Bus.connect(url, name="test-barrier-rebuilt")
    try:
        job = new_job("barrier")
        group = await start_workers(workers, job, url, numbered(3))
        assert await meet(group, "step") == [0] * 3

        # Generation 0's arrivals are recorded just after its release: before the next one opens.
        await recorded(bus, job, 3)
        opened = await bus.nc.subscribe(subjects.event_subject(job, "barrier.opened"))
        waiting = [asyncio.create_task(timed_barrier(w, "step")) for w in group[:2]]
        await opened.next_msg(timeout=ARRIVALS_TIMEOUT)
        await opened.unsubscribe()

        async def both_answered() -> bool:
            # Each waiter's first answer ("waiting at 1") has come back.
            return all(w._barriers is not None and w._barriers._waiters for w in group[:2])

        await async_wait_until(both_answered, 10, "both arrivals to be answered")
        stored = await job_events(bus, job)
        assert [e.generation for e in of_type(stored, BarrierArrived)] == [0, 0, 0]
        barrier.kill()
        await asyncio.to_thread(barrier.start)
        last, _ = await timed_barrier(group[2], "step")
        results = await asyncio.gather(*waiting)
        assert [outcome for outcome, _ in results] == [1, 1]
        assert last == 1

        events = await recorded(bus, job, 6)
        assert [(e.generation, e.participants) for e in of_type(events, BarrierReleased)] == [
            (0, 3),
            (1, 3),
        ]
        assert [e.generation for e in of_type(events, BarrierOpened)] == [0, 1]
        rebuilt = [e for e in of_type(events, BarrierArrived) if e.generation == 1]
        assert sorted(e.worker_id for e in rebuilt) == sorted(w.id for w in group)
        # and the name goes on with the restarted service
        assert await meet(group, "step") == [2] * 3
    finally:
        await asyncio.gather(*(w.stop() for w in workers), return_exceptions=True)
        await bus.close()
        barrier.stop()
        registry.stop()


@pytest.mark.usefixtures("services")
async def test_a_name_reused_for_fifty_generations_never_mixes_them(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str
) -> None:
    job = new_job("barrier")
    group = await start_workers(workers, job, nats_url, numbered(4))
    for step in range(50):
        assert await meet(group, "step") == [step] * 4

    events = await recorded(bus, job, 50 * 4)
    assert [e.generation for e in of_type(events, BarrierOpened)] == list(range(50))
    released = of_type(events, BarrierReleased)
    assert [e.generation for e in released] == list(range(50))
    assert all(e.participants == 4 for e in released)
    by_generation: dict[int, list[str]] = {}
    for arrived in of_type(events, BarrierArrived):
        by_generation.setdefault(arrived.generation, []).append(arrived.worker_id)
        # each worker's n-th arrival at the name is generation n
        assert arrived.arrival == arrived.generation
    assert {gen: sorted(ids) for gen, ids in by_generation.items()} == {
        gen: sorted(w.id for w in group) for gen in range(50)
    }


# -- counts, timeouts and leaves ------------------------------------------------------------------


@pytest.mark.usefixtures("services")
async def test_an_explicit_count_releases_whoever_arrives_that_many(
    workers: list[strata.aio.Worker], nats_url: str
) -> None:
    job = new_job("barrier")
    a, b, c = await start_workers(workers, job, nats_url, numbered(3))
    for pair, generation in (([a, b], 0), ([c, a], 1)):
        assert await meet(pair, "pair", expected=2) == [generation, generation]


@pytest.mark.usefixtures("services")
async def test_an_incomplete_barrier_times_out_for_every_waiter_at_its_deadline(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str
) -> None:
    job = new_job("barrier")
    a, b, absent = await start_workers(workers, job, nats_url, numbered(3))
    called = time.monotonic()
    results = await asyncio.gather(timed_barrier(a, "slow", 1.5), timed_barrier(b, "slow", 1.5))
    for outcome, returned in results:
        assert isinstance(outcome, strata.BarrierTimeout), outcome
        assert outcome.details["missing"] == [absent.id]
        assert 1.5 <= returned - called < 1.5 + 1.0
    [timed_out] = of_type(await job_events(bus, job), BarrierTimedOut)
    assert (timed_out.generation, timed_out.arrived, timed_out.missing) == (0, 2, [absent.id])
    # the absent worker's arrival, late, was for generation 0: it gets the time-out too
    with pytest.raises(strata.BarrierTimeout) as late:
        await absent.barrier("slow", 30)
    assert late.value.details["generation"] == 0
    # the timed-out generation is over; the next one opens for everyone again
    assert await meet([a, b, absent], "slow") == [1, 1, 1]


@pytest.mark.usefixtures("services")
async def test_a_graceful_leave_breaks_the_barrier_for_sync_and_async_waiters(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str
) -> None:
    job = new_job("barrier")
    [waiter, leaver] = await start_workers(workers, job, nats_url, numbered(2))
    sync_worker = strata.Worker(job=job, nats_url=nats_url, worker_id="sync-waiter")
    await asyncio.to_thread(sync_worker.start)
    try:
        watch = await watch_arrivals(bus, job)
        in_thread = asyncio.create_task(asyncio.to_thread(sync_worker.barrier, "step", 30))
        in_loop = asyncio.create_task(waiter.barrier("step", 30))
        await arrivals(watch, 2)
        await leaver.stop()
        for task in (in_thread, in_loop):
            with pytest.raises(strata.BarrierBroken, match=f"{leaver.id}' left the job"):
                await task
    finally:
        await asyncio.to_thread(sync_worker.stop)


@pytest.mark.usefixtures("services")
async def test_a_worker_restarted_under_the_same_id_meets_the_others_again(
    workers: list[strata.aio.Worker], nats_url: str
) -> None:
    job = new_job("barrier")
    stays, restarts = await start_workers(workers, job, nats_url, numbered(2))
    for step in range(3):
        assert await meet([stays, restarts], "step") == [step, step]
    await restarts.stop()
    # A new process counts its arrivals from zero again under the same worker id.
    again = strata.aio.Worker(job, nats_url, worker_id=restarts.id)
    workers.append(again)
    await again.start()
    assert await meet([stays, again], "step") == [3, 3]


@pytest.mark.usefixtures("services")
async def test_a_restart_that_supersedes_a_participant_breaks_the_barrier_at_once(
    bus: Bus, workers: list[strata.aio.Worker], nats_url: str
) -> None:
    job = new_job("barrier")
    stays = await start_workers(workers, job, nats_url, numbered(3))
    [old] = await start_workers(workers, job, nats_url, ["restarting"])
    assert await meet([*stays, old], "step") == [0] * 4
    await recorded(bus, job, 4)  # before watching for the next ones
    # Two of the others and the process about to be replaced wait; the third is still busy.
    watch = await watch_arrivals(bus, job)
    waiting = [asyncio.create_task(timed_barrier(w, "step")) for w in [*stays[:2], old]]
    await arrivals(watch, 3)
    # Its restart comes faster than the heartbeat timeout, under the same worker id.
    restarted = strata.aio.Worker(job, nats_url, worker_id=old.id)
    workers.append(restarted)
    await restarted.start()
    registered_at = time.monotonic()
    results = await asyncio.gather(*waiting)
    for outcome, returned in results[:2]:
        assert isinstance(outcome, strata.BarrierBroken), outcome
        assert f"'{old.id}' failed" in str(outcome)
        # At once: the replaced process still heartbeats, so no timeout would ever break it.
        assert returned - registered_at < BREAK_ALLOWANCE
    # The replaced process learns it too: from the break, or from its refused retry.
    old_outcome, _ = results[2]
    assert isinstance(old_outcome, strata.BarrierBroken | strata.WorkerSuperseded), old_outcome
    # It can no longer arrive: not at the next generation, where it would stand for the new one.
    with pytest.raises(strata.WorkerSuperseded, match=old.id):
        await old.barrier("step", 5)
    # The one that was still busy arrives late for generation 1: it learns of the break too.
    with pytest.raises(strata.BarrierBroken, match=f"'{old.id}' failed"):
        await stays[2].barrier("step", 30)
    assert await meet([*stays, restarted], "step") == [2] * 4

    events = await recorded(bus, job, 4 + 4 + 4)  # generation 0's, 1's and 2's
    [broken] = of_type(events, BarrierBrokenEvent)
    assert (broken.generation, broken.culprits) == (1, [old.id])
    arrived = [(e.generation, e.worker_id, e.arrival) for e in of_type(events, BarrierArrived)]
    # Generation 2 has the restarted process's first arrival (0), none of the old one's.
    assert sorted(a for a in arrived if a[0] == 2) == sorted(
        [(2, stays[0].id, 2), (2, stays[1].id, 2), (2, stays[2].id, 2), (2, old.id, 0)]
    )
