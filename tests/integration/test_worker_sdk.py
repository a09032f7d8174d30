"""The worker SDK (`strata.Worker`, `strata.aio.Worker`) against a real registry process and a real
nats-server: registration and membership, state, restarts under the same id and rank conflicts,
heartbeats that never block, automatic re-registration after a failure (at a requested rank), riding
out a registry restart and a NATS restart, and the opt-in graceful leave on SIGTERM.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import strata
from strata import procutil
from strata._loop import LoopRunner
from strata.bus.server import NatsServer
from strata.events.requests import MemberInfo, MembersResult, Registration

from tests import support
from tests.support import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    ServiceProcess,
    async_wait_until,
    wait_until,
)

pytestmark = pytest.mark.nats


def new_job() -> str:
    return support.new_job("sdk")


def member(result: MembersResult, worker_id: str) -> MemberInfo | None:
    return next((m for m in result.members if m.worker_id == worker_id), None)


class RegistryProcess(ServiceProcess):
    def __init__(
        self, nats_url: str, log_dir: Path, *, heartbeat_timeout: float = HEARTBEAT_TIMEOUT
    ) -> None:
        super().__init__("registry", nats_url, log_dir, heartbeat_timeout=heartbeat_timeout)


@pytest.fixture(scope="module")
def registry(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RegistryProcess]:
    """One registry on the shared server for the tests that do not kill it."""
    process = RegistryProcess(nats_url, tmp_path_factory.mktemp("registry"))
    process.start()
    yield process
    process.stop()


@pytest.fixture
def start_registry(tmp_path: Path) -> Iterator[Callable[..., RegistryProcess]]:
    """Registries of the test's own (on its own server, so no other replica answers for them)."""
    started: list[RegistryProcess] = []

    def start(nats_url: str, **options: float) -> RegistryProcess:
        process = RegistryProcess(nats_url, tmp_path, **options)
        process.start()
        started.append(process)
        return process

    yield start
    for process in started:
        process.stop()


@pytest.fixture
async def aio_workers() -> AsyncIterator[list[strata.aio.Worker]]:
    """Every async worker a test makes is stopped at its end, pass or fail."""
    made: list[strata.aio.Worker] = []
    yield made
    for worker in made:
        await worker.stop()


# -- registration and membership ------------------------------------------------------------------


def test_sync_workers_get_ranks_and_follow_the_world_size(
    registry: RegistryProcess, nats_url: str
) -> None:
    job = new_job()
    first = strata.Worker(job=job, nats_url=nats_url)
    with pytest.raises(strata.WorkerNotStarted, match=r"call start\(\) first"):
        _ = first.rank
    assert first.start() is first
    try:
        assert first.started
        assert first.id == f"w-{first.instance[:24]}"
        assert (first.rank, first.world_size) == (0, 1)
        assert first.heartbeat_interval == HEARTBEAT_INTERVAL
        assert not first.rejoined

        second = strata.Worker(job=job, nats_url=nats_url).start()
        assert (second.rank, second.world_size) == (1, 2)
        wait_until(lambda: first.world_size == 2, 5, "the first worker to see the second join")
        epoch_with_two = first.membership_epoch

        second.stop()
        second.stop()  # idempotent
        assert not second.started
        wait_until(lambda: first.world_size == 1, 5, "the first worker to see the second leave")
        assert first.membership_epoch > epoch_with_two

        with strata.Worker(job=job, nats_url=nats_url) as third:
            assert third.rank == 1  # the lowest free rank again
            wait_until(lambda: first.world_size == 2, 5, "the third worker to be seen")
            assert {m.worker_id for m in first.members().members} == {first.id, third.id}
        assert not third.started
        wait_until(lambda: first.world_size == 1, 5, "the third worker to leave")
    finally:
        first.stop()


