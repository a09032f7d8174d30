"""`strata.aio.Worker`: the worker's life (start, stop, leave on SIGTERM) and its barriers, on top
of its registration, heartbeats, membership and training metrics."""

from __future__ import annotations

import asyncio
import contextlib
from types import TracebackType
from typing import Self

from strata import _signals
from strata._supervise import Supervisor
from strata.aio._barrier import BarrierClient
from strata.aio._core import CLOSE_TIMEOUT_S, _Saver, log
from strata.aio._training import _TrainingMetrics
from strata.bus import Bus, Caller
from strata.errors import StrataError
from strata.events import subjects


class Worker(_TrainingMetrics):
    """One training process's membership of a job, for asyncio code.

    `start()` registers with the registry (retrying while it restarts) and heartbeats in the
    background; when the registry has marked the worker failed (a long pause, a partition), the
    worker registers again on its own and calls `on_rejoin`. `stop()` leaves the job. A newer
    process that starts under the same worker id supersedes this one, which then stops
    heartbeating and never registers again (`superseded`).
    """

    _barriers: BarrierClient | None = None
    """The barrier waits of this worker, from its first `barrier()` until `stop()`."""

    # -- life -------------------------------------------------------------------------------------

    async def start(self) -> Self:
        """Connect, register and start heartbeating in the background; returns the worker.
        Idempotent.

        A live process registered under the same worker id is superseded (recorded as failed):
        this one takes its place, with its rank unless `rank=` asks for another. Raises
        `ConflictError` when the requested rank is held by another live worker, `BusError` when
        NATS cannot be reached within 30 s, `ServiceUnavailable` when no registry answers for 60 s.
        The blocking `strata.Worker.start(timeout=...)` gives up after `timeout` seconds.
        """
        async with self._lock():
            if self._started:
                return self
            # Every request goes out as this worker of this job, and its replies come to an inbox
            # of its own: with a worker credential, NATS lets it use no other.
            bus = await Bus.connect(
                self._nats_url,
                settings=self._settings,
                name=f"strata-worker-{self._worker_id}",
                caller=Caller(self._job, self._worker_id),
            )
            self._bus = bus
            try:
                # Subscribed before registering, so no notice is missed. The registry's compact
                # world notices, not the membership events: those would reach every worker from
                # every other one, N squared messages at a job's start.
                self._world_sub = await bus.nc.subscribe(
                    subjects.world_subject(self._job), cb=self._on_world_notice
                )
                await self._subscribe_control()
                registration = await self._register()
                if registration.worker_id != self._worker_id:
                    # A registry that derived another id than the one asked as: be that one.
                    self._worker_id = registration.worker_id
                    self._log = log.bind(job=self._job, worker=self._worker_id)
                    bus.rpc = bus.rpc.bound(Caller(self._job, self._worker_id))
                    await self._subscribe_control()
            except BaseException:
                await self._close_bus()
                raise
            self._apply_registration(registration)
            self._started = True
            self._tasks = Supervisor("strata-worker")
            self._metrics.start(self._spawn)
            self._heartbeat_task = self._spawn(self._heartbeat_loop(), "heartbeat")
            self._log.info(
                "worker_registered",
                rank=registration.rank,
                world_size=self._membership_view[1],
                membership_epoch=self._membership_view[0],
                rejoined=registration.rejoined,
                heartbeat_interval=registration.heartbeat_interval,
            )
            return self

    def _track_saves(self, saver: _Saver) -> None:
        """A checkpoint manager of this worker: `stop()` waits for its pending saves."""
        self._savers.add(saver)

    async def _pending_saves_failure(self) -> BaseException | None:
        """Wait (up to `saves_timeout`) until this worker's checkpoint saves are durable."""
        savers = list(self._savers)
        if not savers or self._superseded is not None:
            return None
        try:
            async with asyncio.timeout(self._saves_timeout):
                for saver in savers:
                    await saver.wait()
        except TimeoutError:
            return StrataError(
                f"checkpoint saves of {self._worker_id!r} still pending after "
                f"{self._saves_timeout:g}s; the worker left the job without them (their steps "
                "abort). Call wait() before leaving, or give Worker(saves_timeout=...) more time",
                code="pending_saves",
            )
        except Exception as exc:  # a failed save: raised here, as wait() would
            return exc
        return None

    async def stop(self) -> None:
        """Wait for this worker's pending checkpoint saves (up to `saves_timeout`), stop
        heartbeating, leave the job and disconnect. Idempotent. Raises a save that failed or did
        not finish in time (`code="pending_saves"`), after leaving; never raises for a leave the
        registry cannot take (it then marks the worker failed after the heartbeat timeout). The
        blocking `strata.Worker.stop(timeout=...)` also ends its background thread, and gives up
        after `timeout` seconds."""
        failure = await self._pending_saves_failure() if self._started else None
        async with self._lock():
            if not self._started:
                return
            self._stopping = True
            try:
                await self._metrics.close()  # the last samples go out before the worker leaves
                await self._cancel_background()
                if self._barriers is not None:
                    await self._barriers.close()
                    self._barriers = None
                if self._superseded is None:  # else the id is another process's to leave
                    await self._leave()
            finally:
                await self._close_bus()
                # Only now: cancelled on an open connection, its PONG would stop the reader.
                probe, self._probe = self._probe, None
                if probe is not None:
                    probe[1].cancel()
                self._started = False
                self._stopping = False
        if failure is not None:
            raise failure

    def leave_on_sigterm(self) -> None:
        """Leave the job gracefully on SIGTERM, then let SIGTERM do what it did before (by
        default: end the process, with the usual status), so the registry records `worker.left`
        at once instead of failing the worker after its heartbeat timeout.

        Opt in: the library installs no signal handler unless this is called. Call it on the
        main thread (Python runs signal handlers only there): `strata.Worker`'s from that thread,
        `strata.aio.Worker`'s from a coroutine on its event loop (it uses
        `loop.add_signal_handler`); `strata.ConfigError` otherwise.
        """
        _signals.install_async(self._worker_id, self.stop)

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _cancel_background(self) -> None:
        await self._tasks.stop()
        self._heartbeat_task = self._rejoin_task = None

    async def _close_bus(self) -> None:
        bus, self._bus = self._bus, None
        self._control, self._world_sub, self._probes = None, None, None
        if bus is None:
            return
        with contextlib.suppress(Exception):
            await asyncio.wait_for(bus.close(), CLOSE_TIMEOUT_S)
        # Draining is refused while reconnecting; the client must still not reconnect forever.
        if not bus.nc.is_closed:
            with contextlib.suppress(Exception):
                await bus.nc.close()

    # -- barriers ---------------------------------------------------------------------------------

    async def barrier(
        self, name: str, timeout: float = 60.0, *, expected: int | None = None
    ) -> int:
        """Wait until every expected participant has arrived at `name`; returns the generation.

        Expected participants are the job's live workers when the barrier opens, or `expected`
        workers when given. Raises `strata.BarrierBroken` as soon as a participant fails or
        leaves, and `strata.BarrierTimeout` if it is not complete within `timeout` seconds.
        """
        self._check_tasks()
        self._registered("barrier()")
        if self._barriers is None:
            self._barriers = BarrierClient(self)
        outcome = await self._barriers.wait(name, timeout, expected)
        return outcome.generation
