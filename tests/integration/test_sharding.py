"""Datasets, shards and `ShardSampler` against real registry and sharding processes and nats-server.

A worker killed with SIGKILL hands exactly its unfinished shards to the survivors within the
failure timeout; a sampler-driven epoch with a worker dying in the middle consumes every sample
exactly once; DataLoader workers get each index once; a sharding service restart keeps the plan.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import strata
from nats.aio.msg import Msg
from strata import procutil
from strata.aio import DatasetRegistry as AsyncDatasetRegistry
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.errors import EpochOutOfRange
from strata.events import (
    ShardPlanChanged,
    ShardProgress,
    decode_event,
    subjects,
)
from strata.events.models import MAX_EPOCH
from strata.events.requests import (
    GetShardsRequest,
    ProgressResult,
    RegisterDatasetRequest,
    ReportProgressRequest,
    ShardAssignment,
)
from strata.services.sharding.domain import EPOCHS_KEPT
from strata.torch import ShardSampler, within_shard_order
from torch.utils.data import DataLoader, Dataset

from tests import support
from tests.support import HEARTBEAT_INTERVAL, ServiceProcess, async_wait_until

pytestmark = pytest.mark.nats

HEARTBEAT_TIMEOUT = 3.0
"""The registry's timeout here: up to 20 in-process workers heartbeat on the test's own event
loop, which a loaded machine can hold up past the suite's usual second."""
FAILURE_MARGIN_S = 3.0
"""Beyond the heartbeat timeout: detection cadence, the re-plan, and a loaded machine."""


@dataclass
class Services:
    registry: ServiceProcess
    sharding: ServiceProcess


@pytest.fixture(scope="module")
def services(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Services]:
    log_dir = tmp_path_factory.mktemp("sharding")
    started = Services(
        *(
            ServiceProcess(
                name,
                nats_url,
                log_dir,
                heartbeat_interval=HEARTBEAT_INTERVAL,
                heartbeat_timeout=HEARTBEAT_TIMEOUT,
            )
            for name in ("registry", "sharding")
        )
    )
    started.registry.start()
    started.sharding.start()
    yield started
    started.sharding.stop()
    started.registry.stop()


@pytest.fixture
async def aio_workers() -> AsyncIterator[list[strata.aio.Worker]]:
    made: list[strata.aio.Worker] = []
    yield made
    await asyncio.gather(*(worker.stop() for worker in made))


@pytest.fixture
def workers() -> Iterator[list[strata.Worker]]:
    made: list[strata.Worker] = []
    yield made
    for worker in made:
        worker.stop()


@pytest.fixture
def children() -> Iterator[list[subprocess.Popen[str]]]:
    made: list[subprocess.Popen[str]] = []
    yield made
    for child in made:
        if child.poll() is None:
            child.kill()
        child.wait()


def spawn(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        preexec_fn=procutil.child_preexec,
    )


def said(lines: Iterator[str] | list[str]) -> list[str]:
    """What a child said on purpose: its lines starting with "@ " (logs go to stdout too)."""
    return [line[2:].strip() for line in lines if line.startswith("@ ")]


def expect_line(child: subprocess.Popen[str], wanted: str) -> None:
    assert child.stdout is not None
    for line in child.stdout:
        if said([line]) == [wanted]:
            return
    pytest.fail(f"child ended (exit {child.wait()}) without saying {wanted!r}")


def shard_ids(assignment: ShardAssignment) -> list[int]:
    return [span.shard_id for span in assignment.shards]


# -- round trips ----------------------------------------------------------------------------------


