"""The worker side of checkpoints: declare, snapshot, persist in the background, recover.

`save()` declares this rank's shard of the step to the checkpoint service (the `begin` RPC, in the
caller's call, so a rank that dies while writing is a participant that never acked and the step
aborts) and returns once the bytes are snapshotted; the write to storage and the ack (the `ack`
RPC: the service records the shard as saved, under the key it derives itself) run in the
background, bounded by `max_pending_bytes` (a save waits for room rather than queueing without
limit). `save_state()` blocks only to copy tensors off the training state and declare; it
serialises in the background. A background failure is raised by the next call or by `wait()`.
A write that fails (a full disk, an S3 error) is reported to the service at once (the `fail` RPC),
which aborts the step for every rank instead of letting it run to its deadline; a shard written
for a step that ended without it (its ack refused) is deleted by its writer.
`latest()`/`load()` see complete checkpoints only (a shard of every rank of their world); they ask
the service and, when it is down, read the manifests in storage directly.

`CheckpointManager` here is `strata.aio.CheckpointManager`; `strata.CheckpointManager` is its
blocking face (`strata.checkpoint`), and both take their options as one `CheckpointOptions`.
"""

from __future__ import annotations

import asyncio
import importlib
import io
import sys
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, TypedDict, Unpack

import structlog

from strata._checks import check_int
from strata._supervise import Supervisor
from strata.aio.worker import Worker
from strata.errors import (
    BusError,
    ConflictError,
    Forbidden,
    MissingShard,
    NotFound,
    StorageError,
    StrataError,
    ValidationError,
)
from strata.events import DataCursor
from strata.events.models import MAX_STEP
from strata.events.requests import (
    AckShardRequest,
    AckShardResult,
    BeginCheckpointRequest,
    CheckpointAnswer,
    CheckpointInfo,
    CheckpointQuery,
    Manifest,
    ManifestShard,
    ShardFailedRequest,
)
from strata.storage import StorageBackend, manifest_key, open_storage, shard_key

log = structlog.get_logger("strata.checkpoint")

SERVICE = "checkpoint"
DEFAULT_MAX_PENDING = 4 * 1024**3
STATUS_TIMEOUT_S = 2.0
REPORT_TIMEOUT_S = 2.0
"""Per attempt, for telling the service a write failed."""
REPORT_FOR_S = 30.0
"""How long a failed write's report is retried (through a service restart)."""


class _Staging:
    """CPU buffers that tensors are copied into off the training state (the only blocking part of
    `save_state`), kept from one save to the next.

    Copying into memory that is already mapped runs at memory speed; a fresh allocation of the
    same size costs a page fault per 4 KiB as well, which doubles the time the caller blocks. Once
    a save's bytes are serialised its buffers come back here for the next save, so at most one
    state's worth of buffers is kept between saves. Device tensors are copied into pinned buffers
    without blocking, then synchronised once.
    """

    def __init__(self, keep: bool) -> None:
        self._keep = keep
        self._lock = threading.Lock()
        self._free: dict[tuple[Any, ...], list[Any]] = {}

    def copy_off(self, state: Any) -> tuple[Any, list[Any]]:
        """A deep copy of `state` in which every tensor is a CPU copy; the buffers it used."""
        torch = sys.modules.get("torch")
        used: list[Any] = []
        if torch is None:
            return _copy_structure(state, lambda tensor: tensor), used
        device_copies = False

        def copy(tensor: Any) -> Any:
            nonlocal device_copies
            source = tensor.detach()
            buffer = self._take(torch, source)
            on_device = source.device.type != "cpu"
            buffer.copy_(source, non_blocking=on_device and buffer.is_pinned())
            device_copies = device_copies or on_device
            used.append(buffer)
            return buffer

        with self._lock:
            copied = _copy_structure(state, copy)
        if device_copies and torch.cuda.is_available():
            torch.cuda.synchronize()
        return copied, used

    def _take(self, torch: Any, source: Any) -> Any:
        pin = source.device.type == "cuda" and torch.cuda.is_available()
        free = self._free.get((tuple(source.shape), source.dtype, pin))
        if free:
            return free.pop()
        return torch.empty(source.shape, dtype=source.dtype, device="cpu", pin_memory=pin)

    def give_back(self, buffers: list[Any]) -> None:
        """Keep a serialised save's buffers for the next save (replacing any kept before)."""
        if not self._keep or not buffers:
            return
        free: dict[tuple[Any, ...], list[Any]] = {}
        for buffer in buffers:
            key = (tuple(buffer.shape), buffer.dtype, buffer.is_pinned())
            free.setdefault(key, []).append(buffer)
        with self._lock:
            self._free = free


