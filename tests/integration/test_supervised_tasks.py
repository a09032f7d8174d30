"""A background task that dies takes its service down loudly: `/readyz` answers 503 naming it, the
probe the chart gives Kubernetes fails, the traceback is logged once, and the process exits with
`EXIT_TASK_FAILED` (so Kubernetes starts it again, and the new process rebuilds from the stream).

Every long-lived task of every service and of the gateway is made to fail in turn, in a real
service process against a real nats-server (`faulty_service.py`: whatever the task waits on
raises an exception nothing in the service expects).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from strata import procutil
from strata._supervise import Supervisor
from strata.bus import Bus
from strata.config import Env, Settings, load_settings
from strata.errors import BackgroundTaskFailed
from strata.services.runtime import EXIT_TASK_FAILED, serve

from tests.integration.faulty_service import InjectedFault
from tests.support import HEARTBEAT_INTERVAL, HEARTBEAT_TIMEOUT, POLL

pytestmark = pytest.mark.nats

ROOT = Path(__file__).resolve().parents[2]
CHILD = Path(__file__).with_name("faulty_service.py")
CHART = ROOT / "deploy" / "charts" / "strata" / "templates"
DEADLINE_S = 60.0

SHARED = ("feed", "reactions", "status")
"""Every service's: the projection's feed and reactions, the RPC server's status announcements."""
CASES: list[tuple[str, str]] = [
    *[("registry", task) for task in (*SHARED, "snapshots")],
    *[
        ("registry", task)
        for task in ("detector", "outbox", "notices", "commits", "worlds", "progress")
    ],
    *[("sharding", task) for task in (*SHARED, "snapshots", "commits")],
    *[("checkpoint", task) for task in (*SHARED, "commits", "timeouts")],
    *[("barrier", task) for task in (*SHARED, "arrivals", "timeouts")],
    *[("gateway", task) for task in ("events", "heartbeats", "metrics", "http")],
]


async def _provision(nats_url: str) -> None:
    async with await Bus.connect(nats_url, deadline=10) as bus:
        await bus.ensure_streams()


def readiness_probe() -> dict[str, Any]:
    """The readiness probe of the chart's service pods: path, port name and timeout."""
    services = (CHART / "services.yaml").read_text()
    probe = re.search(
        r'readinessProbe:\s*\{\{-\s*include "strata.probe" \(list "(\S+)" "(\S+)"\)', services
    )
    assert probe is not None, "the services' readiness probe moved: update this test"
    helpers = (CHART / "_helpers.tpl").read_text()
    block = helpers.split('{{- define "strata.probe" -}}', 1)[1].split("{{- end }}\n{{- end }}", 1)[
        0
    ]
    timeout = re.findall(r"timeoutSeconds: (\d+)", block.split("{{- else }}", 1)[1])
    assert len(timeout) == 1, "the chart's probe template changed shape: update this test"
    return {"path": probe.group(1), "port": probe.group(2), "timeout": int(timeout[0])}


def kubelet_probe(port: int, path: str, timeout: float) -> bool:
    """What the kubelet does for an httpGet probe: success is a status in [200, 400) within the
    timeout; anything else (a 503, a refused connection, no answer) is a failure."""
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=timeout) as answer:
            return bool(200 <= answer.status < 400)
    except (urllib.error.URLError, OSError):
        return False


def readyz(port: int) -> tuple[int, dict[str, Any]] | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=5) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())
    except (urllib.error.URLError, OSError):
        return None


def wait_for(condition: Any, what: str, proc: subprocess.Popen[bytes], log: Path) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while not (value := condition()):
        if proc.poll() is not None:
            pytest.fail(f"exited with {proc.returncode} waiting for {what}:\n{tail(log)}")
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {DEADLINE_S}s waiting for {what}:\n{tail(log)}")
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(timeout=POLL)
    return value


def tail(log: Path, lines: int = 40) -> str:
    return "\n".join(log.read_text(errors="replace").splitlines()[-lines:])


def log_records(log: Path) -> list[dict[str, Any]]:
    records = []
    for line in log.read_text(errors="replace").splitlines():
        with contextlib.suppress(ValueError):
            record = json.loads(line)
            if isinstance(record, dict):
                records.append(record)
    return records


def test_the_probe_read_from_the_chart_is_the_readiness_endpoint() -> None:
    probe = readiness_probe()
    assert probe["path"] == "/readyz"
    assert probe["port"] == "health"
    assert probe["timeout"] >= 1


