"""Shard plans: which worker reads which shards of a dataset in an epoch, balanced and elastic.

The shard order of an epoch comes from a numpy generator seeded with (seed, epoch), the same in
every process and after every restart. The first plan of an epoch deals that order round-robin over
the members (sorted by id), so loads differ by at most one shard. When membership changes, `replan`
moves only unfinished shards, and as few as balance allows: a leaver's unfinished shards go to the
least-loaded survivors, a joiner takes the surplus of the most-loaded. A moved shard is read after
the shards its new reader already had, so the shard a worker is reading stays its first. A plan is
a function of the epoch's first members and its sequence of changes, all of which are events, so a
replay rebuilds it exactly.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import numpy.typing as npt

from strata.errors import ValidationError

UNASSIGNED = -1
IndexArray = npt.NDArray[np.int64]


class ShardRange(NamedTuple):
    """Samples `[start, end)` of shard `shard_id`."""

    shard_id: int
    start: int
    end: int

    def __len__(self) -> int:
        return self.end - self.start


@dataclass(frozen=True)
class DatasetSpec:
    dataset_id: str
    total_samples: int
    shard_size: int
    shuffle: bool
    seed: int

    @property
    def num_shards(self) -> int:
        return math.ceil(self.total_samples / self.shard_size)

    def shard_range(self, shard_id: int) -> ShardRange:
        if not 0 <= shard_id < self.num_shards:
            raise ValidationError(
                f"shard {shard_id} does not exist in {self.dataset_id!r} "
                f"(it has {self.num_shards} shards)",
                field="shard_id",
            )
        start = shard_id * self.shard_size
        return ShardRange(shard_id, start, min(start + self.shard_size, self.total_samples))

    def same_as(self, other: DatasetSpec) -> bool:
        return self == other


def shard_order(spec: DatasetSpec, epoch: int) -> IndexArray:
    """The epoch's shard order: a permutation seeded by (seed, epoch), or the natural order."""
    if not spec.shuffle:
        return np.arange(spec.num_shards, dtype=np.int64)
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([spec.seed, epoch])))
    return rng.permutation(spec.num_shards).astype(np.int64)


@dataclass
class Plan:
    """The assignment of one dataset's shards for one epoch.

    `owner[s]` is the index into `members` of the worker that reads shard `s`; `position[s]` is the
    shard's place in the reading order, and each worker reads its shards in that order. It starts
    as the epoch order; `replan` puts the shards it moves after all others (keeping their order),
    so a worker never finds a shard it is given ahead of the one it is reading.
    """

    dataset: DatasetSpec
    epoch: int
    members: list[str]
    owner: IndexArray
    position: IndexArray
    version: int = 0
    done: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=np.bool_))
    # Each worker's shards in reading order, made on first use: a worker with many shards reads
    # them in pages, and sorting a million shards again for each page would block its service
    # for tens of milliseconds each time. Owners and positions never change in place.
    _orders: dict[str, IndexArray] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    def __post_init__(self) -> None:
        if self.done.shape != self.owner.shape:
            self.done = np.zeros(self.owner.shape, dtype=np.bool_)

    def shards_of(self, worker_id: str) -> list[int]:
        """Every shard of `worker_id` in reading order (done ones included)."""
        return [int(s) for s in self.ordered_shards(worker_id)]

    def ordered_shards(self, worker_id: str) -> IndexArray:
        """`shards_of` as an array (do not change it): a page of it is sliced before any Python
        int is made."""
        ordered = self._orders.get(worker_id)
        if ordered is not None:
            return ordered
        try:
            index = self.members.index(worker_id)
        except ValueError:
            return np.empty(0, dtype=np.int64)
        mine = np.flatnonzero(self.owner == index)
        ordered = mine[np.argsort(self.position[mine], kind="stable")]
        self._orders[worker_id] = ordered
        return ordered

    def ranges_of(self, worker_id: str) -> list[ShardRange]:
        return [self.dataset.shard_range(s) for s in self.shards_of(worker_id)]

    def loads(self) -> dict[str, int]:
        counts = np.bincount(self.owner[self.owner >= 0], minlength=len(self.members))
        return {worker: int(counts[i]) for i, worker in enumerate(self.members)}

    def mark_done(self, shard_ids: Iterable[int]) -> None:
        ids = np.fromiter(shard_ids, dtype=np.int64)
        if ids.size and (ids.min() < 0 or ids.max() >= self.owner.size):
            raise ValidationError(
                f"progress names shards outside 0..{self.owner.size - 1}", field="completed"
            )
        self.done[ids] = True

    def assignment(self) -> dict[str, list[int]]:
        return {worker: self.shards_of(worker) for worker in self.members}

    def unowned(self) -> int:
        """Unfinished shards with no reader: done shards of a departed reader that a restore to
        an earlier checkpoint made unfinished again. `replan` gives them readers."""
        return int(np.count_nonzero(~self.done & (self.owner < 0)))

    def reset_progress(self, completed: Iterable[int]) -> None:
        """Make exactly `completed` the done shards (a restore to a checkpoint's cursors)."""
        self.done[:] = False
        self.mark_done(completed)


