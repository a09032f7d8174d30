"""`ShardSampler` against the sharding service's own pure domain, run in memory.

`LocalShards` answers the sampler's calls with the domain functions the service runs, so these
tests cover the sampler's logic (reading order, reports, cursors, failures, joins, manual acks,
DataLoader workers) without NATS; the real service is in tests/integration/test_sharding.py.
"""

from __future__ import annotations

import itertools
import os
from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strata.errors import ConflictError, StaleLease, StrataError, ValidationError
from strata.events.requests import (
    ProgressResult,
    RestoreProgressRequest,
    ShardAssignment,
    ShardSpan,
)
from strata.services.sharding import domain
from strata.torch import ShardSampler, within_shard_order
from strata.torch.sampler import check_cursor, reading_queue
from torch.utils.data import DataLoader, Dataset

from tests.unit.sharding.local_shards import DS, JOB, LocalShards, done_by

# -- pure parts -----------------------------------------------------------------------------------


def test_within_shard_order_is_a_pinned_permutation_seeded_by_seed_epoch_and_shard() -> None:
    order = within_shard_order(100, 110, shuffle=True, seed=3, epoch=1, shard_id=10)
    # Pinned: offsets in cursors and reports count samples in this order.
    assert order == [109, 105, 100, 103, 108, 104, 106, 101, 102, 107]
    again = within_shard_order(100, 110, shuffle=True, seed=3, epoch=1, shard_id=10)
    assert again == order
    others = [
        within_shard_order(100, 110, shuffle=True, seed=4, epoch=1, shard_id=10),
        within_shard_order(100, 110, shuffle=True, seed=3, epoch=2, shard_id=10),
        within_shard_order(100, 110, shuffle=True, seed=3, epoch=1, shard_id=11),
    ]
    assert all(sorted(o) == list(range(100, 110)) and o != order for o in others)
    assert within_shard_order(5, 9, shuffle=False, seed=3, epoch=1, shard_id=0) == [5, 6, 7, 8]


@given(
    start=st.integers(0, 10**9),
    size=st.integers(0, 300),
    seed=st.integers(0, 2**63 - 1),
    epoch=st.integers(0, 2**31 - 1),
    shard=st.integers(0, 999_999),
)
def test_within_shard_order_covers_the_shard_exactly_once(
    start: int, size: int, seed: int, epoch: int, shard: int
) -> None:
    order = within_shard_order(
        start, start + size, shuffle=True, seed=seed, epoch=epoch, shard_id=shard
    )
    assert sorted(order) == list(range(start, start + size))


def test_reading_queue_skips_done_and_starts_after_the_larger_offset() -> None:
    assignment = ShardAssignment(
        job=JOB,
        dataset_id=DS,
        epoch=0,
        worker_id="w",
        plan_version=0,
        world_size=1,
        shards=[
            ShardSpan(shard_id=4, start=40, end=50, done=True),
            ShardSpan(shard_id=1, start=10, end=20, offset=3),
            ShardSpan(shard_id=7, start=70, end=75),
            ShardSpan(shard_id=2, start=20, end=30, offset=2),
            ShardSpan(shard_id=9, start=90, end=99, offset=50),
        ],
    )
    queue = reading_queue(assignment, {7}, (2, 6))
    assert [(q.shard_id, q.offset, q.left) for q in queue] == [(1, 3, 7), (2, 6, 4), (9, 9, 0)]
    assert [q.offset for q in reading_queue(assignment, set(), (1, 1))][:1] == [3]


def test_cursor_round_trip_and_refusals() -> None:
    settings: dict[str, Any] = {"dataset_id": DS, "shuffle_within_shard": True, "seed": 5}
    state = {
        "version": 1,
        "dataset_id": DS,
        "epoch": 3,
        "shuffle_within_shard": True,
        "seed": 5,
        "completed": [4, 1],
        "current": [2, 7],
    }
    cursor = check_cursor(state, **settings)
    assert (cursor.epoch, cursor.completed, cursor.current) == (3, frozenset({1, 4}), (2, 7))
    assert check_cursor({**state, "current": [4, 3]}, **settings).current is None
    refused = [
        {**state, "version": 2},
        {**state, "dataset_id": "other"},
        {**state, "seed": 6},
        {**state, "shuffle_within_shard": False},
        {**state, "epoch": -1},
        {**state, "epoch": True},
        {**state, "completed": "1,2"},
        {**state, "completed": [1, 2_000_000]},
        {**state, "current": [1]},
        {**state, "current": [1, -5]},
    ]
    for bad in refused:
        with pytest.raises(ValidationError):
            check_cursor(bad, **settings)