async def test_async_worker_registers_and_reports_its_state(
    registry: RegistryProcess, nats_url: str, aio_workers: list[strata.aio.Worker]
) -> None:
    job = new_job()
    async with strata.aio.Worker(job, nats_url) as first:
        assert (first.rank, first.world_size) == (0, 1)
        second = strata.aio.Worker(job, nats_url, hostname="node-7", gpus=8, labels={"zone": "a"})
        aio_workers.append(second)
        assert await second.start() is second
        assert (second.rank, second.world_size) == (1, 2)

        async def first_sees_two() -> bool:
            return first.world_size == 2

        await async_wait_until(first_sees_two, 5, "the first worker to see the second")

        await second.set_state("training", step=10, epoch=1)
        assert (second.state, second.step, second.epoch) == ("training", 10, 1)

        async def training_is_visible() -> bool:
            info = member(await first.members(), second.id)
            return info is not None and (info.status, info.step, info.epoch) == (
                "training",
                10,
                1,
            )

        await async_wait_until(training_is_visible, 1.0, "the new state in members()")
        info = member(await first.members(), second.id)
        assert info is not None
        assert (info.hostname, info.gpus, info.rank) == ("node-7", 8, 1)

        await second.stop()
        assert not second.started

        async def first_sees_one() -> bool:
            return first.world_size == 1

        await async_wait_until(first_sees_one, 5, "the first worker to see the second leave")
    assert not first.started


def test_a_second_process_with_the_same_worker_id_supersedes_the_first(
    registry: RegistryProcess, nats_url: str
) -> None:
    job = new_job()
    with strata.Worker(job=job, nats_url=nats_url, worker_id="trainer-0") as first:
        assert first.id == "trainer-0"
        with strata.Worker(job=job, nats_url=nats_url, worker_id="trainer-0") as restarted:
            assert (restarted.rank, restarted.world_size) == (first.rank, 1)
            assert restarted.rejoined
            wait_until(lambda: first.superseded, 5, "the first worker to learn it was replaced")
            assert not restarted.superseded
            [info] = restarted.members().members
            assert (info.worker_id, info.instance) == ("trainer-0", restarted.instance)
            # The replaced one leaves nothing: the id is the restarted process's now.
            first.stop()
            [info] = restarted.members().members
            assert (info.instance, info.status) == (restarted.instance, "idle")
            assert first.rejoin_count == 0


def test_a_rank_taken_by_another_worker_id_is_refused(
    registry: RegistryProcess, nats_url: str
) -> None:
    job = new_job()
    with strata.Worker(job=job, nats_url=nats_url, worker_id="trainer-0", rank=3) as first:
        assert first.rank == 3
        twin = strata.Worker(job=job, nats_url=nats_url, worker_id="trainer-1", rank=3)
        try:
            with pytest.raises(strata.ConflictError, match="'trainer-0'"):
                twin.start()
            assert not twin.started
            assert not twin.runner.running  # a refused start leaves no thread behind
        finally:
            twin.stop()
        assert [m.worker_id for m in first.members().members] == ["trainer-0"]


# -- heartbeats -----------------------------------------------------------------------------------


def test_heartbeats_keep_flowing_while_the_caller_computes(
    registry: RegistryProcess, nats_url: str
) -> None:
    job = new_job()
    with strata.Worker(job=job, nats_url=nats_url) as worker:
        rank = worker.rank
        busy_until = time.monotonic() + 3 * worker.heartbeat_timeout
        began_ns = time.time_ns()
        spins = 0
        while time.monotonic() < busy_until:  # pure Python, never yields on purpose
            spins += 1
        ended_ns = time.time_ns()
        assert spins > 0

        listed = worker.members(include_gone=True)
        info = member(listed, worker.id)
        assert info is not None
        assert info.status == "idle", f"the worker was {info.status} after a busy caller"
        assert info.last_heartbeat_ts is not None
        assert began_ns < info.last_heartbeat_ts <= time.time_ns()
        assert ended_ns - info.last_heartbeat_ts < 2 * worker.heartbeat_timeout * 1e9
        assert (worker.rank, worker.rejoin_count) == (rank, 0)


