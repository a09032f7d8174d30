"""The worker side of sharding: register a dataset, ask for this worker's shards, report progress.

`DatasetRegistry` here is `strata.aio.DatasetRegistry`: it talks to the sharding service over the
worker's bus; `strata.DatasetRegistry` (`strata.datasets`) is its blocking face for ordinary
training loops, and both take their options as one `DatasetOptions`. Arguments are checked here,
before any network call, with errors that say what to change.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final, TypedDict, TypeVar, Unpack

import pydantic
import structlog
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from strata._checks import check_id, check_int
from strata.aio.worker import Worker
from strata.errors import ConflictError, StrataError, ValidationError
from strata.events import ShardPlanChanged, decode_event, subjects
from strata.events.models import (
    MAX_EPOCH,
    MAX_PROGRESS_ITEMS,
    MAX_SHARDS,
    MAX_TOTAL_SAMPLES,
    DataCursor,
    ShardOffset,
)
from strata.events.requests import (
    DatasetInfo,
    GetShardsRequest,
    Lease,
    Manifest,
    PlanRequest,
    PlanSummary,
    ProgressResult,
    RegisterDatasetRequest,
    ReportProgressRequest,
    RestoreProgressRequest,
    ShardAssignment,
)

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

SERVICE: Final = "sharding"
RPC_TIMEOUT_S: Final = 5.0
RETRY_FOR_S: Final = 30.0
PAGED_READ_ATTEMPTS: Final = 5
"""Times a paged read of a worker's shards starts again when the plan changed under it."""
"""How long a call keeps retrying while no sharding service answers: long enough for a restart."""
MAX_SEED: Final = 2**63 - 1
_R = TypeVar("_R", bound=pydantic.BaseModel)

log = structlog.get_logger("strata.datasets")


# -- argument checks ------------------------------------------------------------------------------


def _check_epoch(epoch: object) -> int:
    return check_int("epoch", epoch, 0, MAX_EPOCH)


def _check_progress(
    completed: Iterable[int], partial: Mapping[int, int] | None
) -> tuple[list[int], list[ShardOffset]]:
    if isinstance(completed, str | bytes):
        raise ValidationError("completed must be shard ids, not a string", field="completed")
    done = list(dict.fromkeys(check_int("completed", s, 0, MAX_SHARDS - 1) for s in completed))
    offsets = []
    for shard, offset in (partial or {}).items():
        shard_id = check_int("partial shard id", shard, 0, MAX_SHARDS - 1)
        if shard_id in done:
            continue  # completed says more than any offset
        offsets.append(
            ShardOffset(
                shard_id=shard_id,
                offset=check_int("partial offset", offset, 0, MAX_TOTAL_SAMPLES),
            )
        )
    return done, offsets


def merge_cursors(dataset_id: str, epoch: int, cursors: Iterable[DataCursor]) -> DataCursor:
    """One cursor for what several say was consumed of `dataset_id` in `epoch` (others ignored).

    A shard any of them completed is completed; otherwise the furthest offset into it counts.
    Offsets are absolute within a shard, so whichever rank read a shard last knows the most.
    """
    completed: set[int] = set()
    offsets: dict[int, int] = {}
    for cursor in cursors:
        if cursor.dataset_id != dataset_id or cursor.epoch != epoch:
            continue
        completed.update(cursor.completed)
        for item in cursor.partial:
            offsets[item.shard_id] = max(offsets.get(item.shard_id, 0), item.offset)
    return DataCursor(
        dataset_id=dataset_id,
        epoch=epoch,
        completed=sorted(completed),
        partial=[
            ShardOffset(shard_id=s, offset=o)
            for s, o in sorted(offsets.items())
            if s not in completed and o > 0
        ],
    )


def checkpoint_cursor(manifest: Manifest | None, dataset_id: str) -> DataCursor:
    """What the job had consumed of `dataset_id` when `manifest`'s checkpoint was taken: every
    rank's cursor of the checkpoint's epoch, merged (nothing of epoch 0 without a checkpoint).

    Every rank's, not only the caller's: after a restart with fewer or other ranks, the shards a
    departed rank had read are still read, and a rank's cursor alone would make them read again.
    """
    if manifest is None:
        return DataCursor(dataset_id=dataset_id, epoch=0)
    cursors = (cursor for shard in manifest.shards for cursor in shard.cursors)
    return merge_cursors(dataset_id, manifest.epoch, cursors)


def remaining_ranges(assignment: ShardAssignment) -> list[ShardRange]:
    """What is left to read of an assignment, in reading order.

    Done shards are left out, and a shard with a recorded offset starts that many samples later:
    right for readers that read each shard in its natural order (`ShardSampler` without
    `shuffle_within_shard`), whose offsets count samples from the shard's start.
    """
    # Imported here: the planner needs numpy, which `import strata` should not load.
    from strata.sharding.plan import ShardRange

    return [
        ShardRange(span.shard_id, span.start + span.offset, span.end)
        for span in assignment.shards
        if not span.done and span.start + span.offset < span.end
    ]


