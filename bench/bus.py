"""Throughput and latency of Strata's bus layer next to plain nats-py doing the same work.

Acknowledged publishes (one at a time and pipelined) and request/reply round trips run against one
nats-server with the same subjects, payload bytes and `Nats-Msg-Id` headers on both sides. Variants
alternate in short slices over several rounds and each figure is the median of its rounds, so a
noisy shared machine skews both sides alike.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import importlib.metadata
import os
import platform
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Annotated, Any, Literal

import msgpack
import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import PubAck
from pydantic import Field
from strata.bus import Bus, RpcServer
from strata.bus.publish import MSG_ID
from strata.bus.server import NatsServer
from strata.events import CheckpointShardSaved, encode_event, pack, subject_for, subjects
from strata.events.models import Id, Rank, StrictModel
from strata.logs import configure_logging

AIM = 0.20
SLICE_TIMEOUT_S = 120.0
SERVICE = "benchs"
# Same length as the Strata service name, so plain requests carry subjects of the same size.
PLAIN_SUBJECT = subjects.rpc_subject("benchp", "lookup")
PLAIN_CODEC_SUBJECT = subjects.rpc_subject("benchm", "lookup")
CHECKSUM = "sha256:9f86d081884c7d659a2feaa0c55ad015a3bf4f1b2b0b822cd15d6c15b0f00a08"


class LookupRequest(StrictModel):
    job: Id
    worker_id: Id


class LookupResult(StrictModel):
    worker_id: Id
    rank: Rank
    world_size: Annotated[int, Field(ge=1)]
    membership_epoch: Annotated[int, Field(ge=0)]
    hostname: str


REQUEST = LookupRequest(job="bench-job", worker_id="worker-0007")
RESULT = LookupResult(
    worker_id="worker-0007", rank=7, world_size=64, membership_epoch=12, hostname="gpu-node-07"
)
REQUEST_DICT: dict[str, Any] = REQUEST.model_dump()
RESULT_DICT: dict[str, Any] = RESULT.model_dump()
# The exact bytes RpcClient sends and RpcServer answers with, so the plain side moves as much.
REQUEST_BYTES = pack(REQUEST_DICT)
REPLY_BYTES = pack({"ok": True, "result": RESULT_DICT})


@dataclass
class Slice:
    ops: int
    seconds: float
    latencies: list[float] = field(default_factory=list)


@dataclass
class Variant:
    label: str
    kind: Literal["rate", "latency"]
    run: Callable[[int], Awaitable[Slice]]
    rounds: list[dict[str, float]] = field(default_factory=list)
    slices: list[Slice] = field(default_factory=list)

    @property
    def unit(self) -> str:
        return "ev/s" if self.kind == "rate" else "µs"

    def end_round(self) -> None:
        if self.kind == "rate":
            ops, seconds = sum(s.ops for s in self.slices), sum(s.seconds for s in self.slices)
            self.rounds.append({"rate": ops / seconds})
        else:
            latencies = [x for s in self.slices for x in s.latencies]
            cuts = statistics.quantiles(latencies, n=100, method="inclusive")
            self.rounds.append({"p50": cuts[49] * 1e6, "p99": cuts[98] * 1e6})
        self.slices = []

    def median(self, figure: str) -> float:
        return statistics.median(r[figure] for r in self.rounds)


@dataclass(frozen=True)
class Row:
    metric: str
    strata: Variant
    plain: Variant
    figure: str
    judged: bool

    def ratio(self) -> float:
        return self.strata.median(self.figure) / self.plain.median(self.figure)

    def overhead(self) -> float:
        """Extra time per operation that the Strata path costs over the plain one."""
        ratio = self.ratio()
        return 1 / ratio - 1 if self.strata.kind == "rate" else ratio - 1


class Timer:
    def __enter__(self) -> Timer:
        # A collection set off by the previous variant's garbage must not be billed to this one.
        gc.collect()
        self.started = time.perf_counter()
        return self

    def __exit__(self, *exc: object) -> None:
        self.seconds = time.perf_counter() - self.started


def check_acks(acks: Sequence[PubAck], n: int) -> None:
    if len(acks) != n or any(ack.duplicate for ack in acks):
        raise SystemExit("a benchmark publish was lost or deduplicated: the figures are invalid")


class Bench:
    """Connections, responders and workloads shared by every variant of one run."""

    def __init__(self, url: str, window: int) -> None:
        self.url = url
        self.window = window
        self.run_id = uuid.uuid4().hex[:8]
        self.jobs: list[str] = []
        self._closers: list[Callable[[], Awaitable[None]]] = []

    async def open(self) -> None:
        self.bus = await Bus.connect(self.url, name="bench-strata")
        self._closers.append(self.bus.close)
        await self.bus.ensure_streams()
        server_bus = await Bus.connect(self.url, name="bench-strata-server")
        self._closers.append(server_bus.close)
        self.rpc_server = RpcServer(server_bus.nc, SERVICE)
        self.rpc_server.route("lookup", LookupRequest, self._lookup, scope="open")
        await self.rpc_server.start()
        self._closers.append(self.rpc_server.stop)
        # nats-py's default options rather than Strata's, so the baseline is what a plain user gets.
        self.nc: NATS = await nats.connect(self.url, name="bench-plain")
        self._closers.append(self.nc.drain)
        self.js: JetStreamContext = self.nc.jetstream()
        self.js_async: JetStreamContext = self.nc.jetstream(publish_async_max_pending=self.window)
        plain_server = await nats.connect(self.url, name="bench-plain-server")
        self._closers.append(plain_server.drain)
        queue = subjects.rpc_queue_group("benchp")
        await plain_server.subscribe(PLAIN_SUBJECT, queue=queue, cb=self._plain_reply)
        await plain_server.subscribe(PLAIN_CODEC_SUBJECT, queue=queue, cb=self._codec_reply)

    async def close(self, purge: bool) -> None:
        if purge:
            # A server that outlives the benchmark keeps no trace of it in the real stream.
            for job in self.jobs:
                await self.js.purge_stream(subjects.EVENTS_STREAM, subject=subjects.job_events(job))
        for close in reversed(self._closers):
            await close()

    async def _lookup(self, request: LookupRequest) -> LookupResult:
        return RESULT

    async def _plain_reply(self, msg: Msg) -> None:
        await msg.respond(REPLY_BYTES)

    async def _codec_reply(self, msg: Msg) -> None:
        request = msgpack.unpackb(msg.data)
        result = {**RESULT_DICT, "worker_id": request["worker_id"]}
        await msg.respond(msgpack.packb({"ok": True, "result": result}))

    def fresh_events(self, tag: str, n: int) -> list[CheckpointShardSaved]:
        """`n` events never published before (new ids), on the variant's own job."""
        job = f"bench-{self.run_id}-{tag}"
        if job not in self.jobs:
            self.jobs.append(job)
        return [
            CheckpointShardSaved(
                job=job,
                source="bench",
                step=1000 + i,
                epoch=3,
                rank=i % 64,
                worker_id=f"worker-{i % 64:04d}",
                uri=f"s3://strata-ckpt/{job}/step-{1000 + i:012d}/rank-{i % 64:05d}.bin",
                key=f"{job}/step-{1000 + i:012d}/rank-{i % 64:05d}.bin",
                bytes=1_073_741_824 + i,
                checksum=CHECKSUM,
            )
            for i in range(n)
        ]

    def fresh_wire(self, tag: str, n: int) -> list[tuple[str, bytes, str]]:
        """Subject, payload and msg id of fresh events, encoded exactly as Strata encodes them."""
        return [(subject_for(e), encode_event(e), e.id) for e in self.fresh_events(tag, n)]

    # -- acknowledged publishes, one at a time ----------------------------------------------------

    async def strata_sequential(self, n: int) -> Slice:
        events = self.fresh_events("sseq", n)
        publish = self.bus.publish
        acks = []
        with Timer() as t:
            for event in events:
                acks.append(await publish(event))
        check_acks(acks, n)
        return Slice(n, t.seconds)

    async def plain_sequential(self, n: int) -> Slice:
        wire = self.fresh_wire("pseq", n)
        publish = self.js.publish
        acks = []
        with Timer() as t:
            for subject, payload, msg_id in wire:
                acks.append(await publish(subject, payload, headers={MSG_ID: msg_id}))
        check_acks(acks, n)
        return Slice(n, t.seconds)

    async def plain_sequential_encoding(self, n: int) -> Slice:
        events = self.fresh_events("penc", n)
        subject = subject_for(events[0])
        publish = self.js.publish
        acks = []
        with Timer() as t:
            for event in events:
                payload = msgpack.packb(event.model_dump())
                acks.append(await publish(subject, payload, headers={MSG_ID: event.id}))
        check_acks(acks, n)
        return Slice(n, t.seconds)

    # -- acknowledged publishes, pipelined --------------------------------------------------------

    async def strata_pipelined(self, n: int) -> Slice:
        events = self.fresh_events("spip", n)
        with Timer() as t:
            acks = await self.bus.publish_many(events, window=self.window)
        check_acks(acks, n)
        return Slice(n, t.seconds)

    async def plain_publish_async(self, n: int) -> Slice:
        wire = self.fresh_wire("pasy", n)
        publish_async = self.js_async.publish_async
        with Timer() as t:
            futures = [
                await publish_async(subject, payload, headers={MSG_ID: msg_id})
                for subject, payload, msg_id in wire
            ]
            acks = await asyncio.gather(*futures)
        check_acks(acks, n)
        return Slice(n, t.seconds)

    async def plain_gather(self, n: int) -> Slice:
        wire = self.fresh_wire("pgat", n)
        publish = self.js.publish
        gate = asyncio.Semaphore(self.window)

        async def one(subject: str, payload: bytes, msg_id: str) -> PubAck:
            async with gate:
                return await publish(subject, payload, headers={MSG_ID: msg_id})

        with Timer() as t:
            acks = await asyncio.gather(*(one(*w) for w in wire))
        check_acks(acks, n)
        return Slice(n, t.seconds)

    # -- request/reply ----------------------------------------------------------------------------

    async def strata_rpc(self, n: int) -> Slice:
        call = self.bus.rpc.call
        latencies = []
        with Timer() as t:
            for _ in range(n):
                started = time.perf_counter()
                reply = await call(SERVICE, "lookup", REQUEST, result=LookupResult)
                latencies.append(time.perf_counter() - started)
        assert reply == RESULT
        return Slice(n, t.seconds, latencies)

    async def plain_rpc(self, n: int) -> Slice:
        request = self.nc.request
        latencies = []
        with Timer() as t:
            for _ in range(n):
                started = time.perf_counter()
                msg = await request(PLAIN_SUBJECT, REQUEST_BYTES, timeout=5.0)
                latencies.append(time.perf_counter() - started)
        assert msg.data == REPLY_BYTES
        return Slice(n, t.seconds, latencies)

    async def plain_rpc_codec(self, n: int) -> Slice:
        request = self.nc.request
        latencies = []
        with Timer() as t:
            for _ in range(n):
                started = time.perf_counter()
                msg = await request(PLAIN_CODEC_SUBJECT, msgpack.packb(REQUEST_DICT), timeout=5.0)
                body = msgpack.unpackb(msg.data)
                latencies.append(time.perf_counter() - started)
        assert body["result"] == RESULT_DICT
        return Slice(n, t.seconds, latencies)


