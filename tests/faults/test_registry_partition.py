"""A registry cut off from what the majority hears fails nobody the majority hears.

Three nats-server nodes; every route passes through a proxy in front of the node it dials, so a
cut can hold every link of one node or only the links between two. The registry is connected to
node 1 alone, the workers to nodes 0 and 2.

- Node 1 cut off from both others for 8 s: its failures need the quorum, which it has not.
- Only the links between nodes 0 and 1 cut (a partial partition): node 1 still reaches the
  quorum through node 2, so the registry proves that it hears, yet the heartbeats of a worker on
  node 0 no longer reach it, while the streams (on the majority) store them. The registry
  re-reads the stream's record of a worker's heartbeats right before failing it, and fails no
  worker whose heartbeats the stream holds beyond those its decision knew of. When the cut
  heals, the heartbeats it held reach the registry in a burst, perhaps while the stream is
  read: they count as unknown to a decision taken before them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import nats.errors
import pytest
from strata.bus import Bus
from strata.bus.connection import retry_transient
from strata.bus.server import NatsCluster, NatsServer
from strata.config import Env
from strata.events import subjects

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


def _wait_routed(cluster: NatsCluster, proxies: Proxies, timeout: float = 30.0) -> bool:
    """Until node 1 has routes to both other nodes, every route dialled through a proxy: True
    then, False as soon as a node dialled a route past the proxies (a cut would not hold it).

    A route dialled past the proxies is one whose remote port is a node's own route port. Any
    other port is a proxy's: the one it listens on (dialled through it) or the one its upstream
    connection comes from (accepted from it: nats-server lists some of those as solicited too,
    which an earlier check took for routes dialled past the proxies)."""
    deadline = time.monotonic() + timeout
    own_ports = {node.cluster_port for node in cluster.nodes}
    assert not own_ports & {proxy.port for proxy in proxies.proxies}
    while True:
        routes = _routes(cluster, 1)
        for i in range(3):
            direct = [r for r in _routes(cluster, i) if r.get("port") in own_ports]
            if direct:
                return False
        peers = {r.get("remote_name") for r in routes}
        if {cluster.nodes[0].name, cluster.nodes[2].name} <= peers:
            return True
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


CLUSTER_ATTEMPTS = 3


@contextlib.contextmanager
def _proxied_cluster(tmp_path: Path) -> Iterator[tuple[NatsCluster, Proxies]]:
    """Three nodes routed through one proxy each, in front of the node dialled. A cluster in
    which a node dialled a route past the proxies (now and then one does) is built again."""
    for attempt in range(CLUSTER_ATTEMPTS):
        with _cluster_attempt(tmp_path / f"cluster-{attempt}") as built:
            if built is not None:
                yield built
                return
    pytest.fail(f"no cluster routed only through the proxies in {CLUSTER_ATTEMPTS} attempts")


@contextlib.contextmanager
def _cluster_attempt(store: Path) -> Iterator[tuple[NatsCluster, Proxies] | None]:
    cluster = NatsCluster(store, size=3)
    first, cut_off, third = cluster.nodes
    # The nodes' ports are chosen, not yet bound: a proxy that took one would answer in place
    # of a node (a health check once read a route's INFO).
    ports = {p for n in cluster.nodes for p in (n.port, n.monitor_port, n.cluster_port)}
    # Every route passes through the proxy in front of the node dialled; a cut holds the links
    # of node 1 only, whichever side dialled them.
    with (
        Proxy(first.cluster_port, avoid=ports) as to_first,
        Proxy(cut_off.cluster_port, avoid=ports) as to_cut_off,
        Proxy(third.cluster_port, avoid=ports) as to_third,
    ):
        proxies = Proxies([to_first, to_cut_off, to_third])
        first.routes = [to_cut_off.route_url, to_third.route_url]
        cut_off.routes = [to_first.route_url, to_third.route_url]
        third.routes = [to_first.route_url, to_cut_off.route_url]
        for node, proxy in zip(cluster.nodes, proxies.proxies, strict=True):
            _advertise(node, proxy.port)
        try:
            cluster.start(60)
            yield (cluster, proxies) if _wait_routed(cluster, proxies) else None
        finally:
            proxies.heal()
            cluster.stop()


async def _ensure_streams(bus: Bus) -> None:
    """The streams on three replicas, through what a cluster formed a moment ago may answer
    transiently (a meta leader elected again, peers not all known yet), as services do."""
    await retry_transient(functools.partial(bus.ensure_streams, replicas=3), "creating streams")


async def test_a_registry_cut_off_with_its_node_fails_no_worker_heard_by_the_majority(
    tmp_path: Path,
) -> None:
    with _proxied_cluster(tmp_path) as (cluster, proxies):
        await _partition_scenario(cluster, proxies, tmp_path)


async def _partition_scenario(cluster: NatsCluster, proxy: Proxies, tmp_path: Path) -> None:
    first, cut_off, third = cluster.nodes
    job = new_job("partition")
    async with await Bus.connect(first.url, deadline=10) as bus:
        await _ensure_streams(bus)
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


def _server_id(node: NatsServer) -> bytes:
    return str(node.varz()["server_id"]).encode()


async def _lead_on(bus: Bus, stream: str, node: NatsServer, timeout: float = 60.0) -> None:
    """Until `node` leads `stream`: its leader is asked to step down while another node leads."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            info = await bus.js.stream_info(stream)
            if info.cluster is not None and info.cluster.leader == node.name:
                return
            await bus.nc.request(f"$JS.API.STREAM.LEADER.STEPDOWN.{stream}", b"", timeout=5)
        except (nats.errors.Error, TimeoutError):
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"{stream} not led by {node.name} within {timeout}s")
        await asyncio.sleep(0.5)


