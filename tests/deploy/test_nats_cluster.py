"""The chart's NATS cluster, rendered by helm and run as real nats-server processes.

Three servers get the rendered configuration (the ConfigMap, the route Secret, the passwords the
StatefulSet passes in), with only what Kubernetes provides swapped for this machine: addresses,
ports and directories. They must form a cluster, and a fourth server that knows every address but
not the route password must be refused by each of them, while the same server given the password
joins.
"""

from __future__ import annotations

import base64
import json
import re
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from strata import procutil
from strata.bus.server import nats_server_binary

from tests.deploy import natsconf
from tests.deploy.chart import NAMESPACE, RELEASE, Render, Rendered

pytestmark = [pytest.mark.nats, pytest.mark.cluster]

REPLICAS = 3
DEADLINE_S = 30.0


def _name(part: str) -> str:
    return f"{RELEASE}-{part}"


def _swap(text: str, old: str, new: str) -> str:
    """Replace `old`, which must be there exactly once: a template change must not go unseen."""
    assert text.count(old) == 1, f"expected {old!r} once in:\n{text}"
    return text.replace(old, new)


def _secret_text(rendered: Rendered, name: str, key: str) -> str:
    return base64.b64decode(rendered.get("Secret", name)["data"][key]).decode()


def _get(url: str) -> dict[str, Any]:
    with urllib.request.urlopen(url, timeout=2) as answer:
        found = json.load(answer)
    assert isinstance(found, dict)
    return found


