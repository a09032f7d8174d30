"""`strata.CheckpointManager`: checkpoints for ordinary (non-asyncio) training loops.

A blocking face over `strata.aio.CheckpointManager` (`strata/aio/_checkpoint.py`, where the
behaviour lives: declare, snapshot, persist in the background, recover): each call runs the async
manager's coroutine on the worker's background loop. The blocking parts of a save (copying the
bytes or the tensors off the training state) run on the caller's thread, so the loop, and with it
the worker's heartbeats, is never held by them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any, Unpack

from strata.aio import CheckpointArgs, CheckpointOptions, ShardSlot
from strata.aio import CheckpointManager as AsyncCheckpointManager
from strata.aio import Worker as AsyncWorker
from strata.events import DataCursor
from strata.events.requests import AckShardResult, CheckpointAnswer, CheckpointInfo, Manifest
from strata.storage import StorageBackend, open_storage
from strata.worker import Worker, resolve_worker

__all__ = ["CheckpointArgs", "CheckpointManager", "CheckpointOptions", "ShardSlot"]


class CheckpointManager:
    """Checkpoints for synchronous training loops: `strata.CheckpointManager(worker, path)`.

    Without a worker (`strata.CheckpointManager(path="s3://bucket/models", keep_count=5)`) it
    uses the process's implicit worker (`strata.default_worker()`), built from the environment.
    """

    def __init__(
        self,
        worker: Worker | None = None,
        path: str | None = None,
        *,
        options: CheckpointOptions | None = None,
        **overrides: Unpack[CheckpointArgs],
    ) -> None:
        options = replace(options or CheckpointOptions(), **overrides)
        worker = resolve_worker(worker, "CheckpointManager", "path")
        self._runner = worker.runner
        # Opened here, on the caller's thread: opening S3 storage imports aioboto3, which would
        # hold the worker's loop, and so its heartbeats, for seconds.
        storage = open_storage(path, worker.aio.settings)
        self._aio = self._runner.run(_make_async(worker.aio, path, storage, options))

    @property
    def aio(self) -> AsyncCheckpointManager:
        """The `strata.aio.CheckpointManager` this one drives on the worker's loop."""
        return self._aio

    @property
    def root_uri(self) -> str:
        """Where this manager's checkpoints live (a file:// or s3:// URI)."""
        return self._aio.root_uri

    @property
    def storage(self) -> StorageBackend:
        """The storage backend checkpoints are written to."""
        return self._aio.storage

    @property
    def options(self) -> CheckpointOptions:
        """The options this manager was made with."""
        return self._aio.options

    def save(
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
        snapshot = data if isinstance(data, bytes) else bytes(data)  # copied on this thread
        self._runner.run(self._aio.save(snapshot, step, epoch, cursors=cursors))

    def save_state(
        self,
        state: Mapping[str, Any],
        step: int,
        epoch: int = 0,
        *,
        cursors: list[DataCursor] | None = None,
    ) -> None:
        """Copy the tensors of `state` off the training state; serialise and persist later."""
        staged = self._aio._stage(state, step, epoch)  # the blocking part, on this thread
        self._runner.run(self._aio._save_staged(staged, cursors))

    def declare(self, step: int, epoch: int = 0) -> ShardSlot:
        """Declare this rank's shard of `step` now and write it later with `write_declared`.

        For formats that write their shard in steps (DCP: data first, metadata at the end), so
        that the rank is a participant from the start and its death aborts the step.
        """
        return self._runner.run(self._aio.declare(step, epoch))

    def write_declared(
        self, data: bytes | memoryview, step: int, epoch: int, slot: ShardSlot
    ) -> AckShardResult:
        """Write a declared shard and ack it, in this call; `ConflictError` or `NotFound` when
        the service refuses the ack (the step ended without it)."""
        return self._runner.run(self._aio.write_declared(data, step, epoch, slot))

    def wait(self) -> None:
        """Return once every save of this worker is durable; raise a background failure."""
        self._runner.run(self._aio.wait())

    def status(
        self, step: int | None = None, *, include_incomplete: bool = False
    ) -> CheckpointAnswer:
        """The service's view of `step` (None: the latest complete checkpoint, or with
        `include_incomplete` the latest committed one)."""
        return self._runner.run(self._aio.status(step, include_incomplete=include_incomplete))

    def wait_committed(self, step: int, timeout: float = 60.0) -> CheckpointInfo:
        """Wait until `step` is committed (raise `ConflictError` if it was aborted)."""
        return self._runner.run(self._aio.wait_committed(step, timeout))

    def latest(self, *, include_incomplete: bool = False) -> Manifest | None:
        """The manifest of the latest complete checkpoint (a shard of every rank of its world):
        from the service, else from storage. `include_incomplete`: the latest committed one,
        complete or not (only checkpoints committed before worlds were recorded can lack one)."""
        return self._runner.run(self._aio.latest(include_incomplete=include_incomplete))

    def latest_in_storage(self, *, include_incomplete: bool = False) -> Manifest | None:
        """The newest complete checkpoint's manifest in storage, read directly (no service)."""
        return self._runner.run(self._aio.latest_in_storage(include_incomplete=include_incomplete))

    def manifests(self, *, include_incomplete: bool = False) -> list[Manifest]:
        """Every complete checkpoint's manifest in storage (with `include_incomplete`, every
        committed one), newest first; no service needed."""
        return self._runner.run(self._aio.manifests(include_incomplete=include_incomplete))

    def load(self, step: int | None = None, rank: int | None = None) -> bytes:
        """The bytes `rank` (default: this worker's rank) saved in the latest complete checkpoint
        (or `step`'s committed one), checksum-verified.

        `NotFound`: no such checkpoint. `MissingShard`: the checkpoint has no shard of that rank.
        """
        return self._runner.run(self._aio.load(step, rank))

    def load_state(self, step: int | None = None, rank: int | None = None) -> Any:
        """`load()` read back with `torch.load` (weights only): tensors and plain containers,
        never code, whoever wrote the bytes."""
        return self._runner.run(self._aio.load_state(step, rank))

    def close(self) -> None:
        """Wait for pending saves, then release the storage client."""
        self._runner.run(self._aio.close())


async def _make_async(
    worker: AsyncWorker, path: str | None, storage: StorageBackend, options: CheckpointOptions
) -> AsyncCheckpointManager:
    # Built on the worker's loop: its asyncio primitives belong to that loop.
    return AsyncCheckpointManager(worker, path, storage=storage, options=options)
