"""`strata up`: the whole stack on one machine, supervised until Ctrl-C or SIGTERM.

Starts an embedded nats-server (store under `--data-dir`), provisions the streams, then runs every
available service as its own process (as in Kubernetes, so one can be killed alone), restarting
any that dies. On Ctrl-C or SIGTERM it stops the services, then NATS; no child outlives it, even
if `strata up` itself is SIGKILLed (children carry a parent-death signal). Every port it opens,
the children's probe ports included, binds `--host` only; with `--secure` the gateway asks for an
API token, kept beside the NATS credentials in files only their owner can read. The worker
credentials `--secure` makes belong to one job (`--job`): each is `worker-N@<job>`, and a worker
that connects with one is that worker of that job and can act for no other. With
`--registry-partitions N` the registry runs as N processes sharing the heartbeat intake
(`registry` is partition 0, the leader; `registry-1` ... the others).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import structlog
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from strata import procutil
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env, Settings, load_settings
from strata.errors import ConfigError
from strata.events import subjects
from strata.logs import configure_logging
from strata.security import (
    Credential,
    Role,
    api_token,
    authorization_config,
    by_role,
    job_credential,
    job_user,
    load_credentials,
    save_credentials,
    service_credentials,
    worker_credentials,
)

log = structlog.get_logger("strata.up")
console = Console(stderr=True)

READY_TIMEOUT_S = 60.0
CREDENTIALS_FILE = "credentials.json"
API_TOKEN_FILE = "api-token"
RESTART_DELAY_S = 1.0


@dataclass
class Child:
    name: str
    health_port: int
    log_path: Path
    env: dict[str, str]
    probe_host: str = "127.0.0.1"
    proc: subprocess.Popen[bytes] | None = None
    restarts: int = 0
    started_at: float = field(default_factory=time.monotonic)
    service: str = ""
    """The service it runs, when not its name (`registry-1` runs the registry)."""

    def spawn(self) -> None:
        # Own process group: a terminal's Ctrl-C reaches only `strata up`, which then stops the
        # services before NATS, in order.
        self.proc = procutil.spawn_service(
            self.service or self.name, self.env, self.log_path, own_process_group=True
        )
        self.started_at = time.monotonic()

    @property
    def probe_url(self) -> str:
        return f"http://{_url_host(self.probe_host)}:{self.health_port}"

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.probe_url}/readyz", timeout=1) as answer:
                return bool(json.loads(answer.read()).get("ready"))
        except (urllib.error.URLError, OSError, ValueError):
            return False


def _reachable(host: str) -> str:
    """Where a client on this machine reaches a port bound to `host` (a wildcard: loopback)."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host else host


def _check_port_free(host: str, port: int, what: str, flag: str) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            raise ConfigError(
                f"{what} port {port} on {host} is already in use (another strata up?); "
                f"stop that process or pass {flag} with a free port"
            ) from None


async def _provision(url: str, settings: Settings) -> None:
    async with await Bus.connect(url, settings=settings, name="strata-up", deadline=15.0) as bus:
        await bus.ensure_streams(settings.stream_replicas, settings)


def _credentials(data_dir: Path, workers: int, job: str) -> list[Credential]:
    """Reuse the credentials of an earlier `strata up --secure`, adding worker credentials for
    `job` if it has none yet (so one data directory can serve several jobs), or make them: one
    per worker (`worker-N@<job>`) and the one the job's workers share (`strata-workers-<job>`)."""
    path = data_dir / CREDENTIALS_FILE
    found = load_credentials(path) if path.exists() else []
    # A worker user that names no job (made before credentials were bound to one) cannot be
    # confined to a job: it is dropped, and the job's workers get new ones.
    kept = [c for c in found if c.role != "worker" or c.job is not None]
    if len(kept) != len(found):
        log.warning("worker_credentials_replaced", dropped=len(found) - len(kept), job=job)
    if not by_role(kept, "services") or not by_role(kept, "gateway"):
        kept = service_credentials() + [c for c in kept if c.role == "worker"]
    if not any(c.identity is not None and c.identity[0] == job for c in kept):
        kept += worker_credentials(job, [f"worker-{i}" for i in range(workers)])
    if not any(c.user == job_user(job) for c in kept):
        kept.append(job_credential(job))
    if kept != found:
        save_credentials(path, kept)
    return kept


