"""A background asyncio event loop that the synchronous SDK runs its coroutines on.

Training loops are plain synchronous code, so each sync `strata.Worker` owns a `LoopRunner`: a
daemon thread running an event loop, where heartbeats keep flowing while the caller computes. `run`
submits a coroutine and blocks until it finishes, raising exactly what the coroutine raised.
"""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Coroutine
from typing import Any, TypeVar

from strata.errors import StrataError

__all__ = ["LoopRunner"]

T = TypeVar("T")


class LoopRunner:
    """An event loop in a daemon thread, started by the first `run` and ended by `close`."""

    def __init__(self, name: str = "strata-loop") -> None:
        self.name = name
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None

    def __repr__(self) -> str:
        return f"<LoopRunner {self.name} {'running' if self.running else 'idle'}>"

    @property
    def running(self) -> bool:
        thread = self._thread
        return thread is not None and thread.is_alive()

    def in_loop_thread(self) -> bool:
        """True when called from the runner's own thread (inside one of its coroutines)."""
        return self._thread is not None and threading.current_thread() is self._thread

    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is not None and self.running:
                return self._loop
            loop = asyncio.new_event_loop()
            ready = threading.Event()
            thread = threading.Thread(
                target=self._main, args=(loop, ready), name=self.name, daemon=True
            )
            thread.start()
            ready.wait()
            self._loop, self._thread = loop, thread
            return loop

    @staticmethod
    def _main(loop: asyncio.AbstractEventLoop, ready: threading.Event) -> None:
        asyncio.set_event_loop(loop)
        loop.call_soon(ready.set)
        try:
            loop.run_forever()
        finally:
            try:
                pending = asyncio.all_tasks(loop)
                for task in pending:
                    task.cancel()
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
                loop.run_until_complete(loop.shutdown_asyncgens())
                loop.run_until_complete(loop.shutdown_default_executor())
            finally:
                asyncio.set_event_loop(None)
                loop.close()

    def run(self, coro: Coroutine[Any, Any, T], timeout: float | None = None) -> T:
        """Run `coro` on the loop and return its result, or raise what it raised.

        With a `timeout` (seconds), a coroutine still running then is cancelled and the builtin
        `TimeoutError` is raised. An interrupt (Ctrl-C) while waiting cancels the coroutine too.
        """
        if self.in_loop_thread():
            coro.close()
            raise StrataError(
                f"a blocking Strata call was made on the SDK's own event-loop thread {self.name!r}"
                " (from inside an on_rejoin callback or another coroutine running there), where it"
                " would wait for itself forever; use the coroutines of worker.aio there instead",
                code="loop_reentry",
            )
        loop = self._ensure_loop()
        future = asyncio.run_coroutine_threadsafe(coro, loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            if future.done() and not future.cancelled():
                raise  # the coroutine's own TimeoutError
            future.cancel()
            raise TimeoutError(
                f"a Strata call did not finish within {timeout}s and was cancelled"
            ) from None
        except BaseException:
            future.cancel()
            raise

    def close(self, timeout: float = 10.0) -> None:
        """Cancel what still runs on the loop, close it and end the thread. Idempotent."""
        with self._lock:
            loop, thread = self._loop, self._thread
            self._loop = self._thread = None
        if loop is None or thread is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop already closed
            loop.call_soon_threadsafe(loop.stop)
        if threading.current_thread() is not thread:
            thread.join(timeout)
