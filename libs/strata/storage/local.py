"""Checkpoint storage on a local (or mounted) filesystem, durable across power loss.

A write goes to a hidden temp file beside the target in large sequential chunks, starting each
chunk's disk write-back at once while a second thread hashes the buffer; the file is then fsynced,
renamed over the key and the directory fsynced, so readers see the old object or the whole new
one. The checksum is also kept in a `user.strata.checksum` extended attribute where the filesystem
has them and is verified on every read; all file work runs in threads, off the event loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import os
import shutil
import stat
import sys
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Final, TypeVar

from strata.errors import NotFound, StorageError, ValidationError
from strata.storage._checksum import check_checksum, checksum_of, verify
from strata.storage._keys import valid_key
from strata.storage.base import StorageBackend, WriteResult, check_range

CHECKSUM_XATTR: Final = "user.strata.checksum"
DEFAULT_CHUNK_SIZE: Final = 8 * 1024 * 1024
# Below this, hashing in a second thread costs more than it overlaps.
_PARALLEL_HASH_MIN: Final = 4 * 1024 * 1024
_TEMP_SUFFIX: Final = ".tmp"
T = TypeVar("T")


_SYNC_FILE_RANGE_WRITE: Final = 2


def _load_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    function.restype = ctypes.c_int
    return function


# Starting write-back chunk by chunk overlaps copying into the page cache with the disk writing
# earlier chunks; a plain write leaves all of it to the final fsync. Linux only; elsewhere the
# fsync does all the work.
_sync_file_range = _load_sync_file_range()


class _Cancelled(Exception):
    """The awaiting coroutine was cancelled; the writing thread stops between chunks."""


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _make_dirs(directory: Path) -> None:
    """Create `directory` and its missing parents, the root's own included (a checkpoint path
    under a data directory that does not exist yet), making each new entry durable."""
    missing: list[Path] = []
    current = directory
    while not current.is_dir():
        missing.append(current)
        if current.parent == current:
            break
        current = current.parent
    for path in reversed(missing):
        with contextlib.suppress(FileExistsError):
            path.mkdir()
        _fsync_dir(path.parent)


def _set_checksum_xattr(fd: int, checksum: str) -> None:
    try:
        os.setxattr(fd, CHECKSUM_XATTR, checksum.encode("ascii"))
    except OSError as exc:
        # Without xattrs (some network and FUSE filesystems) the caller's recorded checksum,
        # e.g. from the manifest, is the only one; that is still verified on read.
        if exc.errno not in (errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM, errno.E2BIG):
            raise


def _read_checksum_xattr(fd: int) -> str | None:
    try:
        return os.getxattr(fd, CHECKSUM_XATTR).decode("ascii")
    except OSError as exc:
        if exc.errno in (errno.ENODATA, errno.ENOTSUP, errno.EOPNOTSUPP):
            return None
        raise


class LocalStorage(StorageBackend):
    """Objects as files under `root`; keys map to sub-paths, which never leave `root`."""

    def __init__(self, root: Path | str, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
        if chunk_size < 1:
            raise ValidationError("chunk_size must be at least 1 byte", field="chunk_size")
        self.root = Path(root).expanduser().resolve()
        self.root_uri = self.root.as_uri()
        self.chunk_size = chunk_size

    def __repr__(self) -> str:
        return f"LocalStorage({str(self.root)!r})"

    def path(self, key: str) -> Path:
        """The file for `key`; `ValidationError` if the key is not allowed or escapes the root."""
        path = self.root.joinpath(*valid_key(key).split("/"))
        # The key rules already keep paths inside the root; this also catches a symlink inside
        # the tree that points out of it.
        if not path.resolve().is_relative_to(self.root):
            raise ValidationError(
                f"storage key {key!r} resolves outside {self.root} (through a symlink?)",
                field="key",
            )
        return path

    async def _io(self, action: str, key: str, function: Callable[..., T], *args: Any) -> T:
        """`function(*args)` in a thread; OS errors become `StorageError` (code `storage_error`)."""
        try:
            return await asyncio.to_thread(function, *args)
        except OSError as exc:
            where = self.uri(key) if key else self.root_uri
            raise StorageError(f"{action} {where} failed: {exc}", key=key) from exc

    async def write(self, key: str, data: bytes | memoryview) -> WriteResult:
        valid_key(key)
        view = memoryview(data).cast("B")
        cancel = threading.Event()
        job = asyncio.ensure_future(self._io("writing", key, self._write_file, key, view, cancel))
        try:
            checksum = await asyncio.shield(job)
        except asyncio.CancelledError:
            # Let the thread stop and remove its temp file before the cancellation goes on,
            # so a cancelled write leaves nothing behind either.
            cancel.set()
            with contextlib.suppress(BaseException):
                await job
            raise
        return WriteResult(uri=self.uri(key), bytes=view.nbytes, checksum=checksum)

    def _write_file(self, key: str, view: memoryview, cancel: threading.Event) -> str:
        path = self.path(key)
        directory = path.parent
        _make_dirs(directory)
        temp = directory / f".{path.name}.{uuid.uuid4().hex}{_TEMP_SUFFIX}"
        hashing: Future[str] | None = None
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                if view.nbytes >= _PARALLEL_HASH_MIN:
                    hashing = Future()
                    threading.Thread(
                        target=_hash_into, args=(view, hashing), name="strata-hash", daemon=True
                    ).start()
                self._write_all(fd, view, cancel)
                # Hashing goes on while this thread waits for the disk, so the checksum costs
                # little time. The xattr set after the fsync is made durable by the directory
                # fsync on journalling filesystems; where it is not, reads still verify the
                # checksum the caller recorded.
                os.fsync(fd)
                checksum = checksum_of(view) if hashing is None else hashing.result()
                _set_checksum_xattr(fd, checksum)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            if hashing is not None:
                # The buffer belongs to the caller again once write() returns.
                with contextlib.suppress(BaseException):
                    hashing.result()
            with contextlib.suppress(FileNotFoundError):
                temp.unlink()
            raise
        _fsync_dir(directory)
        return checksum

    def _write_all(self, fd: int, view: memoryview, cancel: threading.Event) -> None:
        offset, size, chunk = 0, view.nbytes, self.chunk_size
        while offset < size:
            if cancel.is_set():
                raise _Cancelled
            written = os.write(fd, view[offset : offset + chunk])
            if _sync_file_range is not None:
                # Advisory: a failure here only loses the overlap, the fsync still runs.
                _sync_file_range(fd, offset, written, _SYNC_FILE_RANGE_WRITE)
            offset += written

    async def read(self, key: str, checksum: str | None = None) -> bytes:
        valid_key(key)
        if checksum is not None:
            check_checksum(checksum)
        data, stored = await self._io("reading", key, self._read_file, key)
        await asyncio.to_thread(verify, key, self.uri(key), data, checksum, stored)
        return data

    def _read_file(self, key: str) -> tuple[bytes, str | None]:
        try:
            file = self.path(key).open("rb", buffering=0)
        except FileNotFoundError:
            raise NotFound(f"no object {key!r} in {self.root_uri}", key=key) from None
        with file:
            # From the open file, not the path: a concurrent overwrite renames a new file in.
            stored = _read_checksum_xattr(file.fileno())
            data = file.read()
        return data, stored

    async def read_range(self, key: str, offset: int, length: int) -> bytes:
        valid_key(key)
        check_range(offset, length)
        return await self._io("reading", key, self._read_file_range, key, offset, length)

    def _read_file_range(self, key: str, offset: int, length: int) -> bytes:
        try:
            fd = os.open(self.path(key), os.O_RDONLY)
        except FileNotFoundError:
            raise NotFound(f"no object {key!r} in {self.root_uri}", key=key) from None
        try:
            parts: list[bytes] = []
            while length > 0:
                part = os.pread(fd, length, offset)
                if not part:
                    break
                parts.append(part)
                offset += len(part)
                length -= len(part)
            return parts[0] if len(parts) == 1 else b"".join(parts)
        finally:
            os.close(fd)

    async def exists(self, key: str) -> bool:
        valid_key(key)
        return await self._io("checking", key, lambda: self.path(key).is_file())

    async def size(self, key: str) -> int | None:
        valid_key(key)
        return await self._io("checking", key, self._file_size, key)

    def _file_size(self, key: str) -> int | None:
        try:
            found = self.path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        return found.st_size if stat.S_ISREG(found.st_mode) else None

    async def delete(self, key: str) -> None:
        valid_key(key)
        await self._io("deleting", key, lambda: self.path(key).unlink(missing_ok=True))

    async def delete_prefix(self, prefix: str) -> int:
        # An empty prefix is refused (by the key rules): one bad argument must not wipe the root.
        valid_key(prefix)
        return await self._io("deleting under", prefix, self._delete_tree, prefix)

    def _delete_tree(self, prefix: str) -> int:
        directory = self.path(prefix)
        if not directory.is_dir():
            return 0
        count = len(_keys_under(self.root, directory))
        shutil.rmtree(directory)
        with contextlib.suppress(FileNotFoundError):
            _fsync_dir(directory.parent)
        return count

    async def list(self, prefix: str) -> list[str]:
        """Keys under `prefix/`, sorted; the empty prefix lists the whole root."""
        if prefix:
            valid_key(prefix)
        return await self._io(
            "listing",
            prefix,
            lambda: _keys_under(self.root, self.path(prefix) if prefix else self.root),
        )


def _keys_under(root: Path, directory: Path) -> list[str]:
    keys: list[str] = []
    for current, dirs, files in os.walk(directory):
        # Symlinked directories are not followed: they could lead out of the root.
        dirs[:] = [name for name in dirs if not (Path(current) / name).is_symlink()]
        for name in files:
            relative = (Path(current) / name).relative_to(root).as_posix()
            # Temp files start with '.', which no valid key segment does.
            with contextlib.suppress(ValidationError):
                keys.append(valid_key(relative))
    return sorted(keys)


def _hash_into(view: memoryview, result: Future[str]) -> None:
    try:
        result.set_result(checksum_of(view))
    except BaseException as exc:
        result.set_exception(exc)
