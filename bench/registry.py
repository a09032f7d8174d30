"""Heartbeat intake of the registry, with failure detection checked while it is loaded.

Simulated workers register through the registry's RPC; load-generator processes then write their
heartbeats (payloads pre-encoded with the real codec, each with a fresh event id) onto NATS, at
1 Hz per worker and at full speed, while some workers fall silent. A plain nats-py subscriber fed
by the same generators, on the same server, gives the intake ceiling of a Python NATS consumer.
Then alternating rounds measure full-speed intake of the subscriber, of one registry process and
of the registry split into two heartbeat partitions (two processes), each round the three in turn.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.metadata
import multiprocessing as mp
import os
import platform
import select
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from multiprocessing.sharedctypes import RawArray, RawValue
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import nats
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from strata import procutil
from strata.bus import Bus, EventFeed
from strata.bus.publish import MSG_ID
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import (
    WorkerFailed,
    WorkerHeartbeat,
    WorkerRegistered,
    decode_event,
    encode_event,
    subjects,
)
from strata.logs import configure_logging
from strata.services.registry import domain

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.registration import AIM_SECONDS as REGISTER_AIM_S
from bench.registration import AIM_WORKERS as REGISTER_AIM_WORKERS
from bench.registration import register_workers

AIM_RATIO = 0.9
"""One registry process takes in at least this share of what the plain subscriber does."""
REGISTER_PROCS = 2
PACE_PERIOD_S = 0.05
CHUNK = 1_000
"""Frames written per socket write by a generator."""

# Generator modes and worker flags, shared with the generator processes through shared memory.
IDLE, PACED, FLOOD, STOP = 0, 1, 2, 3
UNREGISTERED, ACTIVE, SILENT = 0, 1, 2

_HEADER_START = f"NATS/1.0\r\n{MSG_ID}: ".encode()
_ID_SLOT = "e" * 32
"""The event id the payload templates are encoded with; each frame gets a fresh one in its place."""


# -- load generator (child processes) --------------------------------------------------------------


@dataclass(frozen=True)
class GeneratorSpec:
    url: str
    job: str
    workers: list[tuple[str, str]]
    """(worker id, instance) of every simulated worker; a generator sends for `indices` of them."""
    indices: list[int]
    tag: bytes
    """16 hex characters unique to this generator and run: message ids never repeat."""


def _templates(spec: GeneratorSpec) -> list[tuple[bytes, bytes, bytes]]:
    """Per worker: the frame up to the message id, between the two ids, and after the second.

    The id appears twice, as the `Nats-Msg-Id` header (as `Bus.publish_telemetry` sends it) and
    as the event's `id` field; both slots have a fixed width, so the lengths never change.
    """
    out = []
    for index in spec.indices:
        worker_id, instance = spec.workers[index]
        heartbeat = WorkerHeartbeat(
            id=_ID_SLOT,
            job=spec.job,
            source=worker_id,
            worker_id=worker_id,
            instance=instance,
            seq=1,
            state="idle",
            step=0,
            epoch=0,
            cpu_percent=97.5,
            rss_bytes=3_221_225_472,
        )
        payload = encode_event(heartbeat)
        at = payload.index(_ID_SLOT.encode())
        if payload.count(_ID_SLOT.encode()) != 1:
            raise SystemExit("heartbeat template has more than one id slot")
        header_len = len(_HEADER_START) + 32 + 4
        subject = subjects.heartbeat_subject(spec.job, worker_id)
        head = f"HPUB {subject} {header_len} {header_len + len(payload)}\r\n".encode()
        out.append((head + _HEADER_START, b"\r\n\r\n" + payload[:at], payload[at + 32 :] + b"\r\n"))
    return out


def _connect_raw(url: str) -> socket.socket:
    """A NATS client connection spoken directly: the cheapest possible publisher."""
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), 10)
    buffer = b""
    while not buffer.endswith(b"\r\n"):
        buffer += sock.recv(4096)
    if not buffer.startswith(b"INFO"):
        raise SystemExit(f"not a NATS server at {url}: {buffer[:80]!r}")
    connect = (
        b'CONNECT {"verbose":false,"pedantic":false,"headers":true,"no_responders":true,'
        b'"protocol":1,"lang":"python","version":"bench","name":"strata-bench-generator"}\r\n'
    )
    sock.sendall(connect + b"PING\r\n")
    buffer = b""
    while b"PONG\r\n" not in buffer:
        chunk = sock.recv(4096)
        if not chunk or b"-ERR" in chunk:
            raise SystemExit(f"nats-server refused the generator: {chunk!r}")
        buffer += chunk
    sock.settimeout(None)
    return sock


def _answer_server(sock: socket.socket, pending: bytes) -> bytes:
    """Answer the server's keep-alive PINGs (it drops a client that never does)."""
    while select.select([sock], [], [], 0)[0]:
        data = sock.recv(65536)
        if not data:
            raise SystemExit("nats-server closed the generator's connection")
        pending += data
        if b"-ERR" in pending:
            raise SystemExit(f"nats-server error: {pending[-200:]!r}")
        while b"PING\r\n" in pending:
            sock.sendall(b"PONG\r\n")
            pending = pending.replace(b"PING\r\n", b"", 1)
    return pending[-16:]