# -- reporting ------------------------------------------------------------------------------------


def fmt(value: float, unit: str) -> str:
    return f"{value:,.0f} {unit}"


def print_table(rows: Sequence[Row]) -> None:
    head = ("metric", "strata", "figure", "plain nats-py", "figure", "ratio", "overhead", "aim")
    lines = [head]
    for row in rows:
        overhead = row.overhead()
        verdict = ("ok" if overhead <= AIM else "OVER") if row.judged else "info"
        lines.append(
            (
                row.metric,
                row.strata.label,
                fmt(row.strata.median(row.figure), row.strata.unit),
                row.plain.label,
                fmt(row.plain.median(row.figure), row.plain.unit),
                f"{row.ratio():.2f}",
                f"{overhead * 100:+.1f}%",
                verdict,
            )
        )
    widths = [max(len(line[i]) for line in lines) for i in range(len(head))]
    numeric = {2, 4, 5, 6}
    for n, line in enumerate(lines):
        cells = [
            cell.rjust(width) if i in numeric else cell.ljust(width)
            for i, (cell, width) in enumerate(zip(line, widths, strict=True))
        ]
        print("  ".join(cells).rstrip())
        if n == 0:
            print("  ".join("-" * width for width in widths))


def print_rounds(variants: Sequence[Variant]) -> None:
    print("\nper round (each row's median is the figure above):")
    width = max(len(v.label) for v in variants) + 4
    for v in variants:
        for figure in v.rounds[0]:
            name = v.label if v.kind == "rate" else f"{v.label} {figure}"
            values = "  ".join(f"{r[figure]:>8,.0f}" for r in v.rounds)
            print(f"  {name:<{width}}  {values}  {v.unit}")


