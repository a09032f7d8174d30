"""`strata up` runs the stack, answers its probes, and leaves no process behind when stopped.

It also keeps to what it was told: every port of every child binds `--host` alone, and with
`--secure` the gateway wants an API token and every file holding a secret is the owner's alone.
"""

from __future__ import annotations

import asyncio
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

import nats
import pytest
from strata import procutil
from strata.bus import Caller, RpcClient
from strata.errors import RateLimited

pytestmark = [pytest.mark.nats, pytest.mark.slow]

START_TIMEOUT = 60.0


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    http_port: int
    nats_port: int
    data_dir: Path
    log: Path

    def get(self, path: str, token: str | None = None) -> tuple[int, dict[str, object]]:
        request = urllib.request.Request(f"http://127.0.0.1:{self.http_port}{path}")
        if token is not None:
            request.add_header("Authorization", f"Bearer {token}")
        try:
            with urllib.request.urlopen(request, timeout=2) as answer:
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


def _socket_inodes(pid: int) -> set[str]:
    """The inodes of the sockets `pid` holds open, from its file descriptors."""
    found: set[str] = set()
    try:
        descriptors = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return found
    for descriptor in descriptors:
        try:
            target = os.readlink(descriptor)
        except OSError:
            continue
        if target.startswith("socket:["):
            found.add(target[len("socket:[") : -1])
    return found


def _tcp_listeners() -> dict[str, str]:
    """inode -> local address of every listening TCP socket, from /proc/net/tcp and tcp6."""
    listening: dict[str, str] = {}
    for table, width in (("/proc/net/tcp", 8), ("/proc/net/tcp6", 32)):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            local, state, inode = fields[1], fields[3], fields[9]
            if state != "0A":  # TCP_LISTEN
                continue
            address, port = local.split(":")
            assert len(address) == width
            if width == 8:
                host = ".".join(str(b) for b in reversed(bytes.fromhex(address)))
            else:
                host = address  # kernel byte order: compared with the wildcard only
            listening[inode] = f"{host}:{int(port, 16)}"
    return listening


