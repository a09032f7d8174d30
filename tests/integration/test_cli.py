"""The one-shot verbs as a script sees them: one line per error, an exit status that says so,
STRATA_LOG_FORMAT honoured."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env
from strata.procutil import free_port

from tests.support import new_job


def strata(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "strata", *args],
        env={**{k: v for k, v in os.environ.items() if k != Env.LOG_FORMAT}, **env},
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_status_with_nats_down_is_one_error_line_and_a_failure() -> None:
    down = f"nats://127.0.0.1:{free_port()}"
    result = strata("status", "--nats-url", down)
    assert result.returncode == 1
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error [bus_error] cannot reach NATS at " + down)
    assert result.stdout == ""


@pytest.mark.slow
def test_errors_are_json_lines_under_the_json_log_format() -> None:
    down = f"nats://127.0.0.1:{free_port()}"
    result = strata("status", "--nats-url", down, **{Env.LOG_FORMAT: "json"})
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    error = json.loads(line)
    assert error["level"] == "error"
    assert error["code"] == "bus_error"
    assert down in error["message"]


def test_a_server_without_strata_streams_is_one_error_line(own_nats_server: NatsServer) -> None:
    result = strata("replay", "--job", new_job(), "--nats-url", own_nats_server.url)
    assert result.returncode == 1
    (line,) = result.stderr.splitlines()
    assert "has no Strata streams" in line


async def test_replaying_a_job_with_no_events_fails_and_says_so(bus: Bus, nats_url: str) -> None:
    job = new_job("nosuchjob")
    result = await asyncio.to_thread(strata, "replay", "--job", job, "--nats-url", nats_url)
    assert result.returncode == 1, result.stdout + result.stderr
    assert f"job {job!r}: no events in that range" in result.stderr
    export = await asyncio.to_thread(
        strata, "export", "--job", job, "--nats-url", nats_url, "--output", "-"
    )
    assert export.returncode == 1
    assert f"job {job!r} has no events" in export.stderr