class PreparedPlans:
    """Plans computed ahead of the call that needs them, handed to that call.

    A service folds a plan event on its event loop, and planning a large dataset takes a good
    fraction of a second there; so it computes the plan first in a thread (the sharding service's
    planner, `strata.services.sharding.service`) and puts the result here, and the `initial_plan`
    or `replan` that the fold then calls takes it instead of computing it again, provided its
    inputs are exactly those the result was computed from (the same dataset, epoch and members;
    for a re-plan, the same plan object at the same version and progress). Anything else is
    computed as ever, so the result is the same function of the same inputs either way. An entry
    is taken once, and the few newest untaken are kept (`keep`), so a prediction that no call
    took costs a bounded amount of memory.
    """

    def __init__(self, keep: int = 4) -> None:
        self.keep = keep
        """Results kept of each kind: the oldest untaken one goes first."""
        self._initial: dict[tuple[DatasetSpec, int, tuple[str, ...]], Plan] = {}
        self._replans: dict[tuple[int, tuple[str, ...]], tuple[Plan, int, Any, Plan, int]] = {}
        self.taken = 0
        """Results handed to a call (for tests and metrics)."""

    def put_initial(
        self, spec: DatasetSpec, epoch: int, members: Sequence[str], plan: Plan
    ) -> None:
        self._initial[(spec, epoch, tuple(_check_members(members)))] = plan
        while len(self._initial) > self.keep:
            del self._initial[next(iter(self._initial))]

    def put_replan(
        self, plan: Plan, members: Sequence[str], result: tuple[Plan, int], made_from: Plan
    ) -> None:
        """`result` is `replan(made_from, members)`, where `made_from` is `plan` as it was
        (`frozen`): it is taken only while `plan` is still at that version and progress."""
        key = (id(plan), tuple(_check_members(members)))
        self._replans[key] = (plan, made_from.version, made_from.done, *result)
        while len(self._replans) > self.keep:
            del self._replans[next(iter(self._replans))]

    def take_initial(self, spec: DatasetSpec, epoch: int, members: list[str]) -> Plan | None:
        found = self._initial.pop((spec, epoch, tuple(members)), None)
        if found is not None:
            self.taken += 1
        return found

    def take_replan(self, plan: Plan, members: list[str]) -> tuple[Plan, int] | None:
        found = self._replans.pop((id(plan), tuple(members)), None)
        if found is None:
            return None
        source, version, done, result, moved = found
        if source is not plan or version != plan.version or not np.array_equal(done, plan.done):
            return None
        self.taken += 1
        return result, moved


def frozen(plan: Plan) -> Plan:
    """A copy of `plan` that a thread may plan from while `plan` changes: only its progress
    (`done`) and version change in place, so those are copied and the rest shared."""
    return Plan(
        plan.dataset,
        plan.epoch,
        list(plan.members),
        plan.owner,
        plan.position,
        version=plan.version,
        done=plan.done.copy(),
    )


PREPARED = PreparedPlans()
"""The plans computed ahead for this process's next fold (see `PreparedPlans`)."""


def _check_members(members: Sequence[str]) -> list[str]:
    ordered = sorted(set(members))
    if not ordered:
        raise ValidationError("a plan needs at least one live worker", field="members")
    return ordered


def initial_plan(spec: DatasetSpec, epoch: int, members: Sequence[str]) -> Plan:
    """The epoch's first plan: its shard order dealt round-robin over the members."""
    ordered = _check_members(members)
    prepared = PREPARED.take_initial(spec, epoch, ordered)
    if prepared is not None:
        return prepared
    order = shard_order(spec, epoch)
    position = np.empty_like(order)
    position[order] = np.arange(order.size, dtype=np.int64)
    owner = position % len(ordered)
    return Plan(spec, epoch, ordered, owner, position)


