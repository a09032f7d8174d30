"""A job start of simulated workers: 10,000 registrations offered at once to one registry.

The client must offer more than the registry takes, or the figure is the client's: each of several
client processes speaks NATS directly on one socket, with every request pre-encoded (the real
`RegisterRequest`, packed by the real codec) and all of them written at once, replies to an inbox
of its own, each reply decoded and checked. The baseline, in the same run and alternating rounds,
is the same client against a plain nats-py responder that answers every request with a fixed
reply: what a Python NATS service costs before it decides anything.

    python -m bench.registration --workers 10000 --procs 2 --rounds 3 [--check] [--profile FILE]

`bench.registry` uses the same client for its registration row, under heartbeat load.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import select
import socket
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.sharedctypes import RawArray
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import msgpack
import nats
from nats.aio.msg import Msg
from strata import procutil
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import pack, subjects
from strata.events.requests import RegisterRequest

AIM_WORKERS = 10_000
AIM_SECONDS = 2.0
REGISTER = subjects.rpc_subject("registry", "register")
ECHO = "bench.registration.echo"
REPLY_TIMEOUT_S = 60.0


# -- the client (child processes) ------------------------------------------------------------------


@dataclass(frozen=True)
class ClientSpec:
    url: str
    subject: str
    job: str
    workers: list[tuple[str, str]]
    """(worker id, instance) of every simulated worker; this client registers `indices`."""
    indices: list[int]


def _frames(spec: ClientSpec, inbox: str) -> list[bytes]:
    frames = []
    for index in spec.indices:
        worker_id, instance = spec.workers[index]
        request = RegisterRequest(job=spec.job, worker_id=worker_id, instance=instance)
        payload = pack(request.model_dump())
        frames.append(
            f"PUB {spec.subject} {inbox}.{index} {len(payload)}\r\n".encode() + payload + b"\r\n"
        )
    return frames


def _connect(url: str, name: str) -> socket.socket:
    parsed = urlparse(url)
    sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 4222), 10)
    buffer = b""
    while not buffer.endswith(b"\r\n"):
        buffer += sock.recv(4096)
    if not buffer.startswith(b"INFO"):
        raise SystemExit(f"not a NATS server at {url}: {buffer[:80]!r}")
    connect = (
        b'{"verbose":false,"pedantic":false,"headers":true,"no_responders":true,'
        b'"protocol":1,"lang":"python","version":"bench","name":"' + name.encode() + b'"}'
    )
    sock.sendall(b"CONNECT " + connect + b"\r\nPING\r\n")
    buffer = b""
    while b"PONG\r\n" not in buffer:
        chunk = sock.recv(4096)
        if not chunk or b"-ERR" in chunk:
            raise SystemExit(f"nats-server refused the client: {chunk!r}")
        buffer += chunk
    return sock


class _Replies:
    """Reads the MSG frames of the inbox subscription (sid 1) off the socket and decodes them."""

    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.buffer = b""

    def read(self, timeout: float) -> list[tuple[int, bytes]]:
        """(worker index, payload) of every complete reply that arrived within `timeout`."""
        if not select.select([self.sock], [], [], timeout)[0]:
            return []
        data = self.sock.recv(1 << 20)
        if not data:
            raise SystemExit("nats-server closed the client's connection")
        buffer = self.buffer + data
        out = []
        at = 0
        while True:
            end = buffer.find(b"\r\n", at)
            if end < 0:
                break
            line = buffer[at:end]
            if line.startswith(b"MSG "):
                parts = line.split(b" ")
                size = int(parts[-1])
                if len(buffer) < end + 2 + size + 2:
                    break
                payload = buffer[end + 2 : end + 2 + size]
                out.append((int(parts[1].rsplit(b".", 1)[1]), payload))
                at = end + 2 + size + 2
                continue
            if line == b"PING":
                self.sock.sendall(b"PONG\r\n")
            elif line.startswith(b"-ERR"):
                raise SystemExit(f"nats-server error: {line!r}")
            at = end + 2
        self.buffer = buffer[at:]
        return out


def register_all(
    spec: ClientSpec, flags: Any, active: int, ready: Any, go: Any, results: Any, slot: int
) -> None:
    """Write every request of `spec` at once when `go` is set, then read every reply.

    `results[slot]` gets (seconds from `go` to the last reply, failed replies); a worker whose
    registration succeeded gets `flags[index] = active` at once (its heartbeats may start).
    """
    inbox = f"_INBOX.bench{uuid.uuid4().hex[:12]}"
    frames = _frames(spec, inbox)
    sock = _connect(spec.url, f"strata-bench-register-{slot}")
    sock.sendall(f"SUB {inbox}.* 1\r\nPING\r\n".encode())
    replies = _Replies(sock)
    while not sock.recv(4096).endswith(b"PONG\r\n"):
        pass
    ready.set()
    go.wait()
    started = time.perf_counter()
    sock.sendall(b"".join(frames))
    waiting = set(spec.indices)
    failed = 0
    deadline = started + REPLY_TIMEOUT_S
    while waiting and time.perf_counter() < deadline:
        for index, payload in replies.read(0.5):
            if index not in waiting:
                continue
            waiting.discard(index)
            body = msgpack.unpackb(payload)
            if isinstance(body, dict) and body.get("ok") is True:
                if flags is not None:
                    flags[index] = active
            else:
                failed += 1
    seconds = time.perf_counter() - started
    results[2 * slot] = seconds
    results[2 * slot + 1] = failed + len(waiting)
    sock.close()


@dataclass(frozen=True)
class Start:
    seconds: float
    failed: int


def register_workers(
    url: str,
    job: str,
    workers: list[tuple[str, str]],
    procs: int,
    *,
    subject: str = REGISTER,
    flags: Any = None,
    active: int = 1,
) -> Start:
    """Register `workers` of `job` from `procs` client processes at once; the time until the last
    reply. With `flags` (a shared array), each registered worker's flag is set to `active`."""
    ctx = mp.get_context("spawn")
    go = ctx.Event()
    results = RawArray("d", 2 * procs)
    children = []
    readies = []
    for slot in range(procs):
        spec = ClientSpec(url, subject, job, workers, list(range(slot, len(workers), procs)))
        ready = ctx.Event()
        child = ctx.Process(
            target=register_all,
            args=(spec, flags, active, ready, go, results, slot),
            daemon=True,
        )
        child.start()
        children.append(child)
        readies.append(ready)
    for ready in readies:
        if not ready.wait(60):
            raise SystemExit("a registration client did not start")
    go.set()
    for child in children:
        child.join(REPLY_TIMEOUT_S + 30)
        if child.is_alive():
            child.kill()
            raise SystemExit("a registration client did not finish")
    return Start(
        seconds=max(results[2 * slot] for slot in range(procs)),
        failed=int(sum(results[2 * slot + 1] for slot in range(procs))),
    )