def test_a_silent_worker_is_failed_then_rejoins_on_its_own(
    registry: RegistryProcess, nats_url: str
) -> None:
    job = new_job()
    rejoins: list[tuple[Registration, int]] = []
    holder: list[strata.Worker] = []

    def on_rejoin(registration: Registration) -> None:
        # Runs off the SDK's loop, so the blocking API works inside it.
        rejoins.append((registration, holder[0].members().world_size))

    with strata.Worker(job=job, nats_url=nats_url, on_rejoin=on_rejoin) as worker:
        holder.append(worker)
        worker.aio._suspend_heartbeats(True)

        def is_failed() -> bool:
            info = member(worker.members(include_gone=True), worker.id)
            return info is not None and info.status == "failed"

        wait_until(is_failed, 10 * HEARTBEAT_TIMEOUT, "the registry to fail the silent worker")
        wait_until(lambda: worker.world_size == 0, 5, "the worker to see its own failure")

        worker.aio._suspend_heartbeats(False)
        wait_until(lambda: worker.rejoin_count == 1, 5, "the worker to re-register")
        assert worker.rejoined
        wait_until(lambda: len(rejoins) == 1, 5, "on_rejoin to be called")
        registration, world_size = rejoins[0]
        assert (registration.worker_id, registration.instance) == (worker.id, worker.instance)
        assert registration.rejoined
        assert world_size == 1
        assert (worker.rank, worker.world_size) == (0, 1)

        def is_live() -> bool:
            info = member(worker.members(), worker.id)
            return info is not None and info.last_heartbeat_ts is not None

        wait_until(is_live, 5, "the rejoined worker to heartbeat")
        assert worker.rejoin_count == 1
        assert len(rejoins) == 1


def test_a_worker_that_asked_for_a_rank_rejoins_at_that_rank(
    registry: RegistryProcess, nats_url: str
) -> None:
    job = new_job()
    with strata.Worker(job=job, nats_url=nats_url, rank=6) as worker:
        assert (worker.rank, worker.requested_rank) == (6, 6)
        worker.aio._suspend_heartbeats(True)

        def is_failed() -> bool:
            info = member(worker.members(include_gone=True), worker.id)
            return info is not None and info.status == "failed"

        wait_until(is_failed, 10 * HEARTBEAT_TIMEOUT, "the registry to fail the silent worker")
        worker.aio._suspend_heartbeats(False)
        wait_until(lambda: worker.rejoin_count == 1, 5, "the worker to re-register")
        # Not the lowest free rank (0): the one it asked for.
        assert (worker.rank, worker.world_size) == (6, 1)
        info = member(worker.members(), worker.id)
        assert info is not None
        assert (info.rank, info.status) == (6, "idle")


# -- outages --------------------------------------------------------------------------------------


def test_a_worker_keeps_its_rank_through_a_registry_restart(
    own_nats_server: NatsServer, start_registry: Callable[..., RegistryProcess]
) -> None:
    url = own_nats_server.url
    registry = start_registry(url)
    job = new_job()
    with (
        strata.Worker(job=job, nats_url=url) as first,
        strata.Worker(job=job, nats_url=url) as second,
    ):
        epoch = second.membership_epoch
        registry.kill()
        registry.start()
        restarted_ns = time.time_ns()

        def seen_by_the_new_registry_long_enough() -> bool:
            info = member(second.members(retry_for=20), second.id)
            return (
                info is not None
                and info.last_heartbeat_ts is not None
                and info.last_heartbeat_ts - restarted_ns > 1.5 * HEARTBEAT_TIMEOUT * 1e9
            )

        # Past the heartbeat timeout after the restart, so a missed heartbeat would show.
        wait_until(seen_by_the_new_registry_long_enough, 20, "heartbeats to the new registry")
        listed = second.members(include_gone=True)
        assert [(m.worker_id, m.rank, m.status) for m in listed.members] == [
            (first.id, 0, "idle"),
            (second.id, 1, "idle"),
        ]
        assert listed.membership_epoch == epoch
        assert (first.rank, second.rank) == (0, 1)
        assert (first.rejoin_count, second.rejoin_count) == (0, 0)


