"""Bursts of requests: a service deciding in batches next to the same service one request at a time.

Group commit (`strata.services.commit`) is measured against its absence in the same run: two
nats-servers, each with one process of the service, one built with the default batch limit and
one with `max_batch=1`, which decides, stores and folds each request before the next (the
service's path before group commit). Every round sends the same burst to each in turn, the order
alternating, and each figure is the median of the rounds with their spread (min to max).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from strata import procutil
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import WorkerRegistered
from strata.events.requests import Lease
from strata.services.commit import MAX_BATCH

READY_TIMEOUT_S = 60.0
SERVICE_CODE = """
import sys
from importlib import import_module
from strata.config import load_settings
from strata.services.runtime import run
module = import_module(f"strata.services.{sys.argv[1]}.service")
run(getattr(module, sys.argv[2])(max_batch=int(sys.argv[3])), load_settings())
"""


@dataclass(frozen=True)
class Variant:
    label: str
    max_batch: int


BATCHED = Variant("group commit", MAX_BATCH)
ONE_AT_A_TIME = Variant("one at a time", 1)
VARIANTS = (BATCHED, ONE_AT_A_TIME)


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


@contextlib.contextmanager
def service_stack(base: Path, service: str, factory: str, variant: Variant) -> Iterator[str]:
    """A nats-server with one process of `service` (`factory(max_batch=...)` from its
    `service` module); yields the NATS URL."""
    directory = base / f"{service}-{variant.max_batch}"
    directory.mkdir(parents=True)
    with NatsServer(store_dir=directory / "nats") as server:
        port = procutil.free_port()
        env = {
            **os.environ,
            Env.NATS_URL: server.url,
            Env.HEALTH_PORT: str(port),
            Env.LOG_LEVEL: "warning",
        }
        with (directory / "service.log").open("ab") as log:
            proc = subprocess.Popen(
                [sys.executable, "-c", SERVICE_CODE, service, factory, str(variant.max_batch)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=procutil.child_preexec,
            )
        try:
            deadline = time.monotonic() + READY_TIMEOUT_S
            while not _ready(port):
                if proc.poll() is not None or time.monotonic() > deadline:
                    tail = (directory / "service.log").read_text(errors="replace")[-2000:]
                    raise SystemExit(f"the {service} service did not start:\n{tail}")
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=0.05)
            yield server.url
        finally:
            procutil.terminate(proc, timeout=10)


async def register_workers(bus: Bus, job: str, count: int) -> list[str]:
    """`count` workers of `job`, as the registry records them (the services fold these)."""
    workers = [f"w{i:05d}" for i in range(count)]
    await bus.publish_many(
        [
            WorkerRegistered(
                job=job,
                source="registry",
                worker_id=worker,
                instance=f"proc-{worker}",
                rank=rank,
                world_size=rank + 1,
                membership_epoch=rank + 1,
                heartbeat_interval=300.0,
                heartbeat_timeout=3600.0,
            )
            for rank, worker in enumerate(workers)
        ]
    )
    return workers


def registered_lease(worker: str) -> Lease:
    """The lease `register_workers` gave `worker` (named w<rank>)."""
    return Lease(worker_id=worker, instance=f"proc-{worker}", epoch=int(worker[1:]) + 1)


async def timed_burst(calls: Sequence[Callable[[], Awaitable[object]]]) -> float:
    """Seconds from sending every call at once until the last is answered."""
    started = time.perf_counter()
    await asyncio.gather(*(call() for call in calls))
    return time.perf_counter() - started


@dataclass
class Row:
    """One measured burst: seconds per round for each variant."""

    label: str
    seconds: dict[str, list[float]] = field(default_factory=dict)

    def add(self, variant: Variant, value: float) -> None:
        self.seconds.setdefault(variant.label, []).append(value)

    def median(self, variant: Variant) -> float:
        return statistics.median(self.seconds[variant.label])

    def cell(self, variant: Variant) -> str:
        values = self.seconds[variant.label]
        return (
            f"{statistics.median(values) * 1e3:,.0f} ms "
            f"({min(values) * 1e3:,.0f}-{max(values) * 1e3:,.0f})"
        )


def render_rows(rows: Sequence[Row], rounds: int) -> str:
    header = ["burst", f"{BATCHED.label}", f"{ONE_AT_A_TIME.label} (baseline)", "speed-up"]
    table = [header]
    for row in rows:
        ratio = row.median(ONE_AT_A_TIME) / row.median(BATCHED)
        table.append([row.label, row.cell(BATCHED), row.cell(ONE_AT_A_TIME), f"{ratio:.1f}x"])
    widths = [max(len(line[i]) for line in table) for i in range(len(header))]
    lines = []
    for n, line in enumerate(table):
        lines.append(
            "  ".join(
                c.ljust(w) if i == 0 else c.rjust(w)
                for i, (c, w) in enumerate(zip(line, widths, strict=True))
            )
        )
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append(
        f"(median of {rounds} alternating rounds, min-max in brackets; speed-up = baseline / "
        "group commit)"
    )
    return "\n".join(lines)


def round_order(number: int) -> tuple[Variant, ...]:
    """Who goes first alternates from round to round."""
    return VARIANTS if number % 2 == 0 else VARIANTS[::-1]
