"""Strata's `torch.distributed.Store` (`KVStore`, JetStream KV) next to its floor and torch's own.

For each store operation (set, get, add, wait on a set key, multi_get of 4 keys) three variants
run against one nats-server, alternating in rounds: `strata` is `KVStore` called as torch calls
it (synchronously, from the caller's thread); `floor` is the plain nats-py JetStream request that
operation needs at the least (a publish with its ack, a direct get, an expected-sequence publish,
four direct gets at once), called as `strata` is, from the caller's thread through the same kind
of background event loop (`in-loop`: the same requests awaited on the loop itself, without the
hop between threads that any synchronous face over nats-py's asyncio client pays); `tcpstore` is
torch's TCPStore on loopback, which keeps its keys in one process's memory. Then a whole
one-node rendezvous round (torch's DynamicRendezvousHandler: join, the store's keys, shutdown) on
Strata's backend and on torch's c10d backend over a TCPStore, without torch's random delay
before a first round: what the durable store costs a round. Each figure is the median of the
rounds' means, with the spread (min-max).
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
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import nats
import torch
import torch.distributed as dist
from nats.aio.client import Client as NATS
from strata._loop import LoopRunner
from strata.bus.server import NatsServer
from strata.config import Env, load_settings
from strata.events import subjects
from strata.torch.rendezvous import create_backend
from strata.torch.store import KVStore, RendezvousBucket
from torch.distributed.elastic.rendezvous import RendezvousParameters, dynamic_rendezvous
from torch.distributed.elastic.rendezvous.c10d_rendezvous_backend import C10dRendezvousBackend
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import create_handler

OPERATIONS = ("set", "get", "add", "wait", "multi_get")
AIM = 1.5
"""Strata's time per operation over the floor's, at most."""
MULTI = 4
VALUE = b"x" * 64


def job_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:12]}"


class Floor:
    """The least JetStream work each operation needs, in plain nats-py on an event loop."""

    def __init__(self, nc: NATS, job: str) -> None:
        self.nc = nc
        self.js = nc.jetstream()
        self.job = job
        self.sequences: dict[str, int] = {}

    def key(self, name: str) -> str:
        return subjects.rendezvous_store_key(self.job, name)

    async def set(self, name: str) -> None:
        subject = subjects.kv_subject(subjects.RENDEZVOUS_BUCKET, self.key(name))
        ack = await self.js.publish(subject, VALUE)
        self.sequences[name] = ack.seq

    async def get(self, name: str) -> bytes:
        reply = await self.nc.request(subjects.rendezvous_read(self.key(name)), b"", timeout=5)
        return reply.data

    async def add(self, name: str) -> None:
        subject = subjects.kv_subject(subjects.RENDEZVOUS_BUCKET, self.key(name))
        headers = {"Nats-Expected-Last-Subject-Sequence": str(self.sequences[name])}
        ack = await self.js.publish(subject, b"1", headers=headers)
        self.sequences[name] = ack.seq

    async def multi_get(self, names: list[str]) -> list[bytes]:
        return list(await asyncio.gather(*(self.get(name) for name in names)))


def timed(call: Callable[[], object], count: int) -> float:
    started = time.perf_counter()
    for _ in range(count):
        call()
    return (time.perf_counter() - started) / count * 1e6


def timed_async(runner: LoopRunner, make: Callable[[], object], count: int) -> float:
    async def loop() -> float:
        started = time.perf_counter()
        for _ in range(count):
            await make()  # type: ignore[misc]
        return (time.perf_counter() - started) / count * 1e6

    return runner.run(loop())


def store_calls(store: dist.Store) -> dict[str, Callable[[], object]]:
    names = [f"m{i}" for i in range(MULTI)]
    store.set("g", VALUE)
    for name in names:
        store.set(name, VALUE)
    return {
        "set": lambda: store.set("s", VALUE),
        "get": lambda: store.get("g"),
        "add": lambda: store.add("a", 1),
        "wait": lambda: store.wait(["g"]),
        "multi_get": lambda: store.multi_get(names),
    }


def rendezvous_round(kind: str, url: str, tcp_port: int) -> float:
    """Seconds for one one-node rendezvous round: torch's `next_rendezvous()`, a key set and read
    in the round's store, `shutdown()`; the backend is made before, as an agent makes it once."""
    run_id = job_id("bench-rdzv")
    params = RendezvousParameters(
        backend=kind,
        endpoint=url if kind == "strata" else f"127.0.0.1:{tcp_port}",
        run_id=run_id,
        min_nodes=1,
        max_nodes=1,
        last_call_timeout="1",
    )
    if kind == "strata":
        backend, store = create_backend(params)
    else:
        store = dist.TCPStore("127.0.0.1", tcp_port, is_master=False, timeout=timedelta(seconds=30))
        backend = C10dRendezvousBackend(store, run_id)
    handler = create_handler(store, backend, params)
    started = time.perf_counter()
    info = handler.next_rendezvous()
    info.store.set("master", b"127.0.0.1:29500")
    info.store.get("master")
    handler.shutdown()
    elapsed = time.perf_counter() - started
    if kind == "strata":
        backend.close()  # type: ignore[attr-defined]
    return elapsed


