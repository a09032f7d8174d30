"""Run what the chart renders as local processes: each container's command and environment as the
kubelet would resolve them, with only what Kubernetes provides swapped for this machine.

Kubernetes gives every pod its own network namespace, its own /tmp (an emptyDir), volumes and DNS
names for Services. Here a `Cluster` stands in for those: Service addresses map to 127.0.0.1 ports,
mount paths to directories, and each container's listening ports (given to Strata through its
environment) to free ports. The rest (secrets, `$(VAR)` expansion, downward API fields, the
image's entry point) is resolved the way Kubernetes does it, so a template that renders something
Kubernetes would run differently makes these processes fail.
"""

from __future__ import annotations

import base64
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strata import procutil
from strata.bus.server import nats_server_binary

from tests.deploy.chart import NAMESPACE, RELEASE, Rendered

REPO = Path(__file__).resolve().parents[2]
PYROOT = REPO / ".pyroot"
IMAGE_ENTRYPOINT = ["strata"]
"""deploy/docker/Dockerfile's ENTRYPOINT: what runs when a container gives `args` only."""

COMPLETION_INDEX = "metadata.annotations['batch.kubernetes.io/job-completion-index']"


def name(part: str) -> str:
    return f"{RELEASE}-{part}"


def swap(text: str, old: str, new: str) -> str:
    """Replace `old`, which must be there exactly once: a template change must not go unseen."""
    assert text.count(old) == 1, f"expected {old!r} once in:\n{text}"
    return text.replace(old, new)


def secret_data(rendered: Rendered) -> dict[str, dict[str, str]]:
    """Every rendered Secret's data, decoded."""
    return {
        s["metadata"]["name"]: {k: base64.b64decode(v).decode() for k, v in s["data"].items()}
        for s in rendered.of_kind("Secret")
    }


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' `$(VAR)` expansion: defined names are replaced, `$$` escapes, others stay."""

    def one(match: re.Match[str]) -> str:
        if match[0] == "$$":
            return "$"
        return env.get(match[1], match[0])

    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)", one, text)


def get_json(url: str, token: str | None = None, timeout: float = 3.0) -> Any:
    request = urllib.request.Request(url)
    if token is not None:
        request.add_header("Authorization", f"Bearer {token}")
    with urllib.request.urlopen(request, timeout=timeout) as answer:
        return json.load(answer)


