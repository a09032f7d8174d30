"""Leaving a job on SIGTERM, for the workers whose code asks for it (`leave_on_sigterm()`).

Schedulers (Kubernetes, Slurm, torchrun) stop a process with SIGTERM. Left to the default action
the process dies at once, and the registry learns of it only after the heartbeat timeout; with a
graceful leave first, `worker.left` is recorded at once and the rank is free again. The library
never installs a handler on its own: one is installed only by these calls, and once the worker has
left, SIGTERM does what it did before (by default, end the process with the usual status).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
import threading
from collections.abc import Awaitable, Callable
from types import FrameType
from typing import Any

import structlog

from strata.errors import ConfigError

log = structlog.get_logger("strata.worker")

Handler = Callable[[int, FrameType | None], Any] | int | None
"""What `signal.getsignal` returns: a function, SIG_DFL, SIG_IGN, or None (not set from Python)."""


def _main_thread_only(what: str) -> None:
    if threading.current_thread() is not threading.main_thread():
        raise ConfigError(
            f"{what} must be called from the main thread: Python runs signal handlers only "
            f"there (it was called from thread {threading.current_thread().name!r})"
        )


def _hand_over(previous: Handler, signum: int, frame: FrameType | None) -> None:
    """Do what the signal did before the worker's handler was installed."""
    if previous == signal.SIG_IGN:
        signal.signal(signum, signal.SIG_IGN)
        return
    if callable(previous):
        signal.signal(signum, previous)
        previous(signum, frame)
        return
    # The default action (also for a handler Python did not install, which it cannot restore):
    # end the process by the same signal, so its exit status says SIGTERM as usual.
    signal.signal(signum, signal.SIG_DFL)
    for stream in (sys.stdout, sys.stderr):
        # A closed or broken stream must not keep the process alive.
        with contextlib.suppress(Exception):
            stream.flush()
    os.kill(os.getpid(), signum)


def install_sync(worker_id: str, stop: Callable[[], None]) -> None:
    """On SIGTERM, call `stop` (a blocking graceful leave) in the main thread, then hand over."""
    _main_thread_only("leave_on_sigterm()")
    previous: Handler = signal.getsignal(signal.SIGTERM)
    leaving = False

    def on_sigterm(signum: int, frame: FrameType | None) -> None:
        nonlocal leaving
        if leaving:  # a second SIGTERM while the first one's leave runs: that one hands over
            return
        leaving = True
        log.info("worker_leaving_on_sigterm", worker=worker_id)
        try:
            stop()
        except Exception as exc:
            log.warning("worker_leave_on_sigterm_failed", worker=worker_id, error=str(exc))
        _hand_over(previous, signum, frame)

    signal.signal(signal.SIGTERM, on_sigterm)


def install_async(worker_id: str, stop: Callable[[], Awaitable[None]]) -> None:
    """On SIGTERM, run `stop()` on the running event loop (which must be the main thread's),
    then hand over. Uses `loop.add_signal_handler`, so the leave runs as a task of that loop."""
    _main_thread_only("leave_on_sigterm()")
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:
        raise ConfigError(
            "strata.aio.Worker.leave_on_sigterm() must be called with its event loop running "
            "(from a coroutine, e.g. right after `await worker.start()`)"
        ) from None
    previous: Handler = signal.getsignal(signal.SIGTERM)
    leaving: list[asyncio.Task[None]] = []

    async def leave() -> None:
        log.info("worker_leaving_on_sigterm", worker=worker_id)
        try:
            await stop()
        except Exception as exc:
            log.warning("worker_leave_on_sigterm_failed", worker=worker_id, error=str(exc))
        loop.remove_signal_handler(signal.SIGTERM)
        _hand_over(previous, signal.SIGTERM, None)

    def on_sigterm() -> None:
        if not leaving:  # a second SIGTERM while the first one's leave runs: that one hands over
            leaving.append(loop.create_task(leave(), name=f"strata-sigterm-{worker_id}"))

    try:
        loop.add_signal_handler(signal.SIGTERM, on_sigterm)
    except (RuntimeError, ValueError) as exc:
        raise ConfigError(f"cannot handle SIGTERM on this event loop: {exc}") from None
