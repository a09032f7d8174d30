"""A noisy neighbour cannot hurt another job: job A floods the real services while job B works.

Job A, from a process of its own (`flood.py`), sends `members` requests to the registry and
`ping`s to the barrier as one of its workers, and `get_shards` requests for its 400,000-shard
dataset with no reply subject, in floods of 50,000 of each. Job B meanwhile registers workers,
meets at barriers, reads its shards and begins checkpoints; its latencies are measured in quiet
phases (the baseline) and flood phases, alternating in the same test, so a change in the
machine's load lands on both.
B loses nothing, A is told why it is refused (`rate_limited`, `busy`, `quota_exceeded`), the
services count what they refused and dropped on their `/metrics`, and no service's peak resident
memory passes its bound (`RSS_BOUND_MB`, stated in docs/operations.md).

A and B are in different request partitions (the NATS server's subject mapping sorts requests by
job; each service takes each partition on a connection of its own), as 7 jobs in 8 are with the
default partitions. Where the machine has the cores for it (`has_room_for_the_goal`: 8 or more,
load under a quarter of them), B's p50 and p99 are asserted against the goal itself, max(2x,
+50 ms) of the baseline. On a smaller or busier machine, where the flooding process, nats-server
and the flooded service share the same cores, the p50 is asserted against the goal with 50 ms
more and the p99 against a bound that holds on a shared 2-core machine. The figures are printed;
docs/operations.md gives them.
"""

from __future__ import annotations

import asyncio
import json
import os
import statistics
import sys
import time
import urllib.request
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
import strata
from strata.aio import DatasetRegistry as AsyncDatasetRegistry
from strata.bus import Bus, Caller, RpcClient
from strata.bus.server import NatsServer
from strata.config import Env
from strata.errors import QuotaExceeded
from strata.events.requests import (
    ArriveRequest,
    BarrierOutcome,
    BeginCheckpointRequest,
    CheckpointInfo,
    GetShardsRequest,
    Lease,
    MembersResult,
    RegisterDatasetRequest,
    RegisterRequest,
    Registration,
    ShardAssignment,
)
from strata.events.subjects import DEFAULT_RPC_PARTITIONS, rpc_partition_of

from tests.support import ServiceProcess, new_job, running_services

# A flood of thousands of requests for tens of seconds; the check tier keeps the fair queue's
# properties (tests/unit/test_admission.py) and test_rpc_admission.py.
pytestmark = [pytest.mark.nats, pytest.mark.slow]

FLOOD = Path(__file__).with_name("flood.py")
FLOOD_COUNT = 50_000
"""Requests of each kind in one flood; there are `PHASES` floods."""
PHASES = 2
BIG_DATASET_SHARDS = 400_000
BASELINE_ROUNDS = 15
MIN_ROUNDS_DURING = 5
CALL_TIMEOUT = 10.0
P50_ROOM = 0.1
"""B's p50 during a flood within max(2x, + this) of its baseline: the goal's 50 ms and as much
again for the machine's load."""
P99_ROOM = 2.5
"""B's p99 during a flood within its baseline + this: what holds on a loaded shared machine
(docs/operations.md, "Figures"); it was 1.7-5.5 s over before requests had partitions."""
GOAL_ROOM = 0.05
"""The goal: B's p50 and p99 during a flood within max(2x, + this) of its baseline."""
GOAL_CORES = 8
SERVICES = ("registry", "sharding", "barrier", "checkpoint")
RSS_BOUND_MB = {"registry": 256, "sharding": 512, "barrier": 256, "checkpoint": 256}
"""Each service's peak resident memory over the whole suite (start, A's 400,000-shard plan and
its pages, the floods): docs/operations.md states the same bounds."""


def has_room_for_the_goal(load: list[float]) -> bool:
    """Whether the goal itself is asserted: `GOAL_CORES` or more cores for this process and the
    load average under a quarter of them throughout, so that the flooding process, nats-server
    and the services each have a core."""
    cores = len(os.sched_getaffinity(0))
    return cores >= GOAL_CORES and max(load) < cores / 4


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def peak_rss_mb(service: ServiceProcess) -> float:
    """The service process's peak resident memory so far (VmHWM), in MiB."""
    assert service.proc is not None
    for line in Path(f"/proc/{service.proc.pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmHWM for {service.name}")


