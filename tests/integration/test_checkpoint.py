"""Checkpoints end to end: real registry and checkpoint services, local disk and a real S3 server.

Ranks commit steps and reload their exact bytes; retention keeps `keep_count`; a rank SIGKILLed in
the middle of its upload aborts the step and leaves nothing behind; a restart superseding a rank
aborts the step it had not saved; a corrupted shard is refused; a checkpoint service SIGKILLed
between acks commits after its restart.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
import strata
import strata.aio
import torch
from strata.bus.server import NatsServer
from strata.config import Env
from strata.storage import manifest_key, shard_key

from tests.s3 import S3Endpoint, moto_server  # noqa: F401
from tests.support import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    ServiceProcess,
    async_wait_until,
    new_job,
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
    started = [
        ServiceProcess(name, own_nats_server.url, tmp_path / "logs", env=env).start()
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
        # The restarted process takes rank 3's part in the next step.
        again = strata.aio.CheckpointManager(restarted, str(root), keep_count=5)
        await save_step([*managers[:3], again], 30)
        assert await again.load() == payload(3, 30)
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
    services["checkpoint"].kill()
    for rank, manager in enumerate(managers[2:], start=2):
        await manager.save(payload(rank, 5), step=5)
    await asyncio.sleep(0)  # the acks are published while the service is down
    restarted = ServiceProcess("checkpoint", services["checkpoint"].env[Env.NATS_URL], tmp_path)
    services["checkpoint"] = await asyncio.to_thread(restarted.start)
    for manager in managers:
        await manager.wait()
    info = await managers[0].wait_committed(5, timeout=30)
    assert info.status == "committed"
    assert await managers[3].load() == payload(3, 5)


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
