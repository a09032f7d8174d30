"""`GroupCommit`: batches in arrival order, the `committed` hook once per stored batch, a failed
store failing every caller of the batch, and the batch's preparation, awaited once per batch
before anything is decided.

The projection is a stand-in holding the lock and recording what it is asked to store; what the
group commit does with a real stream is covered by the services' integration tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from strata.errors import BusError, ServiceUnavailable
from strata.events import DatasetRegistered, Event
from strata.events.ids import event_id
from strata.services.commit import GroupCommit
from strata.services.domain import Decision


class Stored:
    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.batches: list[list[Event]] = []

    async def publish_all(self, events: Sequence[Event]) -> None:
        self.batches.append(list(events))


def registered(name: str) -> Event:
    return DatasetRegistered(
        id=event_id("test-group-commit", name),
        ts=1,
        job="j",
        source="sharding",
        dataset_id=name,
        total_samples=10,
        shard_size=1,
        shuffle=False,
        seed=0,
    )


async def test_a_batch_is_prepared_once_then_decided_stored_and_answered() -> None:
    stored = Stored()
    seen: list[str] = []

    async def prepare(commands: list[str]) -> None:
        seen.append(f"prepare {commands}")

    def decide_all(commands: list[str]) -> list[Decision[None]]:
        seen.append(f"decide {commands}")
        return [Decision([registered(c)]) for c in commands]

    commits: GroupCommit[str, Decision[None]] = GroupCommit(stored, decide_all, prepare=prepare)
    runner = asyncio.create_task(commits.run())
    try:
        answers = await asyncio.gather(
            *(commits.submit(name, lambda d: len(d.events)) for name in ("a", "b", "c"))
        )
    finally:
        runner.cancel()
    assert answers == [1, 1, 1]
    assert seen == ["prepare ['a', 'b', 'c']", "decide ['a', 'b', 'c']"]
    assert stored.batches == [[registered("a"), registered("b"), registered("c")]]


async def test_a_batch_that_cannot_be_prepared_fails_every_caller_and_decides_nothing() -> None:
    stored = Stored()
    decided: list[str] = []

    async def prepare(commands: list[str]) -> None:
        raise ServiceUnavailable("cannot read the event stream; try again")

    def decide_all(commands: list[str]) -> list[Decision[None]]:
        decided.extend(commands)
        return [Decision() for _ in commands]

    commits: GroupCommit[str, Decision[None]] = GroupCommit(stored, decide_all, prepare=prepare)
    runner = asyncio.create_task(commits.run())
    try:
        outcomes = await asyncio.gather(
            *(commits.submit(name, lambda d: d) for name in ("a", "b")), return_exceptions=True
        )
    finally:
        runner.cancel()
    assert all(isinstance(o, ServiceUnavailable) for o in outcomes)
    assert decided == []
    assert stored.batches == []


@dataclass
class Decided:
    events: list[Event] = field(default_factory=list)
    error: None = None


@dataclass
class Store:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    fail: bool = False
    stored: list[int] = field(default_factory=list)

    async def publish_all(self, events: Sequence[Event]) -> None:
        if self.fail:
            raise BusError("the stream is out of reach")
        self.stored.append(len(events))


def decide_all(commands: list[int]) -> list[Decided]:
    return [Decided(events=[object()] * command) for command in commands]  # type: ignore[list-item]


async def test_each_stored_batch_is_told_once_then_its_callers_are_answered_in_order() -> None:
    store = Store()
    told: list[list[int]] = []
    commits: GroupCommit[int, Decided] = GroupCommit(
        store, decide_all, max_batch=3, committed=lambda commands, _: told.append(commands)
    )
    runner = asyncio.create_task(commits.run())
    try:
        answers = await asyncio.gather(
            *(commits.submit(i, lambda decided, i=i: (i, len(decided.events))) for i in range(7))
        )
    finally:
        runner.cancel()
    assert answers == [(i, i) for i in range(7)]
    assert told == [[0, 1, 2], [3, 4, 5], [6]]
    assert store.stored == [3, 12, 6]


async def test_a_batch_that_cannot_be_stored_fails_every_caller_and_is_not_told() -> None:
    store = Store(fail=True)
    told: list[list[int]] = []
    commits: GroupCommit[int, Decided] = GroupCommit(
        store, decide_all, committed=lambda commands, _: told.append(commands)
    )
    runner = asyncio.create_task(commits.run())
    try:
        results = await asyncio.gather(
            *(commits.submit(i, lambda decided: decided) for i in (1, 2)), return_exceptions=True
        )
    finally:
        runner.cancel()
    assert all(isinstance(result, BusError) for result in results)
    assert told == []