def replan(plan: Plan, members: Sequence[str]) -> tuple[Plan, int]:
    """The plan after a membership change, and how many unfinished shards changed reader.

    Done shards never move: their samples were consumed. The unfinished shards of departed
    members, and unfinished shards with no reader at all (`Plan.unowned`), go one by one to the
    least-loaded members; so after any replan every unfinished shard has a reader, even with the
    members unchanged. Joiners first take the last unfinished shards of the most-loaded members
    (never their first, which may be in progress), up to an even share. Shards of members that
    stay move only to feed a joiner, so a departure moves exactly the departed member's
    unfinished shards.

    Moved shards go to the back of the reading order. A worker reads its shards in that order and
    reports each before it starts the next, so the shard it is reading is its first unfinished one:
    the one a joiner never takes. Were an inherited shard placed ahead of it (by epoch order), the
    shard being read would no longer be first, and a later joiner could take it and read again the
    samples consumed of it and not yet reported. (A reader that reports seldom, as
    `strata.torch.live.LiveGroup` does, can lose the shard it is reading to a joiner: its next
    report is refused for it, and the group's votes say where the new reader starts.)
    """
    new_members = _check_members(members)
    if new_members == plan.members and not plan.unowned():
        return plan, 0
    prepared = PREPARED.take_replan(plan, new_members)
    if prepared is not None:
        return prepared
    new_index = {w: i for i, w in enumerate(new_members)}
    remap = np.array(
        [new_index.get(w, UNASSIGNED) for w in plan.members] + [UNASSIGNED], dtype=np.int64
    )
    # A done shard of a departed reader has owner -1, which maps through the trailing entry.
    carried = remap[plan.owner]
    owner = carried.copy()
    open_mask = ~plan.done
    n = len(new_members)

    # Everything below walks shards in reading order; inverting the permutation costs no sort.
    in_order = _reading_order(plan)
    open_in_order = open_mask[in_order]
    owner_in_order = owner[in_order]
    pool = in_order[open_in_order & (owner_in_order < 0)].tolist()
    held = in_order[open_in_order & (owner_in_order >= 0)]
    # Grouped by reader, each reader's shards still in reading order.
    held = held[np.argsort(_narrow(owner[held], n), kind="stable")]
    counts = np.bincount(owner[held], minlength=n)
    bounds = np.concatenate(([0], np.cumsum(counts)))
    loads = counts.tolist()

    old_members = set(plan.members)
    joiners = [i for i, w in enumerate(new_members) if w not in old_members]
    share = (sum(loads) + len(pool)) // n
    wanted = sum(max(0, share - loads[j]) for j in joiners) - len(pool)
    if wanted > 0:
        # Take from the top: the most-loaded member gives its last unfinished shard, repeatedly.
        # Nobody gives its first unfinished shard: it may be reading it right now.
        taken_from = [0] * n
        heap = [(-loads[i], new_members[i], i) for i in range(n) if loads[i] > 1]
        heapq.heapify(heap)
        for _ in range(wanted):
            if not heap:
                break
            _, name, i = heapq.heappop(heap)
            taken_from[i] += 1
            loads[i] -= 1
            if loads[i] > 1:
                heapq.heappush(heap, (-loads[i], name, i))
        for i, count in enumerate(taken_from):
            if count:
                pool.extend(held[bounds[i + 1] - count : bounds[i + 1]].tolist())
        pool.sort(key=plan.position.__getitem__)
    # Fill from the bottom, in reading order, so moved shards keep their order among themselves.
    heap = [(loads[i], new_members[i], i) for i in range(n)]
    heapq.heapify(heap)
    for shard in pool:
        load, name, i = heapq.heappop(heap)
        owner[shard] = i
        heapq.heappush(heap, (load + 1, name, i))
    moved = open_mask & ((owner != carried) | (carried < 0))
    changed = Plan(
        plan.dataset,
        plan.epoch,
        new_members,
        owner,
        _moved_to_back(in_order, moved[in_order], plan.position),
        version=plan.version + 1,
        done=plan.done.copy(),
    )
    return changed, int(np.count_nonzero(moved))


def _moved_to_back(
    in_order: IndexArray, moved_in_order: npt.NDArray[np.bool_], position: IndexArray
) -> IndexArray:
    """`position` with the moved shards after all others, each part in its old order."""
    if not moved_in_order.any():
        return position
    order = np.concatenate((in_order[~moved_in_order], in_order[moved_in_order]))
    moved_position = np.empty_like(order)
    moved_position[order] = np.arange(order.size, dtype=np.int64)
    return moved_position


def _reading_order(plan: Plan) -> IndexArray:
    """Shard ids in reading order: the inverse of the `position` permutation."""
    order = np.empty_like(plan.position)
    order[plan.position] = np.arange(plan.position.size, dtype=np.int64)
    return order


def _narrow(indices: IndexArray, bound: int) -> npt.NDArray[np.integer[Any]]:
    """`indices` (all below `bound`) as 16-bit integers when they fit: numpy radix-sorts those."""
    return indices.astype(np.int16) if bound <= np.iinfo(np.int16).max else indices
