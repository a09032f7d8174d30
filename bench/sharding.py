"""Shard plans: Strata's planner next to a plain consistent-hash ring with 150 virtual nodes.

Both sides plan the same shards over the same workers in the same process: plan time, balance of
shards per worker (max/mean, std/mean), the time to re-plan after one join or leave, and the
fraction of shards that move when one worker joins a hundred. Repetitions alternate the two sides
and each time is the median of its repetitions, so a noisy machine slows both alike.

`--part burst` measures the sharding service itself (`bench.burst`): N workers asking for their
epoch's shards at once, then reporting them all done at once, against a sharding service that
decides one request at a time, in the same run.
"""

from __future__ import annotations

import argparse
import asyncio
import bisect
import contextlib
import functools
import gc
import hashlib
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from strata.bus import Bus
from strata.events.requests import (
    GetShardsRequest,
    PlanRequest,
    PlanSummary,
    ProgressResult,
    RegisterDatasetRequest,
    ReportProgressRequest,
    ShardAssignment,
)
from strata.sharding import DatasetSpec, initial_plan, replan

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.burst import (
    VARIANTS,
    Row,
    Variant,
    register_workers,
    registered_lease,
    render_rows,
    round_order,
    service_stack,
    timed_burst,
)

VNODES = 150
AIM_PLAN_MS = 50.0
AIM_MAX_OVER_MEAN = 1.05
AIM_MOVED = 0.015
ORIGINAL_CLAIMS = "92 ms plan, std 4.2%, 0.98% moved (its real ring: ~70% std at 1,000 workers)"


# -- the baseline ---------------------------------------------------------------------------------


def _point(key: str) -> int:
    return int.from_bytes(hashlib.md5(key.encode()).digest()[:8], "big")


class HashRing:
    """A plain consistent-hash ring: `vnodes` points per worker; a shard goes to the first point
    clockwise of its own hash."""

    def __init__(self, workers: Sequence[str], vnodes: int = VNODES) -> None:
        points = sorted(
            (_point(f"{worker}#{i}"), worker) for worker in workers for i in range(vnodes)
        )
        self._keys = [key for key, _ in points]
        self._owners = [worker for _, worker in points]

    def owner(self, key: str) -> str:
        return self._owners[bisect.bisect(self._keys, _point(key)) % len(self._keys)]


def ring_plan(workers: Sequence[str], num_shards: int) -> list[str]:
    ring = HashRing(workers)
    return [ring.owner(f"shard-{shard}") for shard in range(num_shards)]


# -- the two sides --------------------------------------------------------------------------------


def workers_named(count: int, prefix: str = "worker") -> list[str]:
    return [f"{prefix}-{i:05d}" for i in range(count)]


def spec_for(num_shards: int) -> DatasetSpec:
    return DatasetSpec(
        "bench", total_samples=num_shards * 100, shard_size=100, shuffle=True, seed=7
    )


def strata_loads(workers: Sequence[str], num_shards: int) -> list[int]:
    return list(initial_plan(spec_for(num_shards), 0, workers).loads().values())


def ring_loads(workers: Sequence[str], num_shards: int) -> list[int]:
    counts = Counter(ring_plan(workers, num_shards))
    return [counts.get(worker, 0) for worker in workers]


def balance(loads: Sequence[int]) -> tuple[float, float]:
    mean = statistics.fmean(loads)
    return max(loads) / mean, statistics.pstdev(loads) / mean


def strata_moved(workers: Sequence[str], num_shards: int, joiner: str) -> float:
    _, moved = replan(initial_plan(spec_for(num_shards), 0, workers), [*workers, joiner])
    return moved / num_shards


def ring_moved(workers: Sequence[str], num_shards: int, joiner: str) -> float:
    before, after = ring_plan(workers, num_shards), ring_plan([*workers, joiner], num_shards)
    return sum(a != b for a, b in zip(before, after, strict=True)) / num_shards


# -- timing ---------------------------------------------------------------------------------------


