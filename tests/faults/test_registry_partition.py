"""A registry cut off from the cluster's majority fails nobody: its failures need the quorum.

Three nats-server nodes; every route to node 1 passes through a proxy that can cut it (node 1
dials no route of its own). The registry is connected to node 1 alone, the workers to nodes 0
and 2. Node 1 is cut off for 8 s while the workers keep heartbeating to the majority."""

from __future__ import annotations

import asyncio
import json
import time
import urllib.request
from pathlib import Path

import pytest
from strata.bus import Bus
from strata.bus.server import NatsCluster, NatsServer
from strata.config import Env

from tests.faults.conftest import (
    DETECTION_BOUND,
    TIMEOUT,
    Heartbeater,
    failed_within,
    failed_workers,
    no_failures_for,
    registry,
)
from tests.faults.netproxy import Proxies, Proxy
from tests.support import new_job

pytestmark = [pytest.mark.nats, pytest.mark.cluster, pytest.mark.slow]

CUT_S = 8.0


def _routes(cluster: NatsCluster, i: int) -> list[dict[str, object]]:
    with urllib.request.urlopen(f"{cluster.nodes[i].monitor_url}/routez", timeout=5) as response:
        routes: list[dict[str, object]] = json.load(response).get("routes") or []
    return routes


def _wait_routed(cluster: NatsCluster, proxies: Proxies, timeout: float = 30.0) -> None:
    """Until node 1 has routes to both other nodes, every route dialled through a proxy."""
    deadline = time.monotonic() + timeout
    through = {proxy.port for proxy in proxies.proxies}
    while True:
        routes = _routes(cluster, 1)
        for i in range(3):
            dialled = [r for r in _routes(cluster, i) if r.get("did_solicit")]
            direct = [r for r in dialled if r.get("port") not in through]
            assert not direct, f"node {i} dialled a route past the proxies: {direct}"
        peers = {r.get("remote_name") for r in routes}
        if {cluster.nodes[0].name, cluster.nodes[2].name} <= peers:
            return
        if time.monotonic() > deadline:
            pytest.fail(f"node 1 not routed to both others within {timeout}s: {routes}")
        time.sleep(0.1)


def _advertise(node: NatsServer, port: int) -> None:
    """Make `node` tell the others to reach it on `port` (its proxy): the nodes that learn of it
    from each other, and dial it on their own, pass through its proxy too."""
    text = node.config_text().replace(
        "  listen: ", f'  advertise: "{node.host}:{port}"\n  listen: ', 1
    )
    node.config_text = lambda: text  # type: ignore[method-assign]


async def test_a_registry_cut_off_with_its_node_fails_no_worker_heard_by_the_majority(
    tmp_path: Path,
) -> None:
    cluster = NatsCluster(tmp_path / "cluster", size=3)
    first, cut_off, third = cluster.nodes
    # Every route passes through the proxy in front of the node dialled; a cut holds the links
    # of node 1 only, whichever side dialled them.
    with (
        Proxy(first.cluster_port) as to_first,
        Proxy(cut_off.cluster_port) as to_cut_off,
        Proxy(third.cluster_port) as to_third,
    ):
        proxies = Proxies([to_first, to_cut_off, to_third])
        first.routes = [to_cut_off.route_url, to_third.route_url]
        cut_off.routes = [to_first.route_url, to_third.route_url]
        third.routes = [to_first.route_url, to_cut_off.route_url]
        for node, proxy in zip(cluster.nodes, proxies.proxies, strict=True):
            _advertise(node, proxy.port)
        try:
            cluster.start(60)
            _wait_routed(cluster, proxies)
            await _partition_scenario(cluster, proxies, tmp_path)
        finally:
            proxies.heal()
            cluster.stop()


async def _partition_scenario(cluster: NatsCluster, proxy: Proxies, tmp_path: Path) -> None:
    first, cut_off, third = cluster.nodes
    job = new_job("partition")
    async with await Bus.connect(first.url, deadline=10) as bus:
        await bus.ensure_streams(replicas=3)
        service = registry(cut_off.url, tmp_path, env={Env.STREAM_REPLICAS: "3"}).start(60)
        workers = [
            Heartbeater(job, first.url, "w0"),
            Heartbeater(job, third.url, "w1"),
            Heartbeater(job, first.url, "w2"),
        ]
        try:
            for worker in workers:
                worker.wait_line("registered")
            await no_failures_for(bus, job, 1.0)
            proxy.cut(involving=str(cut_off.varz()["server_id"]).encode())
            cut_at = time.monotonic()
            try:
                await asyncio.sleep(1.0)  # into the cut
                workers[2].kill()  # really dead, with nobody able to tell the registry
                # The rest of the cut. Its verdicts are read after the heal: while the stream
                # may have no leader the majority side cannot always be asked, and whatever the
                # registry decided during the cut is in the stream after it.
                await asyncio.sleep(CUT_S - (time.monotonic() - cut_at))
            finally:
                proxy.heal()
            # Failed after the heal, once the registry hears again and its timeout ran out...
            await failed_within(bus, job, "w2", TIMEOUT + DETECTION_BOUND)
            # ...and w0 and w1, heard by the majority throughout, never.
            await asyncio.sleep(0)
            deadline = time.monotonic() + 2 * TIMEOUT
            while time.monotonic() < deadline:
                assert await failed_workers(bus, job) == ["w2"]
                await asyncio.sleep(0.25)
        finally:
            for worker in workers:
                worker.stop()
            service.stop()