def metric_total(service: ServiceProcess, name: str, **labels: str) -> float:
    """The sum of a Prometheus counter's samples on a service's `/metrics` matching `labels`."""
    url = f"http://127.0.0.1:{service.health_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{"):
            continue
        if all(f'{key}="{value}"' in line for key, value in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


class JobB:
    """The quiet job: one live worker (b0) that meets at barriers, reads its shards and begins
    checkpoints, and fresh registrations, each call timed."""

    def __init__(self, bus: Bus, job: str, lease: Lease, root_uri: str) -> None:
        self.bus = bus
        self.job = job
        self.lease = lease
        self.root_uri = root_uri
        self.rpc = RpcClient(bus.nc, timeout=CALL_TIMEOUT)
        self.registered: list[str] = []
        self.barriers = 0

    async def timed_round(self) -> list[float]:
        """One registration, one barrier, one get_shards, one checkpoint begin; their latencies
        in seconds."""
        latencies = []
        worker = f"b-{uuid.uuid4().hex[:10]}"
        started = time.perf_counter()
        registration = await self.rpc.bound(Caller(self.job, worker)).call(
            "registry",
            "register",
            RegisterRequest(job=self.job, instance=f"p-{worker}", worker_id=worker),
            result=Registration,
        )
        latencies.append(time.perf_counter() - started)
        assert registration.worker_id == worker
        self.registered.append(worker)

        self.barriers += 1
        as_b0 = self.rpc.bound(Caller(self.job, "b0"))
        started = time.perf_counter()
        outcome = await as_b0.call(
            "barrier",
            "arrive",
            ArriveRequest(
                job=self.job,
                name=f"step-{self.barriers}",
                worker_id="b0",
                arrival=0,
                expected_count=1,
                timeout_s=30,
            ),
            result=BarrierOutcome,
        )
        latencies.append(time.perf_counter() - started)
        assert outcome.status == "released"

        started = time.perf_counter()
        shards = await as_b0.call(
            "sharding",
            "get_shards",
            GetShardsRequest(
                job=self.job, dataset_id="small", worker_id="b0", epoch=0, lease=self.lease
            ),
            result=ShardAssignment,
        )
        latencies.append(time.perf_counter() - started)
        assert shards.total_shards > 0

        started = time.perf_counter()
        opened = await as_b0.call(
            "checkpoint",
            "begin",
            BeginCheckpointRequest(
                job=self.job,
                worker_id="b0",
                step=self.barriers,
                epoch=0,
                root_uri=self.root_uri,
                world_size=1,
                membership_epoch=self.lease.epoch,
                instance=self.lease.instance,
                lease=self.lease,
                save_id=f"save-{self.barriers}",
            ),
            result=CheckpointInfo,
        )
        latencies.append(time.perf_counter() - started)
        assert (opened.step, opened.status) == (self.barriers, "open")
        return latencies


@pytest.fixture
async def quiet_bus(own_nats_server: NatsServer) -> AsyncIterator[Bus]:
    connected = await Bus.connect(own_nats_server.url, deadline=10)
    try:
        yield connected
    finally:
        await connected.close()


async def test_a_flooding_job_does_not_slow_another_job_down(
    own_nats_server: NatsServer,
    quiet_bus: Bus,
    workers: list[strata.aio.Worker],
    tmp_path: Path,
) -> None:
    url = own_nats_server.url
    # A heartbeat timeout longer than the test: B's one live worker must not be failed because
    # this shared machine is busy, nor its registrations (which never beat) before they are
    # counted, which would be a loss of B's for another reason than the flood.
    env = {Env.HEARTBEAT_INTERVAL: "0.5", Env.HEARTBEAT_TIMEOUT: "600"}
    with running_services(url, tmp_path / "logs", SERVICES, env=env) as services:
        by_name = {service.name: service for service in services}
        job_a = new_job("noisy")
        # B in another request partition than A's, as most jobs are (7 in 8 with the default
        # partitions): what the test measures is what a partition of its own keeps from B.
        job_b = new_job("quiet")
        while rpc_partition_of(job_b, DEFAULT_RPC_PARTITIONS) == rpc_partition_of(
            job_a, DEFAULT_RPC_PARTITIONS
        ):
            job_b = new_job("quiet")

        # Job A: one worker and a 400,000-shard dataset of its own.
        noisy = strata.aio.Worker(job_a, url, worker_id="a0")
        workers.append(noisy)
        await noisy.start()
        datasets_a = AsyncDatasetRegistry(noisy)
        await datasets_a.register_dataset(
            "huge", total_samples=BIG_DATASET_SHARDS, shard_size=1, shuffle=True, seed=1
        )
        # Its first read plans the epoch and is answered with one bounded page.
        page = await datasets_a.assignment("huge")
        assert len(page.shards) == BIG_DATASET_SHARDS  # the SDK joined every page
        # A dataset past the per-dataset quota is refused, naming the setting.
        with pytest.raises(QuotaExceeded, match="STRATA_MAX_SHARDS_PER_DATASET"):
            await noisy.bus.rpc.call(
                "sharding",
                "register_dataset",
                RegisterDatasetRequest(
                    job=job_a, dataset_id="too-big", total_samples=2_000_000, shard_size=1
                ),
            )

        # Job B: one live worker, a small dataset.
        quiet = strata.aio.Worker(job_b, url, worker_id="b0")
        workers.append(quiet)
        await quiet.start()
        await AsyncDatasetRegistry(quiet).register_dataset(
            "small", total_samples=1_000, shard_size=10, shuffle=True, seed=2
        )
        job = JobB(quiet_bus, job_b, quiet.lease, (tmp_path / "checkpoints").as_uri())
        await job.timed_round()  # warm: the epoch is planned, the connections are up

        baseline: list[list[float]] = []
        during: list[list[float]] = []
        outcomes: Counter[str] = Counter()
        load: list[float] = []
        for _ in range(PHASES):
            # A quiet phase, then a flood: alternating, so the machine's load lands on both.
            load.append(os.getloadavg()[0])
            baseline += [await job.timed_round() for _ in range(BASELINE_ROUNDS)]
            flood = await asyncio.create_subprocess_exec(
                sys.executable,
                str(FLOOD),
                url,
                job_a,
                "a0",
                "huge",
                str(FLOOD_COUNT),
                stdout=asyncio.subprocess.PIPE,
            )
            assert flood.stdout is not None
            assert (await flood.stdout.readline()).strip() == b"flooding"
            sent = asyncio.ensure_future(flood.stdout.readline())
            rounds = 0
            while not sent.done() or rounds < MIN_ROUNDS_DURING:
                during.append(await job.timed_round())
                rounds += 1
            assert (await sent).strip() == b"sent"
            load.append(os.getloadavg()[0])
            outcomes.update(json.loads(await asyncio.wait_for(flood.stdout.readline(), 60)))
            assert await asyncio.wait_for(flood.wait(), 30) == 0
        floods = PHASES * FLOOD_COUNT

        # Nothing of B's was lost: every registration is a member, every call was answered.
        members = await RpcClient(quiet_bus.nc).call(
            "registry", "members", {"job": job_b}, result=MembersResult
        )
        listed = {member.worker_id for member in members.members}
        assert set(job.registered) <= listed

        # A was told why: most of its flood refused with rate_limited (or busy), answered.
        refused = outcomes.get("rate_limited", 0) + outcomes.get("busy", 0)
        assert refused > floods, outcomes
        assert set(outcomes) <= {"ok", "rate_limited", "busy"}, outcomes
        # The services counted it: refusals, and the get_shards nobody could be answered.
        registry_refused = metric_total(by_name["registry"], "strata_rpc_refused_total")
        barrier_refused = metric_total(by_name["barrier"], "strata_rpc_refused_total")
        assert registry_refused + barrier_refused >= refused
        dropped = metric_total(
            by_name["sharding"], "strata_rpc_dropped_total", reason="no_reply_subject"
        )
        assert dropped >= floods // 100
        # No service's memory grew past its bound, A's huge plan and floods included.
        peaks = {name: peak_rss_mb(service) for name, service in by_name.items()}
        for name, peak in peaks.items():
            assert peak <= RSS_BOUND_MB[name], (name, peaks)

        per_call = ("register", "barrier", "get_shards", "checkpoint begin")
        strict = has_room_for_the_goal(load)
        report = []
        for index, name in enumerate(per_call):
            before = [round_[index] for round_ in baseline]
            under = [round_[index] for round_ in during]
            p50_0, p99_0 = statistics.median(before), percentile(before, 0.99)
            p50_1, p99_1 = statistics.median(under), percentile(under, 0.99)
            report.append(
                f"{name}: p50 {p50_0 * 1e3:.1f} -> {p50_1 * 1e3:.1f} ms, "
                f"p99 {p99_0 * 1e3:.1f} -> {p99_1 * 1e3:.1f} ms (slowest three during: "
                + ", ".join(f"{value * 1e3:.0f}" for value in sorted(under)[-3:])
                + " ms)"
            )
            # Goal: max(2x, +50 ms), asserted as it is where the machine has the cores. Else
            # B's p50 is asserted against it with 50 ms more room for a machine other suites
            # load too, and its p99 (the slowest call or two of a few dozen) with the room that
            # holds on a shared 2-core machine, where the flood's own process takes one core
            # (docs/operations.md has the figures). Every call of B's was answered within
            # CALL_TIMEOUT (a timeout in timed_round fails the test).
            if strict:
                assert p50_1 <= max(2 * p50_0, p50_0 + GOAL_ROOM), report
                assert p99_1 <= max(2 * p99_0, p99_0 + GOAL_ROOM), report
            else:
                assert p50_1 <= max(2 * p50_0, p50_0 + P50_ROOM), report
                assert p99_1 <= p99_0 + P99_ROOM, report
        print(
            f"job B under a flood ({len(baseline)} rounds quiet, {len(during)} during, in "
            f"{PHASES} alternating phases; load average {min(load):.1f}-{max(load):.1f} on "
            f"{len(os.sched_getaffinity(0))} cores, asserted against "
            f"{'the goal' if strict else 'the shared-machine bounds'}; "
            f"A's answers {dict(outcomes)}; peak RSS MiB "
            + ", ".join(f"{name} {peak:.0f}" for name, peak in peaks.items())
            + "):\n  "
            + "\n  ".join(report)
        )
        # Both workers leave while the services still answer.
        await asyncio.gather(noisy.stop(), quiet.stop())