def generate(
    spec: GeneratorSpec,
    flags: Any,
    mode: Any,
    hz: Any,
    allowed: Any,
    sent: Any,
    slot: int,
    ready: Any,
) -> None:
    """Write heartbeat frames until told to stop.

    PACED: visits each of its workers `hz` times a second, sending for the active ones (so a
    worker silenced or not yet registered sends nothing while the others keep their cadence).
    FLOOD: sends for the active workers in turn as fast as the allowance set by the controller
    lets it (the allowance keeps a bounded backlog in front of the consumer).
    """
    templates = _templates(spec)
    indices = spec.indices
    count = len(indices)
    sock = _connect_raw(spec.url)
    ready.set()
    pending = b""
    position = counter = visited = visited_at_start = 0
    last_mode, started = IDLE, 0.0
    tag = spec.tag
    while True:
        current = mode.value
        if current == STOP:
            break
        now = time.perf_counter()
        if current != last_mode:
            last_mode, started, visited_at_start = current, now, visited
        pending = _answer_server(sock, pending)
        if current == IDLE or count == 0:
            time.sleep(0.005)
            continue
        if current == PACED:
            visits = min(
                CHUNK, int((now - started) * count * hz.value) - (visited - visited_at_start)
            )
            sends = visits
        else:
            visits = count
            sends = min(CHUNK, allowed[slot] - sent[slot])
        frames = []
        while visits > 0 and sends > 0:
            visits -= 1
            visited += 1
            index = position
            position = position + 1 if position + 1 < count else 0
            if flags[indices[index]] != ACTIVE:
                continue
            counter += 1
            message_id = tag + b"%016x" % counter
            head, middle, tail = templates[index]
            frames.append(b"".join((head, message_id, middle, message_id, tail)))
            sends -= 1
        if frames:
            sock.sendall(b"".join(frames))
            sent[slot] += len(frames)
        else:
            time.sleep(0.002)
    sock.close()


def count_messages(url: str, received: Any, ready: Any, stop: Any) -> None:
    """The baseline: a plain nats-py subscriber that only counts the heartbeats it is given."""

    async def main() -> None:
        nc = await nats.connect(url)
        total = 0

        async def on_message(msg: Msg) -> None:
            nonlocal total
            total += 1

        # The registry's subject and client-side pending limit, so both consumers get the same.
        await nc.subscribe(
            subjects.job_heartbeats("*"), cb=on_message, pending_msgs_limit=1_000_000
        )
        await nc.flush()
        ready.set()
        while not stop.is_set():
            received.value = total
            await asyncio.sleep(0.01)
        received.value = total
        await nc.close()

    asyncio.run(main())


# -- controller ------------------------------------------------------------------------------------


@dataclass
class Generators:
    """The generator processes and the shared memory that steers them."""

    flags: Any
    mode: Any
    hz: Any
    allowed: Any
    sent: Any
    processes: list[Any] = field(default_factory=list)

    @property
    def total_sent(self) -> int:
        return int(sum(self.sent))

    def set_mode(self, mode: int, hz: float = 1.0) -> None:
        self.hz.value = hz
        self.mode.value = mode

    def allow(self, bases: Sequence[int], more: int) -> None:
        """Let each generator send `more` messages (its share of them) past its `bases` count."""
        share = more // len(self.allowed) + 1
        for slot, base in enumerate(bases):
            self.allowed[slot] = base + share

    def stop(self) -> None:
        self.mode.value = STOP
        for process in self.processes:
            process.join(10)
            if process.is_alive():
                process.kill()


def start_generators(url: str, job: str, workers: list[tuple[str, str]], count: int) -> Generators:
    ctx = mp.get_context("spawn")
    shared = Generators(
        flags=RawArray("b", len(workers)),
        mode=RawValue("i", IDLE),
        hz=RawValue("d", 1.0),
        allowed=RawArray("q", count),
        sent=RawArray("q", count),
    )
    readies = []
    run = uuid.uuid4().hex[:12]
    for slot in range(count):
        spec = GeneratorSpec(
            url=url,
            job=job,
            workers=workers,
            indices=list(range(slot, len(workers), count)),
            tag=f"{run}{slot:04x}".encode(),
        )
        ready = ctx.Event()
        process = ctx.Process(
            target=generate,
            args=(spec, shared.flags, shared.mode, shared.hz, shared.allowed, shared.sent, slot),
            kwargs={"ready": ready},
            daemon=True,
        )
        process.start()
        shared.processes.append(process)
        readies.append(ready)
    for ready in readies:
        if not ready.wait(60):
            raise SystemExit("a load generator did not start")
    return shared