@dataclass
class Timed:
    label: str
    run: Callable[[], object]
    seconds: list[float] = field(default_factory=list)

    def once(self) -> None:
        # A collection set off by the other side's garbage must not be billed to this one.
        gc.collect()
        started = time.perf_counter()
        self.run()
        self.seconds.append(time.perf_counter() - started)

    @property
    def median_ms(self) -> float:
        return statistics.median(self.seconds) * 1e3


@dataclass
class Pair:
    scenario: str
    strata: Timed
    ring: Timed
    aim_ms: float | None = None


def timing_pairs(args: argparse.Namespace) -> list[Pair]:
    small, large = workers_named(args.small_workers), workers_named(args.large_workers)
    small_spec, large_spec = spec_for(args.small_shards), spec_for(args.large_shards)
    large_plan = initial_plan(large_spec, 0, large)
    joined, left = [*large, "worker-joiner"], large[:-1]

    def pair(scenario: str, strata: Callable[[], object], ring: Callable[[], object]) -> Pair:
        return Pair(scenario, Timed("strata", strata), Timed("ring", ring))

    small_name = f"{len(small):,} workers x {args.small_shards:,} shards"
    large_name = f"{len(large):,} workers x {args.large_shards:,} shards"
    pairs = [
        pair(
            f"plan {small_name}",
            lambda: initial_plan(small_spec, 0, small),
            lambda: ring_plan(small, args.small_shards),
        ),
        pair(
            f"plan {large_name}",
            lambda: initial_plan(large_spec, 0, large),
            lambda: ring_plan(large, args.large_shards),
        ),
        # A plain ring has no incremental step: it maps every shard again.
        pair(
            f"re-plan {large_name}, 1 joins",
            lambda: replan(large_plan, joined),
            lambda: ring_plan(joined, args.large_shards),
        ),
        pair(
            f"re-plan {large_name}, 1 leaves",
            lambda: replan(large_plan, left),
            lambda: ring_plan(left, args.large_shards),
        ),
    ]
    pairs[1].aim_ms = AIM_PLAN_MS
    return pairs


def measure_times(pairs: list[Pair], reps: int) -> None:
    for pair in pairs:  # warm-up: imports, caches, first allocations
        pair.strata.run()
        pair.ring.run()
    for rep in range(reps):
        for pair in pairs:
            sides = (pair.strata, pair.ring) if rep % 2 == 0 else (pair.ring, pair.strata)
            for side in sides:
                side.once()


# -- report ---------------------------------------------------------------------------------------


def verdict(ok: bool) -> str:
    return "ok" if ok else "MISSED"


