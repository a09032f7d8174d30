"""The registry fails a worker only on evidence: a paused nats-server, a stepped wall clock and a
dead heartbeat reader fail nobody, and a worker that really dies is still failed in time."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.clock import OFFSET_FILE_ENV, step_wall_clock

from tests.faults.conftest import (
    DETECTION_BOUND,
    TIMEOUT,
    failed_within,
    failed_workers,
    heartbeaters,
    no_failures_for,
    pause,
    registry,
    resume,
)
from tests.support import new_job

pytestmark = [pytest.mark.nats, pytest.mark.slow]


async def test_a_paused_nats_server_fails_nobody(
    own_nats_server: NatsServer, tmp_path: Path
) -> None:
    url = own_nats_server.url
    job = new_job("paused-nats")
    service = registry(url, tmp_path).start()
    try:
        async with await Bus.connect(url, deadline=10) as bus:
            with heartbeaters(job, url, 3) as workers:
                pid = own_nats_server.pid
                assert pid is not None
                pause(pid)
                try:
                    await asyncio.sleep(
                        10.0
                    )  # the fault itself: 10 s of a server that answers nothing
                finally:
                    resume(pid)
                # The registry heard nobody for 10 s: it must grant a fresh timeout, not judge.
                await no_failures_for(bus, job, 2 * TIMEOUT + 1)
                # Detection still works: a worker that really dies now is failed in time.
                workers[1].kill()
                await failed_within(bus, job, "w1", TIMEOUT + DETECTION_BOUND)
                assert await failed_workers(bus, job) == ["w1"]  # and only that one
    finally:
        service.stop()


async def test_a_wall_clock_stepped_forward_fails_nobody(
    own_nats_server: NatsServer, tmp_path: Path
) -> None:
    url = own_nats_server.url
    job = new_job("clock-ahead")
    offset = tmp_path / "registry-clock"
    service = registry(url, tmp_path, env={OFFSET_FILE_ENV: str(offset)}).start()
    try:
        async with await Bus.connect(url, deadline=10) as bus:
            with heartbeaters(job, url, 3):
                step_wall_clock(offset, +30.0)
                await no_failures_for(bus, job, 2 * TIMEOUT + 1)
    finally:
        service.stop()


async def test_a_wall_clock_stepped_back_still_fails_a_dead_worker(
    own_nats_server: NatsServer, tmp_path: Path
) -> None:
    url = own_nats_server.url
    job = new_job("clock-behind")
    offset = tmp_path / "registry-clock"
    service = registry(url, tmp_path, env={OFFSET_FILE_ENV: str(offset)}).start()
    try:
        async with await Bus.connect(url, deadline=10) as bus:
            with heartbeaters(job, url, 3) as workers:
                step_wall_clock(offset, -30.0)
                await no_failures_for(bus, job, TIMEOUT)
                workers[2].kill()
                await failed_within(bus, job, "w2", TIMEOUT + DETECTION_BOUND)
    finally:
        service.stop()