async def http_get(port: int, path: str) -> bytes:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        await writer.drain()
        data = await reader.read()
    finally:
        writer.close()
        with contextlib.suppress(Exception):
            await writer.wait_closed()
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 200"):
        raise ConnectionError(head.decode(errors="replace").splitlines()[0] if head else "no reply")
    return body


@dataclass(frozen=True)
class Counts:
    at: float
    received: float
    applied: float
    rejected: float


async def registry_counts(port: int) -> Counts:
    at = time.perf_counter()
    text = (await http_get(port, "/metrics")).decode()
    received = applied = rejected = 0.0
    for line in text.splitlines():
        if line.startswith("strata_registry_heartbeats_received_total "):
            received = float(line.rsplit(" ", 1)[1])
        elif line.startswith("strata_registry_heartbeats_applied_total "):
            applied = float(line.rsplit(" ", 1)[1])
        elif line.startswith("strata_messages_rejected_total{") and (
            'consumer="registry.heartbeats"' in line
        ):
            rejected += float(line.rsplit(" ", 1)[1])
    return Counts(at, received, applied, rejected)


class RegistryProcess:
    def __init__(
        self,
        url: str,
        workdir: Path,
        args: argparse.Namespace,
        partition: int = 0,
        partitions: int = 1,
        name: str = "registry",
    ) -> None:
        self.port = procutil.free_port()
        self.log_file = workdir / f"{name}.log"
        env = {
            **os.environ,
            Env.NATS_URL: url,
            Env.HEARTBEAT_INTERVAL: str(args.interval),
            Env.HEARTBEAT_TIMEOUT: str(args.timeout),
            Env.HEALTH_PORT: str(self.port),
            Env.LOG_FORMAT: "json",
            Env.REGISTRY_PARTITIONS: str(partitions),
            Env.REGISTRY_PARTITION: str(partition),
        }
        profiled = args.profile and name == "registry"
        profile = ["-m", "cProfile", "-o", args.profile] if profiled else []
        self.proc = procutil.spawn_service("registry", env, self.log_file, python_args=profile)

    async def wait_ready(self, timeout: float = 30.0) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(OSError, ConnectionError):
                await http_get(self.port, "/readyz")
                return
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self.log_file.read_text(errors="replace").splitlines()[-20:]
                raise SystemExit("registry did not become ready:\n" + "\n".join(tail))
            await asyncio.sleep(0.1)

    def stop(self) -> None:
        procutil.terminate(self.proc, timeout=20)


@dataclass
class Detection:
    """Arrival times, on the controller's clock, of the victims' heartbeats and of the failures."""

    last_heartbeat: dict[str, float] = field(default_factory=dict)
    silenced_at: dict[str, float] = field(default_factory=dict)
    failed_at: dict[str, float] = field(default_factory=dict)

    def latencies(self, workers: Sequence[str]) -> list[float]:
        return [
            self.failed_at[w] - self.last_heartbeat[w]
            for w in workers
            if w in self.failed_at and w in self.last_heartbeat
        ]


@dataclass
class Phase:
    seconds: float
    offered: float
    received: float
    applied: float
    rejected: float
    victims: list[str]


class Pacer:
    """Keeps at most `window` heartbeats between the generators and the consumer.

    Open-loop flooding would only grow the broker's buffer for the consumer until nats-server
    cuts it off as a slow consumer; a bounded backlog keeps the consumer busy all the time, so
    what it takes in is its intake ceiling.
    """

    def __init__(
        self, generators: Generators, consumed: Callable[[], Awaitable[float]], window: int
    ) -> None:
        self.generators = generators
        self.consumed = consumed
        self.window = window
        self.base_sent: list[int] | None = None
        self.base_consumed = 0.0

    async def run(self, until: float) -> None:
        if self.base_sent is None:
            self.base_sent = list(self.generators.sent)
            self.base_consumed = await self.consumed()
        while True:
            taken = await self.consumed() - self.base_consumed
            self.generators.allow(self.base_sent, int(taken) + self.window)
            if time.perf_counter() >= until:
                return
            await asyncio.sleep(PACE_PERIOD_S)


async def silence_over_time(
    generators: Generators,
    victims: list[str],
    index_of: dict[str, int],
    detection: Detection,
    first: float,
    last: float,
) -> None:
    """Silence the victims one by one, evenly spread between `first` and `last` seconds from now."""
    start = time.perf_counter()
    for n, worker in enumerate(victims):
        at = start + first + (last - first) * n / max(1, len(victims) - 1)
        await asyncio.sleep(max(0.0, at - time.perf_counter()))
        generators.flags[index_of[worker]] = SILENT
        detection.silenced_at[worker] = time.perf_counter()


