"""Per-role NATS permissions against a real nats-server: what a worker or the gateway cannot do."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest
import strata
from nats.aio.msg import Msg
from strata.bus.server import NatsServer
from strata.config import Settings
from strata.events import subjects
from strata.security import (
    Credential,
    authorization_config,
    by_role,
    generate_credentials,
    load_credentials,
    save_credentials,
    worker_credentials,
    worker_identity,
)

from tests import natsprobe
from tests.support import async_wait_until, running_services

pytestmark = pytest.mark.nats

JOB = "secure-job"


@pytest.fixture
def credentials() -> list[Credential]:
    return generate_credentials(JOB, ["worker-0", "worker-1"])


@pytest.fixture
def secured(tmp_path: Path, credentials: list[Credential]) -> Iterator[NatsServer]:
    with NatsServer(
        store_dir=tmp_path / "nats", extra_config=authorization_config(credentials)
    ) as server:
        yield server


@pytest.fixture
async def watcher(secured: NatsServer, credentials: list[Credential]) -> AsyncIterator[nats.NATS]:
    services = by_role(credentials, "services")[0]
    nc = await nats.connect(secured.url, user=services.user, password=services.password)
    yield nc
    await nc.close()


def worker_0(credentials: list[Credential]) -> Credential:
    return next(c for c in credentials if c.identity == (JOB, "worker-0"))


async def as_worker(server: NatsServer, credential: Credential) -> natsprobe.Client:
    job, worker = credential.identity or ("", "")
    return await natsprobe.connect(
        server.url,
        credential.user,
        credential.password,
        inbox_prefix=subjects.worker_inbox_prefix(job, worker),
    )


def test_a_worker_credential_names_its_job_and_worker(credentials: list[Credential]) -> None:
    assert [c.user for c in by_role(credentials, "worker")] == [
        f"worker-0@{JOB}",
        f"worker-1@{JOB}",
    ]
    assert worker_identity(f"worker-0@{JOB}") == (JOB, "worker-0")
    for user in ("worker-0", "strata-workers-j", "a@b@c", "@j", "w@", "w@bad job"):
        assert worker_identity(user) is None, user


async def test_a_worker_publishes_nothing_but_its_own_telemetry_and_requests(
    secured: NatsServer, credentials: list[Credential], watcher: nats.NATS
) -> None:
    worker = await as_worker(secured, worker_0(credentials))
    forbidden = [
        # Nothing on the event stream, not even the checkpoint ack it once published.
        f"strata.evt.{JOB}.checkpoint.shard_saved",
        f"strata.evt.{JOB}.checkpoint.committed",
        f"strata.evt.{JOB}.worker.failed",
        f"strata.evt.{JOB}.worker.registered",
        f"strata.evt.{JOB}.barrier.released",
        f"strata.evt.{JOB}.shard.plan_changed",
        # Nothing as another worker or in another job.
        subjects.heartbeat_subject(JOB, "worker-1"),
        subjects.heartbeat_subject("other-job", "worker-0"),
        subjects.metric_subject(JOB, "worker-1", "loss"),
        subjects.rpc_subject("registry", "register", JOB, "worker-1"),
        subjects.rpc_subject("registry", "register", "other-job", "worker-0"),
        # No operator request, no notice, no snapshot, no JetStream.
        subjects.rpc_subject("registry", "register"),
        subjects.control_subject(JOB, "worker-1"),
        # No probe: only the registry probes a registration (`registry.suspect`).
        subjects.probe_subject(JOB, "worker-0", "instance"),
        subjects.probe_subject(JOB, "worker-1", "instance"),
        subjects.probe_subject("other-job", "worker-0", "instance"),
        # It answers its own probes only.
        subjects.probe_answer_subject(JOB, "worker-1", "n0"),
        subjects.probe_answer_subject("other-job", "worker-0", "n0"),
        "$KV.STRATA_SNAPSHOTS.registry",
        "$JS.API.STREAM.PURGE.STRATA_EVENTS",
    ]
    allowed = [
        subjects.heartbeat_subject(JOB, "worker-0"),
        subjects.rpc_subject("registry", "register", JOB, "worker-0"),
        subjects.probe_answer_subject(JOB, "worker-0", "n0"),
    ]
    marker = subjects.metric_subject(JOB, "worker-0", "marker")
    try:
        seen = await natsprobe.reached(watcher, worker, forbidden + allowed, marker)
        await natsprobe.settled(worker)
    finally:
        await worker.close()
    assert seen == set(allowed)
    assert {s.lower() for s in forbidden} <= worker.refused["publish"], worker.errors


async def test_the_gateway_publishes_nothing_on_strata_subjects(
    secured: NatsServer, credentials: list[Credential], watcher: nats.NATS
) -> None:
    cred = by_role(credentials, "gateway")[0]
    gateway = await natsprobe.connect(secured.url, cred.user, cred.password)
    sent = [
        f"strata.evt.{JOB}.checkpoint.committed",
        subjects.heartbeat_subject(JOB, "worker-0"),
        subjects.rpc_subject("registry", "register"),
        subjects.rpc_subject("registry", "register", JOB, "worker-0"),
        subjects.control_subject(JOB, "worker-0"),
    ]
    try:
        seen = await natsprobe.reached(watcher, gateway, sent, "$JS.FC.marker")
        await natsprobe.settled(gateway)
    finally:
        await gateway.close()
    assert seen == set()
    assert {s.lower() for s in sent} <= gateway.refused["publish"]


async def test_a_worker_listens_to_its_own_job_notices_and_replies_only(
    secured: NatsServer, credentials: list[Credential]
) -> None:
    worker = await as_worker(secured, worker_0(credentials))
    refused = [
        subjects.control_subject(JOB, "worker-1"),
        subjects.worker_inboxes(JOB, "worker-1"),
        subjects.event_subject("other-job", "barrier.released"),
        subjects.world_subject("other-job"),
        # Membership reaches a worker as world notices; the events are the services' business.
        subjects.event_subject(JOB, "worker.registered"),
        subjects.event_subject(JOB, "checkpoint.committed"),
        subjects.heartbeat_subject(JOB, "worker-1"),
        # Another worker's probes, or another job's: it answers for nobody but itself.
        subjects.probe_subject(JOB, "worker-1", "*"),
        subjects.probe_subject("other-job", "worker-0", "*"),
        subjects.probe_subject("other-job", "*", "*"),
        "_INBOX.>",
        "strata.>",
    ]
    allowed = [
        subjects.control_subject(JOB, "worker-0"),
        subjects.worker_inboxes(JOB, "worker-0"),
        subjects.world_subject(JOB),
        subjects.event_subject(JOB, "barrier.released"),
        subjects.event_subject(JOB, "shard.plan_changed"),
        subjects.probe_subject(JOB, "worker-0", "*"),
    ]
    try:
        assert await natsprobe.refused_subscriptions(worker, refused + allowed) == set(refused)
    finally:
        await worker.close()


async def test_wrong_password_is_refused(
    secured: NatsServer, credentials: list[Credential]
) -> None:
    impostor = Credential(worker_0(credentials).user, "not-the-password", "worker")
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


async def sdk_worker(server: NatsServer, credential: Credential) -> strata.aio.Worker:
    """An SDK worker started on a one-worker credential (the job and worker it names)."""
    job, worker = credential.identity or ("", "")
    settings = Settings(nats_user=credential.user, nats_password=credential.password)
    return await strata.aio.Worker(job, server.url, worker_id=worker, settings=settings).start()


async def test_a_live_workers_probe_is_answered_and_only_by_its_own_job(
    tmp_path: Path, credentials: list[Credential]
) -> None:
    """`registry.suspect` under `strata up --secure`'s rules: the registry's probe of a live
    worker is answered (the worker may publish its answer), and a credential of another job may
    neither listen to that worker's probes nor answer them."""
    other = worker_credentials("other-job", ["worker-0"])[0]
    services = by_role(credentials, "services")[0]
    with (
        NatsServer(
            store_dir=tmp_path / "nats", extra_config=authorization_config([*credentials, other])
        ) as server,
        running_services(server.url, tmp_path / "logs", ("registry",), env=services.env()),
    ):
        peer = await sdk_worker(server, worker_0(credentials))
        reporter = await sdk_worker(
            server, next(c for c in credentials if c.identity == (JOB, "worker-1"))
        )
        outsider = await as_worker(server, other)
        watcher = await nats.connect(server.url, user=services.user, password=services.password)
        try:
            result = await reporter.report_suspect("worker-0")
            assert result.verdict == "alive", result
            # The other job's credential: no subscription to the peer's probes, no answer.
            probes = subjects.probe_subject(JOB, "worker-0", "*")
            answer = subjects.probe_answer_subject(JOB, "worker-0", "n1")
            assert await natsprobe.refused_subscriptions(outsider, [probes]) == {probes}
            marker = subjects.metric_subject("other-job", "worker-0", "marker")
            assert await natsprobe.reached(watcher, outsider, [answer], marker) == set()
            await natsprobe.settled(outsider)
            assert answer.lower() in outsider.refused["publish"], outsider.errors
            # Still answered, still alive: nothing the outsider tried changed the verdict.
            again = await reporter.report_suspect("worker-0")
            assert again.verdict == "alive", again
        finally:
            await watcher.close()
            await outsider.close()
            await reporter.stop()
            await peer.stop()


