"""Checkpoint storage in S3 or an S3-compatible store (SeaweedFS, MinIO, ...) through aioboto3.

Small objects go up in one PUT, larger ones as a multipart upload with a bounded number of parts in
flight, each a slice of the caller's buffer (no copies), retried with exponential backoff on
transient errors and aborted if the upload cannot complete, so no half object or orphaned parts
remain. The checksum is stored as metadata (`x-amz-meta-strata-checksum`) and verified on every
read; one client is created on first use and reused until `close()`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import random
import re
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Final, TypeVar

import structlog

from strata.errors import ConfigError, MissingExtra, NotFound, StorageError, ValidationError
from strata.extras import install_command
from strata.storage._checksum import check_checksum, checksum_of, verify
from strata.storage._keys import valid_key
from strata.storage.base import StorageBackend, WriteResult, check_key, check_range

try:
    import aioboto3
    from aiobotocore.config import AioConfig
    from botocore.exceptions import (
        ClientError,
        HTTPClientError,
    )
    from botocore.exceptions import ConnectionError as BotoConnectionError
except ImportError as exc:  # pragma: no cover - depends on the installed extras
    raise MissingExtra(f"S3 storage needs aioboto3: {install_command('s3')}") from exc

MiB: Final = 1024 * 1024
DEFAULT_PART_SIZE: Final = 16 * MiB
DEFAULT_CONCURRENCY: Final = 8
DEFAULT_MAX_ATTEMPTS: Final = 5
MIN_PART_SIZE: Final = 1 * MiB
"""Smallest part size accepted here; AWS itself requires 5 MiB for every part but the last."""
MAX_PARTS: Final = 10_000
CHECKSUM_METADATA: Final = "strata-checksum"
"""Metadata name of the checksum; on the wire it is the header `x-amz-meta-strata-checksum`."""

ABORT_ATTEMPTS: Final = 5
PART_SETTLE_S: Final = 5.0
"""How long a cancelled write lets its part requests under way end before it aborts the upload."""
ABORT_RECHECK_S: Final = 0.1
"""After an abort, how long before checking that the upload is gone (longer on each attempt)."""

_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
_DELETE_BATCH: Final = 1000
_TRANSIENT_CODES: Final = frozenset(
    {
        "InternalError",
        "RequestTimeout",
        "RequestTimeoutException",
        "ServiceUnavailable",
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "PriorRequestNotComplete",
    }
)
_MISSING_CODES: Final = frozenset({"NoSuchKey", "404", "NotFound"})

T = TypeVar("T")
log = structlog.get_logger("strata.storage")


def is_transient(exc: BaseException) -> bool:
    """Whether retrying the same request may succeed: connection trouble, 5xx, throttling."""
    if isinstance(exc, ClientError):
        error = exc.response.get("Error", {})
        status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
        return error.get("Code") in _TRANSIENT_CODES or status >= 500 or status == 429
    return isinstance(exc, BotoConnectionError | HTTPClientError | TimeoutError)


def _error_code(exc: ClientError) -> str:
    return str(exc.response.get("Error", {}).get("Code", ""))


def _parts(size: int, part_size: int) -> Iterator[tuple[int, int, int]]:
    """(part number, start, end) of each part, numbered from 1."""
    for number, start in enumerate(range(0, size, part_size), start=1):
        yield number, start, min(start + part_size, size)


class S3Storage(StorageBackend):
    """Objects under `s3://bucket/prefix/`, written and read through one reused aioboto3 client.

    `part_size` and `concurrency` set the multipart upload (objects up to `part_size` go in one
    PUT); `max_attempts` bounds the tries of each request, with exponential backoff and jitter
    between them, starting at `retry_delay` seconds. `session` is an `aioboto3.Session`, by
    default one reading credentials the usual AWS ways (environment, profile, instance role).
    """

    def __init__(
        self,
        bucket: str,
        prefix: str = "",
        *,
        region: str | None = None,
        endpoint_url: str | None = None,
        part_size: int = DEFAULT_PART_SIZE,
        concurrency: int = DEFAULT_CONCURRENCY,
        max_attempts: int = DEFAULT_MAX_ATTEMPTS,
        retry_delay: float = 0.2,
        max_retry_delay: float = 10.0,
        session: Any = None,
    ) -> None:
        if not _BUCKET.match(bucket) or ".." in bucket:
            raise ConfigError(
                f"{bucket!r} is not a valid S3 bucket name (3-63 characters: lowercase letters, "
                "digits, '.' and '-', starting and ending with a letter or digit)"
            )
        prefix = prefix.strip("/")
        if prefix:
            try:
                check_key(prefix)
            except ValidationError:
                raise ConfigError(
                    f"S3 prefix {prefix!r} is not allowed: use '/'-separated parts of letters, "
                    "digits and '_.-' (no '..')"
                ) from None
        if part_size < MIN_PART_SIZE:
            raise ConfigError(f"part_size must be at least {MIN_PART_SIZE} bytes, got {part_size}")
        if concurrency < 1 or max_attempts < 1:
            raise ConfigError("concurrency and max_attempts must be at least 1")
        self.bucket = bucket
        self.prefix = prefix
        self.region = region
        self.endpoint_url = endpoint_url
        self.part_size = part_size
        self.concurrency = concurrency
        self.max_attempts = max_attempts
        self.retry_delay = retry_delay
        self.max_retry_delay = max_retry_delay
        self.root_uri = f"s3://{bucket}/{prefix}" if prefix else f"s3://{bucket}"
        self._session = session if session is not None else aioboto3.Session()
        self._client: Any = None
        self._client_stack: contextlib.AsyncExitStack | None = None
        self._client_lock = asyncio.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"S3Storage({self.root_uri!r}, endpoint_url={self.endpoint_url!r})"

    def object_key(self, key: str) -> str:
        """The S3 object key for a storage key (the prefix joined to it)."""
        valid_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _list_prefix(self, prefix: str) -> str:
        if prefix == "":
            return f"{self.prefix}/" if self.prefix else ""
        return self.object_key(prefix) + "/"

    async def client(self) -> Any:
        """The shared aiobotocore S3 client, created on first use."""
        if self._client is not None:
            return self._client
        async with self._client_lock:
            if self._closed:
                raise StorageError(f"{self!r} is closed")
            if self._client is None:
                config = AioConfig(
                    # Retries happen here, per part, so one slow part does not restart the rest.
                    retries={"total_max_attempts": 1},
                    # Every part of every concurrent write may be in flight at once.
                    max_pool_connections=max(10, 2 * self.concurrency),
                    # Parts are memoryview slices of the caller's buffer, which botocore's
                    # validator would reject although the HTTP layer sends them as they are.
                    parameter_validation=False,
                    # The xxh128 checksum of the whole object is verified on every read; a CRC
                    # per request would hash each byte once more on the way out and in.
                    request_checksum_calculation="when_required",
                    response_checksum_validation="when_required",
                    # S3-compatible stores are commonly reached by path, not by bucket hostname.
                    s3={"addressing_style": "path"} if self.endpoint_url else {},
                )
                stack = contextlib.AsyncExitStack()
                self._client = await stack.enter_async_context(
                    self._session.client(
                        "s3",
                        region_name=self.region,
                        endpoint_url=self.endpoint_url,
                        config=config,
                    )
                )
                self._client_stack = stack
        return self._client

    async def close(self) -> None:
        async with self._client_lock:
            self._closed = True
            stack, self._client_stack, self._client = self._client_stack, None, None
        if stack is not None:
            await stack.aclose()

    async def _retry(self, what: str, call: Callable[[], Awaitable[T]]) -> T:
        """`call()`, tried up to `max_attempts` times while it fails transiently."""
        for attempt in range(1, self.max_attempts + 1):
            try:
                return await call()
            except Exception as exc:
                if attempt == self.max_attempts or not is_transient(exc):
                    raise
                # Full jitter: concurrent parts that failed together do not retry together.
                ceiling = min(self.max_retry_delay, self.retry_delay * 2 ** (attempt - 1))
                delay = random.uniform(0, ceiling)
                log.warning(
                    "s3_retry",
                    request=what,
                    attempt=attempt,
                    delay_s=round(delay, 3),
                    error=f"{type(exc).__name__}: {exc}",
                )
                await asyncio.sleep(delay)
        raise AssertionError("unreachable")  # pragma: no cover

    def _storage_error(self, action: str, key: str, exc: BaseException) -> StorageError:
        return StorageError(f"{action} {self.uri(key)} failed: {exc}", key=key)

    async def write(self, key: str, data: bytes | memoryview) -> WriteResult:
        object_key = self.object_key(key)
        view = memoryview(data).cast("B")
        size = view.nbytes
        if size > 4 * MiB:
            checksum = await asyncio.to_thread(checksum_of, view)
        else:
            checksum = checksum_of(view)
        metadata = {CHECKSUM_METADATA: checksum}
        s3 = await self.client()
        try:
            if size <= self.part_size:
                await self._retry(
                    f"put {object_key}",
                    lambda: s3.put_object(
                        Bucket=self.bucket, Key=object_key, Body=view, Metadata=metadata
                    ),
                )
            else:
                await self._multipart(s3, object_key, view, metadata)
        except (ClientError, BotoConnectionError, HTTPClientError, TimeoutError) as exc:
            raise self._storage_error("writing", key, exc) from exc
        return WriteResult(uri=self.uri(key), bytes=size, checksum=checksum)

    async def _multipart(
        self, s3: Any, object_key: str, view: memoryview, metadata: dict[str, str]
    ) -> None:
        # Grow the parts rather than exceed S3's limit on their number.
        part_size = max(self.part_size, -(-view.nbytes // MAX_PARTS))
        created = await self._retry(
            f"create upload {object_key}",
            lambda: s3.create_multipart_upload(
                Bucket=self.bucket, Key=object_key, Metadata=metadata
            ),
        )
        upload_id: str = created["UploadId"]
        # Part requests under way, each shielded from the write's cancellation: a request cut off
        # on the client may still be stored by the server after the abort and bring the upload
        # back, so a cancelled write lets them end first.
        in_flight: set[asyncio.Future[Any]] = set()
        try:
            etags: dict[int, str] = {}
            pending = _parts(view.nbytes, part_size)

            async def upload_parts() -> None:
                # Each worker takes the next part when it is done with one, so exactly
                # `concurrency` parts are in flight until the last ones.
                for number, start, end in pending:
                    part = asyncio.ensure_future(
                        self._retry(
                            f"upload part {number} of {object_key}",
                            functools.partial(
                                s3.upload_part,
                                Bucket=self.bucket,
                                Key=object_key,
                                UploadId=upload_id,
                                PartNumber=number,
                                Body=view[start:end],
                            ),
                        )
                    )
                    in_flight.add(part)
                    part.add_done_callback(_settled(in_flight))
                    response = await asyncio.shield(part)
                    etags[number] = response["ETag"]

            async with asyncio.TaskGroup() as group:
                for _ in range(self.concurrency):
                    group.create_task(upload_parts())
            parts = [{"PartNumber": n, "ETag": etags[n]} for n in sorted(etags)]

            async def complete() -> None:
                try:
                    await s3.complete_multipart_upload(
                        Bucket=self.bucket,
                        Key=object_key,
                        UploadId=upload_id,
                        MultipartUpload={"Parts": parts},
                    )
                except ClientError as exc:
                    # A retry after a completion whose reply was lost finds the upload gone;
                    # the object carrying this write's checksum means it did complete.
                    if _error_code(exc) != "NoSuchUpload" or not await self._has_checksum(
                        s3, object_key, metadata[CHECKSUM_METADATA]
                    ):
                        raise

            await self._retry(f"complete upload {object_key}", complete)
        except BaseException as exc:
            # Shielded: a cancelled write must still release the parts it stored.
            if isinstance(exc, asyncio.CancelledError) and in_flight:
                await asyncio.shield(asyncio.wait(set(in_flight), timeout=PART_SETTLE_S))
            for part in in_flight:
                part.cancel()
            await asyncio.shield(self._abort(s3, object_key, upload_id))
            if isinstance(exc, BaseExceptionGroup):
                # Report the first part's failure rather than a group of one kind of error.
                first = _first_leaf(exc)
                if isinstance(first, Exception):
                    raise first from exc
            raise

    async def _still_listed(self, s3: Any, object_key: str, upload_id: str) -> bool:
        listed = await self._retry(
            f"list uploads of {object_key}",
            lambda: s3.list_multipart_uploads(Bucket=self.bucket, Prefix=object_key),
        )
        return any(u.get("UploadId") == upload_id for u in listed.get("Uploads", []))

    async def _has_checksum(self, s3: Any, object_key: str, checksum: str) -> bool:
        try:
            head = await s3.head_object(Bucket=self.bucket, Key=object_key)
        except ClientError:
            return False
        return bool(head.get("Metadata", {}).get(CHECKSUM_METADATA) == checksum)

    async def _abort(self, s3: Any, object_key: str, upload_id: str) -> None:
        """Abort the upload, again while it is still listed: a part whose request was under way
        (a cancelled write) may be stored after the first abort and bring the upload back."""
        try:
            for attempt in range(ABORT_ATTEMPTS):
                await self._retry(
                    f"abort upload {object_key}",
                    lambda: s3.abort_multipart_upload(
                        Bucket=self.bucket, Key=object_key, UploadId=upload_id
                    ),
                )
                await asyncio.sleep(ABORT_RECHECK_S * (attempt + 1))
                if not await self._still_listed(s3, object_key, upload_id):
                    return
            raise StorageError(f"upload {upload_id} of {object_key} still listed after aborts")
        except Exception as exc:
            # The write's own error is the one to raise; the parts left behind are reported
            # here, for a bucket lifecycle rule (AbortIncompleteMultipartUpload) to collect.
            log.warning(
                "s3_abort_failed",
                bucket=self.bucket,
                key=object_key,
                upload_id=upload_id,
                error=f"{type(exc).__name__}: {exc}",
            )

    async def read(self, key: str, checksum: str | None = None) -> bytes:
        object_key = self.object_key(key)
        if checksum is not None:
            check_checksum(checksum)
        s3 = await self.client()

        async def fetch() -> tuple[bytes, str | None]:
            response = await s3.get_object(Bucket=self.bucket, Key=object_key)
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data, response.get("Metadata", {}).get(CHECKSUM_METADATA)

        try:
            data, stored = await self._retry(f"get {object_key}", fetch)
        except ClientError as exc:
            if _error_code(exc) in _MISSING_CODES:
                raise NotFound(f"no object {key!r} in {self.root_uri}", key=key) from None
            raise self._storage_error("reading", key, exc) from exc
        except (BotoConnectionError, HTTPClientError, TimeoutError) as exc:
            raise self._storage_error("reading", key, exc) from exc
        if len(data) > 4 * MiB:
            await asyncio.to_thread(verify, key, self.uri(key), data, checksum, stored)
        else:
            verify(key, self.uri(key), data, checksum, stored)
        return data

    async def read_range(self, key: str, offset: int, length: int) -> bytes:
        object_key = self.object_key(key)
        check_range(offset, length)
        if length == 0:
            return b""
        s3 = await self.client()

        async def fetch() -> bytes:
            response = await s3.get_object(
                Bucket=self.bucket, Key=object_key, Range=f"bytes={offset}-{offset + length - 1}"
            )
            async with response["Body"] as body:
                data: bytes = await body.read()
            return data

        try:
            return await self._retry(f"get {object_key} range", fetch)
        except ClientError as exc:
            if _error_code(exc) in _MISSING_CODES:
                raise NotFound(f"no object {key!r} in {self.root_uri}", key=key) from None
            if _error_code(exc) == "InvalidRange":
                return b""
            raise self._storage_error("reading", key, exc) from exc
        except (BotoConnectionError, HTTPClientError, TimeoutError) as exc:
            raise self._storage_error("reading", key, exc) from exc

    async def exists(self, key: str) -> bool:
        object_key = self.object_key(key)
        s3 = await self.client()
        try:
            await self._retry(
                f"head {object_key}", lambda: s3.head_object(Bucket=self.bucket, Key=object_key)
            )
        except ClientError as exc:
            if _error_code(exc) in _MISSING_CODES:
                return False
            raise self._storage_error("checking", key, exc) from exc
        return True

    async def size(self, key: str) -> int | None:
        object_key = self.object_key(key)
        s3 = await self.client()
        try:
            head = await self._retry(
                f"head {object_key}", lambda: s3.head_object(Bucket=self.bucket, Key=object_key)
            )
        except ClientError as exc:
            if _error_code(exc) in _MISSING_CODES:
                return None
            raise self._storage_error("checking", key, exc) from exc
        except (BotoConnectionError, HTTPClientError, TimeoutError) as exc:
            raise self._storage_error("checking", key, exc) from exc
        return int(head["ContentLength"])

    async def delete(self, key: str) -> None:
        object_key = self.object_key(key)
        s3 = await self.client()
        try:
            await self._retry(
                f"delete {object_key}",
                lambda: s3.delete_object(Bucket=self.bucket, Key=object_key),
            )
        except ClientError as exc:
            if _error_code(exc) not in _MISSING_CODES:
                raise self._storage_error("deleting", key, exc) from exc

    async def _object_keys(self, list_prefix: str) -> list[str]:
        s3 = await self.client()
        keys: list[str] = []
        token: str | None = None
        while True:
            extra = {"ContinuationToken": token} if token else {}
            page = await self._retry(
                f"list {list_prefix}",
                functools.partial(
                    s3.list_objects_v2, Bucket=self.bucket, Prefix=list_prefix, **extra
                ),
            )
            keys.extend(item["Key"] for item in page.get("Contents", []))
            if not page.get("IsTruncated"):
                return keys
            token = page["NextContinuationToken"]

    async def delete_prefix(self, prefix: str) -> int:
        # An empty prefix is refused (by the key rules): one bad argument must not wipe the root.
        list_prefix = self.object_key(prefix) + "/"
        s3 = await self.client()
        try:
            object_keys = await self._object_keys(list_prefix)
            for start in range(0, len(object_keys), _DELETE_BATCH):
                batch = [{"Key": k} for k in object_keys[start : start + _DELETE_BATCH]]
                response = await self._retry(
                    f"delete under {list_prefix}",
                    functools.partial(
                        s3.delete_objects,
                        Bucket=self.bucket,
                        Delete={"Objects": batch, "Quiet": True},
                    ),
                )
                errors = response.get("Errors", [])
                if errors:
                    first = errors[0]
                    raise StorageError(
                        f"deleting under {self.uri(prefix)} failed for {len(errors)} objects, "
                        f"e.g. {first.get('Key')}: {first.get('Code')} {first.get('Message')}",
                        key=prefix,
                    )
            # A writer killed mid-upload leaves an incomplete multipart upload: parts that are no
            # object, invisible to listings, yet stored and billed. They go with the prefix.
            uploads = await self._retry(
                f"list uploads under {list_prefix}",
                functools.partial(
                    s3.list_multipart_uploads, Bucket=self.bucket, Prefix=list_prefix
                ),
            )
            for upload in uploads.get("Uploads", []):
                await self._retry(
                    f"abort upload of {upload['Key']}",
                    functools.partial(
                        s3.abort_multipart_upload,
                        Bucket=self.bucket,
                        Key=upload["Key"],
                        UploadId=upload["UploadId"],
                    ),
                )
        except (ClientError, BotoConnectionError, HTTPClientError) as exc:
            raise self._storage_error("deleting under", prefix, exc) from exc
        return len(object_keys)

    async def list(self, prefix: str) -> list[str]:
        """Keys under `prefix/`, sorted; the empty prefix lists everything under the root."""
        list_prefix = self._list_prefix(prefix)
        root = f"{self.prefix}/" if self.prefix else ""
        try:
            object_keys = await self._object_keys(list_prefix)
        except (ClientError, BotoConnectionError, HTTPClientError) as exc:
            raise StorageError(
                f"listing {self.root_uri} under {prefix!r} failed: {exc}",
            ) from exc
        keys = []
        for object_key in object_keys:
            key = object_key[len(root) :]
            # Objects put there by something else, under names no key can have, are not ours.
            with contextlib.suppress(ValidationError):
                keys.append(check_key(key))
        return sorted(keys)


def _settled(in_flight: set[asyncio.Future[Any]]) -> Callable[[asyncio.Future[Any]], None]:
    """A part request's end: out of the set, its error taken (the write reports its own)."""

    def done(part: asyncio.Future[Any]) -> None:
        in_flight.discard(part)
        if not part.cancelled():
            part.exception()

    return done


def _first_leaf(group: BaseExceptionGroup[BaseException]) -> BaseException:
    first = group.exceptions[0]
    return _first_leaf(first) if isinstance(first, BaseExceptionGroup) else first