async def measure_baseline(url: str, generators: Generators, args: argparse.Namespace) -> float:
    ctx = mp.get_context("spawn")
    received, ready, stop = RawValue("q", 0), ctx.Event(), ctx.Event()
    process = ctx.Process(target=count_messages, args=(url, received, ready, stop), daemon=True)
    process.start()
    if not ready.wait(60):
        raise SystemExit("baseline subscriber did not start")

    async def consumed() -> float:
        return float(received.value)

    for index in range(len(generators.flags)):
        generators.flags[index] = ACTIVE
    pacer = Pacer(generators, consumed, args.window)
    await pacer.run(0.0)
    generators.set_mode(FLOOD)
    await pacer.run(time.perf_counter() + args.warmup)
    first, first_at = received.value, time.perf_counter()
    await pacer.run(first_at + args.baseline_s)
    last, last_at = received.value, time.perf_counter()
    generators.set_mode(IDLE)
    stop.set()
    process.join(10)
    for index in range(len(generators.flags)):
        generators.flags[index] = UNREGISTERED
    return (last - first) / (last_at - first_at)


async def run_phase(
    registry: RegistryProcess,
    generators: Generators,
    mode: int,
    seconds: float,
    victims: list[str],
    index_of: dict[str, int],
    detection: Detection,
    args: argparse.Namespace,
) -> Phase:
    async def consumed() -> float:
        return (await registry_counts(registry.port)).received

    pacer = Pacer(generators, consumed, args.window)
    if mode == FLOOD:
        await pacer.run(0.0)
    generators.set_mode(mode, args.hz)
    if mode == FLOOD:
        await pacer.run(time.perf_counter() + args.warmup)
    before, sent_before = await registry_counts(registry.port), generators.total_sent
    until = before.at + seconds
    # The last victim goes quiet early enough for its failure to land inside the phase.
    last = max(1.0, seconds - args.timeout - args.interval - 1.5)
    silencer = asyncio.create_task(
        silence_over_time(generators, victims, index_of, detection, min(1.0, last), last)
    )
    if mode == FLOOD:
        await pacer.run(until)
    else:
        await asyncio.sleep(max(0.0, until - time.perf_counter()))
    after, sent_after = await registry_counts(registry.port), generators.total_sent
    await silencer
    span = after.at - before.at
    return Phase(
        seconds=span,
        offered=(sent_after - sent_before) / span,
        received=(after.received - before.received) / span,
        applied=(after.applied - before.applied) / span,
        rejected=after.rejected - before.rejected,
        victims=victims,
    )


INTAKE_CONFIGS = ("baseline", "1 partition", "2 partitions")


def _as_delivered(frame: bytes, sid: int) -> bytes:
    """A generator's `HPUB` frame as the server hands it to subscription `sid` (`HMSG`)."""
    line, _, rest = frame.partition(b"\r\n")
    _, subject, header_len, total = line.split(b" ")
    return b"HMSG %s %d %s %s\r\n" % (subject, sid, header_len, total) + rest


async def cpu_per_heartbeat(passes: int, count: int = 10_000) -> tuple[list[float], list[float]]:
    """Microseconds of one process's CPU per heartbeat, in process, no socket: nats-py's parser
    fed the same frames, handing them to (a) a plain subscription whose callback counts them,
    (b) the registry's intake (`IntakeClient`) and heartbeat path, over `count` registered
    workers. Passes alternate; the machine's load moves both alike."""
    from nats.aio.subscription import Subscription
    from nats.protocol.parser import Parser
    from strata.services.registry.intake import IntakeClient
    from strata.services.registry.service import Registry

    job = "cpu-job"
    members = [(f"sim-{i:05d}", f"cpu-{i:05d}") for i in range(count)]
    spec = GeneratorSpec(
        url="", job=job, workers=members, indices=list(range(count)), tag=b"0" * 16
    )
    frames = [
        _as_delivered(b"".join((head, b"%032x" % n, middle, b"%032x" % n, tail)), sid=1)
        for n, (head, middle, tail) in enumerate(_templates(spec))
    ]
    chunks = [b"".join(frames[i : i + 200]) for i in range(0, count, 200)]

    plain = NATS()
    taken = 0
    all_taken = asyncio.Event()

    async def on_message(msg: Msg) -> None:
        nonlocal taken
        taken += 1
        if taken == count:
            all_taken.set()

    # nats-py's own subscription object, as `subscribe()` makes it, under sid 1 of the frames.
    sub = Subscription(plain, 1, "strata.hb.>", cb=on_message, pending_msgs_limit=1_000_000)
    plain._subs[1] = sub
    sub._start(plain._error_cb)
    plain_parser = Parser(plain)

    registry = Registry()
    for rank, (worker_id, instance) in enumerate(members):
        domain.evolve(
            registry.state,
            WorkerRegistered(
                job=job, source="registry", worker_id=worker_id, instance=instance, rank=rank,
                world_size=rank + 1, membership_epoch=rank + 1, heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            ),
        )  # fmt: skip
    intake = IntakeClient()
    intake.direct[1] = registry._take_heartbeat
    intake_parser = intake._ps  # the fast lane for heartbeat frames (`DirectParser`)

    async def through_plain() -> None:
        nonlocal taken
        taken = 0
        all_taken.clear()
        for chunk in chunks:
            await plain_parser.parse(chunk)
        await all_taken.wait()

    async def through_registry() -> None:
        for chunk in chunks:
            await intake_parser.parse(chunk)

    plain_us: list[float] = []
    registry_us: list[float] = []
    for _ in range(passes):
        for run, into in ((through_plain, plain_us), (through_registry, registry_us)):
            started = time.process_time()
            await run()
            into.append((time.process_time() - started) / count * 1e6)
    sub._stop_processing()
    if registry.applied != passes * count:
        raise SystemExit(f"the registry applied {registry.applied} of {passes * count} heartbeats")
    return plain_us, registry_us