def test_register_get_report_round_trip(
    services: Services, nats_url: str, workers: list[strata.Worker]
) -> None:
    job = support.new_job("shard")
    worker = strata.Worker(job, nats_url, worker_id="w0").start()
    workers.append(worker)
    other = strata.Worker(job, nats_url, worker_id="w1").start()
    workers.append(other)
    reg = strata.DatasetRegistry(worker)

    info = reg.register_dataset("ds", total_samples=1005, shard_size=10, shuffle=True, seed=4)
    assert (info.num_shards, info.created) == (101, True)
    again = reg.register_dataset("ds", total_samples=1005, shard_size=10, shuffle=True, seed=4)
    assert again.created is False
    with pytest.raises(strata.ConflictError, match="already registered"):
        reg.register_dataset("ds", total_samples=1005, shard_size=20, shuffle=True, seed=4)

    shards = reg.get_shard_for_worker("ds", epoch=0)
    theirs = reg.get_shard_for_worker("ds", "w1", epoch=0)
    assert {r.shard_id for r in shards}.isdisjoint(r.shard_id for r in theirs)
    assert sorted(i for r in shards + theirs for i in range(r.start, r.end)) == list(range(1005))
    assert abs(len(shards) - len(theirs)) <= 1

    first, second = shards[0], shards[1]
    result = reg.report_progress("ds", 0, completed=[first.shard_id], partial={second.shard_id: 3})
    assert (result.done_shards, result.total_shards) == (1, 101)
    left = reg.get_shard_for_worker("ds", epoch=0)
    assert left[0] == (second.shard_id, second.start + 3, second.end)
    assert first.shard_id not in {r.shard_id for r in left}
    full = reg.assignment("ds", epoch=0)
    assert [s.done for s in full.shards][:2] == [True, False]
    assert full.shards[1].offset == 3
    with pytest.raises(strata.ConflictError, match="fetch this worker's shards again"):
        reg.report_progress("ds", 0, completed=[theirs[0].shard_id])
    summary = reg.plan("ds", 0)
    assert summary.loads == {"w0": len(shards), "w1": len(theirs)}
    assert summary.done_shards == 1


def test_arguments_are_checked_before_any_call(nats_url: str) -> None:
    # Never started: any network call would raise WorkerNotStarted instead.
    reg = strata.DatasetRegistry(strata.Worker(support.new_job("shard"), nats_url))
    bad_calls = [
        lambda: reg.register_dataset("no spaces", 10, 1),
        lambda: reg.register_dataset("ds", 0, 1),
        lambda: reg.register_dataset("ds", 10, 0),
        lambda: reg.register_dataset("ds", 10, 1.5),  # type: ignore[arg-type]
        lambda: reg.register_dataset("ds", 10**9, 1),
        lambda: reg.register_dataset("ds", 10, 1, shuffle="yes"),  # type: ignore[arg-type]
        lambda: reg.register_dataset("ds", 10, 1, seed=-1),
        lambda: reg.get_shard_for_worker("ds", "bad id!"),
        lambda: reg.get_shard_for_worker("ds", epoch=-1),
        lambda: reg.report_progress("ds", 0, completed=[-1]),
        lambda: reg.report_progress("ds", 0, completed="12"),
        lambda: reg.report_progress("ds", 0, partial={1: -3}),
    ]
    for call in bad_calls:
        with pytest.raises(strata.ValidationError):
            call()


# -- failures -------------------------------------------------------------------------------------

HOLDER = """
import sys
import strata
job, url, dataset = sys.argv[1:4]
worker = strata.Worker(job, url, worker_id="victim").start()
reg = strata.DatasetRegistry(worker)
mine = reg.assignment(dataset, epoch=0).shards
done = [s.shard_id for s in mine[:3]]
reg.report_progress(dataset, 0, completed=done, partial={mine[3].shard_id: 4})
print("@ ready", flush=True)
sys.stdin.readline()
"""


