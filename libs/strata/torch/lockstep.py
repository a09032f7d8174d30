"""`Lockstep`: a rank's batches of an epoch, stepped in lockstep with every other rank.

DDP needs every rank in every all-reduce, but after a re-plan (a failed worker's shards move to the
survivors) ranks hold different numbers of batches. `Lockstep` is an `IterableDataset` of `Step`s:
while any rank has a batch, every rank yields one step, a rank with none left an empty batch (zero
samples: its gradient is zero), each step carrying the number of samples all ranks train in it
(`global_samples`), so a loss summed over the batch and divided by it averages over the whole step.
The epoch ends on every rank at the same step, when no rank has a batch left and the sharding
service says every shard is done or in a rank's hands.

A step counts as trained when the loop says so (`trained(step)`, in order): a framework that
fetches ahead (Lightning draws the next batch before it trains the current one) holds steps that
are not acknowledged yet, and `Lockstep` never hands them out again nor waits on them. What was
not acknowledged when a process died is read again after the restart, from the checkpoint's
cursor (`cursor()`), so each sample trains exactly once per epoch.

Collectives run on CPU tensors in `group` (the default process group unless given), so the
group must be a gloo one; without torch.distributed initialised, the world is this rank alone.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Final, NamedTuple

import torch
import torch.distributed as dist
from torch.utils.data import BatchSampler, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from strata._checks import check_int
from strata.errors import ConfigError, ValidationError
from strata.events.models import DataCursor
from strata.events.requests import ProgressResult
from strata.torch.sampler import ShardSampler, ShardSource
from strata.torch.wrapping import check_consumer

__all__ = ["Lockstep", "Step"]

WAIT_S: Final = 0.2
"""How long a rank waits before asking again while shards of a failed worker have not moved yet."""


class Step(NamedTuple):
    """One training step of this rank: `batch` (collated; empty when this rank has no sample in
    the step), `samples` of this rank, `global_samples` samples of every rank together."""

    batch: Any
    samples: int
    global_samples: int

    @property
    def scale(self) -> float:
        """`world size / global_samples`: multiply a loss summed over this rank's batch by it and
        DDP's gradient average becomes the mean over every sample the step trained."""
        return _world() / max(self.global_samples, 1)


def _world(group: Any = None) -> int:
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size(group))
    return 1


