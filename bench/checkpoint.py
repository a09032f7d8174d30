"""`CheckpointManager` against the plain code doing the same work, in one run, on one disk.

(a) `save(bytes)` + `wait()` (begin RPC, checksummed durable write, ack event) against one write +
    fsync of the same bytes into the same directory, for each size; rounds alternate, rotating who
    goes first, and each figure is the median. Aim: at least 90% of the plain MB/s.
(c) How long `save_state()` blocks its caller for a 512 MiB state dict, against `torch.save` +
    fsync of the same state dict. Aim: at most 10% of it. The first save allocates its staging
    buffers; later saves copy into the same ones, which is what a training loop sees every save
    after the first. Both are printed.

(d) The checkpoint service under a burst (`bench.burst`): N ranks declaring their shards of a step
    at once, then acknowledging them at once, until `checkpoint.committed`; against a checkpoint
    service that decides one request at a time, in the same run (no registry: the workers'
    registrations are written to the stream as the registry would).

It starts its own nats-server, registry and checkpoint service:
`.venv/bin/python bench/checkpoint.py [--sizes 256M,1G] [--rounds 5] [--part save|state|burst|all]`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import strata
import torch
from nats.aio.msg import Msg
from strata import procutil
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.events import subjects
from strata.events.requests import (
    AckShardRequest,
    AckShardResult,
    BeginCheckpointRequest,
)
from strata.storage.base import shard_key

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.burst import (
    VARIANTS,
    Row,
    register_workers,
    render_rows,
    round_order,
    service_stack,
    timed_burst,
)
from bench.storage import format_size, parse_size, plain_local_write, random_bytes

SAVE_AIM = 0.90
STATE_AIM = 0.10
MiB = 1024 * 1024


def ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as answer:
            return bool(answer.status == 200)
    except OSError:
        return False


@contextmanager
def stack(base: Path) -> Iterator[str]:
    """A nats-server with the registry and checkpoint services; yields the NATS URL."""
    with NatsServer(store_dir=base / "nats") as server:
        services = []
        for name in ("registry", "checkpoint"):
            port = procutil.free_port()
            env = {**os.environ, "STRATA_NATS_URL": server.url, "STRATA_HEALTH_PORT": str(port)}
            proc = procutil.spawn_service(name, env, base / f"{name}.log")
            services.append((proc, port))
        try:
            deadline = time.monotonic() + 60
            while not all(ready(port) for _, port in services):
                if time.monotonic() > deadline:
                    raise SystemExit("services not ready")
                time.sleep(0.1)
            yield server.url
        finally:
            for proc, _ in services:
                procutil.terminate(proc, timeout=10)


def clean(directory: Path) -> None:
    for path in directory.rglob("*"):
        if path.is_file():
            path.unlink()
    os.sync()  # start every write with no dirty pages of earlier writes still being flushed


def alternate(
    variants: Sequence[tuple[list[float], Callable[[int], None]]],
    rounds: int,
    before: Callable[[], None],
) -> None:
    """Run each variant once per round, rotating the order, recording seconds; `before` runs
    untimed ahead of every timed call."""
    for number in range(rounds):
        shift = number % len(variants)
        for times, run in [*variants[shift:], *variants[:shift]]:
            before()
            gc.collect()
            started = time.perf_counter()
            run(number)
            times.append(time.perf_counter() - started)


def measure_save(url: str, base: Path, sizes: list[int], rounds: int) -> list[str]:
    plain_dir = base / "plain"
    plain_dir.mkdir()
    with strata.Worker(job="bench-save", nats_url=url) as worker:
        manager = strata.CheckpointManager(worker, str(base / "ckpt"), keep_count=1)
        steps = [0]  # one job: step numbers go on across sizes
        return [measure_save_size(manager, plain_dir, steps, size, rounds) for size in sizes]


def measure_save_size(
    manager: strata.CheckpointManager, plain_dir: Path, steps: list[int], size: int, rounds: int
) -> str:
    data = random_bytes(size)
    strata_times: list[float] = []
    plain_times: list[float] = []

    def run_strata(number: int) -> None:
        steps.append(steps[-1] + 1)
        manager.save(data, step=steps[-1])
        manager.wait()

    def run_plain(number: int) -> None:
        plain_local_write(plain_dir / f"plain-{number}.bin", data)

    def before() -> None:
        clean(plain_dir)
        if steps[-1]:  # the service's manifest write and retention stay out of the timing
            manager.wait_committed(steps[-1])
        os.sync()

    alternate([(strata_times, run_strata), (plain_times, run_plain)], rounds, before)
    clean(plain_dir)
    s = size / statistics.median(strata_times) / 1e6
    p = size / statistics.median(plain_times) / 1e6
    return (
        f"  (a) save()+wait() {format_size(size):>8}  {s:8.0f} MB/s   "
        f"write+fsync {p:8.0f} MB/s   ratio {s / p:5.2f}  "
        f"({'met' if s / p >= SAVE_AIM else 'missed'}, aim >= {SAVE_AIM:.2f})"
    )


def measure_state(url: str, base: Path, rounds: int) -> list[str]:
    state = {f"layer{i}": torch.randn(16 * MiB) for i in range(8)}  # 8 x 64 MiB
    mib = sum(t.numel() * t.element_size() for t in state.values()) / MiB
    blocking, plain, durable = [], [], []
    with strata.Worker(job="bench-state", nats_url=url) as worker:
        manager = strata.CheckpointManager(
            worker, str(base / "ckpt"), keep_count=1, max_pending_bytes=64 * 2**30
        )
        for step in range(rounds):
            os.sync()
            gc.collect()
            started = time.perf_counter()
            manager.save_state(state, step=step)
            blocking.append(time.perf_counter() - started)
            manager.wait()
            durable.append(time.perf_counter() - started)
            os.sync()
            gc.collect()
            started = time.perf_counter()
            with (base / "plain.pt").open("wb") as out:
                torch.save(state, out)
                out.flush()
                os.fsync(out.fileno())
            plain.append(time.perf_counter() - started)
            (base / "plain.pt").unlink()
    first = blocking[0] * 1000
    b, p, d = (statistics.median(x[1:]) * 1000 for x in (blocking, plain, durable))
    return [
        f"  (c) state dict {mib:.0f} MiB, {rounds} saves (medians of saves 2..{rounds}):",
        f"      save_state() blocks the caller   {b:8.0f} ms",
        f"      torch.save + fsync (baseline)    {p:8.0f} ms",
        f"      ratio                            {b / p:8.3f}   "
        f"({'met' if b / p <= STATE_AIM else 'missed'}, aim <= {STATE_AIM:.2f})",
        f"      first save (allocates buffers)   {first:8.0f} ms   ratio {first / p:.3f}",
        f"      save_state() until durable       {d:8.0f} ms",
    ]


BURST_SHARD_BYTES = 4096
RPC_TIMEOUT_S = 120.0


async def one_burst(bus: Bus, root: Path, ranks: int) -> tuple[float, float, float]:
    """A fresh job of `ranks` workers saving step 1 at once: seconds until every begin is
    answered; then, the shards written (untimed), until every ack is answered and until the
    service has recorded `checkpoint.committed`."""
    job = f"bench-ckpt-{uuid.uuid4().hex[:8]}"
    workers = await register_workers(bus, job, ranks)
    committed: asyncio.Future[float] = asyncio.get_running_loop().create_future()

    async def on_committed(_: Msg) -> None:
        if not committed.done():
            committed.set_result(time.perf_counter())

    sub = await bus.nc.subscribe(
        subjects.event_subject(job, "checkpoint.committed"), cb=on_committed
    )
    attempts: dict[int, int] = {}

    async def begin(rank: int) -> None:
        request = BeginCheckpointRequest(
            job=job,
            worker_id=workers[rank],
            step=1,
            epoch=0,
            root_uri=str(root),
            keep_count=2,
            world_size=ranks,
            membership_epoch=ranks,
            instance=f"proc-{workers[rank]}",
            save_id=uuid.uuid4().hex,
        )
        # Each answer lists the step's participants: every real rank decodes its own in its own
        # process, so this one process takes the plain data and leaves out the model validation.
        info = await bus.rpc.call("checkpoint", "begin", request, timeout=RPC_TIMEOUT_S)
        if info["status"] != "open":
            raise SystemExit(f"a burst's step is {info['status']}, not open")
        attempts[rank] = info["attempt"]

    begun = await timed_burst([functools.partial(begin, rank) for rank in range(ranks)])
    shard = random_bytes(BURST_SHARD_BYTES)
    for rank, attempt in attempts.items():
        path = root / shard_key(job, 1, rank, attempt)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(shard)

    async def ack(rank: int) -> None:
        request = AckShardRequest(
            job=job,
            worker_id=workers[rank],
            step=1,
            epoch=0,
            rank=rank,
            bytes=BURST_SHARD_BYTES,
            checksum="xxh128:" + "ab" * 16,
            instance=f"proc-{workers[rank]}",
        )
        await bus.rpc.call(
            "checkpoint", "ack", request, result=AckShardResult, timeout=RPC_TIMEOUT_S
        )

    started = time.perf_counter()
    acked = await timed_burst([functools.partial(ack, rank) for rank in range(ranks)])
    done = await asyncio.wait_for(committed, RPC_TIMEOUT_S)
    await sub.unsubscribe()
    return begun, acked, done - started


async def measure_bursts(base: Path, ranks: int, rounds: int) -> list[Row]:
    begins = Row(f"{ranks:,} ranks declare their shards (begin)")
    acks = Row(f"{ranks:,} ranks ack their shards")
    commits = Row(f"{ranks:,} ranks ack, until checkpoint.committed")
    with contextlib.ExitStack() as stacks:
        buses: dict[str, Bus] = {}
        for variant in VARIANTS:
            url = stacks.enter_context(service_stack(base, "checkpoint", "Checkpoints", variant))
            buses[variant.label] = await Bus.connect(url, name=f"bench-{variant.max_batch}")
        try:
            for variant in VARIANTS:  # warm-up: connections, imports, the storage backend
                root = base / f"ckpt-{variant.max_batch}"
                await one_burst(buses[variant.label], root, min(ranks, 50))
            for number in range(rounds):
                for variant in round_order(number):
                    gc.collect()
                    root = base / f"ckpt-{variant.max_batch}"
                    begun, acked, until_committed = await one_burst(
                        buses[variant.label], root, ranks
                    )
                    begins.add(variant, begun)
                    acks.add(variant, acked)
                    commits.add(variant, until_committed)
        finally:
            for bus in buses.values():
                await bus.close()
    return [begins, acks, commits]


def measure_burst(base: Path, ranks: int, rounds: int) -> list[str]:
    rows = asyncio.run(measure_bursts(base / "burst", ranks, rounds))
    table = render_rows(rows, rounds)
    return [
        f"  (d) checkpoint service under a burst of {ranks:,} ranks, one service per variant:",
        *(f"      {line}" for line in table.splitlines()),
    ]


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="256M,1G", help="sizes for (a), comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--part", choices=("save", "state", "burst", "all"), default="all")
    parser.add_argument("--burst-ranks", type=int, default=1_000, help="ranks in (d)")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to test")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(dir=args.dir or "/tmp"))
    lines = [
        f"strata checkpoints vs plain code, {time.strftime('%Y-%m-%d')}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"{args.rounds} rounds"
    ]
    if args.part != "burst":
        with stack(base) as url:
            if args.part in ("save", "all"):
                sizes = [parse_size(s) for s in args.sizes.split(",") if s]
                lines += measure_save(url, base, sizes, args.rounds)
            if args.part in ("state", "all"):
                lines += measure_state(url, base, max(args.rounds, 2))
    if args.part in ("burst", "all"):
        lines += measure_burst(base, args.burst_ranks, args.rounds)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
