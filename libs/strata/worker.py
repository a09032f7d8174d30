"""The synchronous worker SDK: `strata.Worker`, for ordinary (non-asyncio) training loops.

It runs a `strata.aio.Worker` on a background event loop (`strata._loop`), so heartbeats keep
flowing while the caller's thread trains, and the caller never touches asyncio. A worker started
and never stopped leaves the job when the interpreter exits.
"""

from __future__ import annotations

import asyncio
import atexit
import functools
import inspect
import os
import weakref
from collections.abc import Callable
from types import TracebackType
from typing import Any, Final, Self

import structlog

from strata import _signals
from strata._loop import LoopRunner
from strata.aio import MEMBERS_RETRY_S, OnRejoin
from strata.aio import Worker as AsyncWorker
from strata.bus import Bus
from strata.config import Settings
from strata.events import LiveState
from strata.events.requests import MembersResult, Registration

__all__ = ["Worker"]

EXIT_STOP_TIMEOUT_S: Final = 10.0

log = structlog.get_logger("strata.worker")


def _off_the_loop(callback: OnRejoin | None) -> OnRejoin | None:
    """Run a user callback in a thread, so it may call the worker's blocking methods."""
    if callback is None:
        return None
    user_callback: Callable[[Registration], Any] = callback

    async def call(registration: Registration) -> None:
        outcome = await asyncio.to_thread(user_callback, registration)
        if inspect.isawaitable(outcome):
            await outcome

    return call


def _stop_at_exit(ref: weakref.ReferenceType[Worker], pid: int) -> None:
    worker = ref()
    # A forked child inherits the hook but not the loop thread, nor the membership.
    if worker is None or os.getpid() != pid or not worker.started:
        return
    try:
        worker.stop(timeout=EXIT_STOP_TIMEOUT_S)
    except Exception as exc:
        log.warning("worker_stop_at_exit_failed", worker=worker.id, error=str(exc))


class Worker:
    """One training process's membership of a job (the blocking twin of `strata.aio.Worker`).

    >>> with strata.Worker(job="resnet") as w:          # doctest: +SKIP
    ...     w.set_state("training", step=0, epoch=0)
    """

    def __init__(
        self,
        job: str | None = None,
        nats_url: str | None = None,
        *,
        worker_id: str | None = None,
        hostname: str | None = None,
        gpus: int = 0,
        labels: dict[str, str] | None = None,
        settings: Settings | None = None,
        on_rejoin: OnRejoin | None = None,
        rank: int | None = None,
    ) -> None:
        self._aio = AsyncWorker(
            job,
            nats_url,
            worker_id=worker_id,
            hostname=hostname,
            gpus=gpus,
            labels=labels,
            settings=settings,
            on_rejoin=_off_the_loop(on_rejoin),
            rank=rank,
        )
        self._runner = LoopRunner(name=f"strata-worker-{self._aio.id}")
        self._exit_hook: Callable[[], None] | None = None

    def __repr__(self) -> str:
        return repr(self._aio).replace("strata.aio.Worker", "strata.Worker", 1)

    # -- life -------------------------------------------------------------------------------------

    def start(self, timeout: float | None = None) -> Self:
        """Connect, register and start heartbeating in the background; returns the worker."""
        try:
            self._runner.run(self._aio.start(), timeout)
        except BaseException:
            if not self._aio.started:
                self._runner.close()  # no thread left behind by a refused start
            raise
        if self._exit_hook is None:
            self._exit_hook = functools.partial(_stop_at_exit, weakref.ref(self), os.getpid())
            atexit.register(self._exit_hook)
        return self

    def stop(self, timeout: float | None = None) -> None:
        """Leave the job, disconnect and end the background thread. Idempotent."""
        if self._exit_hook is not None:
            atexit.unregister(self._exit_hook)
            self._exit_hook = None
        if not self._runner.running:
            return
        try:
            self._runner.run(self._aio.stop(), timeout)
        finally:
            self._runner.close()

    def leave_on_sigterm(self) -> None:
        """Leave the job gracefully on SIGTERM, then let SIGTERM do what it did before (by
        default: end the process, with the usual status), so the registry records `worker.left`
        at once instead of failing the worker after its heartbeat timeout.

        Opt in: the library installs no signal handler unless this is called. Call it from the
        main thread (Python runs signal handlers only there); `strata.ConfigError` otherwise.
        """
        _signals.install_sync(self.id, lambda: self.stop(timeout=EXIT_STOP_TIMEOUT_S))

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- calls ------------------------------------------------------------------------------------

    def set_state(
        self, state: LiveState, *, step: int | None = None, epoch: int | None = None
    ) -> None:
        """Record what the worker is doing (idle, loading, training, checkpointing, recovering);
        a new state is announced at once, step and epoch alone with the next heartbeat."""
        # Recorded on the caller's thread: calling this every training step costs no round trip.
        if self._aio._record_progress(state, step, epoch) and self._aio.started:
            self._runner.run(self._aio._beat())

    def members(
        self, *, include_gone: bool = False, retry_for: float = MEMBERS_RETRY_S
    ) -> MembersResult:
        """The job's membership as the registry sees it (live workers; all with include_gone)."""
        return self._runner.run(self._aio.members(include_gone=include_gone, retry_for=retry_for))

    def barrier(self, name: str, timeout: float = 60.0, *, expected: int | None = None) -> int:
        """Wait at barrier `name` until every participant arrives; returns its generation.

        Raises `strata.BarrierBroken` when a participant fails or leaves meanwhile, and
        `strata.BarrierTimeout` when it is not complete within `timeout` seconds.
        """
        return self._runner.run(self._aio.barrier(name, timeout, expected=expected))

    # -- properties -------------------------------------------------------------------------------

    @property
    def aio(self) -> AsyncWorker:
        """The asyncio worker underneath, for the other SDK parts (run its coroutines on
        `runner`)."""
        return self._aio

    @property
    def runner(self) -> LoopRunner:
        """The background event loop the async worker lives on."""
        return self._runner

    @property
    def bus(self) -> Bus:
        return self._aio.bus

    @property
    def id(self) -> str:
        return self._aio.id

    @property
    def instance(self) -> str:
        return self._aio.instance

    @property
    def job(self) -> str:
        return self._aio.job

    @property
    def rank(self) -> int:
        """The rank the registry gave this worker: the one asked for with `rank=` (or
        `STRATA_RANK`), else the lowest free one when it registered."""
        return self._aio.rank

    @property
    def requested_rank(self) -> int | None:
        return self._aio.requested_rank

    @property
    def world_size(self) -> int:
        return self._aio.world_size

    @property
    def membership_epoch(self) -> int:
        return self._aio.membership_epoch

    @property
    def heartbeat_interval(self) -> float:
        return self._aio.heartbeat_interval

    @property
    def heartbeat_timeout(self) -> float:
        return self._aio.heartbeat_timeout

    @property
    def registration(self) -> Registration:
        return self._aio.registration

    @property
    def state(self) -> LiveState:
        return self._aio.state

    @property
    def step(self) -> int:
        return self._aio.step

    @property
    def epoch(self) -> int:
        return self._aio.epoch

    @property
    def started(self) -> bool:
        return self._aio.started

    @property
    def rejoined(self) -> bool:
        return self._aio.rejoined

    @property
    def rejoin_count(self) -> int:
        return self._aio.rejoin_count

    @property
    def superseded(self) -> bool:
        """A newer process registered this worker id: this one no longer counts; stop it."""
        return self._aio.superseded
