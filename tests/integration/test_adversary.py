"""An attacker holding one ordinary worker credential of `strata up --secure`: what it cannot do.

`strata up --secure --job victim` runs as a person would run it (its own nats-server with the
authorization it generates, a process per service); the data directory it starts from already
holds a worker credential of another job, `attacker`, which it keeps beside the ones it makes.
Each test is one attack from the issue "a worker speaks only for itself", and checks both that it
is refused (by NATS, or by a service with `forbidden`) and that nothing changed: the victim's
membership, its checkpoints (files included) and its event history are as they were.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import strata
import strata.aio
from strata import procutil
from strata.bus import Bus
from strata.config import Env, Settings, load_settings
from strata.errors import ConfigError, ConflictError, Forbidden, NotFound
from strata.events import (
    CheckpointShardSaved,
    WorkerFailed,
    WorkerHeartbeat,
    encode_event,
    subjects,
)
from strata.events.requests import (
    AckShardRequest,
    ArriveRequest,
    BeginCheckpointRequest,
    CheckpointQuery,
    GetShardsRequest,
    LeaveRequest,
    MembersRequest,
    MembersResult,
    PlanRequest,
    RegisterDatasetRequest,
    RegisterRequest,
    ReportProgressRequest,
    RestoreProgressRequest,
)
from strata.security import Credential, load_credentials, save_credentials, worker_credentials
from strata.storage import shard_key

from tests import natsprobe
from tests.support import POLL, async_wait_until, job_events

pytestmark = [pytest.mark.nats, pytest.mark.slow]

VICTIM = "victim"
ATTACKER = "attacker"
START_TIMEOUT = 90.0
HEARTBEAT_INTERVAL = 0.5
HEARTBEAT_TIMEOUT = 3.0
CHECKSUM = "xxh128:" + "ab" * 16


@dataclass
class SecureStack:
    url: str
    data_dir: Path
    credentials: dict[str, Credential]
    proc: subprocess.Popen[bytes]

    def settings(self, job: str, worker: str) -> Settings:
        credential = self.credentials[f"{worker}@{job}"]
        return load_settings(
            nats_url=self.url, nats_user=credential.user, nats_password=credential.password
        )

    def credential(self, job: str, worker: str) -> Credential:
        return self.credentials[f"{worker}@{job}"]

    @property
    def services(self) -> Credential:
        return self.credentials["strata-services"]


def _ready(http_port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{http_port}/readyz", timeout=2) as answer:
            return answer.status == 200
    except (urllib.error.URLError, OSError):
        return False


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SecureStack]:
    base = tmp_path_factory.mktemp("adversary")
    data_dir = base / "data"
    data_dir.mkdir()
    # A credential of another job, made earlier: `strata up` keeps it and adds its own job's.
    save_credentials(data_dir / "credentials.json", worker_credentials(ATTACKER, ["worker-0"]))
    http_port, nats_port = procutil.free_ports(2)
    env = {
        **os.environ,
        Env.LOG_FORMAT: "json",
        Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL),
        Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT),
    }
    log = base / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "strata",
                "up",
                "--secure",
                "--job",
                VICTIM,
                "--worker-credentials",
                "3",
                # Heartbeat intake split over two registry processes: every attack below also
                # meets the partitioned registry.
                *("--registry-partitions", "2"),
                *("--http-port", str(http_port), "--nats-port", str(nats_port)),
                *("--data-dir", str(data_dir)),
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
        )
    try:
        deadline = time.monotonic() + START_TIMEOUT
        while not _ready(http_port):
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"strata up --secure did not start:\n{log.read_text()[-4000:]}")
            time.sleep(POLL * 5)
        made = load_credentials(data_dir / "credentials.json")
        yield SecureStack(
            f"nats://127.0.0.1:{nats_port}", data_dir, {c.user: c for c in made}, proc
        )
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture
async def operator(stack: SecureStack) -> AsyncIterator[Bus]:
    """The services' credential: reads and operator requests (no caller on the subject)."""
    settings = load_settings(
        nats_url=stack.url,
        nats_user=stack.services.user,
        nats_password=stack.services.password,
    )
    bus = await Bus.connect(settings=settings, name="test-operator", deadline=10)
    yield bus
    await bus.close()