def test_bad_arguments_are_refused_before_any_call() -> None:
    shards = LocalShards(100, 10, ["a"])
    view = shards.view("a")
    for kwargs in (
        {"epoch": -1},
        {"seed": -1},
        {"report_every": -1},
        {"shuffle_within_shard": 1},
        {"epoch": 1.5},
    ):
        with pytest.raises(ValidationError):
            ShardSampler(view, DS, **kwargs)
    with pytest.raises(ValidationError):
        ShardSampler(view, "")
    sampler = ShardSampler(view, DS)
    with pytest.raises(ValidationError, match="manual_ack=True"):
        sampler.ack(1)
    assert view.calls == Counter()


# -- one worker -----------------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle_within_shard", [False, True])
def test_one_worker_reads_every_sample_once_and_reports_every_shard(
    shuffle_within_shard: bool,
) -> None:
    shards = LocalShards(95, 10, ["a"])
    view = shards.view("a")
    sampler = ShardSampler(view, DS, shuffle_within_shard=shuffle_within_shard, seed=1)
    assert len(sampler) == 95
    samples = list(sampler)
    assert sorted(samples) == list(range(95))
    plan_order = shards.view("a").assignment(DS).shards
    expected = [
        i
        for span in plan_order
        for i in within_shard_order(
            span.start,
            span.end,
            shuffle=shuffle_within_shard,
            seed=1,
            epoch=0,
            shard_id=span.shard_id,
        )
    ]
    assert samples == expected
    assert sorted(done_by(shards, "a")) == list(range(10))
    assert shards.plan_summary().done_shards == 10
    assert list(sampler) == []  # nothing left in the epoch


def test_report_every_batches_reports_and_the_end_of_the_pass_flushes_them() -> None:
    shards = LocalShards(100, 10, ["a"])
    view = shards.view("a")
    sampler = ShardSampler(view, DS, report_every=4)
    list(sampler)
    assert [len(completed) for _, completed, _ in shards.reports] == [4, 4, 2]
    quiet = LocalShards(100, 10, ["a"])
    sampler = ShardSampler(quiet.view("a"), DS, report_every=0)
    iterator = iter(sampler)
    for _ in range(35):
        next(iterator)
    assert quiet.reports == []
    sampler.flush()
    [(worker, completed, partial)] = quiet.reports
    assert worker == "a"
    assert len(completed) == 3
    assert [offset for _, offset in partial] == [5]


@pytest.mark.parametrize("stop_after", [0, 1, 9, 10, 11, 37, 99])
def test_a_cursor_resumes_exactly_where_the_loop_stopped(stop_after: int) -> None:
    shards = LocalShards(100, 10, ["a"])
    sampler = ShardSampler(shards.view("a"), DS, shuffle_within_shard=True, seed=9)
    first = list(itertools.islice(iter(sampler), stop_after))
    cursor = sampler.state_dict()
    # A new process: nothing but the cursor survives (not even the unreported offset).
    resumed = ShardSampler(shards.view("a"), DS, shuffle_within_shard=True, seed=9, cursor=cursor)
    rest = list(resumed)
    assert sorted(first + rest) == list(range(100))
    assert shards.plan_summary().done_shards == 10


def test_a_flushed_offset_is_where_another_reader_of_the_shard_starts() -> None:
    shards = LocalShards(40, 10, ["a", "b"], shuffle=False)
    a = ShardSampler(shards.view("a"), DS, shuffle_within_shard=True, seed=2, report_every=1)
    iterator = iter(a)
    taken = [next(iterator) for _ in range(14)]  # one shard and 4 samples of the next
    a.flush()
    shards.fail("a")
    b = ShardSampler(shards.view("b"), DS, shuffle_within_shard=True, seed=2)
    rest = list(b)
    assert sorted(taken + rest) == list(range(40))
    assert b.wait_for_more(timeout=1) is False


