"""torch.distributed.checkpoint (DCP) through Strata's two-phase commit.

`Writer(manager, step=N)` and `Reader(manager, step=N)` are DCP's `StorageWriter` and
`StorageReader` on a `CheckpointManager`: `dcp.save`, `dcp.async_save` and `dcp.load` store every
rank's items as that rank's Strata shard of step N, through the manager's storage backend (local
disk or S3). The coordinator's shard also carries DCP's metadata and is acked last, so the step
commits only once every rank's data and the metadata are stored: `latest()` never sees half a DCP
checkpoint, and retention, replay and the dashboard treat it like any other checkpoint.

A shard is the items' raw bytes, each at a 64-byte aligned offset and checksummed on its own, then
the pickled metadata (the coordinator's shard only), then a fixed footer saying where the metadata
is. Tensors are stored as their raw bytes in their own dtype and shape, so a load into another
world size (resharding) reads exactly the parts of the saved chunks it needs.

Verify before you parse: any worker can write the checkpoint store, so a load trusts only the
manifest the checkpoint service committed. The shard holding the metadata is read whole and
checked against the checksum the service recorded for it before a byte of it is parsed; the
metadata it holds then vouches for every item's checksum in every shard. The metadata is
unpickled with an allow-list of DCP's own types, and non-tensor items with
`torch.load(weights_only=True)`, so even bytes that pass the checks cannot run code.
"""

from __future__ import annotations

import asyncio
import copy
import io
import math
import os
import pickle
import struct
import threading
import warnings
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

import torch
import torch.distributed as dist
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.metadata import Metadata, MetadataIndex
from torch.distributed.checkpoint.planner import (
    LoadItemType,
    LoadPlan,
    LoadPlanner,
    ReadItem,
    SavePlan,
    SavePlanner,
    WriteItem,
)
from torch.distributed.checkpoint.staging import AsyncStager
from torch.distributed.checkpoint.storage import StorageReader, StorageWriter, WriteResult
from torch.distributed.tensor import DTensor
from torch.futures import Future

from strata.errors import ChecksumMismatch, Forbidden, StrataError, ValidationError
from strata.events.requests import Manifest, ManifestShard
from strata.storage import StorageBackend, checksum_of

if TYPE_CHECKING:
    from strata.checkpoint import CheckpointManager, ShardSlot

__all__ = ["ItemLocation", "Reader", "Writer"]

_MAGIC: Final = b"STRATADCP1\0\0\0\0\0\0"
_FOOTER: Final = struct.Struct("<16sQQ32s")
"""magic, metadata offset, metadata length, metadata xxh128 digest (hex, 32 ASCII bytes)."""
_ALIGN: Final = 64
_READ_RUN: Final = 64 * 1024 * 1024
"""Adjacent items of one shard are read together, up to this many bytes per request."""
_READS_IN_FLIGHT: Final = 8
_READ_WINDOW: Final = 256 * 1024 * 1024
"""Bytes read before they are copied into the state dict being loaded (bounds the memory)."""
_VERIFY_PART: Final = 32 * 1024 * 1024
"""The metadata's shard is read in parts of this size, `_READS_IN_FLIGHT` at a time."""
_KEEP_VERIFIED: Final = 2 * 1024 * 1024 * 1024
"""The metadata's shard, read whole to verify it, is kept for the item reads up to this size."""


@dataclass(frozen=True)
class ItemLocation:
    """Where one DCP item is stored: in rank `rank`'s shard, `length` bytes from `offset`.

    Tensors record their dtype and shape (the bytes are the tensor's, contiguous); a bytes item
    has `dtype` None. `checksum` is the item's own `xxh128:` checksum.
    """

    rank: int
    offset: int
    length: int
    checksum: str
    dtype: torch.dtype | None = None
    shape: tuple[int, ...] = ()


def _aligned(offset: int) -> int:
    return (offset + _ALIGN - 1) // _ALIGN * _ALIGN


