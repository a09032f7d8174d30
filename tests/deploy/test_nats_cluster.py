"""The chart's NATS cluster, rendered by helm and run as real nats-server processes.

Three servers get the rendered configuration (the ConfigMap, the route Secret, the passwords the
StatefulSet passes in), with only what Kubernetes provides swapped for this machine: addresses,
ports and directories. They must form a cluster, and a fourth server that knows every address but
not the route password must be refused by each of them, while the same server given the password
joins.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from strata import procutil
from strata.bus.server import nats_server_binary

from tests.deploy import natsconf
from tests.deploy.chart import Render
from tests.deploy.localpods import Cluster, NatsNode, Process, name, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.cluster]

DEADLINE_S = 30.0


@dataclass
class RenderedCluster:
    nodes: list[NatsNode]
    routes_conf: str
    cluster_name: str


@pytest.fixture
def cluster(render: Render, tmp_path: Path) -> Iterator[RenderedCluster]:
    """The StatefulSet's replicas with the rendered configuration and the Secrets' passwords
    (tests/deploy/localpods.py)."""
    local = Cluster(render(), tmp_path)
    config = local.rendered.get("ConfigMap", name("nats-config"))["data"]
    try:
        nodes = local.start_nats()
        assert "STRATA_ROUTE_PASSWORD" in nodes[0].process.env
        cluster_name = natsconf.parse(config["nats.conf"])["cluster"]["name"]
        yield RenderedCluster(nodes, local.routes_conf, cluster_name)
    finally:
        local.stop()


def _outsider(cluster: RenderedCluster, server: str, routes_conf: str, tmp_path: Path) -> NatsNode:
    """A server outside the chart that routes to every replica: no JetStream, no users."""
    directory = tmp_path / server
    directory.mkdir()
    client, monitor, port = procutil.free_ports(3)
    (directory / "routes.conf").write_text(routes_conf)
    (directory / "nats.conf").write_text(
        f"server_name: {json.dumps(server)}\n"
        f'listen: "127.0.0.1:{client}"\n'
        f'http: "127.0.0.1:{monitor}"\n'
        "cluster {\n"
        f"  name: {json.dumps(cluster.cluster_name)}\n"
        f'  listen: "127.0.0.1:{port}"\n'
        '  include "routes.conf"\n'
        "}\n"
    )
    process = Process(
        server,
        [str(nats_server_binary()), "-c", str(directory / "nats.conf")],
        {"PATH": "/usr/bin:/bin"},
        directory / "nats-server.log",
    )
    return NatsNode(server, client, monitor, port, process.start())


def test_replicas_form_a_cluster_and_a_server_without_the_route_password_is_refused(
    cluster: RenderedCluster, tmp_path: Path
) -> None:
    names = {node.name for node in cluster.nodes}

    def formed() -> bool:
        routed = all(node.routed_to() == names - {node.name} for node in cluster.nodes)
        return routed and cluster.nodes[0].meta_leader() in names

    wait_until(
        formed, "the three replicas to route to each other and elect a meta leader", DEADLINE_S
    )

    # Every address, the cluster's name, but not the password.
    without_password = re.sub(r"nats://[^@/\"]+@", "nats://", cluster.routes_conf)
    assert "strata-route" not in without_password
    rogue = _outsider(cluster, "rogue", without_password, tmp_path)
    try:

        def refused_by_every_replica() -> bool:
            rogue.process.check_running()
            log = rogue.process.log.read_text(errors="replace")
            refusal = r" - rid:\d+ - Route Error 'Authorization Violation'"
            return all(
                re.search(rf"127\.0\.0\.1:{node.cluster}{refusal}", log) for node in cluster.nodes
            )

        wait_until(refused_by_every_replica, "each replica to refuse the rogue's route", DEADLINE_S)
        assert rogue.routed_to() == set()
        for node in cluster.nodes:
            assert node.routed_to() == names - {node.name}
    finally:
        rogue.process.stop()

    # The same server holding the password joins: the refusal was the password's doing.
    member = _outsider(cluster, "with-password", cluster.routes_conf, tmp_path)
    try:
        wait_until(
            lambda: all("with-password" in node.routed_to() for node in cluster.nodes),
            "every replica to route to a server holding the password",
            DEADLINE_S,
        )
    finally:
        member.process.stop()