async def measure_registry_intake(
    url: str,
    workdir: Path,
    generators: Generators,
    live: Sequence[int],
    partitions: int,
    round_no: int,
    args: argparse.Namespace,
) -> float:
    """Full-speed intake (heartbeats/s) of the registry run as `partitions` processes, summed.

    The processes rebuild membership from the stream (the workers registered earlier); only the
    `live` workers send, so every heartbeat takes the path of a live member's.
    """
    processes = [
        RegistryProcess(
            url, workdir, args, p, partitions, f"registry-round{round_no}-{partitions}p-{p}"
        )
        for p in range(partitions)
    ]
    try:
        for process in processes:
            await process.wait_ready()

        async def consumed() -> float:
            counts = await asyncio.gather(*(registry_counts(p.port) for p in processes))
            return sum(c.received for c in counts)

        for index in live:
            generators.flags[index] = ACTIVE
        pacer = Pacer(generators, consumed, args.window)
        await pacer.run(0.0)
        generators.set_mode(FLOOD)
        await pacer.run(time.perf_counter() + args.warmup)
        first, first_at = await consumed(), time.perf_counter()
        await pacer.run(first_at + args.round_s)
        last, last_at = await consumed(), time.perf_counter()
        generators.set_mode(IDLE)
        return (last - first) / (last_at - first_at)
    finally:
        generators.set_mode(IDLE)
        for index in range(len(generators.flags)):
            generators.flags[index] = UNREGISTERED
        for process in processes:
            process.stop()


async def intake_rounds(
    url: str,
    workdir: Path,
    generators: Generators,
    live: Sequence[int],
    args: argparse.Namespace,
) -> dict[str, list[float]]:
    """Rounds of the three configurations, the order rotated each round so that none always
    runs first (the shared machine's load drifts); rates per configuration, in round order."""
    rates: dict[str, list[float]] = {config: [] for config in INTAKE_CONFIGS}
    baseline_args = argparse.Namespace(**{**vars(args), "baseline_s": args.round_s})
    for round_no in range(args.rounds):
        shift = round_no % len(INTAKE_CONFIGS)
        for config in INTAKE_CONFIGS[shift:] + INTAKE_CONFIGS[:shift]:
            if config == "baseline":
                rate = await measure_baseline(url, generators, baseline_args)
            else:
                partitions = int(config.split()[0])
                rate = await measure_registry_intake(
                    url, workdir, generators, live, partitions, round_no, args
                )
            rates[config].append(rate)
            print(f"  round {round_no + 1}: {config:<13} {rate:>9,.0f}/s")
    return rates


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    if len(values) == 1:
        return values[0]
    return statistics.quantiles(values, n=100, method="inclusive")[int(q) - 1]


@dataclass
class Results:
    baselines: list[float] = field(default_factory=list)
    register_s: float = 0.0
    register_failed: int = 0
    phases: list[Phase] = field(default_factory=list)
    detection: Detection = field(default_factory=Detection)
    failures: list[WorkerFailed] = field(default_factory=list)
    workers: set[str] = field(default_factory=set)
    live: set[str] = field(default_factory=set)
    sent_to_registry: int = 0
    received_by_registry: float = 0.0
    slow_consumers: int = 0
    server_version: str = "?"
    load: list[float] = field(default_factory=list)
    intake: dict[str, list[float]] = field(default_factory=dict)
    cpu: tuple[list[float], list[float]] = ([], [])


async def live_members(bus: Bus, job: str) -> set[str]:
    """The job's live workers, replayed from its events through the registry's own `evolve`.

    (The `members` RPC cannot answer for 10,000 workers: its reply exceeds NATS's 1 MB default
    max_payload.)
    """
    state = domain.RegistryState()
    async with EventFeed(bus.js, subjects.EVENTS_STREAM, subjects.job_events(job)) as feed:
        async for delivered in feed:
            domain.evolve(state, delivered.event)
            if feed.caught_up.is_set():
                break
    found = state.jobs.get(job)
    return {found.ranks[rank] for rank in found.ranks} if found else set()