@pytest.fixture
async def workers(stack: SecureStack) -> AsyncIterator[dict[tuple[str, str], strata.aio.Worker]]:
    """Started SDK workers by (job, worker), each logged in with its own credential."""
    started: dict[tuple[str, str], strata.aio.Worker] = {}
    for job, worker in (
        (VICTIM, "worker-0"),
        (VICTIM, "worker-1"),
        (VICTIM, "worker-2"),
        (ATTACKER, "worker-0"),
    ):
        sdk = strata.aio.Worker(settings=stack.settings(job, worker))
        started[(job, worker)] = await sdk.start()
    yield started
    for sdk in started.values():
        await sdk.stop()


async def raw(stack: SecureStack, job: str, worker: str) -> natsprobe.Client:
    """A plain NATS connection with a worker's credential, for what the SDK would never send."""
    credential = stack.credential(job, worker)
    return await natsprobe.connect(
        stack.url,
        credential.user,
        credential.password,
        inbox_prefix=subjects.worker_inbox_prefix(job, worker),
    )


async def victim_members(operator: Bus) -> list[tuple[str, int, str]]:
    members = await operator.rpc.call(
        "registry",
        "members",
        MembersRequest(job=VICTIM, include_gone=True),
        result=MembersResult,
    )
    return sorted((m.worker_id, m.rank, m.status) for m in members.members)


def files_under(root: Path) -> dict[str, bytes]:
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


# -- the attacks ----------------------------------------------------------------------------------


def test_a_worker_credential_is_its_worker_of_its_job_and_no_other(stack: SecureStack) -> None:
    settings = stack.settings(ATTACKER, "worker-0")
    worker = strata.aio.Worker(settings=settings)
    assert (worker.job, worker.id) == (ATTACKER, "worker-0")
    with pytest.raises(ConfigError, match="is for worker 'worker-0' of job 'attacker'"):
        strata.aio.Worker(VICTIM, settings=settings)
    with pytest.raises(ConfigError, match="worker id 'worker-1' was asked for"):
        strata.aio.Worker(settings=settings, worker_id="worker-1")


async def test_a_forged_worker_failed_for_another_jobs_worker_is_refused_and_never_folded(
    stack: SecureStack, operator: Bus, workers: dict[tuple[str, str], strata.aio.Worker]
) -> None:
    victim = workers[(VICTIM, "worker-0")]
    before = await victim_members(operator)
    forged = WorkerFailed(
        job=VICTIM,
        source="registry",
        worker_id=victim.id,
        rank=victim.rank,
        reason="forged by another job's worker",
        last_heartbeat_ts=0,
        membership_epoch=victim.membership_epoch + 1,
    )
    attacker = await raw(stack, ATTACKER, "worker-0")
    try:
        # Where main let a worker publish (any job's checkpoint acks), its own job's, the
        # event's own subject: the event stream takes nothing from a worker.
        refused = [
            subjects.event_subject(VICTIM, "checkpoint.shard_saved"),
            subjects.event_subject(ATTACKER, "checkpoint.shard_saved"),
            subjects.event_subject(VICTIM, "worker.failed"),
            subjects.event_subject(ATTACKER, "worker.failed"),
        ]
        for subject in refused:
            await attacker.nc.publish(subject, encode_event(forged))
        # The one stream it may write to stores it, and nothing folds it from there.
        await attacker.nc.publish(
            subjects.heartbeat_subject(ATTACKER, "worker-0"), encode_event(forged)
        )
        await natsprobe.settled(attacker)
    finally:
        await attacker.close()
    assert {s.lower() for s in refused} <= attacker.refused["publish"], attacker.errors
    assert forged.id not in {event.id for event in await job_events(operator, VICTIM)}
    assert forged.id not in {event.id for event in await job_events(operator, ATTACKER)}
    assert await victim_members(operator) == before
    assert ("worker-0", victim.rank, "idle") in before


