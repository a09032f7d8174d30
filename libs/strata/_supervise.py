"""Supervised tasks: the background work of a process, watched.

A service's event feed, a registry's failure detector, a worker's heartbeats: each runs on a task
of its own for the life of its owner, and a task that dies of an exception nothing handles takes
its work with it. A `Supervisor` spawns those tasks by name and watches every one: the first that
dies is logged once, with its traceback, and kept as a `BackgroundTaskFailed` (its exception the
cause). Its owner decides what that means: a service turns unready and its process exits non-zero
(`strata.services.runtime`), a worker raises it from the next call (`strata.aio.Worker`).

Expected errors stay handled where they happen, inside a task's loop; only an exception that
escapes a task counts. A task cancelled, or one that returns, is not a failure.
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import structlog

from strata.errors import BackgroundTaskFailed

log = structlog.get_logger("strata.tasks")


class Supervisor:
    """The named background tasks of one owner (a service, the gateway, a worker)."""

    def __init__(self, owner: str) -> None:
        self.owner = owner
        self._tasks: set[asyncio.Task[Any]] = set()
        self._failure: BackgroundTaskFailed | None = None
        self._waiters: list[asyncio.Future[BackgroundTaskFailed]] = []
        self._stopping = False

    def __len__(self) -> int:
        return len(self._tasks)

    @property
    def tasks(self) -> frozenset[asyncio.Task[Any]]:
        """The tasks running now."""
        return frozenset(self._tasks)

    @property
    def failure(self) -> BackgroundTaskFailed | None:
        """The first task that died, or None while none has."""
        return self._failure

    def spawn(self, coro: Coroutine[Any, Any, Any], name: str) -> asyncio.Task[Any]:
        """Run `coro` as the task `<owner>-<name>`, watched until it ends."""
        task = asyncio.create_task(coro, name=f"{self.owner}-{name}")
        self._tasks.add(task)
        task.add_done_callback(self._observe)
        return task

    def check(self) -> None:
        """Raise the failure, if a task died."""
        if self._failure is not None:
            raise self._failure

    def status(self) -> tuple[bool, str]:
        """(False, why) once a task died; (True, "ok") before."""
        if self._failure is None:
            return True, "ok"
        return False, self._failure.message

    async def failed(self) -> BackgroundTaskFailed:
        """Wait until a task dies; return its failure (at once, if one has)."""
        if self._failure is not None:
            return self._failure
        waiter: asyncio.Future[BackgroundTaskFailed] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            return await waiter
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    async def stop(self) -> None:
        """Cancel every task (those spawned meanwhile too) and wait for each to end. One that
        raises while it stops is logged, not raised: the owner is going away. The supervisor
        can spawn again afterwards; a failure it kept stays kept."""
        self._stopping = True
        try:
            while self._tasks:
                tasks = list(self._tasks)
                for task in tasks:
                    task.cancel()
                await asyncio.wait(tasks)
        finally:
            self._stopping = False

    def _observe(self, task: asyncio.Task[Any]) -> None:
        self._tasks.discard(task)
        if task.cancelled():
            return
        exc = task.exception()
        if exc is None:
            return
        name = task.get_name()
        if self._stopping:
            log.warning(
                "task_failed_stopping",
                owner=self.owner,
                task=name,
                error=f"{type(exc).__name__}: {exc}",
            )
            return
        if self._failure is not None:
            # Logged once: the first death is the one to read; the rest usually follow from it.
            log.warning(
                "task_failed_after",
                owner=self.owner,
                task=name,
                error=f"{type(exc).__name__}: {exc}",
                first=self._failure.details.get("task"),
            )
            return
        failure = BackgroundTaskFailed(
            f"the {name} task of {self.owner} died of {type(exc).__name__}: {exc}; what it did "
            "is no longer done (its traceback is logged as task_failed)",
            task=name,
        )
        failure.__cause__ = exc
        self._failure = failure
        log.error("task_failed", owner=self.owner, task=name, exc_info=exc)
        for waiter in self._waiters:
            if not waiter.done() and not waiter.get_loop().is_closed():
                waiter.get_loop().call_soon_threadsafe(_settle, waiter, failure)


def _settle(waiter: asyncio.Future[BackgroundTaskFailed], failure: BackgroundTaskFailed) -> None:
    if not waiter.done():
        waiter.set_result(failure)
