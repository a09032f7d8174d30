"""What a heartbeat partition tells the leader (partition 0), on core NATS: the workers it
found silent (a request; the leader confirms them against its own state and records them) and,
every interval, its workers' last heartbeat, step and epoch (which the leader's `members`
answers show: it hears none of them)."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Callable

import nats.errors
import structlog
from nats.aio.msg import Msg
from strata.clock import monotonic_ns, wall
from strata.events import WorkerFailed, decode_event, encode_event, pack, subjects, unpack
from strata.events.models import Event
from strata.metrics import MESSAGES_REJECTED
from strata.services.registry import domain
from strata.services.registry.base import RegistryBase, _fields

log = structlog.get_logger("strata.registry")

SILENCE_REPORT_TIMEOUT_S = 5.0
"""How long a partition waits for the leader to take its report of silent workers; past it, the
report is sent again on a later look (at most once per interval)."""
PROGRESS_PER_MESSAGE = 5_000
"""Workers per progress report message (about 80 bytes each)."""


class PartitionReports(RegistryBase):
    def __init__(
        self, clock: Callable[[], float] = wall, liveness_ns: Callable[[], int] = monotonic_ns
    ) -> None:
        super().__init__(clock, liveness_ns)
        self._reported: dict[str, float] = {}

    async def _report_silences(self, found: list[Event]) -> None:
        """Send the failures this partition found to the leader, which records them
        (`domain.confirm_failures`); one still live on the next look is sent again, at most once
        per heartbeat interval."""
        now = time.monotonic()
        interval = self.policy.heartbeat_interval
        self._reported = {key: t for key, t in self._reported.items() if now - t < interval}
        fresh = [event for event in found if event.id not in self._reported]
        if not fresh:
            return
        for event in fresh:
            self._reported[event.id] = now
        try:
            await self.bus.nc.request(
                subjects.registry_silences(),
                pack([encode_event(event) for event in fresh]),
                timeout=SILENCE_REPORT_TIMEOUT_S,
            )
        except (nats.errors.Error, TimeoutError) as exc:
            log.error("silences_not_reported", workers=len(fresh), error=str(exc))
            return
        for event in fresh:
            log.info("worker_silent", **_fields(event, "job", "worker_id", "reason"))

    async def _on_silences(self, msg: Msg) -> None:
        """The leader's side of `_report_silences`: record the failures still true here."""
        try:
            found = [decode_event(item) for item in unpack(msg.data)]
        except Exception as exc:  # a malformed report is dropped, never stops the leader
            MESSAGES_REJECTED.labels("registry.silences", "malformed").inc()
            log.warning("silences_rejected", error=str(exc))
            return
        failures = [
            event
            for event in found
            if isinstance(event, WorkerFailed) and event.source == domain.SOURCE
        ]
        async with self.lock:
            events = domain.confirm_failures(self.state, failures)
            await self.publish_all(events)
        for event in events:
            log.warning("worker_failed", **_fields(event, "job", "worker_id", "reason"))
        if msg.reply:
            with contextlib.suppress(Exception):
                await msg.respond(pack(len(events)))

    async def _report_progress(self) -> None:
        """Every interval, tell the leader when this partition's workers last heartbeated and
        their step and epoch, which its `members` answers show (it hears none of them)."""
        since_ns = 0
        while True:
            await asyncio.sleep(self.policy.heartbeat_interval)
            now_ns = self._beat_clock_ns()
            found = domain.progress_since(self.state, since_ns, self.partition, self.partitions)
            since_ns = now_ns
            for first in range(0, len(found), PROGRESS_PER_MESSAGE):
                with contextlib.suppress(Exception):  # the next report carries it again
                    await self.bus.nc.publish(
                        subjects.registry_progress(),
                        pack(found[first : first + PROGRESS_PER_MESSAGE]),
                    )

    async def _on_progress(self, msg: Msg) -> None:
        try:
            progress = [_progress(item) for item in unpack(msg.data)]
        except Exception as exc:  # a malformed report is dropped, never stops the leader
            MESSAGES_REJECTED.labels("registry.progress", "malformed").inc()
            log.warning("progress_rejected", error=str(exc))
            return
        domain.apply_progress(self.state, progress)


def _progress(item: object) -> domain.Progress:
    """One entry of a progress report, checked: (job, worker id, instance, ns, step, epoch)."""
    if not isinstance(item, list) or len(item) != 6:
        raise ValueError(f"a progress entry is a list of 6, not {item!r:.80}")
    job, worker_id, instance, heard, step, epoch = item
    if not all(type(v) is str for v in (job, worker_id, instance)):
        raise ValueError("job, worker id and instance of a progress entry are strings")
    if not all(type(v) is int and v >= 0 for v in (heard, step, epoch)):
        raise ValueError("time, step and epoch of a progress entry are integers >= 0")
    return job, worker_id, instance, heard, step, epoch