def test_set_epoch_reports_leftovers_and_starts_a_new_plan() -> None:
    shards = LocalShards(50, 10, ["a"])
    sampler = ShardSampler(shards.view("a"), DS, report_every=0)
    epoch0 = list(itertools.islice(iter(sampler), 30))
    assert shards.plan_summary(0).done_shards == 0  # report_every=0: held back...
    sampler.set_epoch(1)
    assert shards.plan_summary(0).done_shards == 2  # ...until the epoch changes
    epoch1 = list(sampler)
    assert shards.plan_summary(1).done_shards == 5  # ...or the pass ends
    assert sorted(epoch1) == list(range(50))
    assert epoch0 != epoch1[:30]  # another shard order
    assert sampler.state_dict()["epoch"] == 1


def test_set_epoch_ends_an_iteration_of_the_old_epoch() -> None:
    shards = LocalShards(50, 10, ["a"])
    sampler = ShardSampler(shards.view("a"), DS)
    old = iter(sampler)
    taken = [next(old) for _ in range(15)]
    sampler.set_epoch(1)
    assert list(old) == []
    assert shards.plan_summary(0).done_shards == 1
    assert sorted(sampler) == list(range(50))
    assert len(taken) == 15


# -- elasticity -----------------------------------------------------------------------------------


def drain(sampler: ShardSampler, sink: list[int]) -> None:
    while True:
        sink.extend(sampler)
        if not sampler.wait_for_more(timeout=1):
            return


def test_a_failed_workers_unfinished_shards_are_read_by_the_survivors_exactly_once() -> None:
    shards = LocalShards(2000, 20, ["a", "b", "c"])
    samplers = {w: ShardSampler(shards.view(w), DS, shuffle_within_shard=True) for w in "abc"}
    consumed: dict[str, list[int]] = {w: [] for w in "abc"}
    iterators = {w: iter(s) for w, s in samplers.items()}
    # Interleaved, as on three machines; c stops for good after 250 samples.
    for _ in range(250):
        for w in "abc":
            consumed[w].append(next(iterators[w]))
    samplers["c"].flush()
    shards.fail("c")
    for w in "ab":
        consumed[w].extend(iterators[w])
    for w in "ab":
        drain(samplers[w], consumed[w])
    everything = consumed["a"] + consumed["b"] + consumed["c"]
    assert sorted(everything) == list(range(2000))
    summary = shards.plan_summary()
    assert summary.done_shards == summary.total_shards == 100
    # c read 12 shards and 10 samples of a 13th; the survivor that took it read only its rest.
    assert len(done_by(shards, "c")) == 12
    assert set(shards.samples_of(done_by(shards, "c"))) < set(consumed["c"])
    assert samplers["a"].lost_shards == samplers["b"].lost_shards == []


def test_shards_moved_to_a_joiner_are_not_read_twice_when_the_change_is_heard() -> None:
    shards = LocalShards(1000, 10, ["a", "b"])
    a = ShardSampler(shards.view("a"), DS)
    iterator = iter(a)
    first = [next(iterator) for _ in range(55)]
    shards.join("c")  # takes the last unfinished shards of a and b
    rest_a = list(iterator)
    c = ShardSampler(shards.view("c"), DS)
    b = ShardSampler(shards.view("b"), DS)
    everything = first + rest_a + list(b) + list(c)
    assert sorted(everything) == list(range(1000))
    assert a.lost_shards == []


def test_a_missed_plan_change_costs_at_most_rereading_not_a_crash_or_a_gap() -> None:
    shards = LocalShards(1000, 10, ["a", "b"])
    deaf = ShardSampler(shards.view("a", hears_plan_changes=False), DS)
    iterator = iter(deaf)
    first = [next(iterator) for _ in range(55)]
    shards.join("c")
    rest_a = list(iterator)
    others = list(ShardSampler(shards.view("b"), DS)) + list(ShardSampler(shards.view("c"), DS))
    counts = Counter(first + rest_a + others)
    assert set(counts) == set(range(1000))
    # The only samples read twice are those of the one shard read before its report conflicted.
    twice = sorted(i for i, n in counts.items() if n > 1)
    assert deaf.lost_shards
    assert twice == shards.samples_of(deaf.lost_shards)
    assert len(deaf.lost_shards) == 1


def test_a_report_naming_a_moved_shard_keeps_the_rest() -> None:
    shards = LocalShards(200, 10, ["a", "b"])
    deaf = ShardSampler(shards.view("a", hears_plan_changes=False), DS, report_every=0)
    iterator = iter(deaf)
    for _ in range(30):
        next(iterator)
    shards.join("c")
    deaf.flush()
    assert set(deaf.lost_shards) == {s for s in deaf.completed_shards} - set(done_by(shards, "a"))
    assert done_by(shards, "a")


