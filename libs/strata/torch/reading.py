"""The pure parts of `ShardSampler`, tested without a service: the order of the samples within a
shard, the queue of shards still to read with where each starts, and the checks of a cursor
(`ShardSampler.state_dict()`) before it is loaded.
"""

from __future__ import annotations

from collections.abc import Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Final, NamedTuple

import numpy as np

from strata.errors import ValidationError
from strata.events.models import MAX_EPOCH, MAX_SHARDS, MAX_TOTAL_SAMPLES
from strata.events.requests import ShardAssignment

__all__ = [
    "CURSOR_VERSION",
    "Cursor",
    "Queued",
    "check_cursor",
    "reading_queue",
    "within_shard_order",
]

CURSOR_VERSION: Final = 1


def within_shard_order(
    start: int, end: int, *, shuffle: bool, seed: int, epoch: int, shard_id: int
) -> list[int]:
    """The sample indices of shard `[start, end)` in reading order.

    Shuffled, the order is a permutation seeded by (seed, epoch, shard_id): the same in every
    process, so an offset one worker reports means the same samples to the worker that reads on.
    """
    if not shuffle:
        return list(range(start, end))
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch, shard_id])))
    order: list[int] = (rng.permutation(end - start) + start).tolist()
    return order


class Queued(NamedTuple):
    """A shard to read: samples `[start, end)`, of which the first `offset` are consumed."""

    shard_id: int
    start: int
    end: int
    offset: int

    @property
    def left(self) -> int:
        return self.end - self.start - self.offset


def reading_queue(
    assignment: ShardAssignment,
    skip: AbstractSet[int],
    current: tuple[int, int] | None,
    floors: Mapping[int, int] | None = None,
) -> list[Queued]:
    """The shards of `assignment` still to read, in its order, each with where to start.

    Done shards and those in `skip` are left out. A shard starts after the larger of the
    service's recorded offset, this reader's own (`current`: shard id, samples consumed) and its
    floor in `floors` (samples of it known to be trained elsewhere, not yet recorded).
    """
    queue = []
    for span in assignment.shards:
        if span.done or span.shard_id in skip:
            continue
        offset = max(span.offset, (floors or {}).get(span.shard_id, 0))
        if current is not None and current[0] == span.shard_id:
            offset = max(offset, current[1])
        offset = min(offset, span.end - span.start)
        queue.append(Queued(span.shard_id, span.start, span.end, offset))
    return queue


@dataclass(frozen=True)
class Cursor:
    epoch: int
    completed: frozenset[int]
    current: tuple[int, int] | None


def check_cursor(
    state: Mapping[str, Any], *, dataset_id: str, shuffle_within_shard: bool, seed: int
) -> Cursor:
    """Validate a `ShardSampler.state_dict()` for a sampler with these settings."""

    def fail(message: str) -> ValidationError:
        return ValidationError(f"sampler cursor: {message}", field="cursor")

    if not isinstance(state, Mapping):
        raise fail(f"expected the dict state_dict() returned, got {type(state).__name__}")
    if state.get("version") != CURSOR_VERSION:
        raise fail(f"unknown version {state.get('version')!r}; this sampler reads {CURSOR_VERSION}")
    if state.get("dataset_id") != dataset_id:
        raise fail(f"it is for dataset {state.get('dataset_id')!r}, not {dataset_id!r}")
    # Offsets count samples in reading order, which these settings define.
    if state.get("shuffle_within_shard") != shuffle_within_shard or state.get("seed") != seed:
        raise fail(
            f"it was written with shuffle_within_shard={state.get('shuffle_within_shard')!r}, "
            f"seed={state.get('seed')!r}; this sampler has {shuffle_within_shard!r}, {seed!r}, "
            "and offsets mean other samples under other settings"
        )

    def integer(value: object, what: str, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= high:
            raise fail(f"{what} must be an integer in [0, {high}], got {value!r}")
        return value

    epoch = integer(state.get("epoch"), "epoch", MAX_EPOCH)
    completed = state.get("completed")
    if not isinstance(completed, list | tuple):
        raise fail(f"completed must be a list of shard ids, got {completed!r}")
    done = frozenset(integer(s, "a completed shard id", MAX_SHARDS - 1) for s in completed)
    current = state.get("current")
    if current is None:
        return Cursor(epoch, done, None)
    if not isinstance(current, list | tuple) or len(current) != 2:
        raise fail(f"current must be [shard_id, offset] or None, got {current!r}")
    shard = integer(current[0], "the current shard id", MAX_SHARDS - 1)
    offset = integer(current[1], "the current offset", MAX_TOTAL_SAMPLES)
    return Cursor(epoch, done, None if shard in done else (shard, offset))
