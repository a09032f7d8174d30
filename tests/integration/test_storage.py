"""One suite for every storage backend: local disk, S3 on moto's server, S3 on SeaweedFS.

The S3 backends talk to real servers over HTTP through the real aioboto3 client. Damage is done
behind the backend's back (a byte flipped in the file, or another object body put with plain boto3
under the same metadata), and failures are real ones: a server refusing a request, a file size
limit, or a fault raised from the client's own request hooks before a request goes out.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import resource
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
from botocore.exceptions import EndpointConnectionError
from strata import procutil
from strata.config import Env, load_settings
from strata.errors import ChecksumMismatch, ConfigError, NotFound, StrataError, ValidationError
from strata.storage import (
    LocalStorage,
    StorageBackend,
    checksum_of,
    manifest_key,
    open_storage,
    shard_key,
    step_prefix,
)
from strata.storage.s3 import CHECKSUM_METADATA, S3Storage

from tests.s3 import S3Endpoint, moto_server, seaweedfs  # noqa: F401 - fixtures

MiB = 1024 * 1024
SMALL_PART = 5 * MiB
BIG = 40 * MiB + 12345  # several parts, the last one short
MEDIUM = 3 * SMALL_PART + 4321  # four parts, enough for the failure tests


@dataclass
class Harness:
    """A backend under test plus what the tests need to reach behind it."""

    kind: str
    storage: StorageBackend
    make: Callable[..., StorageBackend]
    """Another backend on the same root: `make(part_size=...)` for small parts, for instance."""
    corrupt: Callable[[str], None]
    """Change one byte of the stored object, keeping everything recorded with it."""
    leftovers: Callable[[], list[str]]
    """Temp files or incomplete multipart uploads under the root."""
    opened: list[StorageBackend] = field(default_factory=list)
    endpoint: S3Endpoint | None = None


def _local(tmp_path: Path) -> Harness:
    root = tmp_path / "store"
    opened: list[StorageBackend] = []

    def make(part_size: int | None = None, **_: Any) -> StorageBackend:
        storage = (
            LocalStorage(root) if part_size is None else LocalStorage(root, chunk_size=part_size)
        )
        opened.append(storage)
        return storage

    def corrupt(key: str) -> None:
        path = root / key
        with path.open("r+b") as file:
            file.seek(path.stat().st_size // 2)
            byte = file.read(1)
            file.seek(-1, os.SEEK_CUR)
            file.write(bytes([byte[0] ^ 0xFF]))

    def leftovers() -> list[str]:
        if not root.exists():
            return []
        return sorted(str(p.relative_to(root)) for p in root.rglob(".*"))

    return Harness("local", make(), make, corrupt, leftovers, opened)


def _s3(endpoint: S3Endpoint, bucket: str) -> Harness:
    prefix = f"t-{uuid4().hex[:12]}"
    client = endpoint.client()
    opened: list[StorageBackend] = []

    def make(part_size: int | None = None, **options: Any) -> StorageBackend:
        options.setdefault("session", endpoint.session())
        if part_size is not None:
            options["part_size"] = part_size
        storage = S3Storage(
            bucket, prefix, endpoint_url=endpoint.url, region=endpoint.region, **options
        )
        opened.append(storage)
        return storage

    def corrupt(key: str) -> None:
        object_key = f"{prefix}/{key}"
        original = client.get_object(Bucket=bucket, Key=object_key)
        body = bytearray(original["Body"].read())
        body[len(body) // 2] ^= 0xFF
        client.put_object(
            Bucket=bucket, Key=object_key, Body=bytes(body), Metadata=original["Metadata"]
        )

    def leftovers() -> list[str]:
        response = client.list_multipart_uploads(Bucket=bucket, Prefix=f"{prefix}/")
        return sorted(upload["Key"] for upload in response.get("Uploads", []))

    return Harness(endpoint.name, make(), make, corrupt, leftovers, opened, endpoint)


@pytest.fixture(scope="session")
def moto_bucket(moto_server: S3Endpoint) -> str:  # noqa: F811
    return moto_server.new_bucket()


@pytest.fixture(scope="session")
def seaweedfs_bucket(seaweedfs: S3Endpoint) -> str:  # noqa: F811
    return seaweedfs.new_bucket()


_SERVER_FIXTURES = {"moto": "moto_server", "seaweedfs": "seaweedfs"}


def _s3_harness(request: pytest.FixtureRequest, server: str) -> Harness:
    endpoint: S3Endpoint = request.getfixturevalue(_SERVER_FIXTURES[server])
    return _s3(endpoint, request.getfixturevalue(f"{server}_bucket"))


async def _close_all(harness: Harness) -> None:
    for storage in harness.opened:
        await storage.close()


@pytest.fixture(params=["local", "moto", "seaweedfs"])
async def store(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Harness]:
    kind = request.param
    harness = _local(tmp_path) if kind == "local" else _s3_harness(request, kind)
    yield harness
    await _close_all(harness)


@pytest.fixture(params=["moto", "seaweedfs"])
async def s3_store(request: pytest.FixtureRequest) -> AsyncIterator[Harness]:
    harness = _s3_harness(request, request.param)
    yield harness
    await _close_all(harness)


KEY = shard_key("job-a", 100, 3)


# --- the suite every backend passes ----------------------------------------------------------


async def test_small_round_trip(store: Harness) -> None:
    result = await store.storage.write(KEY, b"hello, checkpoint")
    assert result.bytes == 17
    assert result.checksum == checksum_of(b"hello, checkpoint")
    assert result.checksum.startswith("xxh128:")
    assert result.uri == store.storage.uri(KEY)
    assert result.uri.startswith(store.storage.root_uri + "/")
    assert await store.storage.read(KEY) == b"hello, checkpoint"
    assert await store.storage.read(KEY, result.checksum) == b"hello, checkpoint"


async def test_large_round_trip_in_parts(store: Harness) -> None:
    data = os.urandom(BIG)
    storage = store.make(part_size=SMALL_PART, concurrency=3)
    result = await storage.write(KEY, data)
    assert result.bytes == BIG
    assert result.checksum == checksum_of(data)
    back = await storage.read(KEY, result.checksum)
    assert back == data
    assert store.leftovers() == []


async def test_empty_object_and_memoryview_input(store: Harness) -> None:
    empty = await store.storage.write(KEY, b"")
    assert empty.bytes == 0
    assert await store.storage.read(KEY, empty.checksum) == b""
    buffer = bytearray(os.urandom(3 * MiB))
    other = manifest_key("job-a", 100)
    result = await store.storage.write(other, memoryview(buffer)[MiB:])
    assert result.bytes == 2 * MiB
    assert await store.storage.read(other, result.checksum) == bytes(buffer[MiB:])


async def test_overwrite_replaces_the_whole_object(store: Harness) -> None:
    await store.storage.write(KEY, b"first version, longer than the second")
    second = await store.storage.write(KEY, b"second")
    assert await store.storage.read(KEY, second.checksum) == b"second"
    assert await store.storage.list("job-a") == [KEY]


async def test_size_is_the_stored_length_without_reading_the_object(store: Harness) -> None:
    storage = store.make(part_size=SMALL_PART)
    assert await storage.size(KEY) is None
    await storage.write(KEY, b"")
    assert await storage.size(KEY) == 0
    await storage.write(KEY, os.urandom(MEDIUM))  # in parts
    assert await storage.size(KEY) == MEDIUM
    await storage.write(KEY, b"shorter")
    assert await storage.size(KEY) == len(b"shorter")
    # A prefix of stored keys is no object.
    assert await storage.size(step_prefix("job-a", 100)) is None
    await storage.delete(KEY)
    assert await storage.size(KEY) is None


async def test_read_range_reads_part_of_an_object(store: Harness) -> None:
    storage = store.make(part_size=SMALL_PART)
    data = os.urandom(MEDIUM)  # stored in parts on S3
    await storage.write(KEY, data)
    assert await storage.read_range(KEY, 0, 10) == data[:10]
    assert (
        await storage.read_range(KEY, SMALL_PART - 7, 20) == data[SMALL_PART - 7 : SMALL_PART + 13]
    )
    assert await storage.read_range(KEY, MEDIUM - 5, 100) == data[-5:]  # cut at the end
    assert await storage.read_range(KEY, 3, 0) == b""
    with pytest.raises(ValidationError, match="offset=-1"):
        await storage.read_range(KEY, -1, 4)
    with pytest.raises(NotFound, match="job-a"):
        await storage.read_range(shard_key("job-a", 100, 9), 0, 4)


async def test_corrupted_object_raises_checksum_mismatch(store: Harness) -> None:
    data = os.urandom(256 * 1024)
    result = await store.storage.write(KEY, data)
    store.corrupt(KEY)
    with pytest.raises(ChecksumMismatch) as caught:
        await store.storage.read(KEY, result.checksum)
    message = str(caught.value)
    assert KEY in message
    assert result.checksum in message
    assert caught.value.details["actual"] in message
    assert caught.value.details["actual"] != result.checksum
    # The checksum stored with the object catches it too, without the caller's record.
    with pytest.raises(ChecksumMismatch):
        await store.storage.read(KEY)


async def test_wrong_recorded_checksum_is_an_error(store: Harness) -> None:
    await store.storage.write(KEY, b"bytes")
    with pytest.raises(ChecksumMismatch):
        await store.storage.read(KEY, checksum_of(b"other bytes"))
    with pytest.raises(ValidationError, match="cannot be verified"):
        await store.storage.read(KEY, "sha256:" + "0" * 64)


async def test_missing_objects(store: Harness) -> None:
    assert not await store.storage.exists(KEY)
    assert await store.storage.size(KEY) is None
    with pytest.raises(NotFound, match="job-a"):
        await store.storage.read(KEY)
    await store.storage.delete(KEY)
    assert await store.storage.list("job-a") == []
    assert await store.storage.delete_prefix("job-a") == 0


async def test_exists_delete_list_and_delete_prefix(store: Harness) -> None:
    storage = store.storage
    keys = [shard_key("job-a", step, rank) for step in (1, 2) for rank in range(3)]
    keys += [manifest_key("job-a", 1), manifest_key("job-a", 2), shard_key("job-ab", 1, 0)]
    await asyncio.gather(*(storage.write(key, key.encode()) for key in keys))
    assert await storage.exists(keys[0])
    assert await storage.list("job-a") == sorted(k for k in keys if k.startswith("job-a/"))
    assert await storage.list(step_prefix("job-a", 1)) == sorted(
        k for k in keys if k.startswith(step_prefix("job-a", 1) + "/")
    )
    assert await storage.list("") == sorted(keys)

    await storage.delete(keys[0])
    assert not await storage.exists(keys[0])
    assert await storage.delete_prefix(step_prefix("job-a", 1)) == 3
    assert await storage.list("job-a") == sorted(
        k for k in keys if k.startswith(step_prefix("job-a", 2) + "/")
    )
    # A sibling whose name merely starts the same is not under the prefix.
    assert await storage.list("job-ab") == [shard_key("job-ab", 1, 0)]
    with pytest.raises(ValidationError):
        await storage.delete_prefix("")


async def test_concurrent_writes_of_different_keys(store: Harness) -> None:
    storage = store.make(part_size=SMALL_PART)
    # Mostly single PUTs, the largest two in parts.
    blobs = {shard_key("job-c", 5, rank): os.urandom((rank + 1) * 600 * 1024) for rank in range(10)}
    results = await asyncio.gather(*(storage.write(key, data) for key, data in blobs.items()))
    assert [r.checksum for r in results] == [checksum_of(d) for d in blobs.values()]
    reads = await asyncio.gather(
        *(storage.read(key, r.checksum) for key, r in zip(blobs, results, strict=True))
    )
    assert reads == list(blobs.values())
    assert await storage.list("job-c") == sorted(blobs)
    assert store.leftovers() == []


@pytest.mark.parametrize(
    "key", ["../escape.bin", "job/../../escape.bin", "/etc/passwd", "", "job/./x", "a\n/b"]
)
async def test_path_traversal_is_refused_before_any_io(store: Harness, key: str) -> None:
    storage = store.storage
    calls = [
        storage.write(key, b"x"),
        storage.read(key),
        storage.exists(key),
        storage.size(key),
        storage.delete(key),
        storage.delete_prefix(key),
        storage.list(key) if key else storage.list("../x"),
    ]
    for call in calls:
        with pytest.raises(ValidationError):
            await call
    if isinstance(storage, S3Storage):
        assert storage._client is None, "a refused key must not even open a connection"
    assert await storage.list("") == []


async def test_closed_backend_is_unusable(store: Harness) -> None:
    await store.storage.write(KEY, b"x")
    await store.storage.close()
    if isinstance(store.storage, S3Storage):
        with pytest.raises(StrataError, match="closed"):
            await store.storage.read(KEY)


# --- failures leave nothing behind ------------------------------------------------------------


async def test_local_failed_write_leaves_no_temp_file(tmp_path: Path) -> None:
    harness = _local(tmp_path)
    storage = harness.make(part_size=MiB)
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    # A real mid-file failure: the kernel refuses bytes past the size limit (EFBIG).
    resource.setrlimit(resource.RLIMIT_FSIZE, (3 * MiB, hard))
    try:
        with pytest.raises(StrataError) as caught:
            await storage.write(KEY, os.urandom(8 * MiB))
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
    assert caught.value.code == "storage_error"
    assert harness.leftovers() == []
    assert not await storage.exists(KEY)

    # The rename fails: a directory stands where the file should go.
    (tmp_path / "store" / KEY).mkdir(parents=True)
    with pytest.raises(StrataError):
        await storage.write(KEY, os.urandom(6 * MiB))
    assert harness.leftovers() == []


async def test_local_cancelled_write_leaves_no_temp_file(tmp_path: Path) -> None:
    harness = _local(tmp_path)
    storage = harness.make(part_size=64 * 1024)
    data = os.urandom(32 * MiB)
    task = asyncio.create_task(storage.write(KEY, data))
    await asyncio.sleep(0)  # let the write start before it is cancelled
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    assert harness.leftovers() == []
    # Cancelled either before the rename (nothing) or after it (the whole object).
    if await storage.exists(KEY):
        assert await storage.read(KEY, checksum_of(data)) == data


def _fail_part(
    session: Any, part_number: int, error: Callable[[], Exception], times: int
) -> list[int]:
    """Make the client raise `error()` instead of sending part `part_number`, `times` times."""
    raised: list[int] = []

    def before_call(params: dict[str, Any], **_: Any) -> None:
        if params.get("PartNumber") == part_number and len(raised) < times:
            raised.append(part_number)
            raise error()

    session.events.register("before-parameter-build.s3.UploadPart", before_call)
    return raised


async def test_s3_failed_part_aborts_the_upload(s3_store: Harness) -> None:
    assert s3_store.endpoint is not None
    session = s3_store.endpoint.fresh_session()
    raised = _fail_part(session, 3, lambda: RuntimeError("disk on fire"), times=1)
    storage = s3_store.make(part_size=SMALL_PART, concurrency=2, session=session)
    with pytest.raises(RuntimeError, match="disk on fire"):
        await storage.write(KEY, os.urandom(MEDIUM))
    assert raised == [3]
    assert s3_store.leftovers() == []
    assert not await storage.exists(KEY)


async def test_s3_transient_part_errors_are_retried(s3_store: Harness) -> None:
    assert s3_store.endpoint is not None
    session = s3_store.endpoint.fresh_session()
    raised = _fail_part(
        session, 2, lambda: EndpointConnectionError(endpoint_url="http://s3"), times=2
    )
    storage = s3_store.make(part_size=SMALL_PART, session=session, retry_delay=0.01)
    data = os.urandom(MEDIUM)
    result = await storage.write(KEY, data)
    assert raised == [2, 2]
    assert await storage.read(KEY, result.checksum) == data
    assert s3_store.leftovers() == []


async def test_s3_cancelled_write_aborts_the_upload(s3_store: Harness) -> None:
    storage = s3_store.make(part_size=SMALL_PART, concurrency=1)
    task = asyncio.create_task(storage.write(KEY, os.urandom(MEDIUM)))
    deadline = asyncio.get_running_loop().time() + 20
    while not await asyncio.to_thread(s3_store.leftovers):
        assert not task.done(), "the upload finished before it could be cancelled"
        assert asyncio.get_running_loop().time() < deadline, "no multipart upload started"
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert s3_store.leftovers() == []
    assert not await storage.exists(KEY)


async def test_s3_refused_completion_aborts_the_upload(
    moto_server: S3Endpoint,  # noqa: F811
    moto_bucket: str,
) -> None:
    # moto, like AWS, refuses to complete an upload whose non-final parts are under 5 MiB.
    harness = _s3(moto_server, moto_bucket)
    storage = harness.make(part_size=MiB)
    try:
        with pytest.raises(StrataError, match="EntityTooSmall"):
            await storage.write(KEY, os.urandom(3 * MiB))
        assert harness.leftovers() == []
        assert not await storage.exists(KEY)
    finally:
        await storage.close()


async def test_s3_unreachable_server_fails_after_retries() -> None:
    port = procutil.free_port()
    storage = S3Storage(
        "nowhere",
        endpoint_url=f"http://127.0.0.1:{port}",
        region="us-east-1",
        max_attempts=3,
        retry_delay=0.01,
        session=S3Endpoint(url="", name="none").session(),
    )
    try:
        with pytest.raises(StrataError) as caught:
            await storage.write(KEY, b"x")
        assert caught.value.code == "storage_error"
        assert "nowhere" in str(caught.value)
    finally:
        await storage.close()


async def test_s3_checksum_is_object_metadata(s3_store: Harness) -> None:
    storage = s3_store.make(part_size=SMALL_PART)
    assert isinstance(storage, S3Storage)
    small = await storage.write(KEY, b"small")
    big = await storage.write(manifest_key("job-a", 100), os.urandom(12 * MiB))
    s3 = await storage.client()
    for key, result in ((KEY, small), (manifest_key("job-a", 100), big)):
        head = await s3.head_object(Bucket=storage.bucket, Key=storage.object_key(key))
        assert head["Metadata"][CHECKSUM_METADATA] == result.checksum
        assert head["ResponseMetadata"]["HTTPHeaders"]["x-amz-meta-strata-checksum"] == (
            result.checksum
        )


# --- open_storage -------------------------------------------------------------------------


@pytest.fixture
def clean_env(monkeypatch: pytest.MonkeyPatch) -> pytest.MonkeyPatch:
    for name in (
        Env.STORAGE_BACKEND,
        Env.CHECKPOINT_BUCKET,
        Env.AWS_REGION,
        Env.S3_ENDPOINT_URL,
        Env.DATA_DIR,
    ):
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


async def test_open_storage_defaults_to_the_data_dir(
    clean_env: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    clean_env.setenv(Env.DATA_DIR, str(tmp_path / "data"))
    storage = open_storage()
    assert isinstance(storage, LocalStorage)
    assert storage.root == (tmp_path / "data" / "checkpoints").resolve()


async def test_open_storage_local_locations(clean_env: pytest.MonkeyPatch, tmp_path: Path) -> None:
    settings = load_settings()
    for location in (
        str(tmp_path / "a"),
        (tmp_path / "a").as_uri(),
        f"file://localhost{tmp_path}/a",
    ):
        storage = open_storage(location, settings)
        assert isinstance(storage, LocalStorage)
        assert storage.root == (tmp_path / "a").resolve()
    # A backend opened from another's root_uri is the same store.
    reopened = open_storage(LocalStorage(tmp_path / "b").root_uri, settings)
    assert reopened.root_uri == (tmp_path / "b").resolve().as_uri()


async def test_open_storage_from_env_writes_to_s3(
    clean_env: pytest.MonkeyPatch,
    moto_server: S3Endpoint,  # noqa: F811
    moto_bucket: str,
) -> None:
    clean_env.setenv(Env.STORAGE_BACKEND, "s3")
    clean_env.setenv(Env.CHECKPOINT_BUCKET, moto_bucket)
    clean_env.setenv(Env.AWS_REGION, "eu-west-1")
    clean_env.setenv(Env.S3_ENDPOINT_URL, moto_server.url)
    clean_env.setenv("AWS_ACCESS_KEY_ID", moto_server.access_key)
    clean_env.setenv("AWS_SECRET_ACCESS_KEY", moto_server.secret_key)
    storage = open_storage()
    try:
        assert isinstance(storage, S3Storage)
        assert storage.root_uri == f"s3://{moto_bucket}/checkpoints"
        assert storage.region == "eu-west-1"
        assert storage.endpoint_url == moto_server.url
        key = shard_key(f"env-{uuid4().hex[:8]}", 1, 0)
        result = await storage.write(key, b"through the environment")
        assert result.uri == f"s3://{moto_bucket}/checkpoints/{key}"
        assert await storage.read(key, result.checksum) == b"through the environment"
        again = open_storage(f"s3://{moto_bucket}/other/place/")
        assert again.root_uri == f"s3://{moto_bucket}/other/place"
        await again.close()
    finally:
        await storage.close()


@pytest.mark.parametrize(
    ("location", "message"),
    [
        ("s3://", "names no bucket"),
        ("s3:///prefix", "names no bucket"),
        ("s3://Bad_Bucket/x", "not a valid S3 bucket"),
        ("s3://bucket/../x", "not allowed"),
        ("s3://bucket/x?versionId=1", "no '\\?'"),
        ("ftp://host/x", "unknown scheme"),
        ("file://otherhost/x", "local"),
        ("file:relative", "absolute"),
        ("  ", "empty"),
    ],
)
def test_open_storage_refuses_bad_locations(
    clean_env: pytest.MonkeyPatch, location: str, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        open_storage(location, load_settings())


def test_s3_backend_without_a_bucket_is_a_config_error(clean_env: pytest.MonkeyPatch) -> None:
    clean_env.setenv(Env.STORAGE_BACKEND, "s3")
    with pytest.raises(ConfigError, match="CHECKPOINT_BUCKET"):
        open_storage()