class LocalStack:
    """NATS, every service and the gateway on this machine, as `strata up` and `strata demo` run
    them. `start()` returns once all are ready; `stop()` stops the services, then NATS."""

    def __init__(
        self,
        data_dir: Path,
        *,
        nats_port: int,
        http_port: int,
        host: str = "127.0.0.1",
        secure: bool = False,
        worker_credentials: int = 16,
        job: str = "default",
        env: dict[str, str] | None = None,
        registry_partitions: int = 1,
    ) -> None:
        self.data_dir = data_dir.resolve()
        # Port 0 picks a free one here, so the dashboard's address can be told.
        self.http_port = http_port or procutil.free_port()
        self.host = host
        self.secure = secure
        self.job = job
        if not 1 <= registry_partitions <= subjects.HEARTBEAT_BUCKETS:
            raise ConfigError(
                f"--registry-partitions must be 1 to {subjects.HEARTBEAT_BUCKETS}, "
                f"not {registry_partitions}"
            )
        self.registry_partitions = registry_partitions
        (self.data_dir / "logs").mkdir(parents=True, exist_ok=True)
        _check_port_free(host, nats_port, "NATS", "--nats-port")
        _check_port_free(host, self.http_port, "HTTP", "--http-port")
        self.credentials = _credentials(self.data_dir, worker_credentials, job) if secure else []
        own = {k: v for k, v in (env or {}).items() if k.startswith("STRATA_")}
        settings = load_settings(**_lower(own))
        self.api_token = api_token(self.data_dir / API_TOKEN_FILE) if secure else None
        self.nats = NatsServer(
            store_dir=self.data_dir / "nats",
            host=host,
            port=nats_port,
            log_file=self.data_dir / "logs" / "nats-server.log",
            extra_config=(
                authorization_config(self.credentials, settings.rpc_partitions) if secure else ""
            ),
            max_file_store=settings.jetstream_max_file_store,
            rpc_partitions=settings.rpc_partitions,
        )
        self._extra_env = env or {}
        self.children: list[Child] = []

    def role_env(self, role: Role) -> dict[str, str]:
        return by_role(self.credentials, role)[0].env() if self.secure else {}

    @property
    def rendezvous_jobs(self) -> list[str]:
        """The jobs whose workers hold a credential, which may not make their rendezvous bucket:
        the services make it, within the job's quota."""
        return sorted({c.job for c in self.credentials if c.role == "worker" and c.job})

    @property
    def dashboard_url(self) -> str:
        return f"http://{_url_host(_reachable(self.host))}:{self.http_port}/"

    def start(self, stop: threading.Event) -> None:
        from strata.services import catalog

        self.nats.start()
        service_env = self.role_env("services")
        if self.rendezvous_jobs:
            service_env = {**service_env, Env.RENDEZVOUS_JOBS: ",".join(self.rendezvous_jobs)}
        asyncio.run(
            _provision(self.nats.url, load_settings(nats_url=self.nats.url, **_lower(service_env)))
        )
        base_env = {
            **os.environ,
            **self._extra_env,
            Env.NATS_URL: self.nats.url,
            Env.DATA_DIR: str(self.data_dir),
            Env.LOG_FORMAT: "json",
            # Every child's HTTP ports (gateway, probes, metrics) bind where NATS does.
            Env.LISTEN_HOST: self.host,
        }
        probe_host = _reachable(self.host)
        for service in catalog.available():
            role_env = self.role_env("gateway") if service == "gateway" else service_env
            if service == "gateway" and self.api_token is not None:
                role_env = {**role_env, Env.API_TOKEN: self.api_token}
            copies = self.registry_partitions if service == "registry" else 1
            for partition in range(copies):
                name = f"{service}-{partition}" if partition else service
                child = Child(
                    name=name,
                    health_port=procutil.free_port(probe_host),
                    log_path=self.data_dir / "logs" / f"{name}.log",
                    env={**base_env, **role_env, Env.HTTP_PORT: str(self.http_port)},
                    probe_host=probe_host,
                    service=service,
                )
                child.env[Env.HEALTH_PORT] = str(child.health_port)
                if copies > 1:
                    child.env[Env.REGISTRY_PARTITIONS] = str(copies)
                    child.env[Env.REGISTRY_PARTITION] = str(partition)
                child.spawn()
                self.children.append(child)
        _wait_ready(self.children, stop)

    def supervise(self, stop: threading.Event) -> None:
        _supervise(self.children, stop)

    def stop(self) -> None:
        for child in reversed(self.children):
            if child.proc is not None:
                procutil.terminate(child.proc, timeout=10)
        self.nats.stop()