def summary(rows: Sequence[Row]) -> list[str]:
    """One line per metric, judged against every plain baseline it has."""
    by_metric: dict[str, list[Row]] = {}
    for row in rows:
        if row.judged:
            by_metric.setdefault(row.metric, []).append(row)
    lines = []
    for metric, judged in by_metric.items():
        strata = judged[0].strata
        versus = ", ".join(
            f"{r.plain.label} {fmt(r.plain.median(r.figure), r.plain.unit)} "
            f"({r.overhead() * 100:+.1f}%)"
            for r in judged
        )
        met = all(r.overhead() <= AIM for r in judged)
        lines.append(
            f"{metric}: {strata.label} {fmt(strata.median(judged[0].figure), strata.unit)} vs "
            f"{versus}: aim {'met' if met else 'MISSED'}"
        )
    return lines


# -- main -----------------------------------------------------------------------------------------


def split(n: int, parts: int) -> list[int]:
    return [size for i in range(parts) if (size := n // parts + (i < n % parts))]


async def measure(args: argparse.Namespace, url: str, own_server: bool) -> list[Row]:
    bench = Bench(url, args.window)
    try:
        await bench.open()
        version = bench.nc.connected_server_version
        print(
            f"strata bus vs nats-py {importlib.metadata.version('nats-py')} on nats-server "
            f"{version.major}.{version.minor}.{version.patch}, Python {platform.python_version()}, "
            f"{os.cpu_count()} cores: {args.events:,} publishes and {args.rpc:,} calls per "
            f"variant and round, window {args.window}, {args.rounds} rounds of {args.slices} slices"
        )
        sequential = [
            Variant("Bus.publish", "rate", bench.strata_sequential),
            Variant("js.publish, pre-encoded", "rate", bench.plain_sequential),
            Variant("js.publish + packb", "rate", bench.plain_sequential_encoding),
        ]
        pipelined = [
            Variant("Bus.publish_many", "rate", bench.strata_pipelined),
            Variant("js.publish_async", "rate", bench.plain_publish_async),
            Variant("gather(js.publish) + sem", "rate", bench.plain_gather),
        ]
        rpc = [
            Variant("RpcClient.call", "latency", bench.strata_rpc),
            Variant("nc.request", "latency", bench.plain_rpc),
            Variant("nc.request + msgpack", "latency", bench.plain_rpc_codec),
        ]
        groups = [(args.events, sequential), (args.events, pipelined), (args.rpc, rpc)]
        for _, variants in groups:
            for v in variants:
                async with asyncio.timeout(SLICE_TIMEOUT_S):
                    await v.run(args.warmup)
        for r in range(args.rounds):
            print(f"round {r + 1}/{args.rounds}", file=sys.stderr, flush=True)
            for n, variants in groups:
                for s, size in enumerate(split(n, args.slices)):
                    # Rotating who goes first spreads drift within a round over every variant.
                    for i in range(len(variants)):
                        v = variants[(i + r * args.slices + s) % len(variants)]
                        async with asyncio.timeout(SLICE_TIMEOUT_S):
                            v.slices.append(await v.run(size))
                for v in variants:
                    v.end_round()
        window = f"publish, window {args.window}"
        rows = [
            Row("publish, sequential", sequential[0], sequential[1], "rate", True),
            Row("publish, sequential", sequential[0], sequential[2], "rate", False),
            Row(window, pipelined[0], pipelined[1], "rate", True),
            Row(window, pipelined[0], pipelined[2], "rate", True),
            Row("rpc p50", rpc[0], rpc[1], "p50", True),
            Row("rpc p99", rpc[0], rpc[1], "p99", True),
            Row("rpc p50", rpc[0], rpc[2], "p50", False),
            Row("rpc p99", rpc[0], rpc[2], "p99", False),
        ]
        print()
        print_table(rows)
        print_rounds([v for _, variants in groups for v in variants])
        print(f"\nAim: the strata layer costs at most {AIM:.0%} over plain nats-py.")
        print("overhead = extra time per operation; 'info' rows show where the cost lies.")
        for line in summary(rows):
            print(line)
        return rows
    finally:
        await bench.close(purge=not own_server)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--events", type=int, default=20_000, help="publishes per variant, round")
    parser.add_argument("--rpc", type=int, default=5_000, help="calls per variant and round")
    parser.add_argument("--window", type=int, default=256, help="acks outstanding when pipelined")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--slices", type=int, default=5, help="alternations per round")
    parser.add_argument("--warmup", type=int, default=1_000, help="untimed ops per variant")
    parser.add_argument("--nats-url", help="use this server instead of starting one")
    parser.add_argument("--check", action="store_true", help="exit 1 if an overhead exceeds 20%%")
    args = parser.parse_args(argv)
    for name in ("events", "rpc", "window", "rounds", "slices", "warmup"):
        if getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    # Disconnect notices from the connections closing at the end would land inside the report.
    configure_logging(level="warning")
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="strata-bench-") as tmp:
        server = None if args.nats_url else NatsServer(store_dir=Path(tmp))
        url = args.nats_url
        if server is not None:
            server.start()
            url = server.url
        try:
            rows = asyncio.run(measure(args, url, own_server=server is not None))
        finally:
            if server is not None:
                server.stop()
    print(f"({time.monotonic() - started:.0f}s)", file=sys.stderr)
    missed = any(row.judged and row.overhead() > AIM for row in rows)
    return 1 if args.check and missed else 0


if __name__ == "__main__":
    sys.exit(main())