@pytest.mark.slow  # a service process per task
@pytest.mark.parametrize(("service", "task"), CASES, ids=[f"{s}-{t}" for s, t in CASES])
def test_a_task_that_dies_makes_the_service_unready_and_exit(
    nats_url: str, tmp_path: Path, service: str, task: str
) -> None:
    probe = readiness_probe()
    trigger, release, log = tmp_path / "trigger", tmp_path / "release", tmp_path / "service.log"
    health_port, http_port = procutil.free_ports(2)
    env = {
        **os.environ,
        Env.NATS_URL: nats_url,
        Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL),
        Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT),
        Env.HEALTH_PORT: str(health_port),
        Env.HTTP_PORT: str(http_port),
        Env.LOG_FORMAT: "json",
    }
    if task == "progress":  # a registry partition other than the leader reports its progress
        env |= {Env.REGISTRY_PARTITIONS: "2", Env.REGISTRY_PARTITION: "1"}
    if service == "gateway":
        # The gateway waits for the streams the other services provision: run alone, this
        # test provisions them itself.
        asyncio.run(_provision(nats_url))
    command = [sys.executable, str(CHILD), service, task, str(trigger), str(release)]
    with log.open("ab") as out:
        proc = subprocess.Popen(
            command, env=env, cwd=ROOT, stdin=subprocess.DEVNULL, stdout=out, stderr=out
        )
    try:
        wait_for(
            lambda: kubelet_probe(health_port, probe["path"], probe["timeout"]), "ready", proc, log
        )

        trigger.touch()
        name = f"{service}-{task}"

        def unready() -> dict[str, Any] | None:
            answer = readyz(health_port)
            return answer[1] if answer is not None and answer[0] == 503 else None

        body = wait_for(unready, f"/readyz to say {name} died", proc, log)
        assert body["ready"] is False
        assert name in body["detail"], body
        assert "InjectedFault" in body["detail"], body
        assert not kubelet_probe(health_port, probe["path"], probe["timeout"])
        if service == "gateway" and task != "http":  # the gateway's own /readyz agrees
            answer = readyz(http_port)
            assert answer is not None, "the gateway's HTTP server answers"
            assert answer[0] == 503, answer
            assert name in answer[1]["detail"]
        assert proc.poll() is None, "the stop is held until the release file exists"

        release.touch()
        try:
            returncode = proc.wait(timeout=DEADLINE_S)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{service} still running after its {task} task died:\n{tail(log)}")
        assert returncode == EXIT_TASK_FAILED, tail(log)
        records = log_records(log)
        failed = [r for r in records if r.get("event") == "task_failed"]
        assert len(failed) == 1, tail(log)
        assert failed[0]["task"] == name
        assert "InjectedFault" in json.dumps(failed[0].get("exception")), failed[0]
        assert "frames" in json.dumps(failed[0].get("exception")), "logged with its traceback"
        stopping = [r for r in records if r.get("event") == "service_stopping"]
        assert [r["level"] for r in stopping] == ["error"]
        assert stopping[0]["task"] == name
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


class WaitsForItsFeed:
    """A service whose start waits for what its feed task would have done, and the feed dies."""

    name = "waits-for-its-feed"
    provisions_streams = True

    def __init__(self) -> None:
        self.tasks = Supervisor(self.name)
        self.fed = asyncio.Event()

    async def start(self, bus: Bus, settings: Settings) -> None:
        async def feed() -> None:
            raise InjectedFault("the feed died before the state was rebuilt")

        self.tasks.spawn(feed(), "feed")
        await self.fed.wait()

    async def stop(self) -> None:
        await self.tasks.stop()

    def ready(self) -> tuple[bool, str]:
        return self.tasks.status() if self.tasks.failure else (False, "starting")


async def test_a_task_that_dies_during_start_ends_the_start(nats_url: str) -> None:
    service = WaitsForItsFeed()
    settings = load_settings(nats_url=nats_url, health_port=0, listen_host="127.0.0.1")
    with pytest.raises(BackgroundTaskFailed) as raised:
        await asyncio.wait_for(serve(service, settings, asyncio.Event()), DEADLINE_S)
    assert isinstance(raised.value.__cause__, InjectedFault)
    assert raised.value.details["task"] == "waits-for-its-feed-feed"
    assert not service.fed.is_set()


def test_a_stop_that_hangs_ends_the_process_with_every_threads_stack() -> None:
    # What the runtime arms as a service's stop begins; here with a short bound, in a process
    # whose stop never ends.
    code = (
        "import time\n"
        "from strata.services.runtime import _bound_the_stop\n"
        "_bound_the_stop('stuck', True, timeout=0.5)\n"
        "time.sleep(600)\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=DEADLINE_S
    )
    output = done.stdout + done.stderr  # the log line, and the stacks faulthandler writes
    assert done.returncode == EXIT_TASK_FAILED, output
    assert "service_stop_stuck" in output, output
    assert 'File "<string>", line 4 in <module>' in done.stderr, output  # the sleeping thread