class Lockstep(IterableDataset[Step]):
    """This rank's samples of `dataset` as `Step`s in lockstep with every rank (see the module).

    `Lockstep(registry, "points", data, batch_size=16)` reads through a `ShardSampler` of its own
    (`manual_ack=True`: only what `trained()` acknowledged counts). Iterate it directly, or put it
    in `DataLoader(lockstep, batch_size=None)` (in the main process: `num_workers=0`).
    `set_epoch(n)` starts another epoch; `flush()` and `cursor(carried)` are the sampler's, for
    checkpoints. Progress reaches the service at each `flush()` (call it at every checkpoint)
    and when no rank has a batch left; `report_every=N` reports every N shards besides (a round
    trip each: under DDP a failed rank stops every rank, which resume from the checkpoint's
    cursors, so reports between checkpoints only show progress sooner).
    """

    def __init__(
        self,
        registry: ShardSource,
        dataset_id: str,
        data: Sequence[Any],
        *,
        batch_size: int,
        epoch: int = 0,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        empty: Any = None,
        shuffle_within_shard: bool = False,
        seed: int = 0,
        report_every: int = 0,
        group: Any = None,
    ) -> None:
        super().__init__()
        self._registry = registry
        self._dataset_id = dataset_id
        self._data = data
        self._batch_size = check_int("batch_size", batch_size, 1, 1 << 30)
        self._collate = collate_fn
        self._empty = empty
        self._group = group
        self.sampler = ShardSampler(
            registry,
            dataset_id,
            epoch,
            manual_ack=True,
            shuffle_within_shard=shuffle_within_shard,
            seed=seed,
            report_every=report_every,
        )
        self._held = 0
        """Samples handed out in steps not yet acknowledged."""

    @property
    def epoch(self) -> int:
        return self.sampler.epoch

    def set_epoch(self, epoch: int) -> None:
        """Read epoch `epoch` next (a no-op for the current one)."""
        if epoch != self.sampler.epoch:
            self.sampler.set_epoch(epoch)
            self._held = 0

    def trained(self, step: Step | int) -> None:
        """The loop is done with the oldest step not yet acknowledged (or this many samples)."""
        count = step.samples if isinstance(step, Step) else step
        if count:
            self.sampler.ack(count)
            self._held -= count

    def flush(self) -> ProgressResult | None:
        return self.sampler.flush()

    def cursor(self, carried: DataCursor | None = None) -> DataCursor:
        return self.sampler.cursor(carried)

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.sampler.load_state_dict(state)
        self._held = 0

    # -- iteration --------------------------------------------------------------------------------

    def _empty_batch(self) -> Any:
        if self._empty is None:
            if not len(self._data):
                raise ValidationError("an empty dataset has no sample to shape an empty batch on")
            # A batch of one sample, sliced to none: tensors keep their trailing shape.
            self._empty = _slice_empty(self._collate([self._data[0]]))
        return self._empty

    def _reduce(self, *values: int) -> list[int]:
        tensor = torch.tensor(values, dtype=torch.int64)
        if _world(self._group) > 1:
            dist.all_reduce(tensor, group=self._group)
        return [int(v) for v in tensor.tolist()]

    def _all(self, flag: bool) -> bool:
        tensor = torch.tensor([int(flag)], dtype=torch.int64)
        if _world(self._group) > 1:
            dist.all_reduce(tensor, op=dist.ReduceOp.MIN, group=self._group)
        return bool(tensor.item())

    def __iter__(self) -> Iterator[Step]:
        check_consumer("Lockstep")
        if get_worker_info() is not None:
            raise ConfigError(
                "Lockstep runs in the training process: use DataLoader(lockstep, batch_size=None, "
                "num_workers=0) (a copy in a loader worker would read and report on its own)"
            )
        epoch = self.sampler.epoch
        world = _world(self._group)
        batches: Iterator[list[int]] | None
        batches, budget = self._pass()
        while True:
            if budget and batches is not None:
                # Every rank has at least `budget` full batches left: no collective needed.
                budget -= 1
                indices = next(batches, None)
                count = len(indices) if indices is not None else 0
                self._held += count
                yield Step(self._batch(indices), count, world * self._batch_size)
                if self.sampler.epoch != epoch:
                    return
                continue
            indices = next(batches, None) if batches is not None else None
            if indices is None:
                batches = None
            count = len(indices) if indices is not None else 0
            total, held = self._reduce(count, self._held + count)
            if total:
                self._held += count
                yield Step(self._batch(indices), count, total)
                if self.sampler.epoch != epoch:
                    return
                continue
            # No rank has a batch. Shards a rank holds (handed out, not yet acknowledged) are
            # as good as done: the framework trains them after this. Anything else still open
            # belongs to a worker whose failure has not been planned around yet.
            # What this rank finished is reported first, and every rank has reported (the
            # reduce) before any asks the service.
            self.sampler.flush()
            held_shards = self._reduce(len(self.sampler.held_shards))[0]
            summary = self._registry.plan(self._dataset_id, epoch)
            if self._all(summary.done_shards + held_shards >= summary.total_shards):
                return
            time.sleep(WAIT_S)
            if held:
                # Let the framework train (and acknowledge) what it fetched ahead.
                yield Step(self._empty_batch(), 0, 0)
            elif self._held == 0:
                batches, budget = self._pass()

    def _pass(self) -> tuple[Iterator[list[int]], int]:
        """A pass over the sampler, and how many steps every rank can surely take in it: the
        fewest full batches any rank has left (one collective per pass, not one per step). A
        shard moved away meanwhile (a joiner) leaves a rank short: it trains empty batches for
        the rest of the budget, and the steps' `global_samples` overstate the samples."""
        own = len(self.sampler) // self._batch_size if self._held == 0 else 0
        budget = torch.tensor([own], dtype=torch.int64)
        if _world(self._group) > 1:
            dist.all_reduce(budget, op=dist.ReduceOp.MIN, group=self._group)
        batches = iter(BatchSampler(self.sampler, self._batch_size, drop_last=False))
        return batches, int(budget.item())

    def _batch(self, indices: list[int] | None) -> Any:
        return self._collate([self._data[i] for i in indices]) if indices else self._empty_batch()


def _slice_empty(batch: Any) -> Any:
    if isinstance(batch, torch.Tensor):
        return batch[:0]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):
        return type(batch)(*(_slice_empty(b) for b in batch))
    if isinstance(batch, list | tuple):
        return type(batch)(_slice_empty(b) for b in batch)
    if isinstance(batch, dict):
        return {k: _slice_empty(v) for k, v in batch.items()}
    return batch