async def test_a_forged_ack_deletes_no_file(
    stack: SecureStack,
    operator: Bus,
    workers: dict[tuple[str, str], strata.aio.Worker],
    tmp_path: Path,
) -> None:
    root = tmp_path / "checkpoints"
    precious_key = shard_key(VICTIM, 777, 0)
    precious = root / precious_key
    precious.parent.mkdir(parents=True)
    precious.write_bytes(b"a victim's shard")
    (root / "notes.txt").write_bytes(b"not a checkpoint at all")
    before = files_under(root)
    # The ack that made the service delete what its uri and key named.
    forged = CheckpointShardSaved(
        job=VICTIM,
        source="worker-0",
        step=777,
        epoch=0,
        rank=0,
        worker_id="worker-0",
        uri=precious.as_uri(),
        key=precious_key,
        bytes=16,
        checksum=CHECKSUM,
    )
    attacker = await raw(stack, ATTACKER, "worker-0")
    try:
        for job in (VICTIM, ATTACKER):
            subject = subjects.event_subject(job, "checkpoint.shard_saved")
            await attacker.nc.publish(subject, encode_event(forged.model_copy(update={"job": job})))
        await natsprobe.settled(attacker)
    finally:
        await attacker.close()
    assert len(attacker.refused["publish"]) == 2, attacker.errors
    # The ack is a request now, and names no file: the service derives the key it records.
    ack = AckShardRequest(
        job=VICTIM, worker_id="worker-0", step=777, epoch=0, rank=0, bytes=16, checksum=CHECKSUM
    )
    with pytest.raises(Forbidden):
        await workers[(ATTACKER, "worker-0")].bus.rpc.call("checkpoint", "ack", ack)
    for job, worker in ((ATTACKER, "worker-0"), (VICTIM, "worker-0")):
        own = ack.model_copy(update={"job": job, "worker_id": worker})
        with pytest.raises(NotFound, match="no open checkpoint of step 777"):
            await workers[(job, worker)].bus.rpc.call("checkpoint", "ack", own)
    assert files_under(root) == before


async def test_another_jobs_begin_and_forged_acks_prune_nothing_of_the_victim(
    stack: SecureStack,
    operator: Bus,
    workers: dict[tuple[str, str], strata.aio.Worker],
    tmp_path: Path,
) -> None:
    root = tmp_path / "shared-root"
    ranks = [workers[(VICTIM, f"worker-{i}")] for i in range(3)]
    managers = [strata.aio.CheckpointManager(w, str(root), keep_count=2) for w in ranks]
    for step in (1, 2, 3):
        for manager in managers:
            await manager.save(f"step {step} of {manager._worker.id}".encode(), step=step)
        for manager in managers:
            await manager.wait()
        await managers[0].wait_committed(step)
    latest = await managers[0].latest()
    assert latest is not None
    assert latest.step == 3
    kept = files_under(root)
    assert {key.split("/")[1] for key in kept} == {"step-000000000002", "step-000000000003"}

    attacker = workers[(ATTACKER, "worker-0")]
    huge = 2**40
    # Asking in the victim's name, from its own subject: refused by the service.
    begin = BeginCheckpointRequest(
        job=VICTIM,
        worker_id="worker-0",
        step=huge,
        epoch=0,
        root_uri=managers[0].root_uri,
        keep_count=1,
        world_size=1,
    )
    with pytest.raises(Forbidden):
        await attacker.bus.rpc.call("checkpoint", "begin", begin)
    # From the victim's subject, or with acks on the event stream: refused by NATS.
    probe = await raw(stack, ATTACKER, "worker-0")
    try:
        as_victim = subjects.rpc_subject("checkpoint", "begin", VICTIM, "worker-0")
        await probe.nc.publish(as_victim, b"")
        for rank in range(3):
            forged = CheckpointShardSaved(
                job=VICTIM,
                source="checkpoint",
                step=huge,
                epoch=0,
                rank=rank,
                worker_id=f"worker-{rank}",
                uri=f"{managers[0].root_uri}/{shard_key(VICTIM, huge, rank)}",
                key=shard_key(VICTIM, huge, rank),
                bytes=1,
                checksum=CHECKSUM,
            )
            await probe.nc.publish(
                subjects.event_subject(VICTIM, "checkpoint.shard_saved"), encode_event(forged)
            )
        await natsprobe.settled(probe)
    finally:
        await probe.close()
    assert as_victim.lower() in probe.refused["publish"]
    assert subjects.event_subject(VICTIM, "checkpoint.shard_saved") in probe.refused["publish"]
    # Its own job may checkpoint to the same root, with retention of one: only its own keys.
    mine = strata.aio.CheckpointManager(attacker, str(root), keep_count=1)
    for step in (huge, huge + 1):
        await mine.save(b"attacker", step=step)
        await mine.wait()
        await mine.wait_committed(step)
    # A worker of the victim's own job cannot shrink its retention, nor ack for another rank.
    insider = strata.aio.CheckpointManager(ranks[1], str(root), keep_count=1)
    with pytest.raises(ConflictError, match="keep_count=2, fixed by its first checkpoint"):
        await insider.save(b"insider", step=huge)
    for_rank_0 = AckShardRequest(
        job=VICTIM, worker_id="worker-0", step=3, epoch=0, rank=0, bytes=1, checksum=CHECKSUM
    )
    with pytest.raises(Forbidden):
        await ranks[1].bus.rpc.call("checkpoint", "ack", for_rank_0)

    assert await managers[0].latest() == latest
    victims = {key: data for key, data in files_under(root).items() if key.startswith(VICTIM)}
    assert victims == kept
    assert await managers[2].load() == b"step 3 of worker-2"