async def test_a_registry_that_hears_the_quorum_but_not_a_worker_does_not_fail_it(
    tmp_path: Path,
) -> None:
    with _proxied_cluster(tmp_path) as (cluster, proxies):
        first, registry_node, third = cluster.nodes
        job = new_job("partial")
        async with await Bus.connect(third.url, deadline=10) as bus:
            await _ensure_streams(bus)
            service = registry(registry_node.url, tmp_path, env={Env.STREAM_REPLICAS: "3"}).start(
                60
            )
            unheard = Heartbeater(job, first.url, "w0")
            heard = Heartbeater(job, third.url, "w1")
            try:
                for worker in (unheard, heard):
                    worker.wait_line("registered")
                # Every stream led by node 2, which both sides of the cut still reach: the
                # registry's proof of hearing (in the snapshot bucket) succeeds during the cut
                # and its writes are stored at once, which is the case to test.
                for stream in (
                    f"KV_{subjects.SNAPSHOT_BUCKET}",
                    subjects.EVENTS_STREAM,
                    subjects.TELEMETRY_STREAM,
                ):
                    await _lead_on(bus, stream, third)
                await no_failures_for(bus, job, 1.0)
                proxies.cut(involving=(_server_id(first), _server_id(registry_node)))
                cut_at = time.monotonic()
                try:
                    await asyncio.sleep(1.0)  # into the cut
                    heard.kill()  # really dead, and the registry can tell
                    # The rest of the cut, w0 heartbeating to node 0 all along, unheard by the
                    # registry. The verdicts are read after the heal: a cut between two nodes
                    # sets the cluster's meta group electing, and JetStream may not answer the
                    # test's reads meanwhile; whatever the registry decided is in the stream.
                    await asyncio.sleep(CUT_S - (time.monotonic() - cut_at))
                finally:
                    proxies.heal()
                # The detector still fails a worker that is silent...
                await failed_within(bus, job, "w1", TIMEOUT + DETECTION_BOUND)
                # ...and not w0, neither during the cut nor by a decision stored after it.
                deadline = time.monotonic() + 2 * TIMEOUT
                while time.monotonic() < deadline:
                    assert await failed_workers(bus, job) == ["w1"]
                    await asyncio.sleep(0.25)
            finally:
                unheard.stop()
                heard.stop()
                service.stop()
