"""`strata up` runs the stack, answers its probes, and leaves no process behind when stopped."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from strata import procutil

pytestmark = [pytest.mark.nats, pytest.mark.slow]

START_TIMEOUT = 60.0


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    http_port: int
    nats_port: int
    data_dir: Path
    log: Path

    def get(self, path: str) -> tuple[int, dict[str, object]]:
        url = f"http://127.0.0.1:{self.http_port}{path}"
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                return answer.status, json.loads(answer.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def _descendants(pid: int) -> set[int]:
    """PIDs of every live descendant of `pid`, from /proc."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in parents.items() if parent in frontier} - found
        found |= frontier
    return found


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def _wait_until(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    secure = ["--secure"] if getattr(request, "param", False) else []
    http_port, nats_port = procutil.free_ports(2)
    log = tmp_path / "up.log"
    env = {**os.environ, "STRATA_LOG_FORMAT": "json"}
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "strata",
                "up",
                "--http-port",
                str(http_port),
                "--nats-port",
                str(nats_port),
                "--data-dir",
                str(tmp_path / "data"),
                *secure,
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    running = Stack(proc, http_port, nats_port, tmp_path / "data", log)

    def ready() -> bool:
        if proc.poll() is not None:
            raise AssertionError(f"strata up exited early:\n{running.output()}")
        try:
            return running.get("/readyz")[0] == 200
        except (OSError, ValueError):
            return False

    _wait_until(ready, START_TIMEOUT, "the gateway to be ready")
    yield running
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def test_up_serves_probes_and_stops_cleanly_on_sigterm(stack: Stack) -> None:
    assert stack.get("/healthz") == (200, {"status": "ok"})
    status, ready = stack.get("/readyz")
    assert status == 200
    assert ready["ready"] is True
    children = _descendants(stack.proc.pid)
    assert len(children) >= 2, "expected nats-server and the gateway as children"
    assert (stack.data_dir / "nats" / "jetstream").is_dir()

    status_cli = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata",
            "status",
            "--nats-url",
            f"nats://127.0.0.1:{stack.nats_port}",
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert "STRATA_EVENTS" in status_cli.stdout

    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=30) == 0, stack.output()
    _wait_until(lambda: not any(_alive(pid) for pid in children), 10, "children to exit")


@pytest.mark.parametrize("stack", [True], indirect=True, ids=["secure"])
def test_secure_up_reports_every_service_up_though_the_gateway_may_not_send(
    stack: Stack,
) -> None:
    def all_up() -> bool:
        services = stack.get("/api/services")[1]["services"]
        assert isinstance(services, dict)
        return all(answer["up"] for answer in services.values())

    _wait_until(all_up, 30, "every service to be reported up")
    services = stack.get("/api/services")[1]["services"]
    assert isinstance(services, dict)
    assert set(services) == {"registry", "sharding", "barrier", "checkpoint"}
    for name, answer in services.items():
        assert answer["service"] == name
        assert 0 <= answer["heard_s_ago"] <= 6.0  # from its announcement: a ping is not allowed
    assert (stack.data_dir / "credentials.json").is_file()


def test_no_child_outlives_a_sigkilled_up(stack: Stack) -> None:
    children = _descendants(stack.proc.pid)
    assert children
    stack.proc.kill()
    stack.proc.wait()
    _wait_until(lambda: not any(_alive(pid) for pid in children), 10, "orphans to die")


def test_up_refuses_a_busy_port_with_an_actionable_message(stack: Stack, tmp_path: Path) -> None:
    second = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata",
            "up",
            "--nats-port",
            str(stack.nats_port),
            "--http-port",
            str(procutil.free_port()),
            "--data-dir",
            str(tmp_path / "other"),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert second.returncode == 1
    assert "config_invalid" in second.stderr
    assert f"port {stack.nats_port}" in second.stderr
    assert "--nats-port" in second.stderr


def test_bad_demo_arguments_are_refused_before_anything_starts() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "strata", "demo", "--workers", "0"],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 2
    assert "--workers must be in 1..64" in result.stderr
