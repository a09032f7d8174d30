"""Checkpoints under faults beyond crash-stop: a checkpoint service whose wall clock steps, a disk
that fills mid-save (ENOSPC on a 2 MiB tmpfs), an S3 server killed in the middle of a multipart
upload, and a writer that finishes after its step aborted.

Real registry and checkpoint processes, a real nats-server and a real S3 server (moto's, killed
with SIGKILL). What must hold: a stepped wall clock does not end a step's deadline early; a write
that fails aborts its step at once (the writer reports it; every rank hears of it well before the
step's deadline) with an error that names the cause; only complete checkpoints are visible; and
a late writer of an aborted step leaves no file behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import strata
from strata import clock
from strata.config import Env
from strata.errors import ConflictError, StorageError, StrataError
from strata.storage.s3 import MIN_PART_SIZE, S3Storage

from tests.s3 import MotoServer
from tests.support import ServiceProcess, async_wait_until, new_job, numbered, start_workers

pytestmark = [pytest.mark.nats, pytest.mark.slow]

INTERVAL = 0.25
TIMEOUT = 3.0
STEP_TIMEOUT_S = 120.0
"""Each step's deadline: an abort that waited for it would fail these tests (they wait 30 s)."""
PROMPT_S = 1.0
LOAD_SLACK_S = 1.0
"""What a loaded 2-core machine may add to a measured interval (event loops late to wake)."""


@dataclass
class Stack:
    checkpoint: ServiceProcess
    offset_file: Path
    moto: MotoServer
    s3_env: dict[str, str]

    def step_clock(self, seconds: float) -> None:
        self.offset_file.write_text(f"{seconds}\n", encoding="utf-8")