async def test_a_worker_reaches_its_jobs_request_partition_only(
    secured: NatsServer, credentials: list[Credential], watcher: nats.NATS
) -> None:
    """nats-server checks a publish permission on the subject its mapping moved the request to:
    a worker may send into its own job's partition (as the mapping does for it) and into no
    other, so a flood of its never reaches the connections that serve another partition."""
    own = subjects.rpc_partition_of(JOB, subjects.DEFAULT_RPC_PARTITIONS)
    other = (own + 1) % subjects.DEFAULT_RPC_PARTITIONS
    into_own = f"{subjects.RPC_PARTITIONED}.{own}.registry.register.{JOB}.worker-0"
    into_other = f"{subjects.RPC_PARTITIONED}.{other}.registry.register.{JOB}.worker-0"
    seen: list[str] = []

    async def note(msg: Msg) -> None:
        seen.append(msg.subject)

    await watcher.subscribe(f"{subjects.RPC_PARTITIONED}.>", cb=note)
    await watcher.flush()
    worker = await as_worker(secured, worker_0(credentials))
    try:
        for subject in (
            into_other,
            into_own,
            subjects.rpc_subject("barrier", "arrive", JOB, "worker-0"),
        ):
            await worker.nc.publish(subject, b"x")
        await natsprobe.settled(worker)

        async def both_in() -> bool:
            return len(seen) >= 2

        await async_wait_until(both_in, 10, "the allowed requests to arrive")
    finally:
        await worker.close()
    assert seen == [into_own, f"{subjects.RPC_PARTITIONED}.{own}.barrier.arrive.{JOB}.worker-0"]
    assert any(into_other.lower() in error for error in worker.errors), worker.errors