# The check tier keeps a server restart in test_history_read.py and test_nats_server.py.
@pytest.mark.slow
def test_a_worker_heartbeats_again_after_a_nats_restart(
    own_nats_server: NatsServer, start_registry: Callable[..., RegistryProcess]
) -> None:
    url = own_nats_server.url
    # A timeout longer than the outage: this test is about the worker, not failure detection.
    start_registry(url, heartbeat_timeout=5.0)
    with strata.Worker(job=new_job(), nats_url=url) as worker:
        rank = worker.rank
        own_nats_server.restart()
        restarted_ns = time.time_ns()

        def heartbeats_arrive() -> bool:
            info = member(worker.members(retry_for=10), worker.id)
            return info is not None and (info.last_heartbeat_ts or 0) > restarted_ns

        wait_until(heartbeats_arrive, 20, "heartbeats after the NATS restart")
        assert (worker.rank, worker.rejoin_count, worker.world_size) == (rank, 0, 1)


# -- SIGTERM --------------------------------------------------------------------------------------

SIGTERM_CHILD = """
import asyncio, signal, sys, time
import strata

job, nats_url, mode = sys.argv[1:4]
if mode == "chained":
    def previous(signum, frame):
        print("previous-handler", flush=True)
        sys.exit(7)
    signal.signal(signal.SIGTERM, previous)
if mode == "aio":
    async def main():
        worker = await strata.aio.Worker(job, nats_url).start()
        worker.leave_on_sigterm()
        print("registered-as", worker.id, flush=True)
        await asyncio.Event().wait()
    asyncio.run(main())
else:
    worker = strata.Worker(job=job, nats_url=nats_url).start()
    worker.leave_on_sigterm()
    print("registered-as", worker.id, flush=True)
    while True:
        time.sleep(3600)
"""

UNTOUCHED_CHILD = """
import asyncio, signal, sys
before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
def now():
    return {s: signal.getsignal(s) for s in before}
import strata, strata.aio
assert now() == before, ("import", now())
job, nats_url = sys.argv[1:3]
worker = strata.Worker(job=job, nats_url=nats_url)
assert now() == before, ("Worker()", now())
worker.start()
assert now() == before, ("start()", now())
worker.stop()
async def main():
    in_loop = now()  # asyncio.run has its own SIGINT handler
    async with strata.aio.Worker(job, nats_url):
        assert now() == in_loop, ("aio start()", now())
    assert now() == in_loop, ("aio stop()", now())
asyncio.run(main())
assert now() == before, ("stopped", now())
print("untouched", flush=True)
"""


def run_child(script: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", script, *args],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=procutil.child_preexec,
    )


@pytest.mark.parametrize(
    ("mode", "status", "said"),
    [
        ("sync", -signal.SIGTERM, ""),
        ("aio", -signal.SIGTERM, ""),
        ("chained", 7, "previous-handler\n"),
    ],
)
def test_leave_on_sigterm_leaves_then_hands_sigterm_to_the_previous_handler(
    registry: RegistryProcess, nats_url: str, mode: str, status: int, said: str
) -> None:
    job = new_job()
    child = run_child(SIGTERM_CHILD, job, nats_url, mode)
    try:
        assert child.stdout is not None
        words = child.stdout.readline().split()
        assert words[:1] == ["registered-as"], f"{words}; exited with {child.poll()}"
        worker_id = words[1]
        with strata.Worker(job=job, nats_url=nats_url) as watcher:
            wait_until(lambda: watcher.world_size == 2, 5, "the watcher to see the child")
            child.send_signal(signal.SIGTERM)
            assert child.wait(30) == status
            assert child.stdout.read() == said
            # Left at once: the registry did not wait for the heartbeat timeout.
            info = member(watcher.members(include_gone=True), worker_id)
            assert info is not None
            assert info.status == "left"
            assert watcher.world_size == 1
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_the_library_installs_no_signal_handler_of_its_own(
    registry: RegistryProcess, nats_url: str
) -> None:
    child = run_child(UNTOUCHED_CHILD, new_job(), nats_url)
    try:
        assert child.stdout is not None
        assert child.stdout.read() == "untouched\n"
        assert child.wait(30) == 0
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()