def _copy_structure(value: Any, copy: Callable[[Any], Any]) -> Any:
    """`value` copied structurally (dicts, lists, tuples), with `copy` applied to each tensor."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(value, torch.Tensor):
        return copy(value)
    if isinstance(value, Mapping):
        copied = {k: _copy_structure(v, copy) for k, v in value.items()}
        return type(value)(copied) if isinstance(value, dict) else copied
    if isinstance(value, list):
        return [_copy_structure(v, copy) for v in value]
    if isinstance(value, tuple):
        return tuple(_copy_structure(v, copy) for v in value)
    return value


def _serialise(state: Any) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


class ShardSlot(NamedTuple):
    """Where one save's shard goes: its rank in the step's world, and its storage key."""

    rank: int
    key: str


class _Staged(NamedTuple):
    """A state dict copied off the training state, with the buffers it was copied into."""

    copied: Any
    buffers: list[Any]
    step: int
    epoch: int


def _check_step(step: object, epoch: object) -> tuple[int, int]:
    return check_int("step", step, 0, MAX_STEP), check_int("epoch", epoch, 0, MAX_STEP)


@dataclass(frozen=True, kw_only=True)
class CheckpointOptions:
    """How a checkpoint manager saves and prunes, checked when made: what
    `strata.CheckpointManager` and `strata.aio.CheckpointManager` take, as `options=` or as
    keyword arguments (`keep_count=3`), which replace the fields they name."""

    keep_count: int = 5
    """The newest committed checkpoints kept; older ones are pruned."""
    timeout: float = 300.0
    """Seconds a step may stay open before it aborts; a save's requests retry as long."""
    max_pending_bytes: int = DEFAULT_MAX_PENDING
    """Bytes of saves in flight in the background; a save waits for room beyond it."""
    keep_staging: bool = True
    """Keep `save_state`'s CPU buffers for the next save (copies run at memory speed)."""

    def __post_init__(self) -> None:
        if not isinstance(self.keep_count, int) or self.keep_count < 1:
            raise ValidationError(f"keep_count must be at least 1, got {self.keep_count!r}")
        if self.max_pending_bytes < 1:
            raise ValidationError("max_pending_bytes must be positive")


class CheckpointArgs(TypedDict, total=False):
    """`CheckpointOptions`' fields as keyword arguments of the constructors."""

    keep_count: int
    timeout: float
    max_pending_bytes: int
    keep_staging: bool