async def measure(args: argparse.Namespace, workdir: Path) -> Results:
    results = Results(load=[os.getloadavg()[0]])
    print(f"CPU per heartbeat in process, {args.cpu_passes} alternating passes ...")
    results.cpu = await cpu_per_heartbeat(args.cpu_passes)
    server = NatsServer(store_dir=workdir / "nats")
    server.start()
    registry: RegistryProcess | None = None
    generators: Generators | None = None
    detection = results.detection
    try:
        bus = await Bus.connect(server.url, name="strata-bench-controller")
        # The baseline's heartbeats must cost the server what the registry's do: stored too.
        await bus.ensure_streams()
        job = f"bench-{uuid.uuid4().hex[:6]}"
        run = uuid.uuid4().hex[:8]
        workers = [(f"sim-{i:05d}", f"{run}-{i:05d}") for i in range(args.workers)]
        index_of = {worker: i for i, (worker, _) in enumerate(workers)}
        results.workers = set(index_of)
        generators = start_generators(server.url, job, workers, args.generators)

        print(f"baseline (before): plain nats-py subscriber, {args.baseline_s:g} s ...")
        results.baselines.append(await measure_baseline(server.url, generators, args))

        print("starting the registry and registering the simulated workers ...")
        registry = RegistryProcess(server.url, workdir, args)
        await registry.wait_ready()
        sent_before_registry = generators.total_sent
        # Victims: spread over the rank range, disjoint between the phases.
        wanted = args.silence + args.full_silence
        step = max(1, args.workers // (wanted + 1))
        chosen = [workers[i * step][0] for i in range(1, wanted + 1)]
        steady_victims, full_victims = chosen[: args.silence], chosen[args.silence :]
        all_failed = asyncio.Event()

        async def on_failed(msg: Msg) -> None:
            event = decode_event(msg.data)
            if isinstance(event, WorkerFailed):
                detection.failed_at.setdefault(event.worker_id, time.perf_counter())
                results.failures.append(event)
                if set(chosen) <= set(detection.failed_at):
                    all_failed.set()

        async def on_victim_heartbeat(msg: Msg) -> None:
            worker = subjects.parse_heartbeat_subject(msg.subject)[1]
            # The second baseline sends for every worker again; a failure already seen is final.
            if worker not in detection.failed_at:
                detection.last_heartbeat[worker] = time.perf_counter()

        await bus.nc.subscribe(subjects.event_subject(job, "worker.failed"), cb=on_failed)
        for worker in chosen:
            await bus.nc.subscribe(subjects.heartbeat_subject(job, worker), cb=on_victim_heartbeat)
        await bus.nc.flush()

        # Heartbeats start for each worker as soon as it is registered, as a real worker's do:
        # the registration clients flag each worker active as its reply comes in, and the
        # generators, visiting every worker once a second, send its first within a second.
        generators.set_mode(PACED, args.hz)
        start = await asyncio.to_thread(
            register_workers,
            server.url,
            job,
            workers,
            args.register_procs,
            flags=generators.flags,
            active=ACTIVE,
        )
        results.register_s = start.seconds
        results.register_failed = start.failed
        print(f"registered {len(workers):,} workers in {results.register_s:.2f} s")

        print(f"1 Hz: {args.steady_s:g} s, silencing {len(steady_victims)} workers ...")
        results.phases.append(
            await run_phase(
                registry, generators, PACED, args.steady_s, steady_victims, index_of, detection,
                args,
            )
        )  # fmt: skip
        print(f"full speed: {args.full_s:g} s, silencing {len(full_victims)} workers ...")
        results.phases.append(
            await run_phase(
                registry, generators, FLOOD, args.full_s, full_victims, index_of, detection, args
            )
        )
        generators.set_mode(PACED, args.hz)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_failed.wait(), args.timeout + args.interval + 5)
        results.live = await live_members(bus, job)
        # Lost heartbeats: stop sending, let the registry drain, compare with what was sent.
        # (Done within the timeout, before the now silent workers could be failed.)
        generators.set_mode(IDLE)
        results.sent_to_registry = generators.total_sent - sent_before_registry
        previous = -1.0
        while True:
            await asyncio.sleep(0.2)
            received = (await registry_counts(registry.port)).received
            if received == previous:
                break
            previous = received
        results.received_by_registry = received
        registry.stop()
        registry = None

        print(f"baseline (after): plain nats-py subscriber, {args.baseline_s:g} s ...")
        results.baselines.append(await measure_baseline(server.url, generators, args))
        varz = server.varz()
        results.server_version = str(varz.get("version", "?"))
        results.slow_consumers = int(varz.get("slow_consumers", 0))

        print(
            f"intake: {args.rounds} rounds of a plain nats-py subscriber, 1 registry partition "
            f"and 2, {args.round_s:g} s each ..."
        )
        silenced = set(chosen)
        live = [i for i, (worker, _) in enumerate(workers) if worker not in silenced]
        results.intake = await intake_rounds(server.url, workdir, generators, live, args)
        await bus.close()
    finally:
        if generators is not None:
            generators.stop()
        if registry is not None:
            registry.stop()
        server.stop()
    results.load.append(os.getloadavg()[0])
    return results