def _wait_until(condition: Callable[[], bool], what: str, timeout: float = DEADLINE_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
        time.sleep(0.05)


@dataclass
class Node:
    """One nats-server started from a configuration directory."""

    name: str
    directory: Path
    env: dict[str, str]
    client: int
    monitor: int
    cluster: int
    proc: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def log(self) -> Path:
        return self.directory / "nats-server.log"

    def start(self) -> None:
        with self.log.open("ab") as log:
            self.proc = subprocess.Popen(
                [str(nats_server_binary()), "-c", str(self.directory / "nats.conf")],
                env=self.env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=procutil.child_preexec,
            )

    def stop(self) -> None:
        if self.proc is not None:
            procutil.terminate(self.proc, 10)

    def check_running(self) -> None:
        assert self.proc is not None
        if self.proc.poll() is not None:
            raise AssertionError(
                f"nats-server {self.name} exited with {self.proc.returncode}:\n"
                + self.log.read_text(errors="replace")[-3000:]
            )

    def routed_to(self) -> set[str]:
        """Names of the servers this one has an established route with."""
        self.check_running()
        try:
            routes = _get(f"http://127.0.0.1:{self.monitor}/routez").get("routes") or []
        except (urllib.error.URLError, OSError, ValueError):
            return set()
        return {route.get("remote_name") for route in routes} - {None, ""}

    def meta_leader(self) -> str | None:
        try:
            report = _get(f"http://127.0.0.1:{self.monitor}/jsz")
        except (urllib.error.URLError, OSError, ValueError):
            return None
        leader = (report.get("meta_cluster") or {}).get("leader")
        return leader if isinstance(leader, str) and leader else None


@dataclass
class RenderedCluster:
    nodes: list[Node]
    routes_conf: str
    cluster_name: str


@pytest.fixture
def cluster(render: Render, tmp_path: Path) -> Iterator[RenderedCluster]:
    rendered = render()
    config = rendered.get("ConfigMap", _name("nats-config"))["data"]
    statefulset = rendered.get("StatefulSet", _name("nats"))
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    # The passwords as the StatefulSet hands them to the server: the route password from the
    # Secret it names, the client users' from theirs (any value: no client logs in here).
    env = {"PATH": "/usr/bin:/bin"}
    for variable in container["env"]:
        reference = (variable.get("valueFrom") or {}).get("secretKeyRef")
        if reference is None:
            continue
        if reference["name"] == _name("nats-routes"):
            env[variable["name"]] = _secret_text(rendered, reference["name"], reference["key"])
        else:
            env[variable["name"]] = f"password-of-{variable['name']}"
    assert "STRATA_ROUTE_PASSWORD" in env
    routes_conf = _secret_text(rendered, _name("nats-routes"), "routes.conf")

    ports = procutil.free_ports(3 * REPLICAS)
    nodes: list[Node] = []
    for i in range(REPLICAS):
        name = f"{_name('nats')}-{i}"
        directory = tmp_path / name
        (directory / "run").mkdir(parents=True)
        node = Node(name, directory, {**env, "POD_NAME": name}, *ports[3 * i : 3 * i + 3])
        text = config["nats.conf"]
        text = _swap(text, 'listen: "0.0.0.0:4222"', f'listen: "127.0.0.1:{node.client}"')
        text = _swap(text, 'http: "0.0.0.0:8222"', f'http: "127.0.0.1:{node.monitor}"')
        text = _swap(text, 'listen: "0.0.0.0:6222"', f'listen: "127.0.0.1:{node.cluster}"')
        text = _swap(text, '"/var/run/nats/nats.pid"', json.dumps(str(directory / "run" / "pid")))
        text = _swap(text, '"/data/jetstream"', json.dumps(str(directory / "jetstream")))
        (directory / "nats.conf").write_text(text)
        (directory / "auth.conf").write_text(config["auth.conf"])
        nodes.append(node)
    # Every replica's DNS name, as the headless Service gives it, becomes its port here.
    local_routes = routes_conf
    for node in nodes:
        host = f"{node.name}.{_name('nats-headless')}.{NAMESPACE}.svc.cluster.local:6222"
        local_routes = _swap(local_routes, f"@{host}", f"@127.0.0.1:{node.cluster}")
    for node in nodes:
        (node.directory / "routes.conf").write_text(local_routes)

    cluster_name = natsconf.parse(config["nats.conf"])["cluster"]["name"]
    try:
        for node in nodes:
            node.start()
        yield RenderedCluster(nodes, local_routes, cluster_name)
    finally:
        for node in nodes:
            node.stop()


def _outsider(cluster: RenderedCluster, name: str, routes_conf: str, tmp_path: Path) -> Node:
    """A server outside the chart that routes to every replica: no JetStream, no users."""
    directory = tmp_path / name
    directory.mkdir()
    client, monitor, port = procutil.free_ports(3)
    (directory / "routes.conf").write_text(routes_conf)
    (directory / "nats.conf").write_text(
        f"server_name: {json.dumps(name)}\n"
        f'listen: "127.0.0.1:{client}"\n'
        f'http: "127.0.0.1:{monitor}"\n'
        "cluster {\n"
        f"  name: {json.dumps(cluster.cluster_name)}\n"
        f'  listen: "127.0.0.1:{port}"\n'
        '  include "routes.conf"\n'
        "}\n"
    )
    node = Node(name, directory, {"PATH": "/usr/bin:/bin"}, client, monitor, port)
    node.start()
    return node


def test_replicas_form_a_cluster_and_a_server_without_the_route_password_is_refused(
    cluster: RenderedCluster, tmp_path: Path
) -> None:
    names = {node.name for node in cluster.nodes}

    def formed() -> bool:
        routed = all(node.routed_to() == names - {node.name} for node in cluster.nodes)
        return routed and cluster.nodes[0].meta_leader() in names

    _wait_until(formed, "the three replicas to route to each other and elect a meta leader")

    # Every address, the cluster's name, but not the password.
    without_password = re.sub(r"nats://[^@/\"]+@", "nats://", cluster.routes_conf)
    assert "strata-route" not in without_password
    rogue = _outsider(cluster, "rogue", without_password, tmp_path)
    try:

        def refused_by_every_replica() -> bool:
            rogue.check_running()
            log = rogue.log.read_text(errors="replace")
            refusal = r" - rid:\d+ - Route Error 'Authorization Violation'"
            return all(
                re.search(rf"127\.0\.0\.1:{node.cluster}{refusal}", log) for node in cluster.nodes
            )

        _wait_until(refused_by_every_replica, "each replica to refuse the rogue's route")
        assert rogue.routed_to() == set()
        for node in cluster.nodes:
            assert node.routed_to() == names - {node.name}
    finally:
        rogue.stop()

    # The same server holding the password joins: the refusal was the password's doing.
    member = _outsider(cluster, "with-password", cluster.routes_conf, tmp_path)
    try:
        _wait_until(
            lambda: all("with-password" in node.routed_to() for node in cluster.nodes),
            "every replica to route to a server holding the password",
        )
    finally:
        member.stop()
