"""`CheckpointManager` against the plain code doing the same work, in one run, on one disk.

(a) `save(bytes)` + `wait()` (begin RPC, checksummed durable write, ack event) against one write +
    fsync of the same bytes into the same directory, for each size; rounds alternate, rotating who
    goes first, and each figure is the median. Aim: at least 90% of the plain MB/s.
(c) How long `save_state()` blocks its caller for a 512 MiB state dict, against `torch.save` +
    fsync of the same state dict. Aim: at most 10% of it. The first save allocates its staging
    buffers; later saves copy into the same ones, which is what a training loop sees every save
    after the first. Both are printed.

It starts its own nats-server, registry and checkpoint service:
`.venv/bin/python bench/checkpoint.py [--sizes 256M,1G] [--rounds 5] [--part save|state|all]`.
"""

from __future__ import annotations

import argparse
import gc
import os
import platform
import statistics
import sys
import tempfile
import time
import urllib.request
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

import strata
import torch
from strata import procutil
from strata.bus.server import NatsServer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
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


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--sizes", default="256M,1G", help="sizes for (a), comma-separated")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--part", choices=("save", "state", "all"), default="all")
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to test")
    args = parser.parse_args(argv)
    base = Path(tempfile.mkdtemp(dir=args.dir or "/tmp"))
    lines = [
        f"strata checkpoints vs plain code, {time.strftime('%Y-%m-%d')}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"{args.rounds} rounds"
    ]
    with stack(base) as url:
        if args.part in ("save", "all"):
            sizes = [parse_size(s) for s in args.sizes.split(",") if s]
            lines += measure_save(url, base, sizes, args.rounds)
        if args.part in ("state", "all"):
            lines += measure_state(url, base, max(args.rounds, 2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