@pytest.fixture(scope="module")
def stack(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    log_dir = tmp_path_factory.mktemp("checkpoint-faults")
    offset_file = log_dir / "checkpoint-clock-offset"
    offset_file.write_text("0\n", encoding="utf-8")
    moto = MotoServer(workdir=log_dir / "moto").start()
    s3_env = {
        Env.S3_ENDPOINT_URL: moto.endpoint.url,
        Env.AWS_REGION: moto.endpoint.region,
        "AWS_ACCESS_KEY_ID": moto.endpoint.access_key,
        "AWS_SECRET_ACCESS_KEY": moto.endpoint.secret_key,
    }
    registry = ServiceProcess(
        "registry", nats_url, log_dir, heartbeat_interval=INTERVAL, heartbeat_timeout=TIMEOUT
    ).start()
    checkpoint = ServiceProcess(
        "checkpoint",
        nats_url,
        log_dir,
        heartbeat_interval=INTERVAL,
        heartbeat_timeout=TIMEOUT,
        env={clock.OFFSET_FILE_ENV: str(offset_file), **s3_env},
    ).start()
    try:
        yield Stack(checkpoint, offset_file, moto, s3_env)
    finally:
        checkpoint.stop()
        registry.stop()
        moto.stop()


@pytest.fixture
def unstepped(stack: Stack) -> Iterator[Stack]:
    stack.step_clock(0.0)
    yield stack
    stack.step_clock(0.0)


def manager(worker: strata.aio.Worker, root: str) -> strata.aio.CheckpointManager:
    return strata.aio.CheckpointManager(worker, root, keep_count=5, timeout=STEP_TIMEOUT_S)


async def committed(managers: list[strata.aio.CheckpointManager], step: int, size: int) -> None:
    for rank, each in enumerate(managers):
        await each.save(bytes([rank]) * size, step=step)
    for each in managers:
        await each.wait()
    await managers[0].wait_committed(step, timeout=30)


async def wait_error(manager: strata.aio.CheckpointManager) -> tuple[BaseException, float]:
    try:
        await manager.wait()
    except Exception as exc:  # the tests check its type
        return exc, time.monotonic()
    raise AssertionError("the save did not fail")


async def committed_error(
    manager: strata.aio.CheckpointManager, step: int
) -> tuple[BaseException | None, float]:
    try:
        await manager.wait_committed(step, timeout=30)
    except StrataError as exc:
        return exc, time.monotonic()
    return None, time.monotonic()


async def assert_aborted_at_once(
    failing: strata.aio.CheckpointManager,
    other: strata.aio.CheckpointManager,
    step: int,
    cause: str,
) -> None:
    """`failing`'s save of `step` fails: its error names `cause`, the step is aborted by the time
    that error is raised (the report is answered after the abort is recorded), and the other
    rank's `wait_committed` hears of the abort within a second."""
    watching = asyncio.create_task(committed_error(other, step))
    error, failed_at = await wait_error(failing)
    assert isinstance(error, StorageError), repr(error)
    assert cause in error.message, error.message
    assert f"step {step}" in error.message
    assert "the step is aborted" in error.message
    answer = await failing.status(step)
    assert answer.checkpoint is not None
    assert answer.checkpoint.status == "aborted"
    assert "could not write its shard" in answer.checkpoint.reason
    heard, heard_at = await watching
    assert isinstance(heard, ConflictError), repr(heard)
    assert "aborted" in heard.message
    assert heard_at - failed_at < PROMPT_S + LOAD_SLACK_S


async def test_a_wall_clock_stepped_forward_does_not_abort_a_60s_step_early(
    workers: list[strata.aio.Worker], nats_url: str, tmp_path: Path, unstepped: Stack
) -> None:
    job = new_job("ckpt-clock")
    w0, w1 = await start_workers(workers, job, nats_url, numbered(2))
    root = str(tmp_path / "ckpt")
    m0 = strata.aio.CheckpointManager(w0, root, timeout=60.0)
    m1 = strata.aio.CheckpointManager(w1, root, timeout=60.0)
    await m0.save(b"rank-0", step=1)
    await m0.wait()
    unstepped.step_clock(120.0)  # NTP steps the service's clock 2 minutes ahead
    # A wall-clock deadline would be a minute behind now: aborted at the next check (0.25 s).
    with pytest.raises(StrataError) as waited:
        await m0.wait_committed(1, timeout=3.0)
    assert waited.value.code == "checkpoint_timeout"  # still open after 3 s, not aborted
    await m1.save(b"rank-1", step=1)
    await m1.wait()
    info = await m0.wait_committed(1, timeout=30)
    assert (info.status, info.acked_ranks) == ("committed", [0, 1])


@contextlib.contextmanager
def small_tmpfs(path: Path, size: str = "2m") -> Iterator[Path]:
    """A file system of `size` at `path`, which a large enough write fills (ENOSPC)."""
    path.mkdir(parents=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here (needs root): {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)


async def test_a_full_disk_aborts_the_step_at_once_and_leaves_only_complete_checkpoints(
    workers: list[strata.aio.Worker], nats_url: str, tmp_path: Path, unstepped: Stack
) -> None:
    job = new_job("enospc")
    w0, w1 = await start_workers(workers, job, nats_url, numbered(2))
    with small_tmpfs(tmp_path / "small") as root:
        managers = [manager(w, str(root)) for w in (w0, w1)]
        await committed(managers, 1, 64 * 1024)
        await managers[1].save(b"\x01" * 64 * 1024, step=2)
        await managers[1].wait()
        await managers[0].save(b"\x00" * 4 * 1024 * 1024, step=2)  # twice the disk
        await assert_aborted_at_once(managers[0], managers[1], 2, "No space left on device")

        step_dir = root / job / "step-000000000002"

        async def removed() -> bool:
            return not step_dir.exists()

        await async_wait_until(removed, 10, "the aborted step's files to be removed")
        latest = await managers[1].latest_in_storage()
        assert latest is not None
        assert latest.step == 1
        assert [m.step for m in await managers[1].manifests()] == [1]
        # The disk has room again for the next step.
        await committed(managers, 3, 64 * 1024)


async def test_a_late_writer_of_an_aborted_step_removes_its_shard(
    workers: list[strata.aio.Worker], nats_url: str, tmp_path: Path, unstepped: Stack
) -> None:
    job = new_job("late-writer")
    w0, _, w2 = await start_workers(workers, job, nats_url, numbered(3))
    root = tmp_path / "ckpt"
    m0 = manager(w0, str(root))
    slot = await m0.declare(4)  # rank 0 declares its shard, then stalls before writing it
    await w2.stop()  # a participant leaves: the step aborts while rank 0 stalls
    with pytest.raises(ConflictError, match="aborted"):
        await m0.wait_committed(4, timeout=30)
    # Rank 0 wakes up and writes: after the service removed the step's files.
    with pytest.raises(ConflictError, match="aborted"):
        await m0.write_declared(b"\x00" * 1024, 4, 0, slot)
    assert not (root / slot.key).exists(), "the late writer left its shard behind"
    assert list((root / job).glob("step-000000000004/*")) == []


async def test_an_s3_server_killed_mid_upload_aborts_the_step_at_once(
    workers: list[strata.aio.Worker],
    nats_url: str,
    unstepped: Stack,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for key, value in unstepped.s3_env.items():
        monkeypatch.setenv(key, value)
    endpoint = unstepped.moto.endpoint
    bucket = endpoint.new_bucket()
    job = new_job("s3-killed")
    w0, w1 = await start_workers(workers, job, nats_url, numbered(2))
    managers = [manager(w, f"s3://{bucket}/runs") for w in (w0, w1)]
    try:
        await s3_killed_mid_upload(managers, unstepped.moto, bucket)
    finally:
        for each in managers:
            with contextlib.suppress(StrataError):  # the failure the test expected, if any
                await each.close()


async def s3_killed_mid_upload(
    managers: list[strata.aio.CheckpointManager], moto: MotoServer, bucket: str
) -> None:
    endpoint = moto.endpoint
    await committed(managers, 1, 1024)
    await managers[1].save(b"\x01" * 1024, step=2)
    await managers[1].wait()
    # Rank 0 uploads its shard in 1 MiB parts, one at a time: a window to kill the server in.
    await managers[0].storage.close()
    managers[0]._storage = S3Storage(
        bucket,
        "runs",
        region=endpoint.region,
        endpoint_url=endpoint.url,
        part_size=MIN_PART_SIZE,
        concurrency=1,
        max_attempts=2,
        retry_delay=0.05,
        session=endpoint.session(),
    )
    await managers[0].save(b"\x00" * 48 * MIN_PART_SIZE, step=2)
    client = endpoint.client()

    def parts_uploaded() -> int:
        uploads = client.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        return sum(
            len(
                client.list_parts(Bucket=bucket, Key=u["Key"], UploadId=u["UploadId"]).get(
                    "Parts", []
                )
            )
            for u in uploads
        )

    async def uploading() -> bool:
        return await asyncio.to_thread(parts_uploaded) >= 2

    await async_wait_until(uploading, 30, "rank 0's multipart upload to be under way")
    proc = moto._proc
    assert proc is not None
    proc.send_signal(signal.SIGKILL)
    await assert_aborted_at_once(managers[0], managers[1], 2, f"s3://{bucket}/runs")
    latest = await managers[1].latest()  # from the service: storage is gone with the server
    assert latest is not None
    assert latest.step == 1