def answers(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as answer:
            return bool(answer.status == 200)
    except (urllib.error.URLError, OSError):
        return False


def wait_until(condition: Callable[[], bool], what: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.1)


@dataclass
class Process:
    """One container's process, its output in a log file."""

    label: str
    argv: list[str]
    env: dict[str, str]
    log: Path
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    def start(self) -> Process:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                self.argv,
                env=self.env,
                cwd=self.env.get("HOME"),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                preexec_fn=procutil.child_preexec,
            )
        return self

    def poll(self) -> int | None:
        assert self.proc is not None
        return self.proc.poll()

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()

    def stop(self) -> None:
        if self.proc is not None:
            procutil.terminate(self.proc, 10)

    def tail(self, chars: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""

    def check_running(self) -> None:
        code = self.poll()
        if code is not None:
            raise AssertionError(f"{self.label} exited with {code}:\n{self.tail()}")


@dataclass
class NatsNode:
    """One nats-server replica (or a server outside the chart), its ports on 127.0.0.1."""

    name: str
    client: int
    monitor: int
    cluster: int
    process: Process

    def routed_to(self) -> set[str]:
        """Names of the servers this one has an established route with."""
        self.process.check_running()
        try:
            routes = get_json(f"http://127.0.0.1:{self.monitor}/routez").get("routes") or []
        except (urllib.error.URLError, OSError, ValueError):
            return set()
        return {route.get("remote_name") for route in routes} - {None, ""}

    def meta_leader(self) -> str | None:
        try:
            report = get_json(f"http://127.0.0.1:{self.monitor}/jsz")
        except (urllib.error.URLError, OSError, ValueError):
            return None
        leader = (report.get("meta_cluster") or {}).get("leader")
        return leader if isinstance(leader, str) and leader else None


class Cluster:
    """What Kubernetes provides to the rendered pods, on this machine."""

    def __init__(self, rendered: Rendered, root: Path) -> None:
        self.rendered = rendered
        self.root = root
        self.secrets = secret_data(rendered)
        self.hosts: dict[str, str] = {}
        """`host:port` as a Service's DNS name gives it -> its local address(es)."""
        self.paths: dict[str, Path] = {}
        """A volume's mount path -> the directory standing in for it (shared by all pods)."""
        self.processes: list[Process] = []
        self.nats: list[NatsNode] = []
        self.routes_conf = ""
        """routes.conf as the replicas here have it: the route Secret's, addresses swapped."""

    # -- what the kubelet resolves ----------------------------------------------------------------

    def resolve_env(
        self, container: dict[str, Any], pod: str, annotations: Mapping[str, str]
    ) -> dict[str, str]:
        """The container's environment as the kubelet gives it, in order, `$(VAR)` expanded."""
        env: dict[str, str] = {}
        for entry in container.get("env", []):
            if "value" in entry:
                env[entry["name"]] = expand(str(entry["value"]), env)
                continue
            source = entry["valueFrom"]
            if "secretKeyRef" in source:
                ref = source["secretKeyRef"]
                if ref["name"] not in self.secrets:
                    raise AssertionError(f"{pod}: Secret {ref['name']} is not rendered")
                env[entry["name"]] = self.secrets[ref["name"]][ref["key"]]
            elif "fieldRef" in source:
                path = source["fieldRef"]["fieldPath"]
                if path == "metadata.name":
                    env[entry["name"]] = pod
                elif path == COMPLETION_INDEX:
                    env[entry["name"]] = annotations["batch.kubernetes.io/job-completion-index"]
                else:
                    raise AssertionError(f"{pod}: no stand-in for field {path}")
            else:
                raise AssertionError(f"{pod}: no stand-in for {source}")
        return env

    def localize(self, text: str, pod_paths: Mapping[str, Path]) -> str:
        """Service DNS names and mount paths (the pod's own and the shared volumes), as this
        machine has them."""
        for host, local in self.hosts.items():
            text = text.replace(host, local)
        for mount, directory in {**pod_paths, **self.paths}.items():
            text = re.sub(rf"(?<![\w/]){re.escape(mount)}(?=/|$|\s)", str(directory), text)
        return text

    def container_process(
        self,
        container: dict[str, Any],
        pod: str,
        *,
        annotations: Mapping[str, str] | None = None,
        ports: Mapping[str, str] | None = None,
        label: str | None = None,
    ) -> Process:
        """The process the kubelet would start for `container` of pod `pod`.

        `ports` replaces the values of the environment variables that name ports the container
        listens on (a pod's ports are its own; here every process shares one network).
        """
        env = self.resolve_env(container, pod, annotations or {})
        command = container.get("command") or IMAGE_ENTRYPOINT
        args = [expand(a, env) for a in container.get("args", [])]
        argv = [expand(c, env) for c in command] + args
        home = self.root / "pods" / pod
        (home / "tmp").mkdir(parents=True, exist_ok=True)
        # /tmp is the pod's emptyDir; the image sets HOME there.
        own = {"/tmp": home / "tmp"}
        local = {key: self.localize(value, own) for key, value in env.items()}
        local.update(ports or {})
        local.update(
            {
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
                "PYTHONPATH": str(PYROOT),
                "HOME": str(home / "tmp"),
                "PYTHONUNBUFFERED": "1",
                "STRATA_LISTEN_HOST": "127.0.0.1",
            }
        )
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        return Process(
            label or pod,
            executable([self.localize(a, own) for a in argv]),
            local,
            self.root / "logs" / f"{label or pod}.log",
        )

    # -- the chart's NATS -------------------------------------------------------------------------

    def start_nats(self) -> list[NatsNode]:
        """The StatefulSet's replicas: the rendered configuration, the Secrets' passwords."""
        config = self.rendered.get("ConfigMap", name("nats-config"))["data"]
        statefulset = self.rendered.get("StatefulSet", name("nats"))
        (container,) = statefulset["spec"]["template"]["spec"]["containers"]
        replicas = int(statefulset["spec"]["replicas"])
        ports = procutil.free_ports(3 * replicas)
        routes_secret = self.secrets.get(name("nats-routes"), {})
        routes_conf = routes_secret.get("routes.conf", "")
        for i in range(replicas):
            pod = f"{name('nats')}-{i}"
            client, monitor, cluster = ports[3 * i : 3 * i + 3]
            directory = self.root / "pods" / pod
            (directory / "run").mkdir(parents=True)
            text = config["nats.conf"]
            text = swap(text, 'listen: "0.0.0.0:4222"', f'listen: "127.0.0.1:{client}"')
            text = swap(text, 'http: "0.0.0.0:8222"', f'http: "127.0.0.1:{monitor}"')
            if replicas > 1:
                text = swap(text, 'listen: "0.0.0.0:6222"', f'listen: "127.0.0.1:{cluster}"')
            text = swap(text, '"/var/run/nats/nats.pid"', json.dumps(str(directory / "pid")))
            text = swap(text, '"/data/jetstream"', json.dumps(str(directory / "jetstream")))
            (directory / "nats.conf").write_text(text)
            if "auth.conf" in config:
                (directory / "auth.conf").write_text(config["auth.conf"])
            if routes_conf:
                # The replica's DNS name, as the headless Service gives it, becomes its port.
                host = f"{pod}.{name('nats-headless')}.{NAMESPACE}.svc.cluster.local:6222"
                routes_conf = swap(routes_conf, f"@{host}", f"@127.0.0.1:{cluster}")
            env = {
                **self.resolve_env(container, pod, {}),
                "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            }
            process = Process(
                pod,
                [str(nats_server_binary()), "-c", str(directory / "nats.conf")],
                env,
                directory / "nats-server.log",
            )
            self.nats.append(NatsNode(pod, client, monitor, cluster, process))
        self.routes_conf = routes_conf
        for node in self.nats:
            directory = node.process.log.parent
            if routes_conf:
                (directory / "routes.conf").write_text(routes_conf)
            self.processes.append(node.process.start())
        # The client Service spreads connections over the replicas; clients take the list.
        self.hosts[f"{name('nats')}.{NAMESPACE}.svc:4222"] = ",nats://".join(
            f"127.0.0.1:{node.client}" for node in self.nats
        )
        return self.nats

    def nats_ready(self) -> bool:
        """Every replica answers /healthz?js-server-only=true (the StatefulSet's readiness)."""
        for node in self.nats:
            node.process.check_running()
        return all(
            answers(f"http://127.0.0.1:{node.monitor}/healthz?js-enabled-only=true")
            for node in self.nats
        )

    def stop(self) -> None:
        for process in reversed(self.processes):
            process.stop()


def executable(argv: list[str]) -> list[str]:
    """The image's programs, from this checkout: `strata` and `python` of the test's interpreter."""
    if argv[0] == "strata":
        return [sys.executable, "-m", "strata", *argv[1:]]
    if argv[0] in ("python", "python3"):
        return [sys.executable, *argv[1:]]
    raise AssertionError(f"the image has no program {argv[0]!r}")