async def test_requests_as_another_worker_or_job_are_forbidden_and_change_nothing(
    stack: SecureStack, operator: Bus, workers: dict[tuple[str, str], strata.aio.Worker]
) -> None:
    victim = workers[(VICTIM, "worker-0")]
    instance = victim.instance
    members_before = await victim_members(operator)
    events_before = len(await job_events(operator, VICTIM))
    in_victims_name: list[tuple[str, str, Any]] = [
        ("registry", "register", RegisterRequest(job=VICTIM, worker_id="worker-0", instance="x")),
        ("registry", "leave", LeaveRequest(job=VICTIM, worker_id="worker-0", instance=instance)),
        ("barrier", "arrive", ArriveRequest(job=VICTIM, name="b", worker_id="worker-0", arrival=0)),
        (
            "sharding",
            "report_progress",
            ReportProgressRequest(
                job=VICTIM, dataset_id="d", epoch=0, worker_id="worker-0", completed=[0]
            ),
        ),
        (
            "sharding",
            "restore_progress",
            RestoreProgressRequest(
                job=VICTIM, dataset_id="d", epoch=0, worker_id="worker-0", checkpoint_step=0
            ),
        ),
        (
            "checkpoint",
            "ack",
            AckShardRequest(
                job=VICTIM,
                worker_id="worker-0",
                step=3,
                epoch=0,
                rank=0,
                bytes=1,
                checksum=CHECKSUM,
            ),
        ),
    ]
    about_the_victims_job: list[tuple[str, str, Any]] = [
        ("registry", "members", MembersRequest(job=VICTIM)),
        ("sharding", "plan", PlanRequest(job=VICTIM, dataset_id="d", epoch=0)),
        (
            "sharding",
            "register_dataset",
            RegisterDatasetRequest(job=VICTIM, dataset_id="d", total_samples=10, shard_size=1),
        ),
        (
            "sharding",
            "get_shards",
            GetShardsRequest(job=VICTIM, dataset_id="d", epoch=0, worker_id="worker-0"),
        ),
        ("checkpoint", "status", CheckpointQuery(job=VICTIM)),
    ]
    attacker = workers[(ATTACKER, "worker-0")]
    for service, verb, request in in_victims_name + about_the_victims_job:
        with pytest.raises(Forbidden, match="acts in its own job only"):
            await attacker.bus.rpc.call(service, verb, request)
    # A worker of the same job may read its job, but speaks only for itself.
    insider = workers[(VICTIM, "worker-1")]
    for service, verb, request in in_victims_name:
        with pytest.raises(Forbidden, match="speaks only for itself"):
            await insider.bus.rpc.call(service, verb, request)
    assert await insider.bus.rpc.call("checkpoint", "status", CheckpointQuery(job=VICTIM))
    assert await victim_members(operator) == members_before
    assert len(await job_events(operator, VICTIM)) == events_before


