"""The bounds of one replay (`strata.history.ReplayBudget`), driven by a clock and a memory gauge
the test owns: records, planned shards, time and memory each stop a replay with its own error."""

from __future__ import annotations

import pytest
from strata.errors import DeadlineExceeded, TooLarge
from strata.events.models import DatasetRegistered, ShardPlanChanged, WorkerLeft
from strata.history import Record, ReplayBudget, ReplayLimits


def registered(dataset: str, shards: int) -> Record:
    event = DatasetRegistered(
        job="j",
        source="sharding",
        dataset_id=dataset,
        total_samples=shards,
        shard_size=1,
        shuffle=False,
        seed=0,
    )
    return Record(1, 1, event)


def replanned(dataset: str) -> Record:
    event = ShardPlanChanged(
        job="j",
        source="sharding",
        dataset_id=dataset,
        epoch=0,
        plan_version=1,
        members=["w"],
        membership_epoch=1,
        reason="join",
    )
    return Record(2, 2, event)


def left() -> Record:
    event = WorkerLeft(job="j", source="registry", worker_id="w", rank=0, membership_epoch=1)
    return Record(3, 3, event)


class Gauge:
    def __init__(self) -> None:
        self.value = 0.0

    def __call__(self) -> float:
        return self.value


def test_planned_shards_count_registrations_and_every_replan_of_that_dataset() -> None:
    budget = ReplayBudget(ReplayLimits(max_planned_shards=250), "job 'j'", "ask for less")
    budget.charge(registered("a", 100))
    budget.charge(replanned("a"))
    budget.charge(replanned("unknown"))  # a re-plan of a dataset not seen plans nothing
    assert budget.planned_shards == 200
    with pytest.raises(TooLarge, match=r"more than 250 shards .*; ask for less$"):
        budget.charge(replanned("a"))


def test_records_time_and_memory_each_stop_a_replay() -> None:
    clock, memory = Gauge(), Gauge()
    limits = ReplayLimits(max_records=2, timeout_s=10, max_memory_bytes=2**20)
    budget = ReplayBudget(limits, "f", "narrow", clock=clock, memory=lambda: int(memory()))
    budget.charge(left())
    budget.charge(left())
    with pytest.raises(TooLarge, match="more than 2 events"):
        budget.charge(left())
    budget = ReplayBudget(limits, "f", "narrow", clock=clock, memory=lambda: int(memory()))
    memory.value = 2 * 2**20
    with pytest.raises(TooLarge, match="grew this process by 2 MiB"):
        budget.charge(left())
    memory.value = 0
    budget = ReplayBudget(limits, "f", "narrow", clock=clock, memory=lambda: int(memory()))
    clock.value = 10
    with pytest.raises(DeadlineExceeded, match="more than 10s"):
        budget.charge(left())


def test_memory_is_not_checked_where_the_process_is_shared() -> None:
    calls: list[int] = []

    def memory() -> int:
        calls.append(1)
        return 10**12

    budget = ReplayBudget(ReplayLimits(), "j", "n", memory=memory)
    budget.charge(left())
    assert calls == []
