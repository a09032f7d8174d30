"""`GroupCommit` with a stand-in projection: batches in arrival order, the `committed` hook once
per stored batch, and a failed store failing every caller of the batch."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from dataclasses import dataclass, field

from strata.errors import BusError
from strata.events.models import Event
from strata.services.commit import GroupCommit


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