async def test_a_killed_workers_unfinished_shards_go_to_survivors_and_nothing_else_moves(
    services: Services,
    nats_url: str,
    aio_workers: list[strata.aio.Worker],
    children: list[subprocess.Popen[str]],
) -> None:
    job = support.new_job("shard")
    survivors = [strata.aio.Worker(job, nats_url, worker_id=f"w{i:02d}") for i in range(19)]
    aio_workers.extend(survivors)
    await asyncio.gather(*(w.start() for w in survivors))
    reg = AsyncDatasetRegistry(survivors[0])
    await reg.register_dataset("ds", total_samples=10_000, shard_size=10, seed=11)
    victim = spawn(HOLDER, job, nats_url, "ds")
    children.append(victim)
    await asyncio.to_thread(expect_line, victim, "ready")
    # Some shards of every survivor are done too: done shards must never move.
    for worker in survivors:
        own = AsyncDatasetRegistry(worker)
        mine = await own.assignment("ds", epoch=0)
        await own.report_progress("ds", 0, completed=shard_ids(mine)[:5])
    before = {w.id: await reg.assignment("ds", w.id, 0) for w in survivors}
    victims = await reg.assignment("ds", "victim", 0)
    assert victims.world_size == 20
    assert {len(a.shards) for a in [*before.values(), victims]} == {50}

    changes: list[ShardPlanChanged] = []

    async def on_event(msg: Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, ShardPlanChanged):
            changes.append(event)

    subject = subjects.event_subject(job, "shard.plan_changed")
    await survivors[0].bus.nc.subscribe(subject, cb=on_event)
    await survivors[0].bus.nc.flush()

    victim.kill()
    killed_at = time.monotonic()

    async def replanned() -> bool:
        return "victim" not in (await reg.plan("ds", 0)).loads

    await async_wait_until(replanned, HEARTBEAT_TIMEOUT + FAILURE_MARGIN_S, "the re-plan")
    took = time.monotonic() - killed_at

    after = {w.id: await reg.assignment("ds", w.id, 0) for w in survivors}
    unfinished = {s.shard_id: s for s in victims.shards if not s.done}
    assert len(unfinished) == 47
    gained: dict[int, str] = {}
    for worker, now in after.items():
        kept = [s for s in now.shards if s.shard_id in set(shard_ids(before[worker]))]
        assert kept == before[worker].shards, f"{worker}'s own shards changed"
        for span in now.shards:
            if span.shard_id not in set(shard_ids(before[worker])):
                assert span.shard_id not in gained, "a shard went to two survivors"
                gained[span.shard_id] = worker
                assert (span.done, span.offset) == (False, unfinished[span.shard_id].offset)
    assert set(gained) == set(unfinished), "exactly the victim's unfinished shards moved"
    assert unfinished[victims.shards[3].shard_id].offset == 4  # its partial offset went along
    open_loads = [sum(not s.done for s in a.shards) for a in after.values()]
    assert max(open_loads) - min(open_loads) <= 1
    summary = await reg.plan("ds", 0)
    assert summary.done_shards == 3 + 19 * 5  # the victim's done shards stay done
    await async_wait_until(lambda: _true(bool(changes)), 5, "the plan_changed event")
    assert changes[-1].moved_shards == 47
    assert "victim" not in changes[-1].members
    print(f"\nfailure to re-plan: {took:.2f}s (heartbeat timeout {HEARTBEAT_TIMEOUT}s)")


async def _true(value: bool) -> bool:
    return value


# -- sampler-driven epochs ------------------------------------------------------------------------

READER = """
import os, signal, sys
import strata
from strata.torch import ShardSampler
job, url, dataset, flush_at, die_at = sys.argv[1:6]
worker = strata.Worker(job, url, worker_id="victim").start()
sampler = ShardSampler(strata.DatasetRegistry(worker), dataset, shuffle_within_shard=True, seed=3)
print("@ ready", flush=True)
sys.stdin.readline()
for n, index in enumerate(sampler, 1):
    print("@", index, flush=True)
    if n == int(flush_at):
        sampler.flush()
        print("@ flushed", flush=True)
    if n == int(die_at):
        os.kill(os.getpid(), signal.SIGKILL)
"""


