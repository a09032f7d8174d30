"""Checkpoints end to end: real registry and checkpoint services, local disk and a real S3 server.

Ranks commit steps and reload their exact bytes; retention keeps `keep_count`; a rank SIGKILLed in
the middle of its upload, or just after its save returned, aborts the step and leaves nothing
behind; a restart superseding a rank aborts the step it had not saved; a world with a failed rank
never commits; a step is saved once; a shard lost or cut short after its ack stops the commit; a
rank a checkpoint lacks is a `MissingShard`, not a `NotFound`; a corrupted shard is refused; a
checkpoint service SIGKILLed between acks commits after its restart.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path

import pytest
import strata
import strata.aio
import torch
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events.requests import (
    AckShardRequest,
    AckShardResult,
    BeginCheckpointRequest,
    CheckpointAnswer,
    CheckpointInfo,
    CheckpointQuery,
    Manifest,
)
from strata.storage import StorageBackend, WriteResult, manifest_key, open_storage, shard_key

from tests.s3 import S3Endpoint, moto_server  # noqa: F401
from tests.support import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    ServiceProcess,
    async_wait_until,
    job_events,
    new_job,
    record_registrations,
)

pytestmark = [pytest.mark.nats, pytest.mark.slow]


@pytest.fixture
def services(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[dict[str, ServiceProcess]]:
    started = {
        name: ServiceProcess(name, own_nats_server.url, tmp_path / "logs").start()
        for name in ("registry", "checkpoint")
    }
    yield started
    for process in started.values():
        process.stop()


@pytest.fixture
async def workers(
    own_nats_server: NatsServer, services: dict[str, ServiceProcess]
) -> AsyncIterator[list[strata.aio.Worker]]:
    job = new_job("ckpt")
    made = [
        await strata.aio.Worker(job, own_nats_server.url, worker_id=f"rank{i}").start()
        for i in range(4)
    ]
    yield made
    for worker in made:
        await worker.stop()


def payload(rank: int, step: int) -> bytes:
    return (f"rank {rank} step {step};".encode() * 5000)[: 40_000 + rank]


async def aborted_reason(manager: strata.aio.CheckpointManager, step: int) -> str:
    """Wait until `step` is aborted; its reason."""

    async def aborted() -> bool:
        answer = await manager.status(step)
        return bool(answer.checkpoint and answer.checkpoint.status == "aborted")

    await async_wait_until(aborted, 20, f"step {step} to be aborted")
    answer = await manager.status(step)
    assert answer.checkpoint is not None
    return answer.checkpoint.reason


async def world_size_is(worker: strata.aio.Worker, size: int) -> None:
    async def reached() -> bool:
        return (await worker.members()).world_size == size

    await async_wait_until(reached, 20, f"the job to have {size} live workers")


class GatedStorage(StorageBackend):
    """Another backend whose writes wait until `gate` is set (the rest passes straight through)."""

    def __init__(self, inner: StorageBackend) -> None:
        self.inner = inner
        self.root_uri = inner.root_uri
        self.gate = asyncio.Event()

    async def write(self, key: str, data: bytes | memoryview) -> WriteResult:
        await self.gate.wait()
        return await self.inner.write(key, data)

    async def read(self, key: str, checksum: str | None = None) -> bytes:
        return await self.inner.read(key, checksum)

    async def exists(self, key: str) -> bool:
        return await self.inner.exists(key)

    async def size(self, key: str) -> int | None:
        return await self.inner.size(key)

    async def delete(self, key: str) -> None:
        await self.inner.delete(key)

    async def delete_prefix(self, prefix: str) -> int:
        return await self.inner.delete_prefix(prefix)

    async def list(self, prefix: str) -> list[str]:
        return await self.inner.list(prefix)


async def save_step(managers: list[strata.aio.CheckpointManager], step: int) -> None:
    for rank, manager in enumerate(managers):
        await manager.save(payload(rank, step), step=step, epoch=0)
    for manager in managers:
        await manager.wait()
    await managers[0].wait_committed(step, timeout=30)


async def test_four_ranks_commit_reload_and_retain_on_local_disk(
    workers: list[strata.aio.Worker], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    managers = [strata.aio.CheckpointManager(w, str(root), keep_count=2) for w in workers]
    for step in (100, 200, 300):
        await save_step(managers, step)
    latest = await managers[2].latest()
    assert latest is not None
    assert latest.step == 300
    assert [s.rank for s in latest.shards] == [0, 1, 2, 3]
    for rank, manager in enumerate(managers):
        assert await manager.load() == payload(rank, 300)
        assert await manager.load(step=200) == payload(rank, 200)
    job = workers[0].job

    async def pruned() -> bool:
        return sorted(os.listdir(root / job)) == ["step-000000000200", "step-000000000300"]

    await async_wait_until(pruned, 10, "retention to keep the newest two steps")
    assert (await managers[1].latest_in_storage()).step == 300  # type: ignore[union-attr]


async def test_commit_and_retention_on_a_real_s3_server(
    moto_server: S3Endpoint,  # noqa: F811
    own_nats_server: NatsServer,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bucket = moto_server.new_bucket()
    env = {
        Env.S3_ENDPOINT_URL: moto_server.url,
        Env.AWS_REGION: moto_server.region,
        "AWS_ACCESS_KEY_ID": moto_server.access_key,
        "AWS_SECRET_ACCESS_KEY": moto_server.secret_key,
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    # Nothing here is about failure detection: a timeout that a loaded machine's late beats
    # (the first S3 client is made on the workers' own loop) cannot reach.
    started = [
        ServiceProcess(
            name, own_nats_server.url, tmp_path / "logs", heartbeat_timeout=10.0, env=env
        ).start()
        for name in ("registry", "checkpoint")
    ]
    job = new_job("s3")
    made = [
        await strata.aio.Worker(job, own_nats_server.url, worker_id=f"r{i}").start()
        for i in range(2)
    ]
    try:
        location = f"s3://{bucket}/runs"
        managers = [strata.aio.CheckpointManager(w, location, keep_count=1) for w in made]
        for step in (1, 2):
            await save_step(managers, step)
        assert await managers[1].load() == payload(1, 2)
        client = moto_server.client()

        def keys() -> list[str]:
            listed = client.list_objects_v2(Bucket=bucket, Prefix=f"runs/{job}/")
            return sorted(o["Key"] for o in listed.get("Contents", []))

        expected = [f"runs/{manifest_key(job, 2)}"] + [
            f"runs/{shard_key(job, 2, rank)}" for rank in (0, 1)
        ]

        async def retained() -> bool:
            return keys() == sorted(expected)

        await async_wait_until(retained, 10, "step 1 to be pruned from S3")
        # A shard deleted after its ack: the commit finds it missing and aborts the step.
        await managers[0].save(payload(0, 3), step=3)
        await managers[0].wait()
        client.delete_object(Bucket=bucket, Key=f"runs/{shard_key(job, 3, 0)}")
        await managers[1].save(payload(1, 3), step=3)
        await managers[1].wait()
        reason = await aborted_reason(managers[0], 3)
        assert f"the shard of rank 0 ({shard_key(job, 3, 0)}) is missing from storage" in reason
        await async_wait_until(retained, 10, "the aborted step's objects to be removed")
        latest = await managers[1].latest()
        assert latest is not None
        assert latest.step == 2
        for manager in managers:
            await manager.close()
    finally:
        for worker in made:
            await worker.stop()
        for process in started:
            process.stop()


KILLED_WRITER = """
import os, sys, time
import strata
w = strata.Worker(job=sys.argv[1], nats_url=sys.argv[2], worker_id="victim")
w.start()
ckpt = strata.CheckpointManager(w, sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
ckpt.save(os.urandom(256 * 1024 * 1024), step=int(sys.argv[4]))
print("saving", flush=True)
time.sleep(600)
"""


async def test_a_rank_killed_mid_upload_aborts_the_step_and_leaves_nothing(
    workers: list[strata.aio.Worker], own_nats_server: NatsServer, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    job = workers[0].job
    survivors = workers[:3]
    await workers[3].stop()  # the victim below takes its place in the job
    # Each survivor's view of the world takes the leave in before it saves: the registry's
    # notice of it may come late on a loaded machine, and a save made on the older view opens
    # the step for a world of 4, whose rank 3 has no live worker (it aborts, as it should).
    for worker in survivors:
        await world_size_is(worker, 3)
    managers = [strata.aio.CheckpointManager(w, str(root), keep_count=5) for w in survivors]
    await save_step(managers, 10)
    # Blocking calls go to threads: the in-process workers heartbeat on this event loop.
    victim = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-c", KILLED_WRITER, job, own_nats_server.url, str(root), "20"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL),
            Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT),
        },
    )
    try:
        assert victim.stdout is not None
        assert victim.stdin is not None
        line = ""
        while line.strip() != "ready":
            line = await asyncio.to_thread(victim.stdout.readline)
            assert line, "the victim exited before it was ready"
        victim.stdin.write("go\n")
        victim.stdin.flush()
        assert (await asyncio.to_thread(victim.stdout.readline)).strip() == "saving"
        for manager in managers:
            await manager.save(b"survivor", step=20)
        step_dir = root / job / "step-000000000020"

        async def writing() -> bool:
            return step_dir.is_dir() and any(p.name.startswith(".") for p in step_dir.iterdir())

        await async_wait_until(writing, 30, "the victim's upload to be under way")
        victim.kill()
        await asyncio.to_thread(victim.wait)
        for manager in managers:
            await manager.wait()

        async def aborted() -> bool:
            answer = await managers[0].status(20)
            return bool(answer.checkpoint and answer.checkpoint.status == "aborted")

        await async_wait_until(aborted, 20, "step 20 to be aborted")
        answer = await managers[0].status(20)
        assert answer.checkpoint is not None
        assert "'victim'" in answer.checkpoint.reason

        async def cleaned() -> bool:
            return not step_dir.exists()

        await async_wait_until(cleaned, 10, "the aborted step's files to be removed")
        latest = await managers[1].latest()
        assert latest is not None
        assert latest.step == 10
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


async def test_a_restart_that_supersedes_a_participant_aborts_the_step_it_had_not_saved(
    workers: list[strata.aio.Worker], own_nats_server: NatsServer, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    managers = [strata.aio.CheckpointManager(w, str(root), keep_count=5) for w in workers]
    await save_step(managers, 10)
    for rank, manager in enumerate(managers[:3]):
        await manager.save(payload(rank, 20), step=20)
    for manager in managers[:3]:
        await manager.wait()

    async def three_acked() -> bool:
        answer = await managers[0].status(20)
        return bool(answer.checkpoint and answer.checkpoint.acked_ranks == [0, 1, 2])

    await async_wait_until(three_acked, 10, "the acks of ranks 0 to 2 to count")
    answer = await managers[0].status(20)
    assert answer.checkpoint is not None
    assert answer.checkpoint.status == "open"
    # rank3's process restarts, faster than the heartbeat timeout, before saving step 20.
    restarted = strata.aio.Worker(workers[0].job, own_nats_server.url, worker_id="rank3")
    try:
        await restarted.start()
        assert restarted.rank == 3

        async def aborted() -> bool:
            answer = await managers[0].status(20)
            return bool(answer.checkpoint and answer.checkpoint.status == "aborted")

        await async_wait_until(aborted, 10, "step 20 to be aborted")
        answer = await managers[0].status(20)
        assert answer.checkpoint is not None
        assert "'rank3' (rank 3) failed" in answer.checkpoint.reason
        latest = await managers[1].latest()
        assert latest is not None
        assert latest.step == 10
        # The job restarts from step 10 and reaches step 20 again: its next attempt, whose
        # shards have keys of their own, commits with the restarted process as rank 3.
        again = strata.aio.CheckpointManager(restarted, str(root), keep_count=5)
        restarted_job = [
            *(strata.aio.CheckpointManager(w, str(root), keep_count=5) for w in workers[:3]),
            again,
        ]
        await save_step(restarted_job, 20)
        answer = await again.status(20)
        assert answer.checkpoint is not None
        assert answer.checkpoint.attempt == 1
        assert answer.manifest is not None
        assert all(".a1.bin" in shard.key for shard in answer.manifest.shards)
        assert await again.load(step=20) == payload(3, 20)
        # And the next step as usual.
        await save_step([*managers[:3], again], 30)
        assert await again.load() == payload(3, 30)
        # The replaced process saves nothing more: its begin is refused, not written.
        with pytest.raises(strata.WorkerSuperseded, match="held by another process"):
            await managers[3].save(b"from the replaced process", step=40)
        assert not (root / workers[0].job / "step-000000000040").exists()
    finally:
        await restarted.stop()


async def test_a_corrupted_shard_is_refused_on_load(
    workers: list[strata.aio.Worker], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    managers = [strata.aio.CheckpointManager(w, str(root)) for w in workers]
    await save_step(managers, 7)
    shard = root / shard_key(workers[1].job, 7, 1)
    data = bytearray(shard.read_bytes())
    data[100] ^= 0xFF
    shard.write_bytes(bytes(data))
    with pytest.raises(strata.ChecksumMismatch):
        await managers[1].load()
    assert await managers[0].load() == payload(0, 7)


async def test_the_commit_happens_after_a_checkpoint_service_restart(
    workers: list[strata.aio.Worker], services: dict[str, ServiceProcess], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    managers = [strata.aio.CheckpointManager(w, str(root)) for w in workers]
    for rank, manager in enumerate(managers[:2]):
        await manager.save(payload(rank, 5), step=5)
        await manager.wait()
    # Ranks 2 and 3 declare their shards while the service is up and write them once it is down.
    gates = []
    for manager in managers[2:]:
        gated = GatedStorage(manager.storage)
        manager._storage = gated
        gates.append(gated.gate)
    for rank, manager in enumerate(managers[2:], start=2):
        await manager.save(payload(rank, 5), step=5)
    services["checkpoint"].kill()
    for gate in gates:
        gate.set()
    # Their writes finish while the service is down; their acks are asked again until it is back.
    writes = [asyncio.create_task(manager.wait()) for manager in managers[2:]]
    restarted = ServiceProcess("checkpoint", services["checkpoint"].env[Env.NATS_URL], tmp_path)
    services["checkpoint"] = await asyncio.to_thread(restarted.start)
    await asyncio.gather(*writes)
    for manager in managers:
        await manager.wait()
    info = await managers[0].wait_committed(5, timeout=30)
    assert info.status == "committed"
    assert await managers[3].load() == payload(3, 5)


async def test_a_shard_whose_step_ended_before_its_ack_does_not_count_nor_fail_the_save(
    workers: list[strata.aio.Worker], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    managers = [strata.aio.CheckpointManager(w, str(root)) for w in workers]
    gated = GatedStorage(managers[0].storage)
    managers[0]._storage = gated
    await managers[0].save(payload(0, 3), step=3)  # declared; its write waits on the gate
    await workers[3].stop()  # a participant leaves before saving: the step aborts
    assert "'rank3' (rank 3) left the job" in await aborted_reason(managers[1], 3)
    gated.gate.set()
    # The shard is written and its ack refused: the step's outcome, not a failed save.
    await managers[0].wait()
    assert managers[0].saved == []
    (refused,) = managers[0].refused
    assert isinstance(refused, strata.ConflictError)
    assert "aborted" in refused.message
    with pytest.raises(strata.ConflictError, match="aborted"):
        await managers[0].wait_committed(3, timeout=5)

    # Once rank 0 knows its world is 3 (a world notice, a moment after the leave; a save from a
    # view of 4 would open the step for a world whose rank 3 is gone), the next save goes on.
    async def world_of_three() -> bool:
        return workers[0].world_size == 3

    await async_wait_until(world_of_three, 10, "rank 0 to see rank 3 gone")
    await managers[0].save(payload(0, 4), step=4)


async def test_save_state_snapshots_at_the_call_and_reuses_its_buffers(
    workers: list[strata.aio.Worker], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    managers = [strata.aio.CheckpointManager(w, str(root)) for w in workers]
    states = [
        {
            "weight": torch.full((64, 32), float(rank)),
            "layers": [torch.arange(10) + rank, (torch.ones(3, dtype=torch.float16), "tag")],
            "step": 1,
        }
        for rank in range(4)
    ]
    first_buffers = []
    for step in (1, 2):
        for rank, manager in enumerate(managers):
            await manager.save_state(states[rank], step=step)
            # Training goes on at once: what was saved is what the state held at the call.
            states[rank]["weight"].add_(100)
            states[rank]["layers"][0].mul_(-1)
            states[rank]["step"] = step + 1
        for manager in managers:
            await manager.wait()
        await managers[0].wait_committed(step, timeout=30)
        staged = [b.data_ptr() for buffers in managers[0]._staging._free.values() for b in buffers]
        assert len(staged) == 3
        if step == 1:
            first_buffers = staged
    assert sorted(staged) == sorted(first_buffers)  # the second save copied into the first's

    for rank, manager in enumerate(managers):
        one, two = await manager.load_state(step=1), await manager.load_state(step=2)
        assert torch.equal(one["weight"], torch.full((64, 32), float(rank)))
        assert torch.equal(two["weight"], torch.full((64, 32), float(rank) + 100))
        assert torch.equal(one["layers"][0], torch.arange(10) + rank)
        assert torch.equal(two["layers"][0], -(torch.arange(10) + rank))
        assert one["layers"][1][1] == "tag"
        assert one["layers"][1][0].dtype == torch.float16
        assert (one["step"], two["step"]) == (1, 2)


async def test_a_rank_failed_before_the_step_opened_never_commits(
    workers: list[strata.aio.Worker], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    managers = [strata.aio.CheckpointManager(w, str(root)) for w in workers]
    await save_step(managers, 1)
    workers[1]._suspend_heartbeats(True)  # rank 1 goes silent and is failed
    await world_size_is(workers[0], 3)
    survivors = [managers[0], managers[2], managers[3]]
    # Live ranks 0, 2 and 3: whatever world the survivors see (3, or 4 if they have not heard of
    # the failure), rank 1 of it has no live worker, so the step aborts as it opens.
    with pytest.raises(strata.ConflictError, match=r"rank 1 of the world of [34] has no live"):
        await survivors[0].save(payload(0, 2), step=2)
    for manager in survivors[1:]:
        with pytest.raises(strata.ConflictError, match="aborted"):
            await manager.save(b"never written", step=2)
    assert "has no live worker" in await aborted_reason(managers[0], 2)
    for manager in survivors:
        await manager.wait()
        latest = await manager.latest()
        assert latest is not None
        assert latest.step == 1
        assert latest.complete
        assert (latest.world_size, [s.rank for s in latest.shards]) == (4, [0, 1, 2, 3])
    assert await managers[2].load() == payload(2, 1)
    assert not (root / workers[0].job / "step-000000000002").exists()


KILLED_AFTER_SAVE = """
import os, signal, sys
import strata
w = strata.Worker(job=sys.argv[1], nats_url=sys.argv[2], worker_id="victim")
w.start()
ckpt = strata.CheckpointManager(w, sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
ckpt.save(os.urandom(32 * 1024 * 1024), step=int(sys.argv[4]))
# Killed before the background write is done: it has declared itself, it never acks.
os.kill(os.getpid(), signal.SIGKILL)
"""


async def test_a_rank_killed_after_its_save_returned_aborts_the_step(
    workers: list[strata.aio.Worker], own_nats_server: NatsServer, tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    job = workers[0].job
    await workers[3].stop()  # the victim below takes its place (rank 3) in the job
    for worker in workers[:3]:
        await world_size_is(worker, 3)  # each saves on a view that took the leave in
    survivors = [strata.aio.CheckpointManager(w, str(root)) for w in workers[:3]]
    await save_step(survivors, 10)
    victim = await asyncio.to_thread(
        subprocess.Popen,
        [sys.executable, "-c", KILLED_AFTER_SAVE, job, own_nats_server.url, str(root), "20"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={
            **os.environ,
            Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL),
            Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT),
        },
    )
    try:
        assert victim.stdout is not None
        assert victim.stdin is not None
        assert (await asyncio.to_thread(victim.stdout.readline)).strip() == "ready"
        victim.stdin.write("go\n")
        victim.stdin.flush()
        assert await asyncio.to_thread(victim.wait) == -9
        # The survivors save after the victim's death: before they do, or as they do, the step
        # is aborted, because the victim declared its shard of it before its save returned.
        reason = await aborted_reason(survivors[0], 20)
        assert "participant 'victim' (rank 3)" in reason
        answer = await survivors[0].status(20)
        assert answer.checkpoint is not None
        assert answer.checkpoint.world_size == 4
        assert "victim" in [p.worker_id for p in answer.checkpoint.participants]

        async def cleaned() -> bool:
            return not (root / job / "step-000000000020").exists()

        await async_wait_until(cleaned, 10, "the aborted step's files to be removed")
        latest = await survivors[1].latest()
        assert latest is not None
        assert latest.step == 10

        # Once the survivors know their world is 3, saving step 20 again is its next attempt.
        async def world_of_three() -> bool:
            return all(w.world_size == 3 for w in workers[:3])

        await async_wait_until(world_of_three, 10, "the survivors to see the victim gone")
        again = [strata.aio.CheckpointManager(w, str(root)) for w in workers[:3]]
        await save_step(again, 20)
        answer = await again[0].status(20)
        assert answer.checkpoint is not None
        assert (answer.checkpoint.attempt, answer.checkpoint.world_size) == (1, 3)
    finally:
        if victim.poll() is None:
            victim.kill()
            victim.wait()


async def test_a_step_is_saved_once_and_a_committed_one_never_again(
    workers: list[strata.aio.Worker], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    managers = [strata.aio.CheckpointManager(w, str(root)) for w in workers]
    await save_step(managers, 3)
    with pytest.raises(strata.ConflictError, match="step 3 was already saved by rank 0"):
        await managers[0].save(b"again", step=3)
    # Another manager of the same worker asks the service, which refuses the committed step.
    other = strata.aio.CheckpointManager(workers[0], str(root))
    with pytest.raises(strata.ConflictError, match="already committed"):
        await other.save(b"again", step=3)
    with pytest.raises(strata.ConflictError, match="already committed"):
        await other.save_state({"x": torch.zeros(4)}, step=3)

    await managers[1].save(payload(1, 4), step=4)
    with pytest.raises(strata.ConflictError, match="step 4 was already saved by rank 1"):
        await managers[1].save(b"second copy", step=4)
    second = strata.aio.CheckpointManager(workers[1], str(root))
    with pytest.raises(strata.ConflictError, match="step 4 was already saved by rank 1"):
        await second.save(b"second copy", step=4)
    for rank in (0, 2, 3):
        await managers[rank].save(payload(rank, 4), step=4)
    for manager in managers:
        await manager.wait()
    await managers[0].wait_committed(4, timeout=30)
    for rank, manager in enumerate(managers):
        assert await manager.load(step=3) == payload(rank, 3)
        assert await manager.load(step=4) == payload(rank, 4)


async def test_a_shard_lost_or_cut_short_after_its_ack_stops_the_commit(
    workers: list[strata.aio.Worker], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    job = workers[0].job
    managers = [strata.aio.CheckpointManager(w, str(root), keep_count=1) for w in workers]
    await save_step(managers, 1)

    async def save_with(step: int, damage: Callable[[Path], None]) -> str:
        for rank, manager in enumerate(managers[:3]):
            await manager.save(payload(rank, step), step=step)
            await manager.wait()
        damage(root / shard_key(job, step, 1))
        await managers[3].save(payload(3, step), step=step)
        await managers[3].wait()
        return await aborted_reason(managers[0], step)

    lost = await save_with(2, Path.unlink)
    assert f"the shard of rank 1 ({shard_key(job, 2, 1)}) is missing from storage" in lost
    cut = await save_with(3, lambda path: os.truncate(path, 1000))
    assert f"holds 1000 bytes in storage, {len(payload(1, 3))} were acked" in cut

    async def only_step_1() -> bool:
        return sorted(os.listdir(root / job)) == ["step-000000000001"]

    # Retention keeps one, and that one is the newest complete checkpoint, through both aborts.
    await async_wait_until(only_step_1, 10, "the aborted steps' files to be removed")
    for rank, manager in enumerate(managers):
        latest = await manager.latest()
        assert latest is not None
        assert latest.step == 1
        assert await manager.load() == payload(rank, 1)
    await save_step(managers, 4)

    async def only_step_4() -> bool:
        return sorted(os.listdir(root / job)) == ["step-000000000004"]

    await async_wait_until(only_step_4, 10, "step 1 to be pruned once step 4 is committed")


async def test_a_rank_the_checkpoint_lacks_is_a_missing_shard_not_a_not_found(
    workers: list[strata.aio.Worker], tmp_path: Path
) -> None:
    root = tmp_path / "checkpoints"
    job = workers[0].job
    managers = [strata.aio.CheckpointManager(w, str(root)) for w in workers]
    with pytest.raises(strata.NotFound):
        await managers[0].load()  # no checkpoint at all: start fresh
    await save_step(managers, 1)
    with pytest.raises(strata.MissingShard) as caught:
        await managers[0].load(rank=7)
    assert not isinstance(caught.value, strata.NotFound)
    assert caught.value.code == "missing_shard"
    assert "step 1 has no shard of rank 7: it holds ranks 0, 1, 2, 3 of its world of 4" in str(
        caught.value
    )
    assert await managers[0].load(rank=2) == payload(2, 1)  # by the rank it was saved under

    # A manifest from before worlds were recorded that lacks a rank of its participants' world:
    # storage readers skip it unless asked, and loading the rank it lacks is a MissingShard too.
    complete = Manifest.model_validate_json((root / manifest_key(job, 1)).read_bytes())
    legacy = complete.model_copy(
        update={
            "step": 2,
            "participants": [p for p in complete.participants if p.rank != 2],
            "shards": [s for s in complete.shards if s.rank != 2],
            "world_size": None,
            "membership_epoch": None,
        }
    )
    (root / job / "step-000000000002").mkdir()
    (root / manifest_key(job, 2)).write_text(legacy.model_dump_json(exclude_none=True))
    assert legacy.missing_ranks() == [2]
    stored = await managers[0].latest_in_storage()
    assert stored is not None
    assert stored.step == 1
    anything = await managers[0].latest_in_storage(include_incomplete=True)
    assert anything is not None
    assert anything.step == 2
    assert [m.step for m in await managers[0].manifests()] == [1]
    assert [m.step for m in await managers[0].manifests(include_incomplete=True)] == [2, 1]
    with pytest.raises(strata.MissingShard, match="rank 2: it holds ranks 0, 1, 3 of its world"):
        managers[0]._shard(anything, 2)


# -- a burst (group commit) -----------------------------------------------------------------------

BURST = 100


async def test_every_rank_saving_at_once_opens_the_step_once_and_commits_it_once(
    own_nats_server: NatsServer, tmp_path: Path
) -> None:
    # The checkpoint service alone, with registrations written as the registry writes them: no
    # registry fails these heartbeat-less workers in the middle of the burst.
    service = ServiceProcess("checkpoint", own_nats_server.url, tmp_path / "logs").start()
    bus = await Bus.connect(own_nats_server.url, deadline=10)
    storage = open_storage(str(tmp_path / "checkpoints"))
    job = new_job("burst")
    workers = [f"w{i:03d}" for i in range(BURST)]
    try:
        await record_registrations(bus, job, workers)
        infos = await asyncio.gather(
            *(
                bus.rpc.call(
                    "checkpoint",
                    "begin",
                    BeginCheckpointRequest(
                        job=job,
                        worker_id=worker,
                        step=1,
                        epoch=0,
                        root_uri=storage.root_uri,
                        world_size=BURST,
                        membership_epoch=BURST,
                        instance=f"p-{worker}",
                        save_id=f"save-{worker}",
                    ),
                    result=CheckpointInfo,
                    timeout=60,
                )
                for worker in workers
            )
        )
        assert {(i.status, i.attempt, i.world_size) for i in infos} == {("open", 0, BURST)}
        assert [p.worker_id for p in infos[0].participants] == workers
        written = [
            await storage.write(shard_key(job, 1, rank), payload(rank, 1)) for rank in range(BURST)
        ]

        def ack(rank: int) -> Awaitable[AckShardResult]:
            return bus.rpc.call(
                "checkpoint",
                "ack",
                AckShardRequest(
                    job=job,
                    worker_id=workers[rank],
                    step=1,
                    epoch=0,
                    rank=rank,
                    bytes=written[rank].bytes,
                    checksum=written[rank].checksum,
                    instance=f"p-{workers[rank]}",
                ),
                result=AckShardResult,
                timeout=60,
            )

        acked = await asyncio.gather(*(ack(rank) for rank in range(BURST)))
        assert len({a.event_id for a in acked}) == BURST

        async def committed() -> bool:
            answer = await bus.rpc.call(
                "checkpoint", "status", CheckpointQuery(job=job, step=1), result=CheckpointAnswer
            )
            return answer.checkpoint is not None and answer.checkpoint.status == "committed"

        await async_wait_until(committed, 30, "the burst's step to commit")
        # Every ack again, at once (a retry after a lost answer): the first answers, nothing new.
        again = await asyncio.gather(*(ack(rank) for rank in range(BURST)))
        assert [a.event_id for a in again] == [a.event_id for a in acked]
        assert {a.status for a in again} == {"committed"}
        manifest = Manifest.model_validate_json(await storage.read(manifest_key(job, 1)))
        assert [s.rank for s in manifest.shards] == list(range(BURST))

        counts = Counter(event.type for event in await job_events(bus, job))
        assert counts["checkpoint.started"] == 1
        assert counts["checkpoint.shard_started"] == BURST
        assert counts["checkpoint.shard_saved"] == BURST
        assert counts["checkpoint.committed"] == 1
        assert counts["checkpoint.aborted"] == 0
    finally:
        await bus.close()
        await storage.close()
        service.stop()