def test_a_floor_raised_after_the_fetch_moves_the_start_of_a_shard_not_begun() -> None:
    """The shards to read are fetched once per pass; `skip_to` for one of them, called later
    (another reader's steps of it committed meanwhile), still moves where it starts."""
    shards = LocalShards(30, 10, ["a"], shuffle=False)
    a = ShardSampler(shards.view("a"), DS, manual_ack=True, report_every=0)
    iterator = iter(a)
    assert next(iterator) == 0  # the pass fetched its queue: shards 0, 1 and 2 from their starts
    a.skip_to(1, 6)
    a.skip_to(2, 10)  # all of it: done at once
    rest = list(iterator)
    assert rest == [*range(1, 10), *range(16, 20)]
    a.ack(1 + len(rest))
    a.flush()
    assert shards.plan_summary().done_shards == 3


@pytest.mark.parametrize("hears_plan_changes", [True, False])
def test_a_refused_report_stops_the_reading_of_the_shard_it_named_mid_shard(
    hears_plan_changes: bool,
) -> None:
    """A worker that reports seldom (`report_every=0`, flushed by its loop) finished its first
    shard and is inside its second when a joiner comes: the service, which still counts the
    first as the one being read, gives the second to the joiner. The worker's next report is
    refused for it, and it must not draw another index of it: the joiner reads it now."""
    shards = LocalShards(20, 10, ["a"], shuffle=False)
    a = ShardSampler(
        shards.view("a", hears_plan_changes=hears_plan_changes),
        DS,
        manual_ack=True,
        report_every=0,
    )
    iterator = iter(a)
    assert [next(iterator) for _ in range(14)] == list(range(14))
    a.ack(14)
    shards.join("b")
    a.flush()

    assert a.lost_shards == [1]
    assert done_by(shards, "a") == [0]
    assert list(iterator) == []
    assert list(ShardSampler(shards.view("b"), DS)) == list(range(10, 20))


def test_a_report_under_a_lease_that_ended_is_refused_and_nothing_of_it_counts() -> None:
    shards = LocalShards(200, 10, ["a", "b"])
    deaf = ShardSampler(shards.view("a", hears_plan_changes=False), DS, report_every=0)
    iterator = iter(deaf)
    for _ in range(30):
        next(iterator)
    shards.join("c")
    shards.fail("a")
    shards.join("a", instance="a-2")  # back as a new instance: a new lease, its old shards gone
    with pytest.raises(StaleLease, match="registered again since"):
        deaf.flush()
    assert done_by(shards, "a") == []
    assert shards.plan_summary().done_shards == 0


# -- manual acknowledgement and DataLoader --------------------------------------------------------


def test_manual_ack_counts_only_acknowledged_samples() -> None:
    shards = LocalShards(100, 10, ["a"], shuffle=False)
    sampler = ShardSampler(shards.view("a"), DS, manual_ack=True)
    iterator = iter(sampler)
    drawn = [next(iterator) for _ in range(25)]  # two shards and a half handed out
    assert shards.reports == []
    sampler.ack(12)
    assert len(shards.reports) == 1
    cursor = sampler.state_dict()
    first = shards.reports[0][1][0]
    assert cursor["completed"] == [first]
    assert cursor["current"] is not None
    assert cursor["current"][1] == 2
    with pytest.raises(ValidationError, match="more than the 13"):
        sampler.ack(14)
    resumed = ShardSampler(shards.view("a"), DS, manual_ack=True, cursor=cursor)
    rest = list(resumed)
    assert sorted(drawn[:12] + rest) == list(range(100))
    assert shards.plan_summary().done_shards == 1  # nothing of `rest` acknowledged yet
    resumed.ack(len(rest))
    assert shards.plan_summary().done_shards == 10


