"""`GroupCommit`'s batch preparation: awaited once per batch, before anything is decided.

The projection is a stand-in holding the lock and recording what it is asked to store; what the
group commit does with a real stream is covered by the services' integration tests.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from strata.errors import ServiceUnavailable
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
