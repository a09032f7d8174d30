"""The worker's heartbeats: its progress (state, step, epoch) sent to the registry on a cadence."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Final

from nats.aio.client import Client as NATS

from strata._checks import check_int
from strata.aio._core import _check_state, _WorkerCore
from strata.events import LiveState, WorkerHeartbeat
from strata.events.models import MAX_EPOCH, MAX_STEP

PROBE_TIMEOUT_S: Final = 600
"""How long a PING confirming heartbeats may wait for its PONG. Never shorter: nats-py 2.16's
`flush(timeout)` cancels its future on a timeout, and a PONG arriving afterwards raises in the
client's read loop and stops it. A connection without PONGs for this long has been dropped by
the client's own PINGs (every 10 s, 3 outstanding) well before, and a dropped connection's
futures are forgotten (a reconnect sends a new PING, `_probe_beats`)."""


class _Heartbeats(_WorkerCore):
    """Progress and heartbeats; see `strata.aio.Worker`."""

    async def set_state(
        self, state: LiveState, *, step: int | None = None, epoch: int | None = None
    ) -> None:
        """Record what the worker is doing; a new state is announced at once, step and epoch
        alone ride on the next heartbeat (so calling this every step costs no messages)."""
        if self._record_progress(state, step, epoch) and self._started:
            await self._beat()

    def _record_progress(self, state: object, step: object, epoch: object) -> bool:
        """Validate and keep the new progress; True when the state itself changed. Raises a
        background task's death first (the sync and async `set_state` both come here)."""
        self._check_tasks()
        previous_state, previous_step, previous_epoch = self._progress
        new_state = _check_state(state)
        new_step = previous_step if step is None else check_int("step", step, 0, MAX_STEP)
        new_epoch = previous_epoch if epoch is None else check_int("epoch", epoch, 0, MAX_EPOCH)
        self._progress = (new_state, new_step, new_epoch)
        return new_state != previous_state

    def _suspend_heartbeats(self, suspended: bool) -> None:
        """Stop or resume sending heartbeats while everything else keeps running (tests)."""
        self._heartbeats_suspended = suspended

    async def _heartbeat_loop(self) -> None:
        next_beat = time.monotonic()
        while True:
            await self._beat()
            interval = self._registered("heartbeat interval").heartbeat_interval
            next_beat += interval
            delay = next_beat - time.monotonic()
            if delay < 0:
                if -delay > self.heartbeat_timeout / 2:
                    self._log.warning(
                        "heartbeat_late",
                        late_s=round(-delay, 3),
                        hint="something blocked the event loop; the registry may mark this "
                        "worker failed",
                    )
                # Beat now and keep the cadence from here, rather than a burst to catch up.
                next_beat, delay = time.monotonic(), 0.0
            await asyncio.sleep(delay)

    async def _beat(self) -> None:
        """Publish one heartbeat; a failure is logged and the next beat tries again."""
        bus = self._bus
        if (
            bus is None
            or self._heartbeats_suspended
            or self._superseded is not None
            or self._rejoining
        ):
            return
        try:
            sent_at = time.monotonic()
            cpu_percent, rss_bytes = self._sampler.sample()
            gpu_util, gpu_mem = self._sampler.gpu()
            self._seq += 1
            state, step, epoch = self._progress
            heartbeat = WorkerHeartbeat(
                job=self._job,
                source=self._worker_id,
                worker_id=self._worker_id,
                instance=self._instance,
                seq=self._seq,
                state=state,
                step=step,
                epoch=epoch,
                cpu_percent=cpu_percent,
                rss_bytes=rss_bytes,
                gpu_util_percent=gpu_util,
                gpu_mem_bytes=gpu_mem,
            )
            await bus.publish_telemetry(heartbeat)
            self._beat_sent_at = sent_at
            self._probe_beats(bus.nc)
        except Exception as exc:
            self._heartbeat_failures += 1
            if self._heartbeat_failures == 1 or self._heartbeat_failures % 100 == 0:
                self._log.warning(
                    "heartbeat_failed",
                    error=f"{type(exc).__name__}: {exc}",
                    failures=self._heartbeat_failures,
                )
            return
        if self._heartbeat_failures:
            self._log.info("heartbeat_recovered", after_failures=self._heartbeat_failures)
            self._heartbeat_failures = 0

    def _probe_beats(self, nc: NATS) -> None:
        """Confirm the heartbeats sent so far with a PING: its PONG proves NATS received them,
        which renews the lease from the time the last of them was sent. One PING at a time per
        connection; a reconnect forgets the PINGs of the old one, so a new one goes out."""
        connection = (nc, nc.stats.get("reconnects", 0))
        if self._probe is not None and self._probe[0] == connection and not self._probe[1].done():
            return
        task = asyncio.get_running_loop().create_task(self._confirm_beats(nc, self._beat_sent_at))
        self._probe = (connection, task)

    async def _confirm_beats(self, nc: NATS, sent_at: float) -> None:
        with contextlib.suppress(Exception):
            await nc.flush(timeout=PROBE_TIMEOUT_S)
            self._confirm_beat(sent_at)