class CheckpointManager:
    """Checkpoints of one worker's shard of the training state (asyncio API)."""

    def __init__(
        self,
        worker: Worker,
        path: str | None = None,
        *,
        storage: StorageBackend | None = None,
        options: CheckpointOptions | None = None,
        **overrides: Unpack[CheckpointArgs],
    ) -> None:
        options = replace(options or CheckpointOptions(), **overrides)
        keep_count, timeout = options.keep_count, options.timeout
        max_pending_bytes, keep_staging = options.max_pending_bytes, options.keep_staging
        self._options = options
        self._worker = worker
        worker._track_saves(self)
        # Opening S3 storage imports aioboto3 (seconds): a caller whose loop sends heartbeats
        # opens it off the loop and passes it in (`strata.CheckpointManager` does).
        self._storage: StorageBackend = (
            storage if storage is not None else open_storage(path, worker.settings)
        )
        self.root_uri = self._storage.root_uri
        self.keep_count = keep_count
        self.timeout = timeout
        self._max_pending = max_pending_bytes
        self._pending_bytes = 0
        self._room = asyncio.Condition()
        self._tasks: set[asyncio.Task[None]] = set()
        self._supervisor = Supervisor("strata-checkpoint")
        self._failure: BaseException | None = None
        self._staging = _Staging(keep_staging)
        self._declared: dict[int, int] = {}
        """Step -> the rank this manager declared a shard of (each step is saved once)."""
        self.saved: list[AckShardResult] = []
        """The service's answers to this worker's acks, in order (what it has made durable)."""
        self.refused: list[StrataError] = []
        """Acks the service refused because their step had ended without them (or another
        process held the rank): written shards that do not count."""

    @property
    def storage(self) -> StorageBackend:
        """The storage backend checkpoints are written to."""
        return self._storage

    @property
    def options(self) -> CheckpointOptions:
        """The options this manager was made with."""
        return self._options

    def _raise_failure(self) -> None:
        failure, self._failure = self._failure, None
        if failure is not None:
            raise failure

    async def _reserve(self, size: int) -> None:
        # One save larger than the bound still goes through, alone.
        async with self._room:
            await self._room.wait_for(
                lambda: self._pending_bytes == 0 or self._pending_bytes + size <= self._max_pending
            )
            self._pending_bytes += size

    async def _release(self, size: int) -> None:
        async with self._room:
            self._pending_bytes -= size
            self._room.notify_all()

    def _spawn(self, size: int, work: Any) -> None:
        async def run() -> None:
            try:
                await work
            except BaseException as exc:  # kept for the next call: never swallowed
                if self._failure is None:
                    self._failure = exc
                log.error("checkpoint_save_failed", error=str(exc))
            finally:
                await self._release(size)

        task = self._supervisor.spawn(run(), "save")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def save(
        self,
        data: bytes | bytearray | memoryview,
        step: int,
        epoch: int = 0,
        *,
        cursors: list[DataCursor] | None = None,
    ) -> None:
        """Declare this rank's shard of `step`, snapshot `data` and persist it in the background.

        Raises `ConflictError` at once for a step already saved (by this manager or committed),
        aborted, or open for another world than this worker's.
        """
        self._raise_failure()
        step, epoch = _check_step(step, epoch)
        self._check_unsaved(step)
        snapshot = data if isinstance(data, bytes) else bytes(data)
        slot = await self._begin(step, epoch)
        await self._reserve(len(snapshot))
        self._spawn(len(snapshot), self._persist(snapshot, step, epoch, slot, cursors or []))

    async def save_state(
        self,
        state: Mapping[str, Any],
        step: int,
        epoch: int = 0,
        *,
        cursors: list[DataCursor] | None = None,
    ) -> None:
        """Copy the tensors of `state` off the training state; serialise and persist later."""
        await self._save_staged(self._stage(state, step, epoch), cursors)

    def _stage(self, state: Mapping[str, Any], step: object, epoch: object) -> _Staged:
        """The blocking part of `save_state`, on the caller's thread: checks, then the copy."""
        self._raise_failure()
        step, epoch = _check_step(step, epoch)
        self._check_unsaved(step)
        copied, buffers = self._staging.copy_off(state)
        return _Staged(copied, buffers, step, epoch)

    async def _save_staged(self, staged: _Staged, cursors: list[DataCursor] | None) -> None:
        copied, buffers, step, epoch = staged
        try:
            slot = await self._begin(step, epoch)
        except BaseException:
            self._staging.give_back(buffers)
            raise
        size = _state_bytes(copied)
        await self._reserve(size)
        self._spawn(
            size, self._serialise_and_persist(copied, buffers, step, epoch, slot, cursors or [])
        )

    def _check_unsaved(self, step: int) -> None:
        rank = self._declared.get(step)
        if rank is not None:
            raise ConflictError(
                f"step {step} was already saved by rank {rank}; save under a later step"
            )

    async def _begin(self, step: int, epoch: int) -> ShardSlot:
        """Declare this rank's shard of `step` to the service (opening the step if it is the
        first); where the shard goes. Waits out a checkpoint service restart."""
        worker = self._worker
        info = await worker.bus.rpc.call(
            SERVICE,
            "begin",
            BeginCheckpointRequest(
                job=worker.job,
                worker_id=worker.id,
                step=step,
                epoch=epoch,
                root_uri=self.root_uri,
                keep_count=self.keep_count,
                timeout_s=self.timeout,
                world_size=worker.world_size or None,
                membership_epoch=worker.membership_epoch,
                instance=worker.instance,
                lease=worker.lease,
                save_id=uuid.uuid4().hex,  # the same in every retry of this one call
            ),
            result=CheckpointInfo,
            timeout=10.0,
            retry_for=self.timeout,
            idempotent=True,
        )
        # The service refuses these itself; an answer saying otherwise is not one to write on.
        if info.status != "open":
            raise ConflictError(f"checkpoint of step {step} is {info.status}; save a later step")
        rank = next((p.rank for p in info.participants if p.worker_id == worker.id), None)
        if rank is None:
            raise ConflictError(
                f"{worker.id!r} is not a participant of step {step}'s checkpoint; save a later step"
            )
        self._declared[step] = rank
        return ShardSlot(rank, shard_key(worker.job, step, rank, info.attempt))

    async def declare(self, step: int, epoch: int = 0) -> ShardSlot:
        """Declare this rank's shard of `step` now and write it later with `write_declared`.

        For formats that write their shard in steps (DCP: data first, metadata at the end), so
        that the rank is a participant from the start and its death aborts the step.
        """
        self._raise_failure()
        step, epoch = _check_step(step, epoch)
        self._check_unsaved(step)
        return await self._begin(step, epoch)

    async def write_declared(
        self, data: bytes | memoryview, step: int, epoch: int, slot: ShardSlot
    ) -> AckShardResult:
        """Write a declared shard and ack it, in this call; `ConflictError` or `NotFound` when
        the service refuses the ack (the step ended without it)."""
        answer = await self._persist(data, step, epoch, slot, [])
        if answer is None:
            raise self.refused[-1]
        return answer

    async def _serialise_and_persist(
        self,
        state: Any,
        buffers: list[Any],
        step: int,
        epoch: int,
        slot: ShardSlot,
        cursors: list[DataCursor],
    ) -> None:
        try:
            data = await asyncio.to_thread(_serialise, state)
        finally:
            del state
            self._staging.give_back(buffers)
        await self._persist(data, step, epoch, slot, cursors)

    async def _persist(
        self,
        data: bytes | memoryview,
        step: int,
        epoch: int,
        slot: ShardSlot,
        cursors: list[DataCursor],
    ) -> AckShardResult | None:
        worker = self._worker
        started = time.perf_counter()
        rank, key = slot
        try:
            written = await self._storage.write(key, data)
        except Exception as exc:
            raise await self._write_failed(step, epoch, rank, key, exc) from exc
        ack = AckShardRequest(
            job=worker.job,
            worker_id=worker.id,
            step=step,
            epoch=epoch,
            rank=rank,
            bytes=written.bytes,
            checksum=written.checksum,
            cursors=cursors,
            instance=worker.instance,
            lease=worker.lease,
        )
        # The same ack again is the same answer (and one recorded event): retried through a
        # checkpoint service restart for as long as a save may take.
        try:
            answer = await worker.bus.rpc.call(
                SERVICE,
                "ack",
                ack,
                result=AckShardResult,
                timeout=10.0,
                retry_for=self.timeout,
                idempotent=True,
            )
        except (ConflictError, NotFound) as exc:
            # The step ended without this shard (a participant failed, the deadline passed) or
            # another process holds the rank now. The shard is written, and does not count: that
            # is the step's outcome, which `wait_committed()` and `latest()` tell, not a failure
            # of this save to raise from the next call.
            self.refused.append(exc)
            log.warning(
                "checkpoint_ack_refused", step=step, rank=rank, code=exc.code, reason=exc.message
            )
            await self._remove_if_orphaned(step, key)
            return None
        self.saved.append(answer)
        seconds = time.perf_counter() - started
        log.info(
            "checkpoint_shard_saved",
            step=step,
            rank=rank,
            bytes=written.bytes,
            mb_per_s=round(written.bytes / max(seconds, 1e-9) / 1e6, 1),
        )
        return answer

    async def _write_failed(
        self, step: int, epoch: int, rank: int, key: str, exc: Exception
    ) -> StrataError:
        """Tell the service this rank's shard of `step` could not be written, so that the step
        aborts now for every rank; the error for this worker's `wait()`."""
        worker = self._worker
        why = exc.message if isinstance(exc, StrataError) else f"{type(exc).__name__}: {exc}"
        report = ShardFailedRequest(
            job=worker.job,
            worker_id=worker.id,
            step=step,
            epoch=epoch,
            rank=rank,
            reason=why[:900],
            instance=worker.instance,
        )
        told = "the step is aborted"
        try:
            await worker.bus.rpc.call(
                SERVICE,
                "fail",
                report,
                result=CheckpointInfo,
                timeout=REPORT_TIMEOUT_S,
                retry_for=REPORT_FOR_S,
                idempotent=True,
            )
        except StrataError as failed:
            told = (
                f"the checkpoint service was not told ({failed.message}); the step aborts at "
                "its deadline"
            )
        log.error("checkpoint_write_failed", step=step, rank=rank, key=key, error=why)
        return StorageError(
            f"rank {rank}'s shard of step {step} could not be written to "
            f"{self._storage.uri(key)}: {why}; {told}. Free space or fix the storage, then save "
            "a later step",
            step=step,
            rank=rank,
        )

    async def _remove_if_orphaned(self, step: int, key: str) -> None:
        """Delete the shard this worker wrote under `key` if no checkpoint can reference it: its
        step aborted, or went on as another attempt (whose shards have other keys). The
        service removes an aborted step's files when it aborts it; a writer that finished
        after that would otherwise leave its file behind forever."""
        try:
            answer = await self.status(step)
        except StrataError as exc:
            log.warning("checkpoint_orphan_unchecked", step=step, key=key, error=exc.message)
            return
        checkpoint = answer.checkpoint if answer.found else None
        if checkpoint is None:
            return
        current = checkpoint.status != "aborted" and any(
            shard_key(self._worker.job, step, p.rank, checkpoint.attempt) == key
            for p in checkpoint.participants
        )
        if current:
            return  # the key of the step as it stands: another writer's shard may be there
        try:
            await self._storage.delete(key)
        except (StrataError, OSError) as exc:
            log.warning("checkpoint_orphan_not_removed", step=step, key=key, error=str(exc))
            return
        log.info("checkpoint_orphan_removed", step=step, key=key)

    async def wait(self) -> None:
        """Return once every save of this worker is durable; raise a background failure."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        self._raise_failure()

    async def status(
        self, step: int | None = None, *, include_incomplete: bool = False
    ) -> CheckpointAnswer:
        """The service's view of `step` (None: the latest complete checkpoint, or with
        `include_incomplete` the latest committed one)."""
        return await self._worker.bus.rpc.call(
            SERVICE,
            "status",
            CheckpointQuery(job=self._worker.job, step=step, include_incomplete=include_incomplete),
            result=CheckpointAnswer,
            timeout=STATUS_TIMEOUT_S,
            idempotent=True,
        )

    async def wait_committed(self, step: int, timeout: float = 60.0) -> CheckpointInfo:
        """Wait until `step` is committed (raise `ConflictError` if it was aborted)."""
        deadline = time.monotonic() + timeout
        while True:
            answer = await self.status(step)
            checkpoint = answer.checkpoint if answer.found else None
            if checkpoint is not None and checkpoint.status == "committed":
                return checkpoint
            if checkpoint is not None and checkpoint.status == "aborted":
                raise ConflictError(f"checkpoint of step {step} was aborted: {checkpoint.reason}")
            if time.monotonic() >= deadline:
                raise StrataError(
                    f"step {step} not committed within {timeout:g}s", code="checkpoint_timeout"
                )
            await asyncio.sleep(0.05)

    async def latest(self, *, include_incomplete: bool = False) -> Manifest | None:
        """The manifest of the latest complete checkpoint (a shard of every rank of its world):
        from the service, else from storage. `include_incomplete`: the latest committed one,
        complete or not (only checkpoints committed before worlds were recorded can lack one)."""
        self._raise_failure()
        try:
            answer = await self.status(None, include_incomplete=include_incomplete)
        except BusError as exc:
            log.warning("checkpoint_service_unreachable", error=str(exc), fallback="storage")
            return await self.latest_in_storage(include_incomplete=include_incomplete)
        return answer.manifest if answer.found else None

    async def latest_in_storage(self, *, include_incomplete: bool = False) -> Manifest | None:
        """The newest complete checkpoint's manifest in storage, read directly (no service)."""
        async for manifest in self._stored_manifests():
            if include_incomplete or manifest.complete:
                return manifest
        return None

    async def manifests(self, *, include_incomplete: bool = False) -> list[Manifest]:
        """Every complete checkpoint's manifest in storage (with `include_incomplete`, every
        committed one), newest first; no service needed."""
        return [
            manifest
            async for manifest in self._stored_manifests()
            if include_incomplete or manifest.complete
        ]

    async def _stored_manifests(self) -> AsyncIterator[Manifest]:
        job = self._worker.job
        steps = sorted(
            {
                int(key.split("/")[1].removeprefix("step-"))
                for key in await self._storage.list(job)
                if key.endswith("/MANIFEST.json")
            },
            reverse=True,
        )
        for step in steps:
            try:
                raw = await self._storage.read(manifest_key(job, step))
                yield Manifest.model_validate_json(raw)
            except (StrataError, ValueError) as exc:
                log.warning("manifest_unreadable", step=step, error=str(exc))

    async def load(self, step: int | None = None, rank: int | None = None) -> bytes:
        """The bytes `rank` (default: this worker's rank) saved in the latest complete checkpoint
        (or `step`'s committed one), checksum-verified.

        `NotFound`: no such checkpoint. `MissingShard`: the checkpoint has no shard of that rank.
        """
        manifest = await self._manifest(step)
        shard = self._shard(manifest, self._worker.rank if rank is None else rank)
        job = self._worker.job
        # A manifest read from storage (the service down) is bytes a worker could write: it
        # may name only this job's own objects.
        if manifest.job != job or not shard.key.startswith(f"{job}/"):
            raise Forbidden(
                f"the checkpoint of step {manifest.step} read for job {job!r} names "
                f"{shard.key!r} of job {manifest.job!r}, outside this job's own prefix; not read",
                key=shard.key,
            )
        # Verified against the checksum in the manifest before a byte is handed back.
        return await self._storage.read(shard.key, shard.checksum)

    async def load_state(self, step: int | None = None, rank: int | None = None) -> Any:
        """`load()` read back with `torch.load` (weights only): tensors and plain containers,
        never code, whoever wrote the bytes."""
        # Imported off the loop: the first import of torch takes seconds, and this loop sends
        # the worker's heartbeats.
        torch = await asyncio.to_thread(importlib.import_module, "torch")
        data = await self.load(step, rank)
        return await asyncio.to_thread(torch.load, io.BytesIO(data), weights_only=True)

    async def _manifest(self, step: int | None) -> Manifest:
        if step is None:
            manifest = await self.latest()
        else:
            try:
                answer = await self.status(step)
                manifest = answer.manifest
            except BusError:
                raw = await self._storage.read(manifest_key(self._worker.job, step))
                manifest = Manifest.model_validate_json(raw)
        if manifest is None:
            raise NotFound(
                f"job {self._worker.job!r} has no committed checkpoint"
                + (f" of step {step}" if step is not None else "")
                + f" in {self.root_uri}"
            )
        return manifest

    @staticmethod
    def _shard(manifest: Manifest, rank: int) -> ManifestShard:
        for shard in manifest.shards:
            if shard.rank == rank:
                return shard
        held = ", ".join(str(shard.rank) for shard in manifest.shards) or "none"
        raise MissingShard(
            f"checkpoint of step {manifest.step} has no shard of rank {rank}: it holds ranks "
            f"{held} of its world of {manifest.world()}",
            step=manifest.step,
            rank=rank,
            ranks=[shard.rank for shard in manifest.shards],
        )

    async def close(self) -> None:
        """Wait for pending saves, then release the storage client."""
        await self.wait()
        await self._storage.close()


def _state_bytes(state: Any) -> int:
    torch = sys.modules.get("torch")
    total = 0
    stack = [state]
    while stack:
        value = stack.pop()
        if torch is not None and isinstance(value, torch.Tensor):
            total += value.numel() * value.element_size()
        elif isinstance(value, Mapping):
            stack.extend(value.values())
        elif isinstance(value, list | tuple):
            stack.extend(value)
    return max(total, 1)