class IndexAndProcess(Dataset[tuple[int, int]]):
    """Sample `i` is `(i, pid of the process that loaded it)`."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, index: int) -> tuple[int, int]:
        return index, os.getpid()


@pytest.mark.parametrize("manual_ack", [False, True])
def test_a_dataloader_with_two_workers_gets_every_index_of_the_shards_once(
    manual_ack: bool,
) -> None:
    shards = LocalShards(300, 10, ["a", "b"])
    sampler = ShardSampler(shards.view("a"), DS, shuffle_within_shard=True, manual_ack=manual_ack)
    mine = shards.view("a").assignment(DS).shards
    loader = DataLoader(IndexAndProcess(300), sampler=sampler, batch_size=7, num_workers=2)
    got: list[int] = []
    loaded_by: set[int] = set()
    for indices, pids in loader:
        assert isinstance(indices, torch.Tensor)
        got.extend(indices.tolist())
        loaded_by.update(pids.tolist())
        if manual_ack:
            sampler.ack(len(indices))
    assert sorted(got) == sorted(shards.samples_of(s.shard_id for s in mine))
    assert len(loaded_by) == 2
    assert os.getpid() not in loaded_by
    assert sorted(done_by(shards, "a")) == sorted(s.shard_id for s in mine)
    assert sampler.state_dict()["current"] is None


def test_errors_other_than_a_conflict_keep_the_report_for_later() -> None:
    shards = LocalShards(30, 10, ["a"])
    view = shards.view("a")
    sampler = ShardSampler(view, DS)
    iterator = iter(sampler)
    for _ in range(10):
        next(iterator)
    original = view.report_progress

    def broken(*args: Any, **kwargs: Any) -> ProgressResult:
        raise StrataError("service down", code="unavailable")

    view.report_progress = broken  # type: ignore[method-assign]
    with pytest.raises(StrataError, match="service down"):
        next(iterator)
    view.report_progress = original  # type: ignore[method-assign]
    assert sampler.flush() is not None
    assert shards.plan_summary().done_shards == 1


def test_conflict_error_is_what_a_foreign_report_gets() -> None:
    shards = LocalShards(30, 10, ["a", "b"])
    b_shard = shards.view("b").assignment(DS).shards[0].shard_id
    with pytest.raises(ConflictError):
        shards.view("a").report_progress(DS, 0, [b_shard])


def restore(shards: LocalShards, worker: str, step: int, cursors: list[Any]) -> Any:
    """What `DatasetRegistry.restore_from` does, against the in-memory domain."""
    from strata.datasets import merge_cursors

    cursor = merge_cursors(DS, 0, cursors)
    request = RestoreProgressRequest(
        job=JOB,
        dataset_id=DS,
        epoch=0,
        worker_id=worker,
        checkpoint_step=step,
        completed=cursor.completed,
        partial=cursor.partial,
        lease=shards.leases[worker],
    )
    decision = domain.restore_progress(shards.state, request, shards.now)
    assert decision.error is None, decision.error
    shards.apply(*decision.events)
    return cursor


def test_two_restores_in_one_epoch_with_a_shrinking_world_count_every_sample_once() -> None:
    """Checkpoint with 3 readers, all read on, one dies, the 2 left restore and read with the
    restored cursor carried; at their checkpoint all read on and fail again; they restore that
    one and finish. What counts is each checkpoint's cursors plus what is read after the last
    restore: every sample exactly once, which needs the carried cursor in the second checkpoint."""
    shards = LocalShards(total=300, shard_size=10, members=["a", "b", "c"])
    samplers = {w: ShardSampler(shards.view(w), DS, 0) for w in "abc"}

    def read(sampler: ShardSampler, count: int) -> list[int]:
        return list(itertools.islice(iter(sampler), count))

    for sampler in samplers.values():
        read(sampler, 35)
        sampler.flush()
    first = [sampler.cursor() for sampler in samplers.values()]
    for sampler in samplers.values():
        read(sampler, 25)  # after the checkpoint: undone by the restore
    shards.fail("c")

    carried = restore(shards, "a", 1, first)
    restore(shards, "b", 1, first)
    samplers = {w: ShardSampler(shards.view(w), DS, 0) for w in "ab"}
    spec = shards.state.jobs[JOB].datasets[DS]
    counted: Counter[int] = Counter(shards.samples_of(carried.completed))
    for item in carried.partial:
        start = spec.shard_range(item.shard_id).start
        counted.update(range(start, start + item.offset))
    since_first: Counter[int] = Counter()
    for sampler in samplers.values():
        since_first.update(read(sampler, 40))
        sampler.flush()
    second = [sampler.cursor(carried) for sampler in samplers.values()]
    for sampler in samplers.values():
        read(sampler, 30)  # undone again

    restore(shards, "a", 2, second)
    restore(shards, "b", 2, second)
    counted += since_first
    for sampler in [ShardSampler(shards.view(w), DS, 0) for w in "ab"]:
        counted.update(sampler)

    assert shards.plan_summary().done_shards == 30
    assert counted == Counter(range(300))