def test_a_sampler_epoch_with_a_worker_dying_midway_consumes_every_sample_exactly_once(
    services: Services,
    nats_url: str,
    workers: list[strata.Worker],
    children: list[subprocess.Popen[str]],
) -> None:
    """Consumed, exactly: by a survivor, every sample its sampler yielded (it reports every
    shard it reads to the end); by the dead worker, the samples of the shards it reported done
    plus the first `offset` samples of the shard whose offset it reported (its first 245)."""
    job = support.new_job("shard")
    survivors = [strata.Worker(job, nats_url, worker_id=w).start() for w in ("a", "b")]
    workers.extend(survivors)
    strata.DatasetRegistry(survivors[0]).register_dataset("ds", 2000, 20, seed=5)
    progress: list[ShardProgress] = []

    async def on_progress(msg: Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, ShardProgress):
            progress.append(event)

    subject = subjects.event_subject(job, "shard.progress")
    watcher = survivors[0]
    watcher.runner.run(watcher.aio.bus.nc.subscribe(subject, cb=on_progress))
    watcher.runner.run(watcher.aio.bus.nc.flush())

    victim = spawn(READER, job, nats_url, "ds", "245", "250")
    children.append(victim)
    expect_line(victim, "ready")
    samplers = {
        w.id: ShardSampler(strata.DatasetRegistry(w), "ds", shuffle_within_shard=True, seed=3)
        for w in survivors
    }
    consumed: dict[str, list[int]] = {w.id: [] for w in survivors}
    errors: list[BaseException] = []

    def drain(worker_id: str) -> None:
        try:
            sampler = samplers[worker_id]
            while True:
                consumed[worker_id].extend(sampler)
                if not sampler.wait_for_more(timeout=HEARTBEAT_TIMEOUT + 15):
                    return
        except BaseException as exc:
            errors.append(exc)

    assert victim.stdin is not None
    victim.stdin.write("go\n")
    victim.stdin.flush()
    threads = [threading.Thread(target=drain, args=(w.id,)) for w in survivors]
    for thread in threads:
        thread.start()
    assert victim.stdout is not None
    lines = said(victim.stdout.read().splitlines())
    assert victim.wait(10) == -9
    for thread in threads:
        thread.join(30)
    assert not errors, errors
    assert lines.index("flushed") == 245
    victim_consumed = [int(line) for line in lines[:245]]
    assert len(lines) == 251  # it read 5 more samples, which were never reported

    everything = victim_consumed + consumed["a"] + consumed["b"]
    assert len(everything) == 2000
    assert sorted(everything) == list(range(2000))
    summary = strata.DatasetRegistry(survivors[0]).plan("ds", 0)
    assert (summary.done_shards, summary.total_shards) == (100, 100)

    # The reports say the same: 12 whole shards and 5 samples of a 13th by the victim, each
    # shard completed by exactly one worker.
    completed = [(e.worker_id, s) for e in progress for s in e.completed]
    assert sorted(s for _, s in completed) == list(range(100))
    victim_done = [s for w, s in completed if w == "victim"]
    partial = [
        (p.shard_id, p.offset) for e in progress if e.worker_id == "victim" for p in e.partial
    ]
    assert len(victim_done) == 12
    assert [offset for _, offset in partial] == [5]
    spec_order = {
        s: within_shard_order(s * 20, s * 20 + 20, shuffle=True, seed=3, epoch=0, shard_id=s)
        for s in [*victim_done, partial[0][0]]
    }
    reported = [i for s in victim_done for i in spec_order[s]] + spec_order[partial[0][0]][:5]
    assert sorted(reported) == sorted(victim_consumed)


class IndexAndProcess(Dataset[tuple[int, int]]):
    """Sample `i` is `(i, pid of the process that loaded it)`."""

    def __len__(self) -> int:
        return 600

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, os.getpid()


def test_a_dataloader_with_two_worker_processes_gets_each_index_of_the_shards_once(
    services: Services, nats_url: str, workers: list[strata.Worker]
) -> None:
    job = support.new_job("shard")
    worker = strata.Worker(job, nats_url, worker_id="w0").start()
    workers.append(worker)
    workers.append(strata.Worker(job, nats_url, worker_id="w1").start())
    reg = strata.DatasetRegistry(worker)
    reg.register_dataset("ds", 600, 25, seed=1)
    sampler = ShardSampler(reg, "ds", shuffle_within_shard=True)
    mine = [i for r in reg.get_shard_for_worker("ds") for i in range(r.start, r.end)]
    loader = DataLoader(IndexAndProcess(), sampler=sampler, batch_size=8, num_workers=2)
    got: list[int] = []
    loaded_by: set[int] = set()
    for indices, pids in loader:
        got.extend(indices.tolist())
        loaded_by.update(pids.tolist())
    assert len(got) == len(mine) == 300
    assert sorted(got) == sorted(mine)
    assert len(loaded_by) == 2
    assert os.getpid() not in loaded_by
    assert reg.get_shard_for_worker("ds") == []
    assert reg.plan("ds").done_shards == 12


# -- the service restarts -------------------------------------------------------------------------


def test_a_sharding_service_restart_keeps_the_plan_and_the_progress(
    services: Services, nats_url: str, workers: list[strata.Worker]
) -> None:
    job = support.new_job("shard")
    started = [strata.Worker(job, nats_url, worker_id=f"w{i}").start() for i in range(3)]
    workers.extend(started)
    regs = [strata.DatasetRegistry(w) for w in started]
    regs[0].register_dataset("ds", 5000, 50, seed=8)
    for reg in regs:
        mine = reg.assignment("ds", epoch=2)
        reg.report_progress(
            "ds", 2, completed=shard_ids(mine)[:4], partial={mine.shards[4].shard_id: 7}
        )
    before = [reg.assignment("ds", epoch=2) for reg in regs]

    services.sharding.kill()
    services.sharding.start()

    after = [reg.assignment("ds", epoch=2) for reg in regs]
    assert after == before
    assert regs[0].plan("ds", 2).done_shards == 12


# -- what a worker can make the service keep ------------------------------------------------------