# -- the baseline responder ------------------------------------------------------------------------


def respond(url: str, ready: Any, stop: Any) -> None:
    """A plain nats-py service: one fixed reply to every request, nothing decided."""

    async def main() -> None:
        nc = await nats.connect(url, name="strata-bench-echo")
        reply = pack({"ok": True, "result": {}})

        async def answer(msg: Msg) -> None:
            await nc.publish(msg.reply, reply)

        await nc.subscribe(ECHO, cb=answer, pending_msgs_limit=1_000_000)
        await nc.flush()
        ready.set()
        await asyncio.to_thread(stop.wait)
        await nc.close()

    asyncio.run(main())


# -- the parent ------------------------------------------------------------------------------------


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process `pid` so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def simulated(count: int) -> list[tuple[str, str]]:
    run = uuid.uuid4().hex[:8]
    return [(f"sim-{i:05d}", f"{run}-{i:05d}") for i in range(count)]


def spread(values: Sequence[float]) -> str:
    return f"{min(values):,.0f} to {max(values):,.0f}"


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=AIM_WORKERS)
    parser.add_argument("--procs", type=int, default=2, help="client processes")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--profile", help="run the registry under cProfile, stats to this file")
    parser.add_argument("--check", action="store_true", help="exit 1 if the aim is missed")
    args = parser.parse_args(argv)

    rates: dict[str, list[float]] = {"baseline": [], "registry": []}
    seconds: list[float] = []
    cpu_us: list[float] = []
    failed = 0
    ctx = mp.get_context("spawn")
    with (
        tempfile.TemporaryDirectory(prefix="strata-bench-registration-") as tmp,
        NatsServer(store_dir=Path(tmp) / "nats") as server,
    ):
        port = procutil.free_port()
        env = {
            **os.environ,
            Env.NATS_URL: server.url,
            Env.HEALTH_PORT: str(port),
            # Nobody heartbeats here: no registration may time out during the run.
            Env.HEARTBEAT_INTERVAL: "60",
            Env.HEARTBEAT_TIMEOUT: "600",
            Env.LOG_FORMAT: "json",
        }
        profile = ["-m", "cProfile", "-o", args.profile] if args.profile else []
        log_file = Path(tmp) / "registry.log"
        registry = procutil.spawn_service("registry", env, log_file, python_args=profile)
        ready, stop = ctx.Event(), ctx.Event()
        echo = ctx.Process(target=respond, args=(server.url, ready, stop), daemon=True)
        echo.start()
        try:
            if not ready.wait(60):
                raise SystemExit("the echo responder did not start")
            _wait_registry(server.url, log_file)
            for round_index in range(args.rounds):
                for mode in ("baseline", "registry"):
                    job = f"start-{uuid.uuid4().hex[:8]}"
                    subject = ECHO if mode == "baseline" else REGISTER
                    cpu_before = cpu_seconds(registry.pid)
                    start = register_workers(
                        server.url, job, simulated(args.workers), args.procs, subject=subject
                    )
                    rates[mode].append(args.workers / start.seconds)
                    cost = ""
                    if mode == "registry":
                        seconds.append(start.seconds)
                        failed += start.failed
                        used = cpu_seconds(registry.pid) - cpu_before
                        cpu_us.append(used / args.workers * 1e6)
                        cost = f", registry CPU {cpu_us[-1]:.0f} us per registration"
                    print(
                        f"round {round_index + 1} {mode:8s} {args.workers:,} registrations "
                        f"in {start.seconds:5.2f} s ({args.workers / start.seconds:7,.0f}/s), "
                        f"{start.failed} failed{cost}",
                        flush=True,
                    )
        finally:
            stop.set()
            echo.join(10)
            procutil.terminate(registry, timeout=30)
    ours = statistics.median(rates["registry"])
    baseline = statistics.median(rates["baseline"])
    took = statistics.median(seconds)
    met = took <= AIM_SECONDS and failed == 0
    print(
        f"\n{args.workers:,} registrations offered at once from {args.procs} client processes "
        f"(median of {args.rounds} rounds, {os.cpu_count()} cores shared, load "
        f"{os.getloadavg()[0]:.1f}):"
        f"\n  registry                 {ours:7,.0f}/s  ({spread(rates['registry'])}), "
        f"{took:.2f} s, {failed} failed, registry CPU {statistics.median(cpu_us):.0f} us "
        f"per registration ({min(cpu_us):.0f} to {max(cpu_us):.0f})"
        f"\n  nats-py fixed responder  {baseline:7,.0f}/s  ({spread(rates['baseline'])})"
        f"\n  ratio {ours / baseline:.2f}; aim: {AIM_WORKERS:,} in <= {AIM_SECONDS:g} s "
        f"({AIM_WORKERS / AIM_SECONDS:,.0f}/s): {'met' if met else 'MISSED'}"
    )
    return 1 if args.check and not met else 0


def _wait_registry(url: str, log_file: Path, timeout: float = 60.0) -> None:
    """Until the registry answers a ping (it serves once its state is rebuilt)."""

    async def ping() -> bool:
        nc = await nats.connect(url)
        try:
            deadline = time.monotonic() + timeout
            while time.monotonic() < deadline:
                try:
                    await nc.request(subjects.rpc_subject("registry", "ping"), pack({}), timeout=1)
                    return True
                except (nats.errors.NoRespondersError, nats.errors.TimeoutError):
                    await asyncio.sleep(0.1)
            return False
        finally:
            await nc.close()

    if not asyncio.run(ping()):
        tail = log_file.read_text(errors="replace")[-2000:]
        raise SystemExit(f"the registry did not start:\n{tail}")


if __name__ == "__main__":
    sys.exit(main())
