"""Per-role NATS permissions against a real nats-server: what a worker or the gateway cannot do."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from strata.bus.server import NatsServer
from strata.security import (
    Credential,
    authorization_config,
    by_role,
    generate_credentials,
    load_credentials,
    save_credentials,
)

pytestmark = pytest.mark.nats

JOB = "secure-job"


@pytest.fixture
def credentials() -> list[Credential]:
    return generate_credentials(["worker-0", "worker-1"])


@pytest.fixture
def secured(tmp_path: Path, credentials: list[Credential]) -> AsyncIterator[NatsServer]:
    with NatsServer(
        store_dir=tmp_path / "nats", extra_config=authorization_config(credentials)
    ) as server:
        yield server


async def _connect(url: str, cred: Credential, errors: list[str]) -> NATS:
    async def on_error(exc: Exception) -> None:
        errors.append(str(exc))

    return await nats.connect(
        url, user=cred.user, password=cred.password, error_cb=on_error, allow_reconnect=False
    )


async def _published(
    server: NatsServer,
    publisher: Credential,
    subjects: list[str],
    services: Credential,
    refusals: int,
) -> tuple[set[str], list[str]]:
    """Which of `subjects` reached a services-role subscriber, and the publisher's errors (given
    until `refusals` permission errors have come, or 5 s have passed)."""
    errors: list[str] = []
    seen: set[str] = set()
    marker = asyncio.Event()
    watcher = await _connect(server.url, services, [])
    sender = await _connect(server.url, publisher, errors)

    async def on_message(msg: Msg) -> None:
        if msg.subject == "strata.hb.marker-job." + publisher.user:
            marker.set()
        else:
            seen.add(msg.subject)

    await watcher.subscribe(">", cb=on_message)
    await watcher.flush()
    for subject in subjects:
        await sender.publish(subject, b"x")
    # Messages of one connection arrive in order: once the marker is in, so is anything before it.
    allowed_marker = publisher.role == "worker"
    if allowed_marker:
        await sender.publish("strata.hb.marker-job." + publisher.user, b"end")
    await sender.flush()
    if allowed_marker:
        await asyncio.wait_for(marker.wait(), 5)
    else:
        # The server has handled every publish once the sender's flush returns, and the watcher
        # has received everything routed to it once its own flush returns.
        await watcher.flush()
    # The server's refusals reach the error callback on tasks of their own: wait for them.
    deadline = asyncio.get_running_loop().time() + 5
    while sum("permissions violation" in e.lower() for e in errors) < refusals:
        if asyncio.get_running_loop().time() > deadline:
            break
        await asyncio.sleep(0.01)
    await sender.close()
    await watcher.close()
    return seen, errors


async def test_worker_cannot_publish_service_events_or_other_workers_heartbeats(
    secured: NatsServer, credentials: list[Credential]
) -> None:
    services = by_role(credentials, "services")[0]
    worker = next(c for c in credentials if c.user == "worker-0")
    forbidden = [
        f"strata.evt.{JOB}.checkpoint.committed",
        f"strata.evt.{JOB}.worker.failed",
        f"strata.evt.{JOB}.worker.registered",
        f"strata.evt.{JOB}.barrier.released",
        f"strata.evt.{JOB}.shard.plan_changed",
        f"strata.hb.{JOB}.worker-1",
        f"strata.ctl.{JOB}.worker-1",
        "$KV.STRATA_SNAPSHOTS.registry",
    ]
    allowed = [
        f"strata.hb.{JOB}.worker-0",
        f"strata.evt.{JOB}.checkpoint.shard_saved",
        "strata.rpc.registry.register",
    ]
    seen, errors = await _published(secured, worker, forbidden + allowed, services, len(forbidden))
    assert seen == set(allowed)
    assert any("permissions violation" in e.lower() for e in errors), errors


async def test_gateway_cannot_publish_on_strata_subjects(
    secured: NatsServer, credentials: list[Credential]
) -> None:
    services = by_role(credentials, "services")[0]
    gateway = by_role(credentials, "gateway")[0]
    subjects = [
        f"strata.evt.{JOB}.checkpoint.committed",
        f"strata.hb.{JOB}.worker-0",
        "strata.rpc.registry.register",
        f"strata.ctl.{JOB}.worker-0",
    ]
    seen, errors = await _published(secured, gateway, subjects, services, len(subjects))
    assert seen == set()
    assert sum("permissions violation" in e.lower() for e in errors) >= len(subjects)


async def test_a_worker_may_not_listen_to_another_workers_notices(
    secured: NatsServer, credentials: list[Credential]
) -> None:
    worker = next(c for c in credentials if c.user == "worker-0")
    errors: list[str] = []
    nc = await _connect(secured.url, worker, errors)
    try:
        await nc.subscribe(f"strata.ctl.{JOB}.worker-1")
        await nc.flush()
        deadline = asyncio.get_running_loop().time() + 5
        while not errors and asyncio.get_running_loop().time() < deadline:
            await nc.flush()
        assert any("permissions violation" in e.lower() for e in errors), errors
    finally:
        await nc.close()


async def test_wrong_password_is_refused(
    secured: NatsServer, credentials: list[Credential]
) -> None:
    impostor = Credential("worker-0", "not-the-password", "worker")
    with pytest.raises(Exception, match=r"(?i)authorization"):
        await nats.connect(
            secured.url,
            user=impostor.user,
            password=impostor.password,
            allow_reconnect=False,
            max_reconnect_attempts=0,
        )


def test_credentials_file_is_private_and_round_trips(
    tmp_path: Path, credentials: list[Credential]
) -> None:
    path = tmp_path / "credentials.json"
    save_credentials(path, credentials)
    assert path.stat().st_mode & 0o777 == 0o600
    assert load_credentials(path) == credentials


def test_the_configuration_holding_the_passwords_is_private(secured: NatsServer) -> None:
    assert secured.config_file.stat().st_mode & 0o777 == 0o600
    assert "password" in secured.config_file.read_text()