def test_epochs_are_planned_in_order_and_only_the_newest_plans_are_kept(
    services: Services, nats_url: str, workers: list[strata.Worker]
) -> None:
    job = support.new_job("shard")
    worker = strata.Worker(job, nats_url, worker_id="w0").start()
    workers.append(worker)
    reg = strata.DatasetRegistry(worker)
    reg.register_dataset("ds", total_samples=100, shard_size=10, seed=1)
    for epoch in range(8):
        reg.assignment("ds", epoch=epoch)
    oldest = 8 - EPOCHS_KEPT

    with pytest.raises(EpochOutOfRange, match="the next is 8") as far:
        reg.assignment("ds", epoch=MAX_EPOCH)
    assert far.value.code == "epoch_out_of_range"
    with pytest.raises(EpochOutOfRange, match=rf"no longer planned.*\({oldest}\.\.7\)"):
        reg.assignment("ds", epoch=0)
    with pytest.raises(EpochOutOfRange):
        reg.plan("ds", 0)
    assert reg.plan("ds", oldest).total_shards == 10

    # Going back to an epoch whose plan was dropped is a restore, and the job goes on from there.
    reg.restore_progress("ds", 0, checkpoint_step=50, completed=[0, 1])
    assert reg.plan("ds", 0).done_shards == 2
    assert len(reg.assignment("ds", epoch=1).shards) == 10

    # A restarted service rebuilds the same window.
    services.sharding.kill()
    services.sharding.start()
    with pytest.raises(EpochOutOfRange, match="the next is 2"):
        reg.assignment("ds", epoch=3)
    assert reg.plan("ds", 0).done_shards == 2
    assert len(reg.assignment("ds", epoch=2).shards) == 10


# -- a burst (group commit) -----------------------------------------------------------------------

BURST = 200


async def test_a_burst_of_workers_asking_at_once_is_planned_once_and_covers_every_shard(
    own_nats_server: NatsServer, tmp_path: Path
) -> None:
    # The sharding service alone, with registrations written as the registry writes them: no
    # registry fails these heartbeat-less workers in the middle of the burst.
    sharding = ServiceProcess("sharding", own_nats_server.url, tmp_path / "logs").start()
    bus = await Bus.connect(own_nats_server.url, deadline=10)
    try:
        job = support.new_job("burst")
        workers = [f"w{i:03d}" for i in range(BURST)]
        await support.record_registrations(bus, job, workers)
        dataset = RegisterDatasetRequest(
            job=job, dataset_id="ds", total_samples=BURST * 3 * 10, shard_size=10, seed=3
        )
        await bus.rpc.call("sharding", "register_dataset", dataset, timeout=30)

        assignments = await asyncio.gather(
            *(
                bus.rpc.call(
                    "sharding",
                    "get_shards",
                    GetShardsRequest(
                        job=job,
                        dataset_id="ds",
                        worker_id=worker,
                        epoch=0,
                        lease=support.recorded_lease(workers, worker),
                    ),
                    result=ShardAssignment,
                    timeout=60,
                )
                for worker in workers
            )
        )
        # Every shard to exactly one worker, all from the one plan.
        assert sorted(s for a in assignments for s in shard_ids(a)) == list(range(BURST * 3))
        assert {a.plan_version for a in assignments} == {0}
        assert [len(a.shards) for a in assignments] == [3] * BURST

        results = await asyncio.gather(
            *(
                bus.rpc.call(
                    "sharding",
                    "report_progress",
                    ReportProgressRequest(
                        job=job,
                        dataset_id="ds",
                        epoch=0,
                        worker_id=a.worker_id,
                        completed=shard_ids(a),
                        lease=support.recorded_lease(workers, a.worker_id),
                    ),
                    result=ProgressResult,
                    timeout=60,
                )
                for a in assignments
            )
        )
        # Each answer is given once its report is stored and folded: at least its own shards.
        assert all(r.done_shards >= 3 for r in results)
        assert max(r.done_shards for r in results) == BURST * 3

        events = await support.job_events(bus, job)
        plans = [e for e in events if isinstance(e, ShardPlanChanged)]
        progress = [e for e in events if isinstance(e, ShardProgress)]
        assert [(p.epoch, p.plan_version, len(p.members)) for p in plans] == [(0, 0, BURST)]
        assert sorted(s for p in progress for s in p.completed) == list(range(BURST * 3))
    finally:
        await bus.close()
        sharding.stop()
