"""The registry's failure detector: every few ticks of a heartbeat interval, the workers
silent past the timeout; a verdict only on proof that this registry hears (a marker written with
the stream's quorum and read back through the heartbeat reader), stored with a conditional write
within a bound of the decision. A heartbeat partition sends its verdicts to the leader
(`partitions`), which alone records failures.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import replace

import nats.errors
import nats.js.errors
import structlog
from strata.clock import monotonic_ns, wall
from strata.errors import ConflictError, StrataError
from strata.events import WorkerFailed, subjects
from strata.events.models import Event
from strata.services.registry import domain
from strata.services.registry.base import _fields
from strata.services.registry.heartbeats import HeartbeatIntake, stored_beat
from strata.services.registry.partitions import PartitionReports

log = structlog.get_logger("strata.registry")

HEARING_BOUND_SHARE = 0.5
"""Of the heartbeat timeout: how long proving that the registry hears may take
(`_heard_until`), and how long a failure decided on that proof may take to be stored
(`_record_failures`). Past it, the evidence is stale: the decision is dropped and made again."""


class FailureDetector(HeartbeatIntake, PartitionReports):
    def __init__(
        self, clock: Callable[[], float] = wall, liveness_ns: Callable[[], int] = monotonic_ns
    ) -> None:
        super().__init__(clock, liveness_ns)
        self._worker_seqs: dict[str, int] = {}
        """Per job, the stream sequence of the last event on its worker subjects folded here:
        what a failure's conditional write expects (`_record_failures`)."""

    async def _detect_failures(self) -> None:
        period = max(0.02, min(self.policy.heartbeat_interval, self.policy.heartbeat_timeout) / 4)
        mine = domain.DetectFailures(self.partition, self.partitions)
        deaf = False
        while True:
            await asyncio.sleep(period)
            try:
                if not await self._can_hear():
                    deaf = True
                    continue
                if deaf:
                    # Nobody could be heard meanwhile, so silence then is no evidence of failure:
                    # once hearing is proven again, the same fresh grace period as after a
                    # restart, counted from the proof.
                    heard = await self._heard_until()
                    if heard is None:
                        continue
                    domain.begin_grace(self.state, heard)
                    log.info("failure_detection_resumed", grace_s=self.policy.heartbeat_timeout)
                    deaf = False
                    continue
                # A first look on the state as it is: most ticks find nobody late and end here.
                first = replace(mine, liveness_ns=self._liveness_ns())
                if not domain.decide(self.state, first, self.now_ns(), self.policy).events:
                    continue
                heard_until = await self._heard_until()
                if heard_until is None:
                    deaf = True
                    continue
                judged = replace(mine, liveness_ns=heard_until)
                if not self.leader:
                    found = domain.decide(self.state, judged, self.now_ns(), self.policy).events
                    async with asyncio.timeout(self._bound_s()):
                        contradicted = await self._contradicted_by_stream(found)
                    if contradicted is None:
                        continue  # the stream could not be read: decided again on a later look
                    if contradicted:
                        found = domain.decide(self.state, judged, self.now_ns(), self.policy).events
                    await self._report_silences(found)
                    continue
                async with self.lock:
                    recorded = await self._record_failures(judged)
                for event in recorded:
                    log.warning("worker_failed", **_fields(event, "job", "worker_id", "reason"))
            except (StrataError, TimeoutError) as exc:
                log.error("failure_detection_failed", error=str(exc))

    def _bound_s(self) -> float:
        return self.policy.heartbeat_timeout * HEARING_BOUND_SHARE

    async def _can_hear(self) -> bool:
        """Whether the heartbeat intake may be reading: connected, its read loop alive, and no
        reconnect since the last look (heartbeats sent meanwhile were lost, so a reconnect is
        a time of deafness too). A dead read loop is replaced by a new connection."""
        nc = self._hb_nc
        if nc is None or not self._listening:
            return False
        if nc.is_closed or (nc.is_connected and not nc.reader_alive):
            # Connected with a dead reader (see `IntakeClient.reader_alive`), or given up on by
            # nats-py (or a reopening that failed): a new connection. While nats-py reconnects
            # by itself, the reader is down and the client not connected: it is left to that.
            log.error("heartbeat_reader_dead", hint="reconnecting the heartbeat intake")
            with contextlib.suppress(Exception):
                await nc.close()
            try:
                await self._open_intake()
            except (StrataError, nats.errors.Error, OSError, TimeoutError) as exc:
                log.error("heartbeat_intake_not_reopened", error=str(exc))
            return False
        if not nc.is_connected or not nc.reader_alive:
            return False
        reconnects = nc.stats["reconnects"]
        if reconnects != self._hb_reconnects:
            self._hb_reconnects = reconnects
            return False
        return True

    async def _heard_until(self) -> int | None:
        """A liveness-clock time before which every heartbeat sent to this registry has been
        applied, or None when that cannot be proven within `_bound_s`.

        The proof is a marker the registry writes through its heartbeat connection to a
        JetStream key (`subjects.registry_hearing`) and reads back through the same reader that
        applies heartbeats. The server delivers what it routed to this connection in order, and
        the intake applies each heartbeat as it reads it (`IntakeClient`), so once the marker is
        back, every heartbeat that reached the server before it is applied; the write's
        acknowledgement needs the stream's quorum, so a registry whose server is cut off from the
        cluster's majority (where the workers may be heartbeating) proves nothing. A PING would
        be answered by the registry's own server, cut off or not; and `flush(timeout)` is not
        used here at all (see `ReadingClient._process_pong` in `strata.bus.intake`).
        """
        nc = self._hb_nc
        if nc is None or not nc.reader_alive:
            return None
        started = self._liveness_ns()
        marker = secrets.token_bytes(16)
        arrived: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._markers[marker] = arrived
        bound = self._bound_s()
        try:
            async with asyncio.timeout(bound):
                await nc.jetstream().publish(
                    subjects.registry_hearing(self.partition), marker, timeout=bound
                )
                await arrived
        except (nats.errors.Error, TimeoutError) as exc:
            log.warning("hearing_not_proven", bound_s=bound, error=type(exc).__name__)
            return None
        finally:
            del self._markers[marker]
        return started

    async def _record_failures(self, judged: domain.DetectFailures) -> list[Event]:
        """Decide the failures `judged` finds and store them, each job's first one with a
        conditional write: it is stored only if no event on the job's worker subjects was stored
        after the last one this registry folded (the quorum's answer that nothing changed since
        the evidence), and only if stored within `_bound_s` of the decision. A refused write
        (a registration, a state change stored meanwhile) is decided again once those events are
        folded; a write not stored in time drops the decision, and the next look decides again
        on fresh evidence. Returns the failures stored."""
        decided = time.monotonic()
        bound = self._bound_s()
        by_job: dict[str, list[Event]] = defaultdict(list)
        for event in domain.decide(self.state, judged, self.now_ns(), self.policy).events:
            by_job[event.job].append(event)
        recorded: list[Event] = []
        checked: set[str] = set()
        for job, failures in by_job.items():
            while failures:
                remaining = bound - (time.monotonic() - decided)
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(remaining):
                        unchecked = [event for event in failures if event.id not in checked]
                        checked.update(event.id for event in unchecked)
                        contradicted = await self._contradicted_by_stream(unchecked)
                        if contradicted is None:
                            raise TimeoutError  # no evidence from the stream: dropped
                        if contradicted:
                            again = domain.decide(self.state, judged, self.now_ns(), self.policy)
                            failures = [event for event in again.events if event.job == job]
                            continue
                        ack = await self.bus.publish(
                            failures[0],
                            expected_last_subject_seq=self._worker_seqs.get(job, 0),
                            expected_subject=subjects.area_events(job, "worker"),
                        )
                except TimeoutError:
                    log.warning("failures_dropped", job=job, workers=len(failures), bound_s=bound)
                    break
                except ConflictError:
                    try:
                        await self.sync(deadline_s=max(remaining, 0.001))
                        async with asyncio.timeout(bound):
                            await self._learn_worker_seq(job)
                    except (StrataError, TimeoutError, nats.errors.Error) as exc:
                        log.warning("failures_dropped", job=job, error=str(exc))
                        break
                    again = domain.decide(self.state, judged, self.now_ns(), self.policy)
                    failures = [event for event in again.events if event.job == job]
                    continue
                await self.wait_applied(ack.seq)
                recorded.append(failures[0])
                if time.monotonic() - decided > bound:
                    # Stored, but on evidence too old for the others: they are decided again.
                    log.warning("failure_stored_late", job=job, bound_s=bound)
                    break
                await self.publish_all(failures[1:])
                recorded.extend(failures[1:])
                break
        return recorded

    async def _learn_worker_seq(self, job: str) -> None:
        """After a refused conditional write, once caught up with the stream: expect the last
        sequence the stream holds on the job's worker subjects from now on. Every event up to it
        is folded (or refused by the provenance rule, which changes nothing), so the evidence
        still stands on all of it; a registry restored from a snapshot folded none of a quiet
        job's worker events, which are older than the snapshot, and knew no sequence to expect."""
        try:
            msg = await self.bus.js.get_last_msg(
                subjects.EVENTS_STREAM, subjects.area_events(job, "worker")
            )
        except nats.js.errors.NotFoundError:
            return
        if msg.seq is not None and msg.seq <= self.last_seq:
            self._worker_seqs[job] = max(self._worker_seqs.get(job, 0), msg.seq)

    async def _contradicted_by_stream(self, failures: list[Event]) -> bool | None:
        """Check the failures about to be recorded (or reported to the leader) against the
        telemetry stream's record of each worker's heartbeats, read from the stream's leader
        right before the write (`domain.stream_contradicts`). A worker whose heartbeats the
        stream stored beyond the last one applied here is not silent, only unheard (a route of
        this registry's node cut while the workers heartbeat to the majority): it gets a fresh
        timeout instead. Returns whether any failure was contradicted (decide again), or None
        when the stream could not be read (the decision is dropped).

        Called right after the failures are decided, before anything is awaited: what the
        decision knew of each worker's heartbeats is taken as the call begins."""
        judged = [event for event in failures if isinstance(event, WorkerFailed)]
        # What each decision knew, taken before the first wait: heartbeats applied while the
        # stream is read (held by a cut that heals now) must not count as known to it.
        decided_on = {event.id: _last_beat_seq(self.state, event) for event in judged}

        async def last_stored(event: WorkerFailed) -> tuple[domain.Beat | None, int]:
            subject = subjects.heartbeat_subject(event.job, event.worker_id)
            try:
                # From the stream's leader, not a direct get: any replica answers those, and a
                # replica on this registry's side of a cut may not have the latest heartbeats yet.
                msg = await self.bus.js.get_last_msg(subjects.TELEMETRY_STREAM, subject)
            except nats.js.errors.NotFoundError:
                return None, 0
            return stored_beat(msg.data or b""), msg.seq or 0

        try:
            found = await asyncio.gather(*(last_stored(event) for event in judged))
        except nats.errors.Error as exc:
            log.warning("failures_unconfirmed", workers=len(judged), error=str(exc))
            return None
        contradicted = False
        for event, (stored, seq) in zip(judged, found, strict=True):
            job = self.state.jobs.get(event.job)
            member = job.members.get(event.worker_id) if job is not None else None
            if member is None or stored is None:
                continue
            if domain.stream_contradicts(
                member, stored, seq, self._listening_from, decided_on[event.id]
            ):
                domain.heard_in_stream(member, stored, self._liveness_ns())
                log.warning(
                    "failure_contradicted",
                    job=event.job,
                    worker_id=event.worker_id,
                    hint="its heartbeats reach the stream but not this registry: is a route "
                    "of this registry's NATS node cut?",
                )
                contradicted = True
        return contradicted


def _last_beat_seq(state: domain.RegistryState, failure: WorkerFailed) -> int | None:
    job = state.jobs.get(failure.job)
    member = job.members.get(failure.worker_id) if job is not None else None
    return member.last_beat_seq if member is not None else None
