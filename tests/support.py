"""Helpers shared by the tests: real service processes, polling with a deadline, unique job ids."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from uuid import uuid4

import pytest
import strata.aio
from strata import procutil
from strata.bus import Bus, EventFeed
from strata.config import Env
from strata.events import AnyEvent, WorkerRegistered, subjects
from strata.events.requests import Lease

HEARTBEAT_INTERVAL = 0.2
HEARTBEAT_TIMEOUT = 1.0
POLL = 0.02


def new_job(prefix: str = "job") -> str:
    """A job id of the test's own, so tests on a shared server never see each other's events."""
    return f"{prefix}-{uuid4().hex[:8]}"


def wait_until(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(POLL)


async def async_wait_until(
    condition: Callable[[], Awaitable[bool]], timeout: float, what: str
) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(POLL)


READY_TIMEOUT_S = 90.0
"""How long a service may take to become ready: on a 2-core machine shared by several test runs
(load 30 and more), importing the service alone took 10 s of wall time for 0.8 s of CPU, and a
30 s bound failed whole fault modules before any fault was injected. A bound on a poll: a
service that is ready sooner is used sooner."""


class ServiceProcess:
    """`python -m strata.services.<name>` in a child process, ready once /readyz says 200."""

    def __init__(
        self,
        name: str,
        nats_url: str,
        log_dir: Path,
        *,
        heartbeat_interval: float = HEARTBEAT_INTERVAL,
        heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
        env: dict[str, str] | None = None,
        health_port: int | None = None,
    ) -> None:
        self.name = name
        self.health_port = procutil.free_port() if health_port is None else health_port
        self.log_file = log_dir / f"{name}-{self.health_port}.log"
        self.env = {
            **os.environ,
            Env.NATS_URL: nats_url,
            Env.HEARTBEAT_INTERVAL: str(heartbeat_interval),
            Env.HEARTBEAT_TIMEOUT: str(heartbeat_timeout),
            Env.HEALTH_PORT: str(self.health_port),
            Env.LOG_FORMAT: "json",
            **(env or {}),
        }
        self.proc: subprocess.Popen[bytes] | None = None

    def _ready(self) -> bool:
        """Whether /readyz on this service's port says 200 and names this service: another
        process that took the port first (this one then failed to bind it) is not this one."""
        url = f"http://127.0.0.1:{self.health_port}/readyz"
        try:
            with urllib.request.urlopen(url, timeout=1) as response:
                body = json.loads(response.read())
                return bool(response.status == 200 and body.get("service") == self.name)
        except (urllib.error.URLError, OSError, ValueError):
            return False

    def log_tail(self, lines: int = 30) -> str:
        text = self.log_file.read_text(encoding="utf-8", errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    def start(self, timeout: float = READY_TIMEOUT_S) -> ServiceProcess:
        return self.launch().wait_ready(timeout)

    def launch(self) -> ServiceProcess:
        """Start the process without waiting for it (children die with the launching thread)."""
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        self.proc = procutil.spawn_service(self.name, self.env, self.log_file)
        return self

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> ServiceProcess:
        assert self.proc is not None, "launch() first"
        deadline = time.monotonic() + timeout
        while not self._ready():
            if self.proc.poll() is not None:
                pytest.fail(f"{self.name} exited with {self.proc.returncode}:\n{self.log_tail()}")
            if time.monotonic() >= deadline:
                self.kill()
                pytest.fail(f"{self.name} not ready after {timeout}s:\n{self.log_tail()}")
            # Waiting on the process is the pause between polls, and notices a crash at once.
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(timeout=0.05)
        return self

    def kill(self) -> None:
        """SIGKILL, as a crash would."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            procutil.terminate(self.proc, timeout=10)


SERVICES: tuple[str, ...] = ("registry", "sharding", "checkpoint", "barrier")
"""Every stateful service: what a training job needs running."""


@contextlib.contextmanager
def running_services(
    nats_url: str,
    log_dir: Path,
    names: tuple[str, ...] = SERVICES,
    env: dict[str, str] | None = None,
    *,
    heartbeat_interval: float = HEARTBEAT_INTERVAL,
    heartbeat_timeout: float = HEARTBEAT_TIMEOUT,
) -> Iterator[list[ServiceProcess]]:
    """The services started together (launched at once, then each waited for), stopped after."""
    # Ports chosen together are distinct: one chosen at a time can be handed out twice.
    ports = procutil.free_ports(len(names))
    services = [
        ServiceProcess(
            name,
            nats_url,
            log_dir,
            env=env,
            health_port=port,
            heartbeat_interval=heartbeat_interval,
            heartbeat_timeout=heartbeat_timeout,
        )
        for name, port in zip(names, ports, strict=True)
    ]
    for service in services:
        service.launch()
    try:
        for service in services:
            service.wait_ready()
        yield services
    finally:
        for service in services:
            service.stop()


def numbered(count: int) -> list[str]:
    """Worker ids w000, w001, ..."""
    return [f"w{i:03d}" for i in range(count)]


async def start_workers(
    made: list[strata.aio.Worker], job: str, nats_url: str, ids: list[str], group: int = 10
) -> list[strata.aio.Worker]:
    """Start a worker per id, `group` at a time, and add them to `made` (stopped by the fixture).

    Every start is a registration plus the membership events it causes at every other worker of
    the process; all at once, that blocks this process's event loop (and so every worker's
    heartbeats) for seconds on a loaded 2-core machine. Smaller groups spread the same work out.
    """
    new = [strata.aio.Worker(job, nats_url, worker_id=worker_id) for worker_id in ids]
    made.extend(new)
    for first in range(0, len(new), group):
        await asyncio.gather(*(worker.start() for worker in new[first : first + group]))
    return new


async def record_registrations(bus: Bus, job: str, workers: list[str]) -> None:
    """Store the registry's `worker.registered` for each of `workers` (rank = position), as a
    registry would: for services under test with no registry, whose workers never heartbeat."""
    await bus.publish_many(
        [
            WorkerRegistered(
                job=job,
                source="registry",
                worker_id=worker,
                instance=f"p-{worker}",
                rank=rank,
                world_size=rank + 1,
                membership_epoch=rank + 1,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
            for rank, worker in enumerate(workers)
        ]
    )


def recorded_lease(workers: list[str], worker: str) -> Lease:
    """The lease `record_registrations(bus, job, workers)` gave `worker`."""
    return Lease(worker_id=worker, instance=f"p-{worker}", epoch=workers.index(worker) + 1)


async def job_events(bus: Bus, job: str) -> list[AnyEvent]:
    """Every event of `job` stored so far, in stream order."""
    events: list[AnyEvent] = []
    feed = await EventFeed(bus.js, subjects.EVENTS_STREAM, subjects.job_events(job)).start()
    try:
        if feed.caught_up.is_set():
            return events
        async with asyncio.timeout(20):
            async for delivered in feed:
                events.append(delivered.event)
                if feed.caught_up.is_set():
                    break
    finally:
        await feed.stop()
    return events