# -- asyncio --------------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class DatasetOptions:
    """How a dataset registry asks the sharding service, checked when made: what
    `strata.DatasetRegistry` and `strata.aio.DatasetRegistry` take, as `options=` or as keyword
    arguments (`retry_for=120`), which replace the fields they name."""

    timeout: float = RPC_TIMEOUT_S
    """Seconds one attempt of a call waits for its answer."""
    retry_for: float = RETRY_FOR_S
    """Seconds a call keeps trying while no sharding service answers (a restart)."""

    def __post_init__(self) -> None:
        if not 0 < self.timeout <= 3600 or not 0 <= self.retry_for <= 86_400:
            raise ValidationError(
                f"timeout must be in (0, 3600] s and retry_for in [0, 86400] s, "
                f"got {self.timeout!r} and {self.retry_for!r}"
            )


class DatasetArgs(TypedDict, total=False):
    """`DatasetOptions`' fields as keyword arguments of the constructors."""

    timeout: float
    retry_for: float


class DatasetRegistry:
    """Datasets and shards of a job, for asyncio code (`strata.aio.DatasetRegistry`).

    Every call retries for `retry_for` seconds while no sharding service answers (a restart) and
    after a timed-out attempt, which is safe: registering the same dataset again, asking for shards
    and reporting the same progress again all change nothing.
    """

    def __init__(
        self,
        worker: Worker,
        *,
        options: DatasetOptions | None = None,
        **overrides: Unpack[DatasetArgs],
    ) -> None:
        options = replace(options or DatasetOptions(), **overrides)
        self._options = options
        self._worker = worker
        self._timeout = options.timeout
        self._retry_for = options.retry_for
        self._plan_versions: dict[tuple[str, int], int] = {}
        self._watch: tuple[NATS, Subscription] | None = None
        self._watch_lock: tuple[asyncio.AbstractEventLoop, asyncio.Lock] | None = None

    def __repr__(self) -> str:
        return f"<strata.aio.DatasetRegistry job={self._worker.job} worker={self._worker.id}>"

    @property
    def worker(self) -> Worker:
        """The worker whose job and identity the calls use."""
        return self._worker

    @property
    def options(self) -> DatasetOptions:
        """The options this registry was made with."""
        return self._options

    async def register_dataset(
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
        check_id("dataset_id", dataset_id)
        total = check_int("total_samples", total_samples, 1, MAX_TOTAL_SAMPLES)
        size = check_int("shard_size", shard_size, 1, MAX_TOTAL_SAMPLES)
        if not isinstance(shuffle, bool):
            raise ValidationError(
                f"shuffle must be True or False, got {shuffle!r}", field="shuffle"
            )
        seed = check_int("seed", seed, 0, MAX_SEED)
        if -(-total // size) > MAX_SHARDS:
            smallest = -(-total // MAX_SHARDS)
            raise ValidationError(
                f"{total} samples in shards of {size} make {-(-total // size)} shards; "
                f"at most {MAX_SHARDS} are allowed: use shard_size >= {smallest}",
                field="shard_size",
            )
        request = RegisterDatasetRequest(
            job=self._worker.job,
            dataset_id=dataset_id,
            total_samples=total,
            shard_size=size,
            shuffle=shuffle,
            seed=seed,
        )
        return await self._call("register_dataset", request, DatasetInfo)

    async def assignment(
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
        check_id("dataset_id", dataset_id)
        worker = self._worker.id if worker_id is None else check_id("worker_id", worker_id)
        epoch = _check_epoch(epoch)
        # Watching before asking: no plan change can fall between the answer and the watch.
        await self._ensure_watch()
        lease = lease if lease is not None else self._worker.lease
        request = GetShardsRequest(
            job=self._worker.job, dataset_id=dataset_id, worker_id=worker, epoch=epoch, lease=lease
        )
        asked_at = time.monotonic()
        for _ in range(PAGED_READ_ATTEMPTS):
            first = await self._call("get_shards", request, ShardAssignment)
            # The sharding service checked the lease against the membership it had caught up with.
            self._worker._lease_verified(lease, asked_at)
            self._saw_version(dataset_id, epoch, first.plan_version)
            shards, page = list(first.shards), first
            while page.next_offset is not None:
                following = request.model_copy(update={"offset": page.next_offset})
                page = await self._call("get_shards", following, ShardAssignment)
                self._saw_version(dataset_id, epoch, page.plan_version)
                if page.plan_version != first.plan_version:
                    break  # re-planned between two pages: read the new plan from its start
                shards.extend(page.shards)
            else:
                return first.model_copy(update={"shards": shards, "next_offset": None})
        raise ConflictError(
            f"the plan of epoch {epoch} of {dataset_id!r} changed while its {first.total_shards} "
            f"shards were read in pages, {PAGED_READ_ATTEMPTS} times in a row; ask again once "
            "the job's membership has settled"
        )

    async def get_shard_for_worker(
        self, dataset_id: str, worker_id: str | None = None, epoch: int = 0
    ) -> list[ShardRange]:
        """What a worker (default: this one) has left to read of an epoch, in reading order.

        Done shards are left out and a partly read shard starts after its recorded offset; use
        `assignment()` for every shard with its state.
        """
        return remaining_ranges(await self.assignment(dataset_id, worker_id, epoch))

    async def report_progress(
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
        check_id("dataset_id", dataset_id)
        epoch = _check_epoch(epoch)
        done, offsets = _check_progress(completed, partial)
        lease = lease if lease is not None else self._worker.lease
        result: ProgressResult | None = None
        # Large reports go in pieces the service accepts; each piece is recorded on its own.
        for start in range(0, max(len(done), len(offsets), 1), MAX_PROGRESS_ITEMS):
            request = ReportProgressRequest(
                job=self._worker.job,
                dataset_id=dataset_id,
                epoch=epoch,
                worker_id=self._worker.id,
                completed=done[start : start + MAX_PROGRESS_ITEMS],
                partial=offsets[start : start + MAX_PROGRESS_ITEMS],
                lease=lease,
            )
            result = await self._call("report_progress", request, ProgressResult)
        assert result is not None
        return result

    async def restore_progress(
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
        check_id("dataset_id", dataset_id)
        epoch = _check_epoch(epoch)
        done, offsets = _check_progress(completed, partial)
        request = RestoreProgressRequest(
            job=self._worker.job,
            dataset_id=dataset_id,
            epoch=epoch,
            worker_id=self._worker.id,
            checkpoint_step=check_int("checkpoint_step", checkpoint_step, 0, 2**62),
            completed=done,
            partial=offsets,
            lease=self._worker.lease,
        )
        return await self._call("restore_progress", request, ProgressResult)

    async def restore_from(self, manifest: Manifest | None, dataset_id: str) -> DataCursor:
        """Reset `dataset_id`'s progress to the checkpoint a job restarts from, and return the
        cursor restored (`checkpoint_cursor`): every rank's cursor of the checkpoint's epoch
        merged. With no checkpoint (None) the data starts over from epoch 0.

        Every rank of the restarting job calls it with the same checkpoint, before any of them
        reads again (then a barrier). Carry the returned cursor into the next checkpoint
        (`ShardSampler.cursor(carried)`): a fresh sampler knows only what it reads itself.
        """
        cursor = checkpoint_cursor(manifest, dataset_id)
        await self.restore_progress(
            dataset_id,
            cursor.epoch,
            manifest.step if manifest is not None else 0,
            cursor.completed,
            {item.shard_id: item.offset for item in cursor.partial},
        )
        return cursor

    async def plan(self, dataset_id: str, epoch: int = 0) -> PlanSummary:
        """The epoch's plan as a whole: version, shards per worker, shards done of all."""
        check_id("dataset_id", dataset_id)
        request = PlanRequest(
            job=self._worker.job, dataset_id=dataset_id, epoch=_check_epoch(epoch)
        )
        return await self._call("plan", request, PlanSummary)

    def plan_version_seen(self, dataset_id: str, epoch: int) -> int | None:
        """The newest plan version of (dataset, epoch) this registry has heard of, if any.

        Plan changes are followed from the time of the first `assignment()` call; one published
        while the connection was down is missed, so a newer version here means "fetch again",
        never the converse. Safe to call from any thread.
        """
        return self._plan_versions.get((dataset_id, epoch))

    async def close(self) -> None:
        """Stop following plan changes (the worker's `stop()` ends it too)."""
        watch, self._watch = self._watch, None
        if watch is not None:
            with contextlib.suppress(Exception):
                await watch[1].unsubscribe()

    # -- internals --------------------------------------------------------------------------------

    async def _call(self, verb: str, request: pydantic.BaseModel, result: type[_R]) -> _R:
        return await self._worker.bus.rpc.call(
            SERVICE,
            verb,
            request,
            result=result,
            timeout=self._timeout,
            retry_for=self._retry_for,
            idempotent=True,
        )

    def _saw_version(self, dataset_id: str, epoch: int, version: int) -> None:
        key = (dataset_id, epoch)
        if version > self._plan_versions.get(key, -1):
            self._plan_versions[key] = version

    def _lock(self) -> asyncio.Lock:
        # The sync registry may run this object on a new loop after its worker restarted.
        loop = asyncio.get_running_loop()
        if self._watch_lock is None or self._watch_lock[0] is not loop:
            self._watch_lock = (loop, asyncio.Lock())
        return self._watch_lock[1]

    async def _ensure_watch(self) -> None:
        nc = self._worker.bus.nc
        if self._watch is not None and self._watch[0] is nc:
            return
        async with self._lock():
            if self._watch is not None and self._watch[0] is nc:
                return
            subject = subjects.event_subject(self._worker.job, "shard.plan_changed")
            self._watch = (nc, await nc.subscribe(subject, cb=self._on_plan_changed))

    async def _on_plan_changed(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except StrataError:
            return
        if isinstance(event, ShardPlanChanged):
            self._saw_version(event.dataset_id, event.epoch, event.plan_version)