def test_leave_on_sigterm_needs_the_main_thread_and_for_aio_a_running_loop(
    nats_url: str,
) -> None:
    before = signal.getsignal(signal.SIGTERM)
    sync_worker = strata.Worker(job=new_job(), nats_url=nats_url)
    aio_worker = strata.aio.Worker(new_job(), nats_url)
    with ThreadPoolExecutor(1) as pool:
        for install in (sync_worker.leave_on_sigterm, aio_worker.leave_on_sigterm):
            with pytest.raises(strata.ConfigError, match="main thread"):
                pool.submit(install).result()
    with pytest.raises(strata.ConfigError, match="event loop running"):
        aio_worker.leave_on_sigterm()
    assert signal.getsignal(signal.SIGTERM) == before


# -- bad input and the loop runner ----------------------------------------------------------------


def test_bad_input_is_refused_with_a_message_naming_it(nats_url: str) -> None:
    with pytest.raises(strata.ValidationError, match="bad job!") as refused:
        strata.Worker(job="bad job!", nats_url=nats_url)
    assert refused.value.field == "job"
    assert "STRATA_JOB" in refused.value.message
    with pytest.raises(strata.ValidationError, match="worker_id"):
        strata.aio.Worker(new_job(), nats_url, worker_id="a/b")
    with pytest.raises(strata.ValidationError, match="labels"):
        strata.Worker(job=new_job(), nats_url=nats_url, labels={"bad key!": "x"})
    with pytest.raises(strata.ConfigError, match="not a NATS URL"):
        strata.Worker(job=new_job(), nats_url="http://127.0.0.1:4222")

    worker = strata.Worker(job=new_job(), nats_url=nats_url)
    with pytest.raises(strata.ValidationError, match="flying") as unknown:
        worker.set_state("flying")  # type: ignore[arg-type]
    assert "training" in unknown.value.message
    with pytest.raises(strata.ValidationError, match="step"):
        worker.set_state("training", step=-1)
    assert (worker.state, worker.step) == ("idle", 0)
    worker.set_state("loading", step=3, epoch=2)  # before start(): recorded, announced later
    assert (worker.state, worker.step, worker.epoch) == ("loading", 3, 2)
    worker.stop()  # never started: nothing to do


def test_the_loop_runner_raises_what_the_coroutine_raised_and_refuses_reentry() -> None:
    runner = LoopRunner(name="test-runner")

    async def conflict() -> None:
        raise strata.ConflictError("taken")

    async def reenter() -> None:
        runner.run(asyncio.sleep(0))

    async def where() -> str:
        return threading.current_thread().name

    try:
        assert runner.run(where()) == "test-runner"
        with pytest.raises(strata.ConflictError, match="taken"):
            runner.run(conflict())
        with pytest.raises(strata.StrataError, match="event-loop thread") as reentry:
            runner.run(reenter())
        assert reentry.value.code == "loop_reentry"
        with pytest.raises(TimeoutError, match=r"within 0\.05s"):
            runner.run(asyncio.sleep(10), timeout=0.05)
    finally:
        runner.close()
    assert not runner.running
    runner.close()