class _Buffers:
    """Host memory for one shard, kept from one save of a manager to the next.

    Copying into memory that is already mapped runs at memory speed; a fresh allocation costs a
    page fault per 4 KiB as well (as `save_state`'s staging buffers avoid too). A save takes the
    kept buffer if it is large enough and no other save holds it, and gives it back once its
    shard is written, so at most one shard's worth is kept.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._free: bytearray | None = None

    def take(self, size: int) -> bytearray:
        with self._lock:
            free, self._free = self._free, None
        if free is not None and len(free) >= size:
            return free
        return bytearray(size)

    def give_back(self, blob: bytearray) -> None:
        with self._lock:
            if self._free is None or len(blob) > len(self._free):
                self._free = blob


_BUFFERS: weakref.WeakKeyDictionary[Any, _Buffers] = weakref.WeakKeyDictionary()
_BUFFERS_LOCK = threading.Lock()


def _buffers(manager: CheckpointManager) -> _Buffers:
    with _BUFFERS_LOCK:
        return _BUFFERS.setdefault(manager, _Buffers())


@dataclass
class _Shard:
    """A shard being built: its buffer, how much of it is used, and the data it was staged from."""

    blob: bytearray
    end: int = 0
    staged_end: int = 0
    """Bytes at the start of `blob` that hold tensors `stage` copied there (`async_save`)."""

    def address(self) -> int:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            probe = torch.frombuffer(self.blob, dtype=torch.uint8, count=1)
        return int(probe.data_ptr())

    def tensor_at(self, offset: int, dtype: torch.dtype, shape: Sequence[int]) -> torch.Tensor:
        length = math.prod(shape) * _element_size(dtype)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            raw = torch.frombuffer(self.blob, dtype=torch.uint8, count=length, offset=offset)
        return raw.view(dtype).view(tuple(shape))

    def put(self, tensor: torch.Tensor) -> tuple[int, torch.Tensor]:
        """Copy `tensor` to the end of the used part; its offset and the copy (a view)."""
        offset = _aligned(self.end)
        view = self.tensor_at(offset, tensor.dtype, tensor.shape) if tensor.numel() else tensor
        if tensor.numel():
            view.copy_(tensor)
        self.end = offset + tensor.numel() * tensor.element_size()
        return offset, view


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


_RESERVE: Final = 4 * 1024 * 1024
"""Room kept after the data for the footer and (the coordinator's) metadata."""


class Writer(StorageWriter, AsyncStager):
    """DCP storage writer: this rank's items become its Strata shard of `step`.

    Every rank declares its shard when DCP hands it its plan (so a rank that dies while saving
    aborts the step), writes it and waits for the service's ack; the coordinator writes its
    shard with the metadata appended once all ranks have written, then (with `wait_commit`)
    waits until the step is committed, so `dcp.save` returning means `latest()` sees it.
    A failure on any rank makes `dcp.save` raise on every rank, as DCP does.

    For `dcp.async_save` it is also the stager: the caller blocks only while the tensors are
    copied into this manager's kept host buffer, which is then written as it is.
    """

    _synchronize_after_execute = False  # staging is done when stage() returns

    def __init__(
        self,
        manager: CheckpointManager,
        step: int,
        epoch: int = 0,
        *,
        wait_commit: bool = True,
        commit_timeout: float = 300.0,
    ) -> None:
        super().__init__()
        self.manager = manager
        self.step = step
        self.epoch = epoch
        self.wait_commit = wait_commit
        self.commit_timeout = commit_timeout
        self.is_coordinator = False
        self._slot: ShardSlot | None = None
        self._staged: _Shard | None = None
        self._held: _Shard | None = None
        """The coordinator's shard, written by `finish` with the metadata appended."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise ValidationError(
                "strata.torch.dcp.Writer takes no checkpoint_id: the step names the checkpoint "
                f"(Writer(manager, step=N)); got checkpoint_id={checkpoint_id!r}",
                field="checkpoint_id",
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        """A copy of `state_dict` whose tensors live in this manager's kept host buffer."""
        size = sum(
            _aligned(_local(t).numel() * _local(t).element_size()) for t in _tensors(state_dict)
        )
        shard = _Shard(_buffers(self.manager).take(size + _RESERVE))
        staged: dict[str, Any] = _copy_structure(state_dict, shard)
        shard.staged_end = shard.end
        self._staged = shard
        return staged

    def synchronize_staging(self) -> None:
        pass

    def close(self) -> None:
        pass

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        self.is_coordinator = is_coordinator

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        self._slot = self.manager._runner.run(self._declare())
        return plan

    async def _declare(self) -> ShardSlot:
        worker = self.manager.aio._worker
        # The step is opened for this worker's view of the world; right after the ranks met
        # (init_process_group, a barrier) the registry's notice of the last join may still be
        # on its way, so a view that differs from torch's world is asked for afresh.
        if dist.is_initialized() and worker.world_size != dist.get_world_size():
            await worker.members()
        return await self.manager.aio.declare(self.step, self.epoch)

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        return plans

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        slot = self._declared()
        staged, self._staged = self._staged, None
        shard, results = _pack(plan.items, planner, slot.rank, staged, _buffers(self.manager))
        if self.is_coordinator:
            self._held = shard  # goes out with the metadata, in finish()
        else:
            self._write(shard, b"")
        future: Future[list[WriteResult]] = Future()
        future.set_result(results)
        return future

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        shard, self._held = self._held, None
        if shard is None:
            shard = _Shard(bytearray(_RESERVE))
        metadata.storage_data = {
            result.index: result.storage_data for rank_results in results for result in rank_results
        }
        self._write(shard, pickle.dumps(metadata, protocol=pickle.HIGHEST_PROTOCOL))
        if self.wait_commit:
            self.manager.wait_committed(self.step, timeout=self.commit_timeout)

    def _declared(self) -> ShardSlot:
        if self._slot is None:
            raise StrataError(
                "the DCP plan was not prepared; pass the Writer to dcp.save/async_save",
                code="dcp_order",
            )
        return self._slot

    def _write(self, shard: _Shard, metadata: bytes) -> None:
        """Write the shard with `metadata` and the footer after its data, and wait for the ack."""
        start = _aligned(shard.end)
        tail = metadata + _footer(start, metadata)
        if start + len(tail) <= len(shard.blob):
            shard.blob[start : start + len(tail)] = tail
            data: bytes | memoryview = memoryview(shard.blob)[: start + len(tail)]
        else:  # metadata larger than the room kept for it: one copy more
            data = bytes(shard.blob[: shard.end]) + bytes(start - shard.end) + tail
        manager = self.manager
        manager._runner.run(
            manager.aio.write_declared(data, self.step, self.epoch, self._declared())
        )
        if isinstance(data, memoryview):
            data.release()
        _buffers(manager).give_back(shard.blob)


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for item in value.values():
            yield from _tensors(item)
    elif isinstance(value, list | tuple):
        for item in value:
            yield from _tensors(item)


def _copy_structure(value: Any, shard: _Shard) -> Any:
    """`value` with every tensor copied into `shard` (DTensors keep their mesh and placements);
    everything else deep-copied, so the training loop may change the original at once."""
    if isinstance(value, DTensor):
        _, local = shard.put(value.to_local().detach())
        return DTensor.from_local(
            local,
            value.device_mesh,
            value.placements,
            run_check=False,
            shape=value.shape,
            stride=value.stride(),
        )
    if isinstance(value, torch.Tensor):
        return shard.put(value.detach())[1]
    if isinstance(value, Mapping):
        copied = {key: _copy_structure(item, shard) for key, item in value.items()}
        return type(value)(copied) if isinstance(value, dict) else copied
    if isinstance(value, list):
        return [_copy_structure(item, shard) for item in value]
    if isinstance(value, tuple):
        return tuple(_copy_structure(item, shard) for item in value)
    return copy.deepcopy(value)


def _pack(
    items: list[WriteItem],
    planner: SavePlanner,
    rank: int,
    staged: _Shard | None,
    buffers: _Buffers,
) -> tuple[_Shard, list[WriteResult]]:
    """This rank's items laid out in one buffer, and where each one went.

    Tensors `stage` already copied into the buffer stay where they are; the rest are copied in.
    """
    resolved: list[tuple[WriteItem, Any]] = []
    for item in items:
        data = planner.resolve_data(item)
        if isinstance(data, torch.Tensor):
            resolved.append((item, data.detach()))
        else:
            resolved.append(
                (item, data.getvalue() if isinstance(data, io.BytesIO) else data.read())
            )
    sizes = [_aligned(len(d) if isinstance(d, bytes) else _nbytes(d)) for _, d in resolved]
    placed: dict[int, int] = {}
    if staged is not None:
        base = staged.address()
        for position, (_, data) in enumerate(resolved):
            offset = _resident(data, staged, base) if isinstance(data, torch.Tensor) else None
            if offset is not None:
                placed[position] = offset
    missing = sum(size for position, size in enumerate(sizes) if position not in placed)
    if staged is None:
        shard = _Shard(buffers.take(sum(sizes) + _RESERVE))
    elif staged.end + missing + _RESERVE > len(staged.blob):
        # The staged copy is still read from: a buffer of its own, not the kept one.
        shard, placed = _Shard(bytearray(sum(sizes) + _RESERVE)), {}
    else:
        shard = staged
    results: list[WriteResult] = []
    view = memoryview(shard.blob)
    try:
        for position, (item, data) in enumerate(resolved):
            if isinstance(data, bytes):
                offset = _aligned(shard.end)
                length = len(data)
                view[offset : offset + length] = data
                shard.end = offset + length
                location = ItemLocation(rank, offset, length, checksum_of(data))
            else:
                if position in placed:
                    offset = placed[position]
                else:
                    offset, _ = shard.put(data)
                length = _nbytes(data)
                location = ItemLocation(
                    rank,
                    offset,
                    length,
                    checksum_of(view[offset : offset + length]),
                    data.dtype,
                    tuple(data.shape),
                )
            results.append(
                WriteResult(index=item.index, size_in_bytes=length, storage_data=location)
            )
    finally:
        view.release()
    return shard, results


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _resident(tensor: torch.Tensor, shard: _Shard, base: int) -> int | None:
    """The offset of `tensor`'s bytes in the staged part of `shard`, if they are there whole."""
    if tensor.device.type != "cpu" or not tensor.is_contiguous() or not tensor.numel():
        return None
    offset = int(tensor.data_ptr()) - base
    if offset >= 0 and offset + _nbytes(tensor) <= shard.staged_end:
        return offset
    return None


def _footer(metadata_offset: int, encoded: bytes) -> bytes:
    """The fixed-size end of every shard: where its metadata is (length 0: none)."""
    digest = checksum_of(encoded).partition(":")[2].encode() if encoded else b"0" * 32
    return _FOOTER.pack(_MAGIC, metadata_offset, len(encoded), digest)


class Reader(StorageReader):
    """DCP storage reader of step `step`'s committed checkpoint (None: the latest complete one).

    Every rank reads only the byte ranges its plan needs, from whichever ranks' shards hold them,
    so a checkpoint saved by N ranks loads into any other number; each item is checksum-verified.
    """

    def __init__(self, manager: CheckpointManager, step: int | None = None) -> None:
        super().__init__()
        self.manager = manager
        self.step = step
        self._manifest: Manifest | None = None
        self._metadata: Metadata | None = None
        self._verified: dict[int, bytes | memoryview] = {}
        """Shards (by rank) read whole and checked against the manifest's checksum."""

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id is not None:
            raise ValidationError(
                "strata.torch.dcp.Reader takes no checkpoint_id: pass the step to the Reader "
                f"(Reader(manager, step=N)); got checkpoint_id={checkpoint_id!r}",
                field="checkpoint_id",
            )

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return False

    def _read_window(self, window: list[tuple[ManifestShard, Run]], planner: LoadPlanner) -> None:
        manager = self.manager
        for (_, run), data in zip(
            window, manager._runner.run(_read_all(manager, window, self._verified)), strict=True
        ):
            for item, location, start in _split(run, data):
                _apply(planner, item, location, data, start)

    @property
    def manifest(self) -> Manifest:
        """The committed checkpoint being read (found on first use)."""
        if self._manifest is None:
            manager = self.manager
            self._manifest = manager._runner.run(manager.aio._manifest(self.step))
        return self._manifest

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is None:
            manager = self.manager
            self._metadata, self._verified = manager._runner.run(
                _read_metadata(manager, self.manifest)
            )
        return self._metadata

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        if metadata is not self._metadata:
            self._verified = {}  # not the metadata this reader verified: no shortcut
        self._metadata = metadata

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        metadata = self.read_metadata()
        shards = {shard.rank: shard for shard in self.manifest.shards}
        storage_data: dict[MetadataIndex, Any] = metadata.storage_data
        located = [(item, _location(storage_data, item)) for item in plan.items]
        reads: list[tuple[ManifestShard, Run]] = []
        for run in _runs(located):
            shard = shards.get(run[0][1].rank)
            if shard is None:
                raise StrataError(
                    f"checkpoint of step {self.manifest.step} has no shard of rank "
                    f"{run[0][1].rank}, which its DCP metadata names",
                    code="dcp_shard_missing",
                )
            reads.append((shard, run))
        # Reads go out several at a time (S3 wants that), a window of up to _READ_WINDOW bytes,
        # which is applied to the state dict before the next one is read.
        window: list[tuple[ManifestShard, Run]] = []
        size = 0
        for position, read in enumerate(reads):
            window.append(read)
            size += _run_bytes(read[1])
            if size >= _READ_WINDOW or position == len(reads) - 1:
                self._read_window(window, planner)
                window, size = [], 0
        future: Future[None] = Future()
        future.set_result(None)
        return future


def _run_bytes(run: Run) -> int:
    return max(loc.offset + loc.length for _, loc in run) - run[0][1].offset


async def _read_all(
    manager: CheckpointManager,
    reads: list[tuple[ManifestShard, Run]],
    verified: Mapping[int, bytes | memoryview],
) -> list[bytes | memoryview]:
    room = asyncio.Semaphore(_READS_IN_FLIGHT)

    async def one(shard: ManifestShard, run: Run) -> bytes | memoryview:
        whole = verified.get(shard.rank)
        if whole is not None:
            return _cut_run(whole, shard, run)
        async with room:
            return await _read_run(manager, shard, run)

    return await asyncio.gather(*(one(shard, run) for shard, run in reads))


def _location(storage_data: dict[MetadataIndex, Any], item: ReadItem) -> ItemLocation:
    location = storage_data.get(item.storage_index)
    if not isinstance(location, ItemLocation):
        raise StrataError(
            f"DCP item {item.storage_index.fqn!r} has no Strata location in the checkpoint's "
            "metadata (was it saved with strata.torch.dcp.Writer?)",
            code="dcp_format",
        )
    return location


Run = list[tuple[ReadItem, ItemLocation]]


def _runs(located: list[tuple[ReadItem, ItemLocation]]) -> Iterator[Run]:
    """Items grouped into reads: the same shard, adjacent or overlapping, up to `_READ_RUN`."""
    ordered = sorted(located, key=lambda pair: (pair[1].rank, pair[1].offset))
    run: Run = []
    for pair in ordered:
        if run:
            first, last = run[0][1], run[-1][1]
            location = pair[1]
            same = location.rank == first.rank
            near = location.offset <= _aligned(last.offset + last.length)
            small = location.offset + location.length - first.offset <= _READ_RUN
            if not (same and near and small):
                yield run
                run = []
        run.append(pair)
    if run:
        yield run


def _split(run: Run, data: bytes | memoryview) -> Iterator[tuple[ReadItem, ItemLocation, int]]:
    base = run[0][1].offset
    for item, location in run:
        yield item, location, location.offset - base


def _cut_run(whole: bytes | memoryview, shard: ManifestShard, run: Run) -> memoryview:
    """A run's bytes (a view, not a copy) from a shard already verified whole against the
    manifest."""
    first = run[0][1].offset
    end = max(location.offset + location.length for _, location in run)
    if end > len(whole):
        raise StrataError(
            f"DCP metadata places an item at {first}..{end} of {shard.key!r}, which holds "
            f"{len(whole)} bytes",
            code="dcp_format",
        )
    return memoryview(whole)[first:end]


async def _read_run(manager: CheckpointManager, shard: ManifestShard, run: Run) -> bytes:
    first = run[0][1].offset
    end = max(location.offset + location.length for _, location in run)
    data = await manager.aio.storage.read_range(shard.key, first, end - first)
    for _, location in run:
        start = location.offset - first
        part = memoryview(data)[start : start + location.length]
        if len(part) != location.length or checksum_of(part) != location.checksum:
            raise ChecksumMismatch(
                f"DCP item at {location.offset}+{location.length} of {shard.key!r} does not "
                f"match its checksum {location.checksum}; the shard is damaged or was replaced",
                key=shard.key,
                expected=location.checksum,
                actual=checksum_of(part),
            )
    return data


def _apply(
    planner: LoadPlanner,
    item: ReadItem,
    location: ItemLocation,
    data: bytes | memoryview,
    start: int,
) -> None:
    raw = memoryview(data)[start : start + location.length]
    if item.type == LoadItemType.BYTE_IO:
        planner.load_bytes(item, _weights_only(item, raw))
        return
    if location.dtype is None:
        raise StrataError(f"DCP item {item.storage_index.fqn!r} is not a tensor", code="dcp_format")
    if location.length:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # read-only bytes: the tensor is only copied from
            stored = torch.frombuffer(raw, dtype=torch.uint8).view(location.dtype)
        stored = stored.view(location.shape)
    else:
        stored = torch.empty(location.shape, dtype=location.dtype)
    tensor = narrow_tensor_by_index(stored, item.storage_offsets, item.lengths)
    target = planner.resolve_tensor(item).detach()
    if target.size() != tensor.size():
        raise StrataError(
            f"DCP item {item.storage_index.fqn!r}: the checkpoint holds {tuple(tensor.size())} "
            f"where the state dict has {tuple(target.size())}",
            code="dcp_shape_mismatch",
        )
    target.copy_(tensor)
    planner.commit_tensor(item, target)


async def _read_metadata(
    manager: CheckpointManager, manifest: Manifest
) -> tuple[Metadata, dict[int, bytes | memoryview]]:
    """DCP's metadata, from the first shard (by rank) that carries it, and that shard's bytes.

    The shard is read whole and checked against the checksum the checkpoint service recorded
    for it at commit before its footer or metadata is looked at: the digest in the footer is
    written by the same hands as the bytes it covers, so it proves nothing.
    """
    storage = manager.aio.storage
    for shard in sorted(manifest.shards, key=lambda shard: shard.rank):
        data = await _read_verified(storage, manifest, shard)
        footer = data[-_FOOTER.size :] if len(data) >= _FOOTER.size else bytes(_FOOTER.size)
        magic, offset, length, digest = _FOOTER.unpack(footer)
        if magic != _MAGIC:
            raise StrataError(
                f"checkpoint of step {manifest.step} is not a DCP checkpoint (rank {shard.rank}'s "
                "shard has no DCP footer); load it with CheckpointManager.load()",
                code="dcp_format",
            )
        if not length:
            continue
        if offset + length > len(data) - _FOOTER.size:
            raise StrataError(
                f"DCP footer of {shard.key!r} places the metadata outside the shard",
                code="dcp_format",
            )
        encoded = memoryview(data)[offset : offset + length]
        expected = "xxh128:" + digest.decode("ascii", "replace")
        if checksum_of(encoded) != expected:
            raise ChecksumMismatch(
                f"DCP metadata in {shard.key!r} does not match its checksum; not loaded",
                key=shard.key,
                expected=expected,
                actual=checksum_of(encoded),
            )
        metadata = await asyncio.to_thread(load_metadata, encoded, shard.key)
        kept: dict[int, bytes | memoryview] = {}
        if len(data) <= _KEEP_VERIFIED:
            kept[shard.rank] = data
        return metadata, kept
    raise StrataError(
        f"checkpoint of step {manifest.step} holds no DCP metadata in any shard",
        code="dcp_format",
    )


async def _read_verified(
    storage: StorageBackend, manifest: Manifest, shard: ManifestShard
) -> memoryview:
    """`shard`'s bytes, checked against the size and checksum its committed manifest records.

    Read in parts, several at a time, straight into one buffer (its pages are mapped by the
    reading threads side by side, as the range reads of a load map theirs), then hashed whole.
    """
    if not shard.key.startswith(f"{manifest.job}/"):
        raise Forbidden(
            f"checkpoint of job {manifest.job!r} names shard {shard.key!r}, which lies outside "
            "the job's own prefix; not read",
            key=shard.key,
        )
    # One byte more than committed: a longer object is caught without reading all of it.
    buffer = torch.empty(shard.bytes + 1, dtype=torch.uint8)
    view = memoryview(buffer.numpy())  # type: ignore[arg-type]  # numpy arrays are buffers
    room = asyncio.Semaphore(_READS_IN_FLIGHT)

    async def part(offset: int) -> int:
        async with room:
            end = min(offset + _VERIFY_PART, len(view))
            return await storage.read_range_into(shard.key, offset, view[offset:end])

    counts = await asyncio.gather(*(part(o) for o in range(0, len(view), _VERIFY_PART)))
    size = sum(counts)
    data = view[: shard.bytes]
    actual = await asyncio.to_thread(checksum_of, data)
    if size != shard.bytes or actual != shard.checksum:
        what = "its checksum" if size == shard.bytes else f"its size ({shard.bytes} bytes)"
        raise ChecksumMismatch(
            f"rank {shard.rank}'s shard of step {manifest.step} ({shard.key!r}) does not match "
            f"{what} recorded at commit ({shard.checksum}); the shard is damaged or was "
            "replaced, so nothing in it is parsed",
            key=shard.key,
            expected=shard.checksum,
            actual=actual,
        )
    return data


_DCP_TYPES: Final = {
    ("strata.torch.dcp", "ItemLocation"): ItemLocation,
    ("torch", "Size"): torch.Size,
    ("torch.serialization", "_get_layout"): torch.serialization._get_layout,
    **{
        ("torch.distributed.checkpoint.metadata", name): getattr(dcp_metadata, name)
        for name in (
            "BytesStorageMetadata",
            "ChunkStorageMetadata",
            "Metadata",
            "MetadataIndex",
            "StorageMeta",
            "TensorProperties",
            "TensorStorageMetadata",
            "_MEM_FORMAT_ENCODING",
        )
    },
}
"""Everything DCP's metadata with Strata's item locations refers to (dtypes aside)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP metadata and nothing else: any other global is refused, so bytes that
    name `os.system` (or any callable outside DCP's plain data types) cannot run it."""

    def find_class(self, module: str, name: str) -> Any:
        found = _DCP_TYPES.get((module, name))
        if found is not None:
            return found
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise Forbidden(
            f"DCP metadata refers to {module}.{name}, which is not one of DCP's metadata types; "
            "not loaded (the checkpoint was not written by strata.torch.dcp.Writer, or was "
            "tampered with)",
            type=f"{module}.{name}",
        )


def load_metadata(encoded: bytes | memoryview, key: str = "") -> Metadata:
    """DCP metadata from its pickle, through an allow-list of DCP's types."""
    try:
        metadata = _MetadataUnpickler(io.BytesIO(encoded)).load()
    except Forbidden:
        raise
    except Exception as exc:  # a truncated or malformed pickle: whatever the unpickler raised
        raise StrataError(
            f"DCP metadata in {key!r} cannot be read: {type(exc).__name__}: {exc}",
            code="dcp_format",
        ) from None
    if not isinstance(metadata, Metadata) or not isinstance(metadata.storage_data, dict):
        raise StrataError(f"DCP metadata in {key!r} is not DCP's", code="dcp_format")
    for location in metadata.storage_data.values():
        if not isinstance(location, ItemLocation) or not _sane(location):
            raise StrataError(
                f"DCP metadata in {key!r} holds an item location that is not Strata's: "
                f"{location!r}",
                code="dcp_format",
            )
    return metadata


def _sane(location: ItemLocation) -> bool:
    numbers = (location.rank, location.offset, location.length, *location.shape)
    return (
        all(type(n) is int and n >= 0 for n in numbers)
        and isinstance(location.checksum, str)
        and (location.dtype is None or isinstance(location.dtype, torch.dtype))
    )


def _weights_only(item: ReadItem, raw: memoryview) -> io.BytesIO:
    """A non-tensor item, loaded with `torch.load(weights_only=True)` and saved again.

    DCP's planners read these with `weights_only=False`; what they are handed is a fresh pickle
    of an object the weights-only loader built, which refers to nothing it refused.
    """
    try:
        value = torch.load(io.BytesIO(raw), weights_only=True)
    except Exception as exc:
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise Forbidden(
            f"DCP item {item.storage_index.fqn!r} is not a plain value torch.load(weights_only="
            f"True) accepts, so it is not loaded: {reason}",
            fqn=item.storage_index.fqn,
        ) from None
    resaved = io.BytesIO()
    torch.save(value, resaved)
    resaved.seek(0)
    return resaved