def without_first_round_delay() -> None:
    """torch waits a random 0-0.3 s before a handler's first round, to spread agents' first
    writes: the same for both backends, and larger than what is measured, so it is left out."""
    real = dynamic_rendezvous._delay

    def delay(seconds: float | tuple[float, float]) -> None:
        if not isinstance(seconds, tuple):
            real(seconds)

    dynamic_rendezvous._delay = delay  # type: ignore[assignment]


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):9.1f} ({min(values):.1f}-{max(values):.1f})"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nats-url", help="an existing server (default: start one)")
    parser.add_argument("--ops", type=int, default=300, help="operations per variant and round")
    parser.add_argument("--rounds", type=int, default=7, help="alternating rounds (at least 5)")
    parser.add_argument("--rendezvous", type=int, default=5, help="rendezvous rounds per backend")
    parser.add_argument("--check", action="store_true", help=f"exit 1 if any ratio is over {AIM}")
    args = parser.parse_args()
    if args.rounds < 5:
        parser.error("--rounds must be at least 5")
    # What create_backend passes on to an agent's workers: not this process's business.
    for name in (Env.JOB, Env.NATS_URL):
        os.environ.pop(name, None)

    with tempfile.TemporaryDirectory() as tmp:
        server = None
        url = args.nats_url
        if url is None:
            server = NatsServer(store_dir=Path(tmp) / "nats")
            server.start()
            url = server.url
        try:
            return run(url, args)
        finally:
            if server is not None:
                server.stop()


def run(url: str, args: argparse.Namespace) -> int:
    runner = LoopRunner("bench-store")
    floor_runner = LoopRunner("bench-floor")
    job = job_id("bench-store")
    bucket = runner.run(RendezvousBucket.open([url], load_settings(), job))
    strata = KVStore(bucket, runner, job, timeout=timedelta(seconds=30))
    tcp = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    tcp_client = dist.TCPStore("127.0.0.1", tcp.port, is_master=False)
    nc = floor_runner.run(nats.connect(url))
    floor = Floor(nc, job_id("bench-floor"))
    names = [f"m{i}" for i in range(MULTI)]

    async def prepare() -> None:
        await floor.set("g")
        for name in names:
            await floor.set(name)
        await floor.set("a")

    floor_runner.run(prepare())
    floor_calls: dict[str, Callable[[], object]] = {
        "set": lambda: floor.set("s"),
        "get": lambda: floor.get("g"),
        "add": lambda: floor.add("a"),
        "wait": lambda: floor.get("g"),
        "multi_get": lambda: floor.multi_get(names),
    }
    calls = {"strata": store_calls(strata), "tcpstore": store_calls(tcp_client)}
    variants = ["strata", "floor", "in-loop", "tcpstore"]
    results: dict[tuple[str, str], list[float]] = {}
    for round_ in range(args.rounds + 1):  # the first round warms up and is not counted
        for operation in OPERATIONS:
            order = variants if round_ % 2 else variants[::-1]
            for variant in order:
                if variant == "floor":
                    make = floor_calls[operation]
                    micros = timed(lambda: floor_runner.run(make()), args.ops)  # type: ignore[arg-type]  # noqa: B023
                elif variant == "in-loop":
                    micros = timed_async(floor_runner, floor_calls[operation], args.ops)
                else:
                    micros = timed(calls[variant][operation], args.ops)
                if round_:
                    results.setdefault((operation, variant), []).append(micros)

    load = os.getloadavg()[0]
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, load {load:.1f}")
    print(f"{args.ops} operations x {args.rounds} rounds; µs per operation, median (min-max)")
    columns = " ".join(f"{v:>24}" for v in variants)
    print(f"{'operation':10} {columns} {'/floor':>7} {'/in-loop':>8} {'/tcp':>6}")
    worst = 0.0
    for operation in OPERATIONS:
        mine = results[(operation, "strata")]

        def ratio(variant: str, mine: list[float] = mine, operation: str = operation) -> float:
            # Round by round, as the variants alternate within a round.
            base = results[(operation, variant)]
            return statistics.median(m / b for m, b in zip(mine, base, strict=True))

        worst = max(worst, ratio("floor"))
        figures = " ".join(f"{spread(results[(operation, v)]):>24}" for v in variants)
        print(
            f"{operation:10} {figures} {ratio('floor'):7.2f} {ratio('in-loop'):8.2f} "
            f"{ratio('tcpstore'):6.1f}"
        )

    rounds: dict[str, list[float]] = {"strata": [], "c10d": []}
    host = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    without_first_round_delay()
    for index in range(args.rendezvous + 1):
        for kind in ("strata", "c10d") if index % 2 else ("c10d", "strata"):
            seconds = rendezvous_round(kind, url, host.port)
            if index:
                rounds[kind].append(seconds * 1000)
    per_round = statistics.median(rounds["strata"]) - statistics.median(rounds["c10d"])
    print(
        f"one-node rendezvous round, ms: strata {spread(rounds['strata'])}, "
        f"c10d {spread(rounds['c10d'])}; the durable store costs {per_round:.0f} ms a round"
    )
    runner.run(bucket.close())
    runner.close()
    floor_runner.run(nc.close())
    floor_runner.close()
    if args.check and worst > AIM:
        print(f"over the aim: {worst:.2f}x the floor > {AIM}x", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