def install_stop_signals() -> threading.Event:
    """An event set by SIGTERM or SIGINT (Ctrl-C)."""
    stop = threading.Event()

    def on_signal(signum: int, _: object) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    return stop


def up(args: argparse.Namespace) -> int:
    settings = load_settings(
        data_dir=args.data_dir, http_port=args.http_port, job=getattr(args, "job", None)
    )
    configure_logging(settings.log_format, settings.log_level)
    stack = LocalStack(
        settings.data_dir,
        nats_port=args.nats_port,
        http_port=args.http_port,
        host=args.host,
        secure=bool(getattr(args, "secure", False)),
        worker_credentials=int(getattr(args, "worker_credentials", 16)),
        job=settings.job,
        registry_partitions=int(getattr(args, "registry_partitions", 1)),
    )
    stop = install_stop_signals()
    try:
        stack.start(stop)
        _print_summary(stack)
        stack.supervise(stop)
    finally:
        stack.stop()
        console.print("[green]stopped[/] every service and NATS")
    return 0


def _wait_ready(children: list[Child], stop: threading.Event) -> None:
    deadline = time.monotonic() + READY_TIMEOUT_S
    waiting = list(children)
    while waiting and not stop.is_set():
        for child in list(waiting):
            assert child.proc is not None
            if child.proc.poll() is not None:
                raise ConfigError(
                    f"service {child.name} exited with {child.proc.returncode} during start-up; "
                    f"see {child.log_path}"
                )
            if child.ready():
                waiting.remove(child)
        if time.monotonic() > deadline:
            names = ", ".join(c.name for c in waiting)
            raise ConfigError(f"{names} not ready after {READY_TIMEOUT_S:.0f}s; see their logs")
        stop.wait(0.1)


def _supervise(children: list[Child], stop: threading.Event) -> None:
    while not stop.wait(0.5):
        for child in children:
            assert child.proc is not None
            code = child.proc.poll()
            if code is None or stop.is_set():
                continue
            if time.monotonic() - child.started_at < RESTART_DELAY_S:
                continue
            child.restarts += 1
            log.warning("service_restarting", service=child.name, exit_code=code)
            console.print(f"[yellow]{child.name} exited ({code}); restarting[/]")
            child.spawn()


def _lower(env: dict[str, str]) -> dict[str, str]:
    """STRATA_NATS_USER=... -> nats_user=... (settings field names)."""
    return {key.removeprefix("STRATA_").lower(): value for key, value in env.items()}


def _print_summary(stack: LocalStack) -> None:
    from strata.services.gateway.assets import find_dashboard, missing_dashboard_message

    dashboard_built = find_dashboard() is not None
    table = Table(title="Strata is up", show_header=True)
    table.add_column("part")
    table.add_column("where")
    table.add_row("NATS", stack.nats.url)
    for child in stack.children:
        assert child.proc is not None
        table.add_row(child.name, f"pid {child.proc.pid}, probes {child.probe_url}")
    table.add_row(
        "dashboard",
        stack.dashboard_url if dashboard_built else f"{stack.dashboard_url} [yellow](not built)[/]",
    )
    table.add_row("data", str(stack.data_dir))
    if stack.secure:
        table.add_row(
            "credentials",
            f"{stack.data_dir / CREDENTIALS_FILE} (workers of job {stack.job}: "
            f"STRATA_NATS_USER=worker-N@{stack.job}, their worker id and job; or "
            f"{job_user(stack.job)}, shared, for torchrun's ranks)",
        )
    if stack.api_token is not None:
        # Shown here, once per start, and nowhere else: the logs never carry it.
        table.add_row(
            "API token",
            f"{stack.api_token} (also in {stack.data_dir / API_TOKEN_FILE}; the dashboard asks "
            "for it, scripts send 'Authorization: Bearer <token>')",
        )
    Console().print(table)
    if not dashboard_built:
        console.print(f"[bold yellow]warning:[/] {escape(missing_dashboard_message())}")
    console.print("Ctrl-C stops everything.")