def render(rows: list[list[str]]) -> str:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    lines = []
    for n, row in enumerate(rows):
        cells = [
            cell.ljust(width) if i == 0 or i == len(row) - 1 else cell.rjust(width)
            for i, (cell, width) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
        if n == 0:
            lines.append("  ".join("-" * width for width in widths))
    return "\n".join(lines)


def cores() -> int:
    affinity: Any = getattr(os, "sched_getaffinity", None)
    return len(affinity(0)) if affinity is not None else os.cpu_count() or 1


def run(args: argparse.Namespace) -> bool:
    print(
        f"shard plans: strata vs a plain consistent-hash ring ({VNODES} virtual nodes per worker, "
        f"md5), Python {platform.python_version()}, numpy {np.__version__}, {cores()} cores: "
        f"{args.reps} alternating repetitions, medians\n"
    )
    pairs = timing_pairs(args)
    measure_times(pairs, args.reps)
    misses: list[str] = []
    header = ["scenario / metric", "strata", f"ring ({VNODES} vn)", "ring/strata", "aim"]
    rows = [header]
    for pair in pairs:
        strata_ms, ring_ms = pair.strata.median_ms, pair.ring.median_ms
        aim = ""
        if pair.aim_ms is not None:
            ok = strata_ms <= pair.aim_ms
            aim = f"<= {pair.aim_ms:g} ms {verdict(ok)}"
            if not ok:
                misses.append(pair.scenario)
        rows.append(
            [
                f"{pair.scenario}: time",
                f"{strata_ms:,.2f} ms",
                f"{ring_ms:,.1f} ms",
                f"{ring_ms / strata_ms:,.0f}x",
                aim,
            ]
        )

    for workers, shards in (
        (args.small_workers, args.small_shards),
        (args.large_workers, args.large_shards),
    ):
        names = workers_named(workers)
        strata_balance = balance(strata_loads(names, shards))
        ring_balance = balance(ring_loads(names, shards))
        ok = strata_balance[0] <= AIM_MAX_OVER_MEAN
        if not ok:
            misses.append(f"balance {workers} x {shards}")
        label = f"{workers:,} workers x {shards:,} shards"
        rows.append(
            [
                f"{label}: max/mean",
                f"{strata_balance[0]:.3f}",
                f"{ring_balance[0]:.3f}",
                "",
                f"<= {AIM_MAX_OVER_MEAN} {verdict(ok)}",
            ]
        )
        rows.append(
            [f"{label}: std/mean", f"{strata_balance[1]:.1%}", f"{ring_balance[1]:.1%}", "", ""]
        )

    names = workers_named(args.join_workers)
    strata_fraction = strata_moved(names, args.join_shards, "worker-joiner")
    ring_fraction = ring_moved(names, args.join_shards, "worker-joiner")
    ok = strata_fraction <= AIM_MOVED
    if not ok:
        misses.append("moved on join")
    rows.append(
        [
            f"1 joins {args.join_workers} workers, {args.join_shards:,} shards: moved",
            f"{strata_fraction:.2%}",
            f"{ring_fraction:.2%}",
            "",
            f"<= {AIM_MOVED:.1%} {verdict(ok)} (even share: {1 / (args.join_workers + 1):.2%})",
        ]
    )
    print(render(rows))
    print("\nper repetition (ms):")
    for pair in pairs:
        for side in (pair.strata, pair.ring):
            figures = "  ".join(f"{s * 1e3:8.2f}" for s in side.seconds)
            print(f"  {pair.scenario:<48} {side.label:<6} {figures}")
    large = f"{args.large_workers:,} x {args.large_shards:,}"
    print(
        f"\nAims: plan {large} in at most {AIM_PLAN_MS:g} ms, max/mean at most "
        f"{AIM_MAX_OVER_MEAN}, at most {AIM_MOVED:.1%} of shards moved when 1 worker joins "
        f"{args.join_workers}."
    )
    print(f"The original design's claims for its ring: {ORIGINAL_CLAIMS}.")
    print("All aims met." if not misses else f"Aims MISSED: {', '.join(misses)}.")
    return not misses


# -- the service under a burst --------------------------------------------------------------------

RPC_TIMEOUT_S = 120.0


async def one_burst(bus: Bus, workers: int, shards_per_worker: int) -> tuple[float, float]:
    """A fresh job of `workers` workers: seconds until every worker has its epoch-0 shards (all
    asking at once), then until every worker's report of them all done is answered."""
    job = f"bench-shards-{uuid.uuid4().hex[:8]}"
    names = await register_workers(bus, job, workers)
    dataset = RegisterDatasetRequest(
        job=job,
        dataset_id="ds",
        total_samples=workers * shards_per_worker * 100,
        shard_size=100,
        seed=7,
    )
    await bus.rpc.call("sharding", "register_dataset", dataset, timeout=RPC_TIMEOUT_S)
    assignments: list[ShardAssignment] = []

    async def ask(worker: str) -> None:
        request = GetShardsRequest(
            job=job, dataset_id="ds", worker_id=worker, epoch=0, lease=registered_lease(worker)
        )
        assignments.append(
            await bus.rpc.call(
                "sharding", "get_shards", request, result=ShardAssignment, timeout=RPC_TIMEOUT_S
            )
        )

    asked = await timed_burst([functools.partial(ask, worker) for worker in names])
    owned = sorted(span.shard_id for a in assignments for span in a.shards)
    if owned != list(range(workers * shards_per_worker)) or len(assignments) != workers:
        raise SystemExit("a burst's assignments do not cover every shard exactly once")

    async def report(assignment: ShardAssignment) -> None:
        request = ReportProgressRequest(
            job=job,
            dataset_id="ds",
            epoch=0,
            worker_id=assignment.worker_id,
            completed=[span.shard_id for span in assignment.shards],
            lease=registered_lease(assignment.worker_id),
        )
        await bus.rpc.call(
            "sharding", "report_progress", request, result=ProgressResult, timeout=RPC_TIMEOUT_S
        )

    reported = await timed_burst([functools.partial(report, a) for a in assignments])
    summary = await bus.rpc.call(
        "sharding",
        "plan",
        PlanRequest(job=job, dataset_id="ds", epoch=0),
        result=PlanSummary,
        timeout=RPC_TIMEOUT_S,
    )
    if summary.done_shards != summary.total_shards:
        raise SystemExit(f"{summary.done_shards} of {summary.total_shards} shards done")
    return asked, reported


async def measure_bursts(args: argparse.Namespace, base: Path) -> list[Row]:
    n = args.burst_workers
    ask = Row(f"{n:,} workers ask for their epoch's shards")
    report = Row(f"{n:,} workers report their shards done")
    with contextlib.ExitStack() as stacks:
        buses: dict[str, Bus] = {}
        for variant in VARIANTS:
            url = stacks.enter_context(service_stack(base, "sharding", "Sharding", variant))
            buses[variant.label] = await Bus.connect(url, name=f"bench-{variant.max_batch}")
        try:
            for variant in VARIANTS:  # warm-up: connections, imports, first allocations
                await one_burst(buses[variant.label], min(n, 50), args.burst_shards)
            for number in range(args.burst_rounds):
                order: tuple[Variant, ...] = round_order(number)
                for variant in order:
                    gc.collect()
                    asked, reported = await one_burst(buses[variant.label], n, args.burst_shards)
                    ask.add(variant, asked)
                    report.add(variant, reported)
        finally:
            for bus in buses.values():
                await bus.close()
    return [ask, report]


def run_bursts(args: argparse.Namespace) -> None:
    print(
        f"sharding service under a burst: {args.burst_workers:,} workers, "
        f"{args.burst_shards} shards each, one sharding process per variant, "
        f"{cores()} cores\n"
    )
    with tempfile.TemporaryDirectory() as tmp:
        rows = asyncio.run(measure_bursts(args, Path(tmp)))
    print(render_rows(rows, args.burst_rounds))


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--reps", type=int, default=7, help="timed repetitions per side")
    parser.add_argument("--small-workers", type=int, default=10)
    parser.add_argument("--small-shards", type=int, default=1_000)
    parser.add_argument("--large-workers", type=int, default=1_000)
    parser.add_argument("--large-shards", type=int, default=100_000)
    parser.add_argument("--join-workers", type=int, default=100)
    parser.add_argument("--join-shards", type=int, default=10_000)
    parser.add_argument("--check", action="store_true", help="exit 1 when an aim is missed")
    parser.add_argument(
        "--part",
        choices=("plans", "burst", "all"),
        default="plans",
        help="the planner (plans), the service under a burst of requests (burst), or both",
    )
    parser.add_argument("--burst-workers", type=int, default=1_000)
    parser.add_argument("--burst-shards", type=int, default=4, help="shards per worker")
    parser.add_argument("--burst-rounds", type=int, default=5)
    args = parser.parse_args(argv)
    if args.reps < 1:
        parser.error("--reps must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    met = True
    if args.part in ("plans", "all"):
        met = run(args)
    if args.part in ("burst", "all"):
        if args.part == "all":
            print()
        run_bursts(args)
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
