"""The registry's notices to workers: "register again" or "superseded" to one worker
(`strata.ctl.<job>.<worker>`), and each job's world (membership epoch, size) to all of its
workers (`strata.world.<job>`), both on core NATS and off the heartbeat path."""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable
from typing import Literal

import structlog
from strata.clock import monotonic_ns, wall
from strata.errors import StrataError
from strata.events import pack, subjects
from strata.events.requests import WorkerNotice, WorldNotice
from strata.services.registry import domain
from strata.services.registry.base import RegistryBase

log = structlog.get_logger("strata.registry")

NoticeKind = Literal["reregister", "superseded"]
NOTIFIED_KEPT = 65_536
"""Re-registration notices remembered (to send one per interval) before old ones are dropped."""
WORLD_COALESCE_S = 0.05
"""How long a burst of membership changes is gathered into one world notice."""
WORLD_SPACING_PER_WORKER = 1e-4
"""Seconds between two world notices of one job, per live worker (see `world_spacing`)."""
WORLD_REPEAT_S = 2.0
"""Every job's world is announced again this often: a worker that missed a notice (a
reconnect, a registry restart) is current again within this time."""
NOTICES_PER_CHECK = 1_000
"""Notices a heartbeat partition checks against one catch-up with the stream (`_still_true`)."""


class Notices(RegistryBase):
    def __init__(
        self, clock: Callable[[], float] = wall, liveness_ns: Callable[[], int] = monotonic_ns
    ) -> None:
        super().__init__(clock, liveness_ns)
        self._notices: asyncio.Queue[tuple[WorkerNotice, domain.Beat]] = asyncio.Queue(
            maxsize=100_000
        )
        self._notified: dict[tuple[str, str, str], float] = {}
        self._notified_limit = NOTIFIED_KEPT
        self._worlds_changed: set[str] = set()
        self._world_wakeup = asyncio.Event()

    def _notify(self, beat: domain.Beat, kind: NoticeKind, reason: str) -> None:
        """Tell the process that sent `beat` to register again, or that a newer process holds
        its worker id: at most once per heartbeat interval (sent off the heartbeat path)."""
        job, worker_id = beat.job, beat.worker_id
        # Per process: a notice for a stale process must not stand in for one to the live one.
        key = (job, worker_id, beat.instance)
        now = time.monotonic()
        if now - self._notified.get(key, 0.0) < self.policy.heartbeat_interval:
            return
        if len(self._notified) >= self._notified_limit:
            # Only recent notices matter; forgetting the rest keeps a stream of strangers
            # (or of garbage ids) from growing this without bound.
            interval = self.policy.heartbeat_interval
            self._notified = {k: t for k, t in self._notified.items() if now - t < interval}
            self._notified_limit = max(NOTIFIED_KEPT, 2 * len(self._notified))
        self._notified[key] = now
        notice = WorkerNotice(
            job=job, worker_id=worker_id, kind=kind, reason=reason, instance=beat.instance
        )
        with contextlib.suppress(asyncio.QueueFull):
            self._notices.put_nowait((notice, beat))

    async def _send_notices(self) -> None:
        while True:
            pending = [await self._notices.get()]
            while not self._notices.empty() and len(pending) < NOTICES_PER_CHECK:
                pending.append(self._notices.get_nowait())
            if not self.leader:
                pending = await self._still_true(pending)
            for notice, _ in pending:
                with contextlib.suppress(Exception):
                    await self.bus.nc.publish(
                        subjects.control_subject(notice.job, notice.worker_id),
                        pack(notice.model_dump()),
                    )

    async def _still_true(
        self, pending: list[tuple[WorkerNotice, domain.Beat]]
    ) -> list[tuple[WorkerNotice, domain.Beat]]:
        """The notices that hold once this partition has folded every event stored so far.

        The leader answers a registration only once it has folded it, so the worker's first
        heartbeat never finds it behind; another partition folds the stream at its own pace and
        may not know yet of a registration, a rejoin or a restart that the leader just made.
        Telling that worker to register again (or, a restarted one, that it was superseded)
        would be wrong, so such a heartbeat is judged again once this partition caught up.
        """
        try:
            await self.sync()
        except (StrataError, TimeoutError) as exc:
            log.warning("notices_deferred", notices=len(pending), error=str(exc))
            return []  # the sender's next heartbeat asks again
        kept = []
        for notice, beat in pending:
            outcome = domain.observe_beat(
                self.state, beat, self._beat_clock_ns(), self._liveness_ns()
            )
            for changed in outcome.events:
                with contextlib.suppress(asyncio.QueueFull):
                    self._outbox.put_nowait(changed)
            if outcome.reregister is not None:
                kept.append(
                    (
                        notice.model_copy(
                            update={"kind": "reregister", "reason": outcome.reregister}
                        ),
                        beat,
                    )
                )
            elif outcome.superseded is not None:
                kept.append(
                    (
                        notice.model_copy(
                            update={"kind": "superseded", "reason": outcome.superseded}
                        ),
                        beat,
                    )
                )
            else:
                self.applied += 1
        return kept

    async def _announce_worlds(self) -> None:
        """A job's world (membership epoch, size) on its world subject: once per burst of
        changes, and again every `WORLD_REPEAT_S` for workers that missed one.

        Every worker of a job listens here instead of to every membership event: a job start
        of N registrations then costs each worker a handful of notices, not N events, and the
        whole job O(N) messages, not O(N^2). A job's notices are spaced by `world_spacing`, so
        while its membership keeps changing (a start of thousands) the fan-out stays under
        1 / `WORLD_SPACING_PER_WORKER` messages a second whatever the job's size.
        """
        last_repeat = time.monotonic()
        announced: dict[str, float] = {}
        while True:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(WORLD_REPEAT_S):
                    await self._world_wakeup.wait()
            # Let the burst finish: registrations arrive together when a job starts.
            await asyncio.sleep(WORLD_COALESCE_S)
            self._world_wakeup.clear()
            now = time.monotonic()
            if now - last_repeat >= WORLD_REPEAT_S:
                last_repeat = now
                self._worlds_changed |= {
                    name for name, job in self.state.jobs.items() if job.world_size
                }
            due = []
            for name in sorted(self._worlds_changed):
                job = self.state.jobs.get(name)
                if job is None or now - announced.get(name, -math.inf) >= world_spacing(
                    job.world_size
                ):
                    due.append(name)
            self._worlds_changed.difference_update(due)
            if self._worlds_changed:
                self._world_wakeup.set()  # the rest are announced once their spacing is over
            for name in due:
                job = self.state.jobs.get(name)
                if job is None:
                    announced.pop(name, None)
                    continue
                announced[name] = now
                notice = WorldNotice(
                    job=name, membership_epoch=job.membership_epoch, world_size=job.world_size
                )
                with contextlib.suppress(Exception):
                    await self.bus.nc.publish(
                        subjects.world_subject(name), pack(notice.model_dump())
                    )


def world_spacing(world_size: int) -> float:
    """The least time between two world notices of a job of `world_size` workers: each notice
    reaches every worker, so a notice per coalescing window at 10,000 workers would be 200,000
    messages a second; spaced by size, it is at most 10,000 (a notice a second at 10,000)."""
    return max(WORLD_COALESCE_S, world_size * WORLD_SPACING_PER_WORKER)
