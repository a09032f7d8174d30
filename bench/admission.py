"""What admission control costs a job on the normal path: the same requests to the same services
with and without it.

Two stacks (registry, sharding, barrier) run side by side, each on a nats-server of its own: one
with the defaults (admission on), the baseline with `STRATA_RPC_ADMISSION=false` (requests taken
as they come, one FIFO, no budgets). Rounds alternate between them; each round times, as workers
of a job (subjects naming their caller, so every request is charged to a budget):

- register: bursts of registrations of new workers at once (a job start), their wall time;
- arrive: `--calls` barrier arrivals one after another (each releases at once), median latency;
- get_shards: `--calls` shard reads one after another, median latency.

Within a round the two stacks take turns in slices of each operation, so a change in this
shared machine's load lands on both alike. Heartbeats are not requests (they never pass admission
control) and are not measured. The figure is each operation's ratio with / without, its median
over the rounds and its spread.

On a loaded machine those ratios spread wider than the few percent they are meant to show, so the
run ends with what admission control itself does per request, measured alone: the CPU time of
charging the budgets of a job's 1,000 workers, queueing, taking the next request round robin,
and counting it in flight, against the same loop without them (alternating rounds, median and
spread), which is the bound of its cost on any call.

With `--against unpartitioned` the baseline keeps admission control on and runs on a nats-server
without the request partitions' subject mapping: every request then comes to one connection per
service through nats-py's subscription, as before partitions; the ratio is what a partition's
connection and the request intake (`strata.bus.intake`) cost the normal path.

    python bench/admission.py [--rounds 5] [--burst 600] [--calls 300] [--slices 6] [--check]
                              [--against off|unpartitioned]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path

from strata.admission import Admission, AdmissionLimits, FairQueue
from strata.bus import Bus, Caller, RpcClient
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import subjects
from strata.events.requests import (
    ArriveRequest,
    BarrierOutcome,
    GetShardsRequest,
    Lease,
    RegisterDatasetRequest,
    RegisterRequest,
    Registration,
    ShardAssignment,
)
from strata.metrics import RPC_QUEUED

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, or with -m
from bench.barrier import ServiceProcess

SERVICES = ("registry", "sharding", "barrier")
CHECK_RATIO = 1.05
TIMEOUT = 30.0


class Stack:
    """A nats-server and the services on it, with or without admission control."""

    def __init__(self, label: str, base: Path, admission: bool, partitioned: bool = True) -> None:
        self.label = label
        self.server = NatsServer(
            store_dir=base / label / "nats",
            rpc_partitions=subjects.DEFAULT_RPC_PARTITIONS if partitioned else None,
        )
        self.services: list[ServiceProcess] = []
        self.admission = admission
        self.base = base / label
        self.bus: Bus | None = None
        self.job = f"bench-{uuid.uuid4().hex[:6]}"
        self.barriers = 0
        self.lease: Lease | None = None

    async def start(self) -> None:
        self.server.start()
        (self.base / "logs").mkdir(parents=True, exist_ok=True)
        for name in SERVICES:
            service = ServiceProcess(name, self.server.url, self.base / "logs")
            service.env[Env.RPC_ADMISSION] = "true" if self.admission else "false"
            service.start()
            self.services.append(service)
        self.bus = await Bus.connect(self.server.url, deadline=30)
        rpc = self.rpc("b0")
        registration = await rpc.call(
            "registry",
            "register",
            RegisterRequest(job=self.job, instance="p-b0", worker_id="b0"),
            result=Registration,
            retry_for=TIMEOUT,
        )
        # Shard reads carry the registration as their lease, as the SDK's do.
        self.lease = Lease(worker_id="b0", instance="p-b0", epoch=registration.lease_epoch)
        await rpc.call(
            "sharding",
            "register_dataset",
            RegisterDatasetRequest(
                job=self.job, dataset_id="data", total_samples=100_000, shard_size=100
            ),
            retry_for=TIMEOUT,
        )

    def rpc(self, worker: str, job: str | None = None) -> RpcClient:
        assert self.bus is not None
        return RpcClient(self.bus.nc, timeout=TIMEOUT, caller=Caller(job or self.job, worker))

    async def register_burst(self, count: int) -> float:
        """Seconds for `count` new workers of a fresh job to register at once."""
        job = f"burst-{uuid.uuid4().hex[:6]}"

        async def one(i: int) -> None:
            worker = f"w{i:05d}"
            await self.rpc(worker, job).call(
                "registry",
                "register",
                RegisterRequest(job=job, instance=f"p-{worker}", worker_id=worker),
                result=Registration,
            )

        started = time.perf_counter()
        await asyncio.gather(*(one(i) for i in range(count)))
        return time.perf_counter() - started

    async def arrive(self) -> None:
        self.barriers += 1
        outcome = await self.rpc("b0").call(
            "barrier",
            "arrive",
            ArriveRequest(
                job=self.job,
                name=f"step-{self.barriers}",
                worker_id="b0",
                arrival=0,
                expected_count=1,
            ),
            result=BarrierOutcome,
        )
        assert outcome.status == "released", outcome

    async def get_shards(self) -> None:
        await self.rpc("b0").call(
            "sharding",
            "get_shards",
            GetShardsRequest(
                job=self.job, dataset_id="data", worker_id="b0", epoch=0, lease=self.lease
            ),
            result=ShardAssignment,
        )

    async def stop(self) -> None:
        if self.bus is not None:
            await self.bus.close()
        for service in self.services:
            service.stop()
        self.server.stop()


async def latencies(call: Callable[[], Awaitable[None]], count: int) -> list[float]:
    taken = []
    for _ in range(count):
        started = time.perf_counter()
        await call()
        taken.append(time.perf_counter() - started)
    return taken


async def one_round(
    stacks: tuple[Stack, Stack], burst: int, calls: int, slices: int
) -> dict[str, tuple[float, float]]:
    """Each operation's figure (with, without) in one round. The two stacks take turns in
    `slices` slices of each operation, so a change in the machine's load lands on both alike."""
    bursts: dict[str, float] = {stack.label: 0.0 for stack in stacks}
    arrive: dict[str, list[float]] = {stack.label: [] for stack in stacks}
    shards: dict[str, list[float]] = {stack.label: [] for stack in stacks}
    for index in range(slices):
        order = stacks if index % 2 == 0 else stacks[::-1]
        for stack in order:
            bursts[stack.label] += await stack.register_burst(burst // slices)
        for stack in order:
            arrive[stack.label] += await latencies(stack.arrive, calls // slices)
        for stack in order:
            shards[stack.label] += await latencies(stack.get_shards, calls // slices)
    on, off = (stack.label for stack in stacks)
    return {
        "register": (bursts[on], bursts[off]),
        "arrive": (statistics.median(arrive[on]), statistics.median(arrive[off])),
        "get_shards": (statistics.median(shards[on]), statistics.median(shards[off])),
    }


def bookkeeping_cost(requests: int = 200_000, rounds: int = 7) -> list[float]:
    """Microseconds of CPU that admission control adds to one request (`RpcServer`'s sorting and
    starting of it, without NATS), one figure per round."""
    # Budgets that never run out: every request takes the path of one admitted.
    limits = AdmissionLimits(job_rate=1e12, job_burst=10**12, worker_rate=1e12, worker_burst=10**12)
    admission = Admission("registry", limits)
    queue: FairQueue[str, tuple[int, str]] = FairQueue(limits.job_pending, limits.max_pending)
    queued = RPC_QUEUED.labels("bench")
    inflight: Counter[str] = Counter()
    workers = [f"w{i:04d}" for i in range(1000)]

    def admitted() -> None:
        for i in range(requests):
            worker = workers[i % len(workers)]
            now = time.monotonic()
            assert admission.admit("job", worker, now) is None
            queue.push("job", (i, worker))
            popped = queue.pop(lambda job: inflight[job] < limits.job_inflight)
            assert popped is not None
            inflight[popped[0]] += 1
            queued.set(len(queue))
            inflight[popped[0]] -= 1

    def bare() -> None:
        for i in range(requests):
            worker = workers[i % len(workers)]
            time.monotonic()
            assert worker

    added = []
    for round_ in range(rounds):
        took = {}
        for name, loop in (("with", admitted), ("without", bare))[:: 1 if round_ % 2 else -1]:
            started = time.process_time()
            loop()
            took[name] = (time.process_time() - started) / requests * 1e6
        added.append(took["with"] - took["without"])
    return added


async def main(
    rounds: int, burst: int, calls: int, slices: int, check: bool, against: str = "off"
) -> int:
    with tempfile.TemporaryDirectory(prefix="strata-bench-admission-") as tmp:
        base = Path(tmp)
        with_it = Stack("admission", base, True)
        if against == "unpartitioned":
            without = Stack("unpartitioned", base, True, partitioned=False)
        else:
            without = Stack("baseline", base, False)
        try:
            await with_it.start()
            await without.start()
            # Warm: connections, plans, code paths.
            await one_round((with_it, without), burst // 5, calls // 5, 1)
            figures: dict[str, list[tuple[float, float]]] = {}
            for round_ in range(rounds):
                got = await one_round((with_it, without), burst, calls, slices)
                for op, pair in got.items():
                    figures.setdefault(op, []).append(pair)
                print(f"round {round_ + 1}/{rounds} done", flush=True)
        finally:
            await with_it.stop()
            await without.stop()
    compared = "partitioned / unpartitioned" if against == "unpartitioned" else "admission on / off"
    print(f"\n{compared}, {rounds} rounds of {slices} alternating slices")
    print(f"{'operation':<12} {'with':>10} {'without':>10} {'ratio':>7}  spread")
    worst = 0.0
    for op, pairs in figures.items():
        ratios = [a / b for a, b in pairs]
        ratio = statistics.median(ratios)
        worst = max(worst, ratio)
        # The burst's wall time in s; the others' median latency in ms.
        scale = 1.0 if op == "register" else 1e3
        with_value = statistics.median(a for a, _ in pairs) * scale
        without_value = statistics.median(b for _, b in pairs) * scale
        print(
            f"{op:<12} {with_value:>10.3f} {without_value:>10.3f} {ratio:>7.3f}  "
            f"[{min(ratios):.3f}, {max(ratios):.3f}]"
        )
    print(
        f"(register: {burst} per round, {burst // slices} at once, wall time in s; "
        f"arrive, get_shards: {calls} per round in a row, p50 in ms)"
    )
    added = bookkeeping_cost()
    median_call_ms = min(
        statistics.median(a for a, _ in figures[op]) * 1e3 for op in ("arrive", "get_shards")
    )
    print(
        f"admission control's own work: {statistics.median(added):.2f} us of CPU per request "
        f"[{min(added):.2f}, {max(added):.2f}] over {len(added)} alternating rounds, "
        f"{statistics.median(added) / (median_call_ms * 1e3):.2%} of the quickest call's "
        f"{median_call_ms:.2f} ms (load average {os.getloadavg()[0]:.1f})"
    )
    if check and worst > CHECK_RATIO:
        print(f"FAIL: a ratio of {worst:.3f} is over {CHECK_RATIO}")
        return 1
    return 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--burst", type=int, default=600, help="registrations per round")
    parser.add_argument("--calls", type=int, default=300, help="arrivals and shard reads")
    parser.add_argument("--slices", type=int, default=6, help="alternations per round")
    parser.add_argument("--check", action="store_true", help=f"exit 1 over {CHECK_RATIO}")
    parser.add_argument(
        "--against",
        choices=("off", "unpartitioned"),
        default="off",
        help="the baseline: admission control off, or on without request partitions",
    )
    args = parser.parse_args()
    sys.exit(
        asyncio.run(
            main(args.rounds, args.burst, args.calls, args.slices, args.check, args.against)
        )
    )