def report(args: argparse.Namespace, results: Results) -> bool:
    """Print the table; True when both aims are met."""
    steady, full = results.phases
    detection = results.detection
    bound = args.timeout + args.interval
    victims = set(steady.victims) | set(full.victims)
    failed = {f.worker_id for f in results.failures}
    wrong = sorted(failed - victims)
    missed = sorted(victims - failed)
    steady_lat = detection.latencies(steady.victims)
    full_lat = detection.latencies(full.victims)
    baseline = statistics.mean(results.baselines)
    ratio = full.received / baseline if baseline else float("nan")
    print()
    print(
        f"registry heartbeat intake: {args.workers:,} simulated workers, nats-py "
        f"{importlib.metadata.version('nats-py')} on nats-server {results.server_version}, "
        f"Python {platform.python_version()}, {os.cpu_count()} cores shared "
        f"(load average {results.load[0]:.1f} before, {results.load[-1]:.1f} after); "
        f"registry heartbeat interval {args.interval:g} s, timeout {args.timeout:g} s"
    )
    print()
    header = (
        f"{'phase':<32} {'offered':>10} {'received':>10} {'applied':>10} "
        f"{'baseline':>10} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    print(
        f"{f'1 Hz x {args.workers:,} workers':<32} {steady.offered:>8,.0f}/s "
        f"{steady.received:>8,.0f}/s {steady.applied:>8,.0f}/s {'':>10} {'':>6}"
    )
    print(
        f"{f'full speed (<= {args.window:,} in flight)':<32} {full.offered:>8,.0f}/s "
        f"{full.received:>8,.0f}/s {full.applied:>8,.0f}/s {baseline:>8,.0f}/s {ratio:>6.2f}"
    )
    print()
    print(
        "baseline: a plain nats-py subscriber process counting the same generator's heartbeats "
        f"at full speed, before and after the registry: "
        f"{', '.join(f'{b:,.0f}/s' for b in results.baselines)}"
    )
    register_ok = (
        results.register_s <= REGISTER_AIM_S * args.workers / REGISTER_AIM_WORKERS
        and results.register_failed == 0
    )
    print(
        f"registration: {args.workers:,} workers in {results.register_s:.2f} s "
        f"({args.workers / results.register_s:,.0f}/s, all offered at once from "
        f"{args.register_procs} client processes, {results.register_failed} failed; aim "
        f"{REGISTER_AIM_WORKERS:,} in <= {REGISTER_AIM_S:g} s: "
        f"{'met' if register_ok else 'MISSED'})"
    )
    lost = results.sent_to_registry - results.received_by_registry
    rejected = sum(p.rejected for p in results.phases)
    print(
        f"heartbeats sent while the registry ran {results.sent_to_registry:,}, received "
        f"{results.received_by_registry:,.0f} (lost {lost:,.0f}); slow consumers reported by "
        f"nats-server: {results.slow_consumers}; rejected by the registry {rejected:,.0f}"
    )
    print()
    decided = {f.worker_id: (f.ts - f.last_heartbeat_ts) / 1e9 for f in results.failures}
    steady_own = [decided[w] for w in steady.victims if w in decided]
    full_own = [decided[w] for w in full.victims if w in decided]
    backlog_s = args.window / full.received if full.received else float("nan")
    print(f"detection latency of the silenced workers, bound timeout + one interval = {bound:g} s:")
    rows = (
        ("1 Hz, end to end", steady_lat),
        ("1 Hz, registry's clock", steady_own),
        ("full speed, end to end", full_lat),
        ("full speed, registry's clock", full_own),
    )
    for label, values in rows:
        if values:
            print(
                f"  {label:<29} n={len(values):<3} p50 {percentile(values, 50):.2f} s   "
                f"p99 {percentile(values, 99):.2f} s   max {max(values):.2f} s"
            )
    print(
        "  end to end: the last heartbeat seen on the bus -> worker.failed seen, both by the "
        "controller; registry's clock: its last heartbeat applied -> the failure decided.\n"
        f"  At full speed up to {args.window:,} heartbeats queue in front of the registry "
        f"(~{backlog_s:.2f} s), which end to end includes."
    )
    print(
        f"failed: {len(victims & failed)} of {len(victims)} silenced workers, "
        f"{len(wrong)} others{' (' + ', '.join(wrong[:5]) + ')' if wrong else ''}; "
        f"live at the end {len(results.live):,} (expected {args.workers - len(victims):,})"
    )
    print()
    detect_ok = (
        bool(steady_lat)
        and bool(full_own)
        and max(steady_lat + steady_own + full_own) <= bound
        and not wrong
        and not missed
        and results.live == results.workers - victims
    )
    plain_us, registry_us = results.cpu
    print()
    print(
        "CPU per heartbeat, in process (nats-py's parser fed the same frames; median, min to max "
        "of the passes):"
    )
    print(f"  {'plain nats-py subscription':<28} {_spread(plain_us, '.2f')} us")
    print(f"  {'registry intake and checks':<28} {_spread(registry_us, '.2f')} us")
    ratios = intake_report(results.intake)
    one = statistics.median(ratios["1 partition"]) if ratios["1 partition"] else 0.0
    rate_ok = one >= AIM_RATIO
    print()
    print(
        f"aim: one registry process takes in >= {AIM_RATIO:g} of what the plain nats-py "
        f"subscriber does (median of the rounds' ratios): {one:.2f}, "
        f"{'met' if rate_ok else 'MISSED'}"
    )
    print(
        f"aim: every silenced worker failed within timeout + one interval ({bound:g} s; at full "
        f"speed on the registry's clock), no other worker failed: "
        f"{'met' if detect_ok else 'MISSED'}"
    )
    return rate_ok and detect_ok and register_ok