def _wait_until(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():  # type: ignore[operator]
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


@pytest.fixture
def stack(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Stack]:
    # The parameter, when given: True for --secure, or a dict of "secure" and extra "env".
    param = getattr(request, "param", False)
    options = param if isinstance(param, dict) else {"secure": param}
    secure = ["--secure"] if options.get("secure") else []
    http_port, nats_port = procutil.free_ports(2)
    log = tmp_path / "up.log"
    env = {**os.environ, "STRATA_LOG_FORMAT": "json", **options.get("env", {})}
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

    # --host 127.0.0.1 (the default): NATS, its monitoring port, the gateway and every
    # service's probe port listen there and nowhere else.
    listening = _tcp_listeners()
    ours = {
        inode: listening[inode]
        for pid in {stack.proc.pid, *children}
        for inode in _socket_inodes(pid)
        if inode in listening
    }
    # NATS client and monitor, the gateway, and a probe port per service at least.
    assert len(ours) >= 2 + 1 + 4, ours
    assert all(address.startswith("127.0.0.1:") for address in ours.values()), ours
    ports = {int(address.rsplit(":", 1)[1]) for address in ours.values()}
    assert {stack.http_port, stack.nats_port} <= ports

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
    token = (stack.data_dir / "api-token").read_text().strip()
    assert stack.get("/api/services")[0] == 401
    assert stack.get("/api/services", token="not-the-token")[0] == 401

    def all_up() -> bool:
        services = stack.get("/api/services", token)[1]["services"]
        assert isinstance(services, dict)
        return all(answer["up"] for answer in services.values())

    _wait_until(all_up, 30, "every service to be reported up")
    services = stack.get("/api/services", token)[1]["services"]
    assert isinstance(services, dict)
    assert set(services) == {"registry", "sharding", "barrier", "checkpoint"}
    for name, answer in services.items():
        assert answer["service"] == name
        assert 0 <= answer["heard_s_ago"] <= 6.0  # from its announcement: a ping is not allowed
    assert (stack.data_dir / "credentials.json").is_file()


@pytest.mark.parametrize("stack", [True], indirect=True, ids=["secure"])
def test_secure_up_keeps_every_secret_in_files_only_their_owner_reads(stack: Stack) -> None:
    token = (stack.data_dir / "api-token").read_text().strip()
    credentials = json.loads((stack.data_dir / "credentials.json").read_text())
    # One credential per worker of the job, and the one its workers share (torchrun's ranks).
    jobs = {c["user"].split("@")[1] for c in credentials if "@" in c["user"]}
    assert len(jobs) == 1, jobs
    users = {c["user"] for c in credentials if c["role"] == "worker"}
    assert {f"worker-0@{job}" for job in jobs} | {f"strata-workers-{job}" for job in jobs} <= users
    secrets = [token.encode(), *(c["password"].encode() for c in credentials)]
    # The token is shown once, on the terminal that started the stack, with the summary printed
    # once every service is ready.
    _wait_until(lambda: "Ctrl-C stops everything" in stack.output(), 30, "the summary")
    assert stack.output().count(token) == 1
    holding = []
    for path in stack.data_dir.rglob("*"):
        if not path.is_file() or path.stat().st_size > 16 * 1024 * 1024:
            continue
        content = path.read_bytes()
        if any(secret in content for secret in secrets):
            holding.append(path.relative_to(stack.data_dir))
            assert path.stat().st_mode & 0o777 == 0o600, path
    assert sorted(map(str, holding)) == ["api-token", "credentials.json", "nats/nats-server.conf"]


@pytest.mark.parametrize("stack", [True], indirect=True, ids=["secure"])
def test_secure_up_makes_its_jobs_rendezvous_bucket_within_a_bounded_store(stack: Stack) -> None:
    """The job's workers may not make their rendezvous bucket: `strata up --secure` has the
    services make it, with the job's quota, in a store whose size is set."""
    import asyncio

    import nats
    from strata.bus.streams import RendezvousQuota
    from strata.config import load_settings
    from strata.events import subjects

    credentials = json.loads((stack.data_dir / "credentials.json").read_text())
    (job,) = {c["user"].split("@")[1] for c in credentials if "@" in c["user"]}
    services = next(c for c in credentials if c["role"] == "services")
    conf = (stack.data_dir / "nats" / "nats-server.conf").read_text()
    assert f"max_file_store: {load_settings().jetstream_max_file_store}" in conf

    async def bucket() -> tuple[int, int, int]:
        nc = await nats.connect(
            f"nats://127.0.0.1:{stack.nats_port}",
            user=services["user"],
            password=services["password"],
        )
        try:
            info = await nc.jetstream().stream_info(subjects.rendezvous_stream_name(job))
        finally:
            await nc.close()
        return info.config.max_bytes, info.config.max_msgs, info.config.max_msg_size

    quota = RendezvousQuota()
    assert asyncio.run(bucket()) == (quota.max_bytes, quota.max_keys, quota.max_value_bytes)


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


def test_up_refuses_an_impossible_number_of_registry_partitions(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata",
            "up",
            *("--registry-partitions", "0"),
            *("--nats-port", str(procutil.free_port())),
            *("--http-port", str(procutil.free_port())),
            *("--data-dir", str(tmp_path / "data")),
        ],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert result.returncode == 1
    assert "config_invalid" in result.stderr
    assert "--registry-partitions must be 1 to 256, not 0" in result.stderr


@pytest.mark.parametrize(
    "stack",
    [{"env": {"STRATA_RPC_WORKER_RATE": "0.001", "STRATA_RPC_WORKER_BURST": "2"}}],
    indirect=True,
)
def test_up_gives_its_services_the_admission_limits_of_its_environment(stack: Stack) -> None:
    """`strata up` takes the same STRATA_RPC_* settings as the chart's services: a worker with a
    budget of two requests is refused the third."""

    async def pings() -> list[str]:
        nc = await nats.connect(f"nats://127.0.0.1:{stack.nats_port}")
        try:
            rpc = RpcClient(nc, caller=Caller("limited", "w0"))
            outcomes = []
            for _ in range(4):
                try:
                    await rpc.call("registry", "ping", {}, retry_for=10.0 if not outcomes else 0)
                    outcomes.append("ok")
                except RateLimited as refused:
                    outcomes.append(refused.message)
            return outcomes
        finally:
            await nc.close()

    outcomes = asyncio.run(pings())
    assert outcomes[:2] == ["ok", "ok"]
    assert len(outcomes) == 4
    for refusal in outcomes[2:]:
        assert "sent registry more than 0.001 requests/s (bursts of 2)" in refusal
        assert "STRATA_RPC_WORKER_RATE" in refusal


def test_up_refuses_an_impossible_admission_limit_before_starting(tmp_path: Path) -> None:
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "strata",
            "up",
            *("--nats-port", str(procutil.free_port())),
            *("--http-port", str(procutil.free_port())),
            *("--data-dir", str(tmp_path / "data")),
        ],
        capture_output=True,
        text=True,
        timeout=30,
        env={**os.environ, "STRATA_RPC_JOB_RATE": "0"},
    )
    assert result.returncode == 1
    assert "STRATA_RPC_JOB_RATE" in result.stderr
    assert not (tmp_path / "data" / "nats").exists()
