"""The storage interface checkpoints are written through, and the key and checksum rules.

Workers write their shard straight to storage (the bytes never travel over NATS); the checkpoint
service writes the manifest, the commit marker. A backend is either the local filesystem or S3;
both pass the same test suite. Keys are relative, `/`-separated and built only from validated ids
and numbers, so nothing can escape a backend's root.
"""

from __future__ import annotations

import re
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Final

from strata.errors import ValidationError
from strata.events.models import ID_PATTERN

CHECKSUM_ALGORITHM: Final = "xxh128"
_SEGMENT = re.compile(ID_PATTERN)


def check_key(key: str) -> str:
    """A key made of id-like segments (`job/step-000000000100/rank-00003.bin`), or an error."""
    segments = key.split("/")
    if not key or any(s in ("", ".", "..") or not _SEGMENT.fullmatch(s) for s in segments):
        raise ValidationError(
            f"storage key {key!r} is not allowed: keys are relative, '/'-separated, and each part "
            f"matches {ID_PATTERN} (no '..', no absolute paths)",
            field="key",
        )
    return key


def shard_key(job: str, step: int, rank: int, attempt: int = 0) -> str:
    """Where rank `rank` stores its shard of `step`; a step opened again after an abort (attempt
    1, 2, ...) writes other keys, so a late writer of an aborted attempt never overwrites one."""
    suffix = f".a{attempt}" if attempt else ""
    return check_key(f"{job}/step-{step:012d}/rank-{rank:05d}{suffix}.bin")


def manifest_key(job: str, step: int) -> str:
    return check_key(f"{job}/step-{step:012d}/MANIFEST.json")


def step_prefix(job: str, step: int) -> str:
    return check_key(f"{job}/step-{step:012d}")


def check_range(offset: int, length: int) -> None:
    if offset < 0 or length < 0:
        raise ValidationError(
            f"byte range offset={offset} length={length} is not allowed: both must be >= 0",
            field="range",
        )


@dataclass(frozen=True)
class WriteResult:
    uri: str
    bytes: int
    checksum: str
    """`xxh128:<hex>` of the bytes written."""


class StorageBackend(ABC):
    """Where checkpoint bytes live. Every method is a coroutine and safe to call concurrently."""

    root_uri: str

    @abstractmethod
    async def write(self, key: str, data: bytes | memoryview) -> WriteResult:
        """Store `data` under `key` durably (replacing any previous object) and checksum it.

        Either the whole object is there afterwards or none of it: a failed write leaves nothing
        behind (a temp file is removed, a multipart upload is aborted).
        """

    @abstractmethod
    async def read(self, key: str, checksum: str | None = None) -> bytes:
        """The bytes under `key`; with `checksum`, `ChecksumMismatch` if they differ from it."""

    async def read_range(self, key: str, offset: int, length: int) -> bytes:
        """`length` bytes of the object under `key` from `offset` (fewer at its end), unverified.

        For formats that keep their own checksums per part (a DCP shard's items): reading a part
        must not cost reading the whole object. Backends that can read a range override this.
        """
        check_range(offset, length)
        return (await self.read(key))[offset : offset + length]

    async def read_range_into(self, key: str, offset: int, into: memoryview) -> int:
        """Fill `into` with the object's bytes from `offset`, unverified; how many there were.

        For a caller that reads a large object in parts into one buffer of its own (and verifies
        the whole): the local backend reads straight into it, with no copy in between.
        """
        data = await self.read_range(key, offset, into.nbytes)
        into[: len(data)] = data
        return len(data)

    @abstractmethod
    async def exists(self, key: str) -> bool: ...

    @abstractmethod
    async def size(self, key: str) -> int | None:
        """The size in bytes of the object under `key`, or None when there is none.

        Metadata only (a `stat`, a HEAD request): the commit checks every acked shard is still
        there, whole, without reading it back.
        """

    @abstractmethod
    async def delete(self, key: str) -> None:
        """Remove `key`; removing a missing key is not an error."""

    @abstractmethod
    async def delete_prefix(self, prefix: str) -> int:
        """Remove every object under `prefix/`; returns how many."""

    @abstractmethod
    async def list(self, prefix: str) -> list[str]:
        """Keys under `prefix/` (relative to the root), sorted."""

    def uri(self, key: str) -> str:
        return f"{self.root_uri.rstrip('/')}/{check_key(key)}"

    async def close(self) -> None:  # noqa: B027 - optional: only backends with connections need it
        """Release connections (S3 clients); the backend is unusable afterwards."""
