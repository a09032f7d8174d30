"""`Supervisor`: the first task that dies is kept (logged once, with its traceback) and reported to
whoever waits; a task cancelled, one that returns, or one that fails while its owner stops is not
a failure."""

from __future__ import annotations

import asyncio

import pytest
import structlog
from strata._supervise import Supervisor
from strata.errors import BackgroundTaskFailed, StrataError, error_from_code


class Injected(RuntimeError):
    pass


async def forever() -> None:
    await asyncio.Event().wait()


async def die(after: asyncio.Event, message: str = "boom") -> None:
    await after.wait()
    raise Injected(message)


async def test_the_first_death_is_kept_reported_and_logged_once() -> None:
    tasks = Supervisor("svc")
    first, second = asyncio.Event(), asyncio.Event()
    tasks.spawn(forever(), "steady")
    tasks.spawn(die(first, "first"), "feed")
    detector = tasks.spawn(die(second, "second"), "detector")
    assert tasks.status() == (True, "ok")
    tasks.check()
    waiting = asyncio.ensure_future(tasks.failed())
    with structlog.testing.capture_logs() as logs:
        first.set()
        failure = await asyncio.wait_for(waiting, 30)
        second.set()
        await asyncio.wait([detector], timeout=30)
    assert len(tasks) == 1
    assert isinstance(failure, BackgroundTaskFailed)
    assert failure.code == "background_task_failed"
    assert failure.details["task"] == "svc-feed"
    assert isinstance(failure.__cause__, Injected)
    assert str(failure.__cause__) == "first"
    ready, detail = tasks.status()
    assert not ready
    assert "svc-feed" in detail
    assert "Injected: first" in detail
    with pytest.raises(BackgroundTaskFailed) as raised:
        tasks.check()
    assert raised.value is failure
    assert await tasks.failed() is failure  # at once, once failed
    errors = [entry for entry in logs if entry["log_level"] == "error"]
    assert [entry["event"] for entry in errors] == ["task_failed"]
    assert isinstance(errors[0]["exc_info"], Injected)
    later = [entry for entry in logs if entry["event"] == "task_failed_after"]
    assert [entry["task"] for entry in later] == ["svc-detector"]
    await tasks.stop()
    assert len(tasks) == 0


async def test_cancelled_returned_and_stopping_tasks_are_not_failures() -> None:
    tasks = Supervisor("svc")

    async def done() -> None:
        return None

    async def fails_when_cancelled() -> None:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise Injected("while stopping") from None

    returned = tasks.spawn(done(), "once")
    cancelled = tasks.spawn(forever(), "cancelled")
    tasks.spawn(fails_when_cancelled(), "stopping")
    await asyncio.wait([returned])
    cancelled.cancel()
    await asyncio.wait([cancelled])
    assert tasks.failure is None
    with structlog.testing.capture_logs() as logs:
        await tasks.stop()
    assert tasks.failure is None
    assert tasks.status() == (True, "ok")
    assert [entry["event"] for entry in logs] == ["task_failed_stopping"]


def test_the_error_travels_by_its_code() -> None:
    rebuilt = error_from_code("background_task_failed", "the x task died")
    assert isinstance(rebuilt, BackgroundTaskFailed)
    assert isinstance(rebuilt, StrataError)
