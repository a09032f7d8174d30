"""A service process whose named background task is made to fail, for test_supervised_tasks.py.

    python tests/integration/faulty_service.py <service> <task> <trigger file> <release file>

Runs the service as `python -m strata.services.<service>` does (`runtime.run`), with two
additions. Once the trigger file exists, the task `<service>-<task>` gets an exception it does
not expect at the point where it waits: whatever it awaits fails with `InjectedFault`, as a
library call raising something no one foresaw would. And the service's stop waits for the release
file, so the test can read `/readyz` between the task's death and the process's exit.
"""

from __future__ import annotations

import asyncio
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from strata.config import load_settings
from strata.services import catalog
from strata.services.runtime import run

POLL_S = 0.02
DEADLINE_S = 120.0


class InjectedFault(RuntimeError):
    """The exception nothing in the service expects."""


async def _until(condition: Any, what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"faulty_service: timed out waiting for {what}")
        await asyncio.sleep(POLL_S)


def _waiting_on(task: asyncio.Task[Any]) -> asyncio.Future[Any] | None:
    """The future `task` is suspended on, when it is a plain future it can be failed through."""
    waiter = getattr(task, "_fut_waiter", None)
    if isinstance(waiter, asyncio.Future) and not isinstance(waiter, asyncio.Task):
        return None if waiter.done() else waiter
    return None


async def inject(service: Any, task_name: str, trigger: Path) -> None:
    await _until(trigger.exists, "the trigger file")
    full = f"{service.name}-{task_name}"

    def target() -> asyncio.Task[Any] | None:
        return next((t for t in asyncio.all_tasks() if t.get_name() == full), None)

    await _until(lambda: target() is not None, f"the task {full}")
    task = target()
    assert task is not None
    await fail_task(task, lambda: InjectedFault(f"injected into {full}"))
    print(f"faulty_service: injected into {full}", flush=True)


async def fail_task(task: asyncio.Task[Any], fault: Callable[[], BaseException]) -> None:
    """Make what `task` waits on raise `fault()` (on the task's loop), until the task dies of
    it: a fault that lands where the task expects errors (a publish inside its `try`) is
    handled there, as it should be, and the next wait gets another."""
    name = task.get_name()
    while not task.done():
        await _until(lambda: task.done() or _waiting_on(task) is not None, f"{name} to wait")
        waiter = _waiting_on(task)
        if waiter is None:
            continue
        # Done now, so the next round waits until the task has run and waits on another one.
        waiter.set_exception(fault())


def main() -> None:
    name, task_name, trigger, release = sys.argv[1:5]
    service = catalog.create(name)
    start, stop = service.start, service.stop
    injector: list[asyncio.Task[None]] = []

    async def start_then_arm(*args: Any) -> None:
        await start(*args)
        injector.append(asyncio.create_task(inject(service, task_name, Path(trigger))))

    async def stop_when_released() -> None:
        await _until(Path(release).exists, "the release file")
        await stop()

    service.start = start_then_arm  # type: ignore[method-assign]
    service.stop = stop_when_released  # type: ignore[method-assign]
    run(service, load_settings())


if __name__ == "__main__":
    main()