def _spread(values: list[float], fmt: str) -> str:
    if not values:
        return "not measured"
    return (
        f"{statistics.median(values):{fmt}} ({min(values):{fmt}} to {max(values):{fmt}}, "
        f"n={len(values)})"
    )


def intake_report(intake: dict[str, list[float]]) -> dict[str, list[float]]:
    """Print the rounds' rates and ratios; each configuration's per-round ratios to the
    subscriber of the same round."""
    baselines = intake.get("baseline", [])
    ratios = {
        config: [rate / base for rate, base in zip(intake.get(config, []), baselines, strict=False)]
        for config in INTAKE_CONFIGS[1:]
    }
    print()
    print("full-speed intake, alternating rounds: median (min to max) of the rounds")
    print(f"  {'plain nats-py subscriber':<28} {_spread(baselines, ',.0f')} hb/s")
    for config in INTAKE_CONFIGS[1:]:
        label = f"registry, {config}"
        print(
            f"  {label:<28} {_spread(intake.get(config, []), ',.0f')} hb/s, "
            f"ratio {_spread(ratios[config], '.2f')}"
        )
    return ratios


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=10_000, help="simulated workers")
    parser.add_argument(
        "--register-procs",
        type=int,
        default=REGISTER_PROCS,
        help="processes offering the registrations, all at once (a job start)",
    )
    parser.add_argument("--hz", type=float, default=1.0, help="heartbeats per worker and second")
    parser.add_argument("--interval", type=float, default=1.0, help="registry heartbeat interval")
    parser.add_argument("--timeout", type=float, default=2.0, help="registry heartbeat timeout")
    parser.add_argument("--steady-s", type=float, default=20.0, help="seconds at 1 Hz")
    parser.add_argument("--full-s", type=float, default=15.0, help="seconds at full speed")
    parser.add_argument("--baseline-s", type=float, default=6.0, help="seconds of the baseline")
    parser.add_argument("--warmup", type=float, default=2.0, help="untimed seconds at full speed")
    parser.add_argument("--silence", type=int, default=50, help="workers silenced at 1 Hz")
    parser.add_argument("--full-silence", type=int, default=10, help="silenced at full speed")
    parser.add_argument("--window", type=int, default=10_000, help="most heartbeats in flight")
    parser.add_argument("--generators", type=int, default=1, help="load generator processes")
    parser.add_argument("--rounds", type=int, default=3, help="alternating intake rounds")
    parser.add_argument("--cpu-passes", type=int, default=15, help="in-process CPU passes")
    parser.add_argument("--round-s", type=float, default=6.0, help="seconds of each intake")
    parser.add_argument("--profile", help="run the registry under cProfile, stats to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 if an aim is missed")
    parser.add_argument("--keep", help="work in this directory and keep it (registry log, store)")
    return parser.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    configure_logging("console", "warning")
    if args.keep:
        workdir = Path(args.keep)
        workdir.mkdir(parents=True, exist_ok=True)
        results = asyncio.run(measure(args, workdir))
    else:
        with tempfile.TemporaryDirectory(prefix="strata-bench-registry-") as temporary:
            results = asyncio.run(measure(args, Path(temporary)))
    met = report(args, results)
    return 1 if args.check and not met else 0


if __name__ == "__main__":
    sys.exit(main())
