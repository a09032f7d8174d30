"""`strata.DatasetRegistry`: datasets and shards for ordinary (non-asyncio) training loops.

A blocking face over `strata.aio.DatasetRegistry` (`strata/aio/_datasets.py`, where the
behaviour and the argument checks live): each call runs the async registry's coroutine on the
worker's background loop. The pure helpers on cursors and assignments (`merge_cursors`,
`checkpoint_cursor`, `remaining_ranges`) are importable from here too.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import TYPE_CHECKING, Unpack

from strata.aio import DatasetArgs, DatasetOptions
from strata.aio import DatasetRegistry as AsyncDatasetRegistry
from strata.aio._datasets import checkpoint_cursor, merge_cursors, remaining_ranges
from strata.events.models import DataCursor
from strata.events.requests import (
    DatasetInfo,
    Lease,
    Manifest,
    PlanSummary,
    ProgressResult,
    ShardAssignment,
)
from strata.worker import Worker, resolve_worker

if TYPE_CHECKING:
    # Imported where used: the planner needs numpy, which `import strata` should not load.
    from strata.sharding.plan import ShardRange

__all__ = [
    "DatasetArgs",
    "DatasetOptions",
    "DatasetRegistry",
    "checkpoint_cursor",
    "merge_cursors",
    "remaining_ranges",
]


class DatasetRegistry:
    """Datasets and shards of a job, for ordinary training loops (`strata.DatasetRegistry`).

    >>> reg = strata.DatasetRegistry(worker)                       # doctest: +SKIP
    >>> reg.register_dataset("imagenet-1k", 1281167, 10000, shuffle=True, seed=42)
    >>> reg.get_shard_for_worker("imagenet-1k", epoch=0)           # what is left to read
    [ShardRange(shard_id=87, start=870000, end=880000), ...]

    Each call runs the coroutine of `strata.aio.DatasetRegistry` on the worker's background loop.
    Without a worker (`strata.DatasetRegistry()`) it uses the process's implicit worker
    (`strata.default_worker()`), built from the environment.
    """

    def __init__(
        self,
        worker: Worker | None = None,
        *,
        options: DatasetOptions | None = None,
        **overrides: Unpack[DatasetArgs],
    ) -> None:
        options = replace(options or DatasetOptions(), **overrides)
        worker = resolve_worker(worker, "DatasetRegistry")
        self._worker = worker
        self._aio = AsyncDatasetRegistry(worker.aio, options=options)

    def __repr__(self) -> str:
        return f"<strata.DatasetRegistry job={self._worker.job} worker={self._worker.id}>"

    @property
    def aio(self) -> AsyncDatasetRegistry:
        """The `strata.aio.DatasetRegistry` this one drives on the worker's loop."""
        return self._aio

    @property
    def worker(self) -> Worker:
        """The worker whose job and identity the calls use."""
        return self._worker

    @property
    def options(self) -> DatasetOptions:
        """The options this registry was made with."""
        return self._aio.options

    @property
    def worker_id(self) -> str:
        """The id of that worker."""
        return self._worker.id

    def register_dataset(
        self,
        dataset_id: str,
        total_samples: int,
        shard_size: int,
        shuffle: bool = True,
        seed: int = 0,
    ) -> DatasetInfo:
        """Register a dataset's sharding; registering it again with the same parameters is a no-op.

        Shard `s` covers samples `[s * shard_size, min((s + 1) * shard_size, total_samples))`.
        Raises `strata.ConflictError` when the dataset exists with other parameters.
        """
        return self._worker.runner.run(
            self._aio.register_dataset(dataset_id, total_samples, shard_size, shuffle, seed)
        )

    def assignment(
        self,
        dataset_id: str,
        worker_id: str | None = None,
        epoch: int = 0,
        *,
        lease: Lease | None = None,
    ) -> ShardAssignment:
        """Every shard of a worker (default: this one) for an epoch, in reading order, with each
        shard's `done` flag and consumed `offset`.

        The first request of an epoch plans it over the live workers. Raises `strata.NotFound`
        for a dataset never registered, or a worker that is not a live member of the job, and
        `strata.StaleLease` when `lease` (default: this worker's current one) has ended. The
        service answers at most `SHARDS_PER_REPLY` shards at a time; more are read page by page
        (all from the same plan version) and returned as one assignment.
        """
        return self._worker.runner.run(
            self._aio.assignment(dataset_id, worker_id, epoch, lease=lease)
        )

    def get_shard_for_worker(
        self, dataset_id: str, worker_id: str | None = None, epoch: int = 0
    ) -> list[ShardRange]:
        """What a worker (default: this one) has left to read of an epoch, in reading order.

        Done shards are left out and a partly read shard starts after its recorded offset; use
        `assignment()` for every shard with its state.
        """
        return self._worker.runner.run(self._aio.get_shard_for_worker(dataset_id, worker_id, epoch))

    def report_progress(
        self,
        dataset_id: str,
        epoch: int,
        completed: Iterable[int] = (),
        partial: Mapping[int, int] | None = None,
        *,
        lease: Lease | None = None,
    ) -> ProgressResult:
        """Record this worker's progress: shards read to the end, and samples read of others.

        A done shard never moves to another worker again; a partial offset (samples consumed from
        the shard's start, in reading order) lets whoever reads the rest start there. Raises
        `strata.ConflictError` when a named shard is no longer this worker's (the plan changed:
        fetch the assignment again, or another worker already finished it); nothing of such a
        report is recorded. Progress is reported under `lease` (default: the current one); pass
        the lease the samples were read under, so that nothing read under an ended lease counts
        (`strata.StaleLease`).
        """
        return self._worker.runner.run(
            self._aio.report_progress(dataset_id, epoch, completed, partial, lease=lease)
        )

    def restore_progress(
        self,
        dataset_id: str,
        epoch: int,
        checkpoint_step: int,
        completed: Iterable[int] = (),
        partial: Mapping[int, int] | None = None,
    ) -> ProgressResult:
        """Reset an epoch's progress to the cursors of the committed checkpoint a job restarts
        from (the union of every rank's cursor); later epochs start afresh.

        Idempotent, so every worker of the restarting job may call it; call it before any worker
        reads again, e.g. before a barrier they all pass afterwards. A restart from the same
        checkpoint as the last one (a failure before the next commit) resets again.
        """
        return self._worker.runner.run(
            self._aio.restore_progress(dataset_id, epoch, checkpoint_step, completed, partial)
        )

    def restore_from(self, manifest: Manifest | None, dataset_id: str) -> DataCursor:
        """Reset `dataset_id`'s progress to the checkpoint a job restarts from, and return the
        cursor restored (`checkpoint_cursor`): every rank's cursor of the checkpoint's epoch
        merged. With no checkpoint (None) the data starts over from epoch 0.

        Every rank of the restarting job calls it with the same checkpoint, before any of them
        reads again (then a barrier). Carry the returned cursor into the next checkpoint
        (`ShardSampler.cursor(carried)`): a fresh sampler knows only what it reads itself.
        """
        return self._worker.runner.run(self._aio.restore_from(manifest, dataset_id))

    def plan(self, dataset_id: str, epoch: int = 0) -> PlanSummary:
        """The epoch's plan as a whole: version, shards per worker, shards done of all."""
        return self._worker.runner.run(self._aio.plan(dataset_id, epoch))

    def plan_version_seen(self, dataset_id: str, epoch: int) -> int | None:
        """The newest plan version of (dataset, epoch) this registry has heard of, if any.

        Plan changes are followed from the time of the first `assignment()` call; one published
        while the connection was down is missed, so a newer version here means "fetch again",
        never the converse. Safe to call from any thread.
        """
        return self._aio.plan_version_seen(dataset_id, epoch)

    @property
    def lease(self) -> Lease:
        """The worker's current lease (its registration); see `strata.Worker.lease`."""
        return self._worker.aio.lease

    @property
    def lease_expired(self) -> bool:
        """Whether the worker's lease may have ended: read no more data under it."""
        return self._worker.aio.lease_expired

    @property
    def lease_in_doubt(self) -> bool:
        """A heartbeat was confirmed after a gap: an `assignment()` call settles it."""
        return self._worker.aio.lease_in_doubt

    @property
    def superseded(self) -> bool:
        """Another process holds the worker id now: no lease will come back."""
        return self._worker.aio.superseded

    def close(self) -> None:
        """Stop following plan changes (the worker's `stop()` ends it too)."""
        if self._worker.runner.running:
            self._worker.runner.run(self._aio.close())
