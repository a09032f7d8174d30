"""Fault tests: real processes (nats-server, the registry, workers) paused, cut off, or with
their clocks stepped, and the registry's verdicts checked against what really happened.

Heartbeats as in a real job: a 1 s interval, a 3 s timeout (3 heartbeats per timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import select
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
from strata.bus import Bus
from strata.errors import StrataError
from strata.events import WorkerFailed

from tests.support import ServiceProcess, job_events

INTERVAL = 1.0
TIMEOUT = 3.0
DETECTION_BOUND = 6.0
"""How long after a worker's timeout a loaded machine may take to record its failure."""
ROOT = Path(__file__).resolve().parents[2]


def registry(
    nats_url: str,
    logs: Path,
    env: dict[str, str] | None = None,
    *,
    interval: float = INTERVAL,
    timeout: float = TIMEOUT,
) -> ServiceProcess:
    return ServiceProcess(
        "registry", nats_url, logs, heartbeat_interval=interval, heartbeat_timeout=timeout, env=env
    )


class Heartbeater:
    """`tests.faults.heartbeater` in a child process: a worker that registers and heartbeats."""

    def __init__(self, job: str, nats_url: str, worker_id: str, work: tuple[str, ...] = ()):
        self.worker_id = worker_id
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.faults.heartbeater", job, nats_url, worker_id, *work],
            cwd=ROOT,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )

    def wait_line(self, prefix: str, timeout: float = 60.0) -> str:
        """The next line it prints, which must start with `prefix`."""
        assert self.proc.stdout is not None
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                pytest.fail(f"{self.worker_id} printed no {prefix!r} within {timeout}s")
            ready, _, _ = select.select([self.proc.stdout], [], [], remaining)
            if ready:
                line = self.proc.stdout.readline().decode()
                if not line:
                    pytest.fail(f"{self.worker_id} exited ({self.proc.wait()}) before {prefix!r}")
                assert line.startswith(prefix), line
                return line

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            assert self.proc.stdin is not None
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@contextlib.contextmanager
def heartbeaters(job: str, nats_url: str, count: int) -> Iterator[list[Heartbeater]]:
    """`count` workers started together, each registered before this yields."""
    started = [Heartbeater(job, nats_url, f"w{i}") for i in range(count)]
    try:
        for worker in started:
            worker.wait_line("registered")
        yield started
    finally:
        for worker in started:
            worker.stop()


def pause(pid: int) -> None:
    """SIGSTOP, returning once every thread of the process is stopped (a Go program's threads
    stop one by one: one may still answer for a moment after the signal is sent)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + 10
    while not _stopped(pid):
        if time.monotonic() > deadline:
            pytest.fail(f"process {pid} not stopped 10 s after SIGSTOP")
        time.sleep(0.005)


def _stopped(pid: int) -> bool:
    threads = Path(f"/proc/{pid}/task")
    for thread in threads.iterdir():
        with contextlib.suppress(OSError):
            # The state is the field after the command's closing parenthesis.
            if (thread / "stat").read_text().rsplit(")", 1)[1].split()[0] != "T":
                return False
    return True


def resume(pid: int) -> None:
    os.kill(pid, signal.SIGCONT)


async def failed_workers(bus: Bus, job: str, deadline_s: float = 30.0) -> list[str]:
    """The workers of `job` the registry recorded as failed, in stream order. Read again while
    JetStream cannot answer (a cluster electing leaders after a fault), for up to `deadline_s`."""
    deadline = time.monotonic() + deadline_s
    while True:
        try:
            events = await job_events(bus, job)
        except (nats.errors.Error, StrataError, TimeoutError) as exc:
            if time.monotonic() > deadline:
                pytest.fail(f"the events of {job} could not be read for {deadline_s}s: {exc!r}")
            await asyncio.sleep(0.2)
            continue
        return [e.worker_id for e in events if isinstance(e, WorkerFailed)]


async def no_failures_for(bus: Bus, job: str, seconds: float) -> None:
    """Watch `job` for `seconds`: fails the test at the first worker recorded failed."""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        failed = await failed_workers(bus, job)
        assert failed == [], f"live workers recorded failed: {failed}"
        await asyncio.sleep(0.25)


async def failed_within(bus: Bus, job: str, worker_id: str, seconds: float) -> float:
    """Seconds until `worker_id` is recorded failed; fails the test past `seconds`."""
    started = time.monotonic()
    while worker_id not in await failed_workers(bus, job):
        if time.monotonic() - started > seconds:
            pytest.fail(f"{worker_id} not recorded failed within {seconds}s")
        await asyncio.sleep(0.1)
    return time.monotonic() - started