async def test_another_jobs_events_and_another_workers_replies_cannot_be_read(
    stack: SecureStack, workers: dict[tuple[str, str], strata.aio.Worker]
) -> None:
    attacker = await raw(stack, ATTACKER, "worker-0")
    insider = await raw(stack, VICTIM, "worker-1")
    try:
        from_another_job = [
            subjects.job_events(VICTIM),
            subjects.world_subject(VICTIM),
            subjects.event_subject(VICTIM, "worker.registered"),
            subjects.event_subject(VICTIM, "barrier.released"),
            subjects.control_subject(VICTIM, "worker-0"),
            subjects.worker_inboxes(VICTIM, "worker-0"),
            subjects.heartbeat_subject(VICTIM, "worker-0"),
            "_INBOX.>",
            "_INBOX_strata.>",
            ">",
        ]
        refused = await natsprobe.refused_subscriptions(attacker, from_another_job)
        assert refused == set(from_another_job)
        of_another_worker = [
            subjects.worker_inboxes(VICTIM, "worker-0"),
            subjects.control_subject(VICTIM, "worker-0"),
            subjects.event_subject(VICTIM, "checkpoint.shard_saved"),
        ]
        refused = await natsprobe.refused_subscriptions(insider, of_another_worker)
        assert refused == set(of_another_worker)
    finally:
        await attacker.close()
        await insider.close()
    # The victim's own requests still get their replies, in its own inbox.
    victim = workers[(VICTIM, "worker-0")]
    assert (await victim.members()).world_size == 3


async def test_heartbeats_for_another_job_or_worker_keep_nobody_alive(
    stack: SecureStack, operator: Bus, workers: dict[tuple[str, str], strata.aio.Worker]
) -> None:
    silent = workers[(VICTIM, "worker-2")]
    silent._suspend_heartbeats(True)
    attacker = await raw(stack, ATTACKER, "worker-0")
    stop = asyncio.Event()

    async def impersonate() -> None:
        seq = 0
        while not stop.is_set():
            seq += 1
            beat = WorkerHeartbeat(
                job=VICTIM,
                source=silent.id,
                worker_id=silent.id,
                instance=silent.instance,
                seq=seq,
                state="training",
            )
            # On the victim's subject (NATS refuses it) and on its own (the registry does).
            for job, worker in ((VICTIM, silent.id), (ATTACKER, "worker-0")):
                await attacker.nc.publish(
                    subjects.heartbeat_subject(job, worker), encode_event(beat)
                )
            await asyncio.sleep(HEARTBEAT_INTERVAL / 2)

    pretending = asyncio.create_task(impersonate())
    try:

        async def failed() -> bool:
            return (silent.id, silent.rank, "failed") in await victim_members(operator)

        await async_wait_until(failed, HEARTBEAT_TIMEOUT * 4, "the silent worker to be failed")
    finally:
        stop.set()
        await pretending
        await natsprobe.settled(attacker)
        await attacker.close()
        silent._suspend_heartbeats(False)
    assert subjects.heartbeat_subject(VICTIM, silent.id) in attacker.refused["publish"]


async def test_no_worker_can_heartbeat_for_another_worker_on_any_partition(
    stack: SecureStack, operator: Bus, workers: dict[tuple[str, str], strata.aio.Worker]
) -> None:
    victim = "worker-0"
    # The victim's worker token under every bucket token, so under every registry partition's
    # subscriptions, not only the one its id hashes to.
    forged = [
        f"{subjects.HEARTBEATS}.{bucket:02x}.{VICTIM}.{victim}"
        for bucket in range(subjects.HEARTBEAT_BUCKETS)
    ]
    assert subjects.heartbeat_subject(VICTIM, victim) in forged
    for job, worker in ((ATTACKER, "worker-0"), (VICTIM, "worker-1")):
        client = await raw(stack, job, worker)
        try:
            own = subjects.heartbeat_subject(job, worker)
            assert await natsprobe.reached(operator.nc, client, forged, own) == set()
            await natsprobe.settled(client)
            assert {s.lower() for s in forged} <= client.refused["publish"], (job, worker)
        finally:
            await client.close()
