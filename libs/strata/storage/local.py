"""Checkpoint storage on a local (or mounted) filesystem, durable across power loss.

A write goes to a hidden temp file beside the target in large sequential chunks, starting each
chunk's disk write-back at once while a second thread hashes the buffer; the file is then fsynced,
renamed over the key and the directory fsynced, so readers see the old object or the whole new
one. The checksum is also kept in a `user.strata.checksum` extended attribute where the filesystem
has them and is verified on every read; all file work runs in threads, off the event loop.

Every worker may write the tree, so no path below the root is followed through a symbolic link:
each directory is opened relative to its parent with `O_NOFOLLOW`, files likewise, and deletes
and listings walk open directories. A key that meets a link (`<root>/attacker -> <root>/victim`)
is refused with `Forbidden` instead of acting on whatever the link points at.
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

from strata.errors import Forbidden, NotFound, StorageError, ValidationError
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
        """The file for `key`; `ValidationError` if the key is not allowed, `Forbidden` if any
        part of it below the root is a symbolic link."""
        path = self.root.joinpath(*valid_key(key).split("/"))
        current = self.root
        for name in key.split("/"):
            current = current / name
            with contextlib.suppress(FileNotFoundError, NotADirectoryError):
                if stat.S_ISLNK(current.lstat().st_mode):
                    raise _linked(key, current)
        return path

    def _open_dir(self, names: list[str], key: str, *, create: bool = False) -> int:
        """A descriptor of the directory `root/names...`, each part opened without following a
        link (`create`: missing parts are made, durably). The caller closes it."""
        fd = os.open(self.root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for name in names:
                if create:
                    try:
                        os.mkdir(name, 0o755, dir_fd=fd)
                        os.fsync(fd)
                    except FileExistsError:
                        pass
                try:
                    child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                except OSError as exc:
                    if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(name, fd):
                        raise _linked(key, name) from None
                    raise
                os.close(fd)
                fd = child
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _open_file(self, key: str, flags: int) -> tuple[int, int, str]:
        """(parent directory fd, file fd, name) of `key`, neither followed through a link."""
        *parents, name = key.split("/")
        try:
            parent = self._open_dir(parents, key)
        except (FileNotFoundError, NotADirectoryError):
            raise NotFound(f"no object {key!r} in {self.root_uri}", key=key) from None
        try:
            fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        except FileNotFoundError:
            os.close(parent)
            raise NotFound(f"no object {key!r} in {self.root_uri}", key=key) from None
        except OSError as exc:
            linked = exc.errno == errno.ELOOP and _is_link(name, parent)
            os.close(parent)
            if linked:
                raise _linked(key, name) from None
            raise
        return parent, fd, name

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
        _make_dirs(self.root)
        *parents, name = key.split("/")
        directory = self._open_dir(parents, key, create=True)
        try:
            return self._write_in(directory, name, view, cancel)
        finally:
            os.close(directory)

    def _write_in(
        self, directory: int, name: str, view: memoryview, cancel: threading.Event
    ) -> str:
        temp = f".{name}.{uuid.uuid4().hex}{_TEMP_SUFFIX}"
        hashing: Future[str] | None = None
        try:
            fd = os.open(
                temp,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o644,
                dir_fd=directory,
            )
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
            # A rename replaces a link of that name, never what it points at.
            os.replace(temp, name, src_dir_fd=directory, dst_dir_fd=directory)
        except BaseException:
            if hashing is not None:
                # The buffer belongs to the caller again once write() returns.
                with contextlib.suppress(BaseException):
                    hashing.result()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=directory)
            raise
        os.fsync(directory)
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
        parent, fd, _ = self._open_file(key, os.O_RDONLY)
        os.close(parent)
        with open(fd, "rb", buffering=0) as file:
            # From the open file, not the path: a concurrent overwrite renames a new file in.
            stored = _read_checksum_xattr(file.fileno())
            data = file.read()
        return data, stored

    async def read_range(self, key: str, offset: int, length: int) -> bytes:
        valid_key(key)
        check_range(offset, length)
        return await self._io("reading", key, self._read_file_range, key, offset, length)

    def _read_file_range(self, key: str, offset: int, length: int) -> bytes:
        parent, fd, _ = self._open_file(key, os.O_RDONLY)
        os.close(parent)
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

    async def read_range_into(self, key: str, offset: int, into: memoryview) -> int:
        valid_key(key)
        check_range(offset, into.nbytes)
        return await self._io("reading", key, self._read_file_into, key, offset, into)

    def _read_file_into(self, key: str, offset: int, into: memoryview) -> int:
        parent, fd, _ = self._open_file(key, os.O_RDONLY)
        os.close(parent)
        try:
            done = 0
            while done < into.nbytes:
                got = os.preadv(fd, [into[done:]], offset + done)
                if not got:
                    break
                done += got
            return done
        finally:
            os.close(fd)

    async def exists(self, key: str) -> bool:
        valid_key(key)
        return await self._io("checking", key, lambda: self._file_size(key) is not None)

    async def size(self, key: str) -> int | None:
        valid_key(key)
        return await self._io("checking", key, self._file_size, key)

    def _file_size(self, key: str) -> int | None:
        """The size of the regular file `key`; None when there is none, or only a link."""
        *parents, name = key.split("/")
        try:
            parent = self._open_dir(parents, key)
        except (FileNotFoundError, NotADirectoryError, Forbidden):
            return None
        try:
            found = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except (FileNotFoundError, NotADirectoryError):
            return None
        finally:
            os.close(parent)
        return found.st_size if stat.S_ISREG(found.st_mode) else None

    async def delete(self, key: str) -> None:
        valid_key(key)
        await self._io("deleting", key, self._delete_file, key)

    def _delete_file(self, key: str) -> None:
        *parents, name = key.split("/")
        try:
            parent = self._open_dir(parents, key)
        except (FileNotFoundError, NotADirectoryError):
            return
        try:
            os.unlink(name, dir_fd=parent)  # a link is removed itself, never its target
        except FileNotFoundError:
            pass
        finally:
            os.close(parent)

    async def delete_prefix(self, prefix: str) -> int:
        # An empty prefix is refused (by the key rules): one bad argument must not wipe the root.
        valid_key(prefix)
        return await self._io("deleting under", prefix, self._delete_tree, prefix)

    def _delete_tree(self, prefix: str) -> int:
        *parents, name = prefix.split("/")
        try:
            parent = self._open_dir(parents, prefix)
        except (FileNotFoundError, NotADirectoryError):
            return 0
        try:
            try:
                directory = os.open(name, _DIR_FLAGS, dir_fd=parent)
            except (FileNotFoundError, NotADirectoryError):
                if _is_link(name, parent):
                    raise _linked(prefix, name) from None
                return 0
            except OSError as exc:
                if exc.errno == errno.ELOOP and _is_link(name, parent):
                    raise _linked(prefix, name) from None
                raise
            try:
                count = len(_keys_in(directory, prefix))
            finally:
                os.close(directory)
            # rmtree with a dir_fd walks open directories and never follows a link, so a
            # link swapped in while it runs cannot send it elsewhere.
            shutil.rmtree(name, dir_fd=parent)
            os.fsync(parent)
        finally:
            os.close(parent)
        return count

    def _list(self, prefix: str) -> list[str]:
        try:
            directory = self._open_dir(prefix.split("/") if prefix else [], prefix)
        except (FileNotFoundError, NotADirectoryError):
            return []
        try:
            return _keys_in(directory, prefix)
        finally:
            os.close(directory)

    async def list(self, prefix: str) -> list[str]:
        """Keys under `prefix/`, sorted; the empty prefix lists the whole root."""
        if prefix:
            valid_key(prefix)
        return await self._io("listing", prefix, self._list, prefix)


_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
    except OSError:
        return False


def _linked(key: str, where: Path | str) -> Forbidden:
    return Forbidden(
        f"storage key {key!r} passes through a symbolic link ({where}); a checkpoint tree is "
        "never followed through links, so nothing was read, written or deleted there",
        key=key,
    )


def _keys_in(directory: int, prefix: str) -> list[str]:
    """Keys of the regular files under the open `directory` (which holds `prefix`), sorted.

    Walks open directories without following links: a linked directory or file is no key.
    """
    keys: list[str] = []
    for current, _, files, current_fd in os.fwalk(".", dir_fd=directory, follow_symlinks=False):
        base = "/".join(part for part in (prefix, current.removeprefix(".").strip("/")) if part)
        for name in files:
            try:
                mode = os.stat(name, dir_fd=current_fd, follow_symlinks=False).st_mode
            except FileNotFoundError:
                continue
            if not stat.S_ISREG(mode):
                continue
            # Temp files start with '.', which no valid key segment does.
            with contextlib.suppress(ValidationError):
                keys.append(valid_key(f"{base}/{name}" if base else name))
    return sorted(keys)


def _hash_into(view: memoryview, result: Future[str]) -> None:
    try:
        result.set_result(checksum_of(view))
    except BaseException as exc:
        result.set_exception(exc)
