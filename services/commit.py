"""Group commit: the commands waiting at a moment are decided, stored and answered as one batch.

A service that decides one request at a time waits a JetStream round trip (publish, acknowledge,
fold back in) per request; when a job's workers all ask at once (a job start, every rank finishing
a step together) that wait is the whole cost. `GroupCommit` queues each command with its caller,
and one task takes everything queued at a moment, under the service's lock:

0. `prepare`, when given, is awaited once for the batch before the lock is taken (a service that
   must see everything stored before its callers asked, such as a registration the registry has
   just written, catches up with the stream here: once per batch, not once per request);
1. `decide_all` decides the batch in arrival order, each command against the state the previous
   ones' events make (the domain works on a fork of its state; the projection's own state still
   changes only by folding what the stream stored);
2. every event of the batch is published pipelined, in order, and the task waits once until the
   feed has folded the last of them in;
3. `committed(commands, decisions)`, when given, sees the stored batch once (a service's one
   log line for the batch, not one per command);
4. each caller is answered, from the state as folded, in arrival order.

Ordering is arrival order, as with one request at a time. Event ids stay deterministic, so a
command decided again after a crash (the caller retries) is dropped as a duplicate as before. A
batch whose events could not all be stored fails every caller in it; each retries and is decided
afresh against what the stream holds.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, Generic, Protocol, TypeVar

import structlog
from strata.errors import StrataError
from strata.events.models import Event

log = structlog.get_logger("strata.commit")

C = TypeVar("C")
R = TypeVar("R")

MAX_BATCH = 1024
"""Commands decided in one batch at most; the rest wait for the next one."""


class Decided(Protocol):
    """What a domain's decision offers: the events to store, or the error to answer with."""

    @property
    def events(self) -> Sequence[Event]: ...

    @property
    def error(self) -> StrataError | None: ...


D = TypeVar("D", bound=Decided)


class Committing(Protocol):
    """The part of a `Projection` a group commit uses."""

    lock: asyncio.Lock

    async def publish_all(self, events: Sequence[Event]) -> None: ...


@dataclass
class _Waiting(Generic[C, D]):
    command: C
    answer: Callable[[D], Any]
    future: asyncio.Future[Any]


class GroupCommit(Generic[C, D]):
    """Commands decided in batches by `decide_all(commands) -> decisions` (one per command)."""

    def __init__(
        self,
        projection: Committing,
        decide_all: Callable[[list[C]], list[D]],
        *,
        max_batch: int = MAX_BATCH,
        prepare: Callable[[list[C]], Awaitable[None]] | None = None,
        committed: Callable[[list[C], list[D]], None] | None = None,
    ) -> None:
        self._projection = projection
        self._decide_all = decide_all
        self._committed = committed
        self._max_batch = max_batch
        self._prepare = prepare
        self._queue: list[_Waiting[C, D]] = []
        self._wakeup = asyncio.Event()
        self.batches = 0
        self.commands = 0

    async def submit(self, command: C, answer: Callable[[D], R]) -> R:
        """Decide `command` with whatever else is waiting; `answer(decision)` is computed once
        its events are folded in (under the service's lock) and returned. A decision's error is
        raised instead."""
        future: asyncio.Future[R] = asyncio.get_running_loop().create_future()
        self._queue.append(_Waiting(command, answer, future))
        self._wakeup.set()
        return await future

    async def run(self) -> None:
        """The committing task: one batch after another, for the life of the service."""
        while True:
            await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = self._queue[: self._max_batch]
                del self._queue[: len(batch)]
                await self._commit(batch)

    async def _commit(self, batch: list[_Waiting[C, D]]) -> None:
        self.batches += 1
        self.commands += len(batch)
        if self._prepare is not None:
            try:
                await self._prepare([waiting.command for waiting in batch])
            except Exception as exc:  # nothing decided yet: every caller may retry
                self._fail(batch, exc)
                return
        async with self._projection.lock:
            commands = [waiting.command for waiting in batch]
            try:
                decisions = self._decide_all(commands)
                events = [event for decision in decisions for event in decision.events]
                if events:
                    await self._projection.publish_all(events)
            except Exception as exc:  # nothing of the batch is known to be stored: all retry
                self._fail(batch, exc)
                return
            if self._committed is not None:
                try:
                    self._committed(commands, decisions)
                except Exception:  # an account of the batch must not stop answering it
                    log.exception("commit_hook_failed")
            for waiting, decision in zip(batch, decisions, strict=True):
                if waiting.future.done():  # the caller went away (cancelled)
                    continue
                if decision.error is not None:
                    waiting.future.set_exception(decision.error)
                    continue
                try:
                    waiting.future.set_result(waiting.answer(decision))
                except Exception as exc:
                    waiting.future.set_exception(exc)

    @staticmethod
    def _fail(batch: list[_Waiting[C, D]], exc: Exception) -> None:
        for waiting in batch:
            if not waiting.future.done():
                waiting.future.set_exception(exc)
