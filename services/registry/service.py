"""The registry's NATS adapter: RPC commands, heartbeat intake, failure detection.

Membership changes only through events folded from the stream (see `Projection`). Heartbeats are
the exception: kept in memory (see `domain.observe_heartbeat`), with state changes they reveal
published in order off the heartbeat path.

Heartbeat intake can be split over several registry processes (`STRATA_REGISTRY_PARTITIONS`): each
takes in the heartbeat buckets of its partition (`subjects.partition_heartbeats`) and watches those
workers for silence. Partition 0 is the leader, the one writer of membership: it alone answers
requests, announces worlds, saves snapshots and records failures, the ones other partitions find
included (they send them to it, `subjects.registry_silences`, and it confirms them against its own
state), so every guarantee of a single registry holds with several.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import secrets
import time
import weakref
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import replace
from typing import Any, Final, Literal

import msgpack
import nats.errors
import structlog
from nats.aio.msg import Msg
from prometheus_client.core import CounterMetricFamily, Metric
from prometheus_client.registry import REGISTRY, Collector
from strata.bus import Bus, ConnectOptions, RpcServer, connect
from strata.clock import monotonic_ns, wall, wall_ns
from strata.config import Settings
from strata.errors import ConflictError, StrataError
from strata.events import (
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
    decode_event,
    encode_event,
    pack,
    provenance,
    subjects,
    unpack,
)
from strata.events.models import Event, plain_heartbeat
from strata.events.requests import (
    LEAVE,
    MEMBERS,
    REGISTER,
    LeaveRequest,
    LeaveResult,
    MembersRequest,
    MembersResult,
    RegisterRequest,
    WorkerNotice,
    WorldNotice,
)
from strata.metrics import MESSAGES_REJECTED, WORKERS_BY_STATUS
from strata.services.commit import GroupCommit
from strata.services.domain import Decision
from strata.services.projection import Projection
from strata.services.registry import domain
from strata.services.registry.domain import Leave, Policy, Register, RegistryState
from strata.services.registry.intake import IntakeClient

log = structlog.get_logger("strata.registry")

HEARTBEATS = "registry.heartbeats"
NoticeKind = Literal["reregister", "superseded"]
NOTIFIED_KEPT = 65_536
"""Re-registration notices remembered (to send one per interval) before old ones are dropped."""
RPC_CONCURRENCY = 4096
"""Requests in hand at once; each waits for its batch (see `strata.services.commit`)."""
WORLD_COALESCE_S = 0.05
"""How long a burst of membership changes is gathered into one world notice."""
WORLD_SPACING_PER_WORKER = 1e-4
"""Seconds between two world notices of one job, per live worker (see `world_spacing`)."""
WORLD_REPEAT_S = 2.0
"""Every job's world is announced again this often: a worker that missed a notice (a
reconnect, a registry restart) is current again within this time."""
SENDERS_KEPT = 200_000
"""Heartbeat subjects remembered as proven to belong to their worker (see `_take_heartbeat`)."""
SILENCE_REPORT_TIMEOUT_S = 5.0
"""How long a partition waits for the leader to take its report of silent workers; past it, the
report is sent again on a later look (at most once per interval)."""
PROGRESS_PER_MESSAGE = 5_000
"""Workers per progress report message (about 80 bytes each)."""
NOTICES_PER_CHECK = 1_000
"""Notices a heartbeat partition checks against one catch-up with the stream (`_still_true`)."""
HEARING_BOUND_SHARE = 0.5
"""Of the heartbeat timeout: how long proving that the registry hears may take
(`_heard_until`), and how long a failure decided on that proof may take to be stored
(`_record_failures`). Past it, the evidence is stale: the decision is dropped and made again."""


class _HeartbeatCounts(Collector):
    """Heartbeat totals of the registries in this process, read at scrape time.

    Counted as plain integers on the hot path: a Prometheus counter costs a lock per increment.
    """

    def __init__(self) -> None:
        self.registries: weakref.WeakSet[Registry] = weakref.WeakSet()

    def collect(self) -> Iterator[Metric]:
        received = CounterMetricFamily(
            "strata_registry_heartbeats_received",
            "Heartbeat messages taken off the bus, valid or not.",
        )
        applied = CounterMetricFamily(
            "strata_registry_heartbeats_applied",
            "Heartbeats that renewed a live member's liveness.",
        )
        registries = list(self.registries)
        received.add_metric([], sum(r.heartbeats for r in registries))
        applied.add_metric([], sum(r.applied for r in registries))
        yield received
        yield applied


HEARTBEAT_COUNTS = _HeartbeatCounts()
REGISTRY.register(HEARTBEAT_COUNTS)


class Registry(Projection[RegistryState]):
    name = "registry"

    def __init__(
        self, clock: Callable[[], float] = wall, liveness_ns: Callable[[], int] = monotonic_ns
    ) -> None:
        super().__init__(clock)
        # Silence is measured on a clock only moving forward; the wall clock stamps events.
        self._liveness_ns = liveness_ns
        self.policy = Policy()
        self.rejected: Counter[str] = Counter()
        self.heartbeats = 0
        self.applied = 0
        HEARTBEAT_COUNTS.registries.add(self)
        WORKERS_BY_STATUS.add(self)
        self.partition, self.partitions = 0, 1
        # The heartbeat path reads the clock once per heartbeat: the wall clock in ns directly
        # when it is the wall clock (no float round trip), else the injected one.
        self._beat_clock_ns: Callable[[], int] = wall_ns if clock is wall else self.now_ns
        self._rpc: RpcServer | None = None
        self._hb_nc: IntakeClient | None = None
        self._hb_reconnects = 0
        self._settings: Settings | None = None
        self._listening = False
        self._markers: dict[bytes, asyncio.Future[None]] = {}
        self._worker_seqs: dict[str, int] = {}
        """Per job, the stream sequence of the last event on its worker subjects folded here:
        what a failure's conditional write expects (`_record_failures`)."""
        self._senders: dict[bytes, tuple[str, str]] = {}
        self._outbox: asyncio.Queue[Event] = asyncio.Queue(maxsize=100_000)
        self._notices: asyncio.Queue[tuple[WorkerNotice, domain.Beat]] = asyncio.Queue(
            maxsize=100_000
        )
        self._reported: dict[str, float] = {}
        self._notified: dict[tuple[str, str, str], float] = {}
        self._notified_limit = NOTIFIED_KEPT
        self._worlds_changed: set[str] = set()
        self._world_wakeup = asyncio.Event()
        self._commits: GroupCommit[Register | Leave, Decision[bool]] = GroupCommit(
            self, self._decide_all, committed=self._committed
        )

    def initial_state(self) -> RegistryState:
        return RegistryState()

    def evolve(self, state: RegistryState, event: Event) -> RegistryState:
        state = domain.evolve(state, event)
        if isinstance(event, WorkerRegistered | WorkerFailed | WorkerLeft):
            self._worlds_changed.add(event.job)
            self._world_wakeup.set()
        if event.type.startswith("worker."):
            self._worker_seqs[event.job] = max(
                self._worker_seqs.get(event.job, 0), self.folding_seq
            )
        if self.live and isinstance(event, WorkerRegistered):
            # Folded late (a slow stream, a reconnect): the registration is a sign of life now,
            # not only when it was decided, or the worker would be failed on arrival. On the
            # liveness clock: the event's wall-clock stamp may be anywhere after a clock step.
            member = state.job(event.job).members[event.worker_id]
            member.last_seen_ns = self._liveness_ns()
        return state

    def _on_reject(self, subject: str, error: StrataError) -> None:
        super()._on_reject(subject, error)
        # A message refused on a job's worker subjects is still the last one stored there: a
        # failure's conditional write must expect it, or it would be refused for ever.
        with contextlib.suppress(ValueError):
            job, event_type = subjects.parse_event_subject(subject)
            if event_type.startswith("worker.") and self._feed is not None:
                self._worker_seqs[job] = max(self._worker_seqs.get(job, 0), self._feed.position)

    def worker_statuses(self) -> dict[str, list[str]]:
        """Each job's workers' statuses now (`strata_workers`), once this registry is live: one
        still replaying its history would report a membership of the past."""
        if not self.live or not self.leader:
            return {}
        return {
            job.job: [member.status for member in job.members.values()]
            for job in self.state.jobs.values()
        }

    def snapshot(self, state: RegistryState) -> dict[str, Any]:
        return domain.snapshot(state)

    def restore(self, data: dict[str, Any]) -> RegistryState:
        return domain.restore(data)

    @property
    def leader(self) -> bool:
        """Partition 0: the registry process that decides membership."""
        return self.partition == 0

    async def save_snapshot(self) -> None:
        # Every partition folds the same stream; the leader's snapshot serves them all.
        if self.leader:
            await super().save_snapshot()

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        self.policy = Policy(settings.heartbeat_interval, settings.heartbeat_timeout)
        self.partition, self.partitions = settings.registry_partition, settings.registry_partitions
        self._settings = settings
        domain.begin_grace(self.state, self._liveness_ns())
        await self._open_intake()
        self._listening = True
        log.info("heartbeat_intake", partition=self.partition, partitions=self.partitions)
        self.spawn(self._detect_failures(), "detector")
        self.spawn(self._drain_outbox(), "outbox")
        self.spawn(self._send_notices(), "notices")
        if not self.leader:
            self.spawn(self._report_progress(), "progress")
            return
        await bus.nc.subscribe(subjects.registry_silences(), cb=self._on_silences)
        await bus.nc.subscribe(subjects.registry_progress(), cb=self._on_progress)
        # Requests are taken concurrently and decided in batches (group commit): a job's start
        # is a few round trips to the stream, not one per worker.
        self._rpc = await self.rpc_server(bus, settings, concurrency=RPC_CONCURRENCY)
        self._rpc.serve(REGISTER, self._register)
        self._rpc.serve(LEAVE, self._leave)
        self._rpc.serve(MEMBERS, self._members)
        await self._rpc.start()
        self.spawn(self._commits.run(), "commits")
        self.spawn(self._announce_worlds(), "worlds")

    async def _open_intake(self) -> None:
        """Connect the heartbeat intake and subscribe its subjects (again after a dead reader)."""
        settings = self._settings
        assert settings is not None
        # Heartbeats come on a connection of their own: a flood of them must not queue this
        # registry's requests, replies and event feed behind it in one socket.
        nc = await connect(
            settings.nats_servers,
            ConnectOptions(
                name=f"strata-registry-heartbeats-{self.partition}",
                user=settings.nats_user,
                password=settings.nats_password,
            ),
            client=IntakeClient,
        )
        assert isinstance(nc, IntakeClient)
        for pattern in subjects.partition_heartbeats(self.partition, self.partitions):
            await nc.subscribe_direct(pattern, self._take_heartbeat)
        await nc.subscribe_direct(subjects.registry_hearing(self.partition), self._take_marker)
        # The subscriptions are in place at the server before anyone is judged. (This client
        # survives a late PONG: see `IntakeClient._process_pong`.)
        await nc.flush()
        self._hb_nc, self._hb_reconnects = nc, nc.stats["reconnects"]

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()
        self._listening = False
        if self._hb_nc is not None and not self._hb_nc.is_closed:
            with contextlib.suppress(Exception):
                await self._hb_nc.close()

    def _decide_all(self, commands: list[Register | Leave]) -> list[Decision[bool]]:
        return domain.decide_all(self.state, commands, self.now_ns(), self.policy)

    # -- commands ---------------------------------------------------------------------------------

    async def _register(self, request: RegisterRequest) -> dict[str, Any]:
        worker_id = domain.worker_id_for(request)

        def answer(decision: Decision[bool]) -> dict[str, Any]:
            job = self.state.job(request.job)
            return domain.registration_reply(
                job, worker_id, self.policy, rejoined=bool(decision.result)
            )

        return await self._commits.submit(Register(request), answer)

    def _committed(self, commands: list[Register | Leave], decisions: list[Decision[bool]]) -> None:
        """One line per job and batch: a job start of thousands of workers is a few lines."""
        registered: Counter[str] = Counter()
        for decision in decisions:
            for event in decision.events:
                if isinstance(event, WorkerRegistered):
                    registered[event.job] += 1
                elif isinstance(event, WorkerFailed):
                    log.warning("worker_failed", **_fields(event, "job", "worker_id", "reason"))
        for name, count in registered.items():
            job = self.state.job(name)
            log.info(
                "workers_registered",
                job=name,
                count=count,
                world_size=job.world_size,
                membership_epoch=job.membership_epoch,
            )

    async def _leave(self, request: LeaveRequest) -> LeaveResult:
        def answer(_: Decision[bool]) -> LeaveResult:
            return domain.leave_result(self.state.job(request.job), request.worker_id)

        return await self._commits.submit(Leave(request), answer)

    async def _members(self, request: MembersRequest) -> MembersResult:
        return domain.members(self.state, request.job, request.include_gone)

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

    def _take_marker(self, subject: bytes, data: bytes) -> None:
        arrived = self._markers.get(data)
        if arrived is not None and not arrived.done():
            arrived.set_result(None)

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
        used here at all (see `IntakeClient._process_pong`).
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
        for job, failures in by_job.items():
            while failures:
                remaining = bound - (time.monotonic() - decided)
                try:
                    if remaining <= 0:
                        raise TimeoutError
                    async with asyncio.timeout(remaining):
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
                    except (StrataError, TimeoutError) as exc:
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

    # -- heartbeats -------------------------------------------------------------------------------

    def _reject(self, code: str) -> None:
        self.rejected[code] += 1
        MESSAGES_REJECTED.labels(HEARTBEATS, code).inc()

    def _take_heartbeat(self, subject: bytes, data: bytes) -> None:
        """One heartbeat, as the intake parses it (`IntakeClient`): a plain call, no task, no
        lock, no log line on the path almost every heartbeat takes."""
        self.heartbeats += 1
        beat = fast_beat(data)
        # The fast path takes only heartbeats whose source is their worker (`plain_heartbeat`),
        # on a subject already proven to be that worker's (`provenance.heartbeat_belongs`).
        sender = self._senders.get(subject)
        if beat is None or sender is None or sender[0] != beat.job or sender[1] != beat.worker_id:
            beat = self._slow_beat(subject, data, beat)
            if beat is None:
                return
        outcome = domain.observe_beat(self.state, beat, self._beat_clock_ns(), self._liveness_ns())
        if outcome is domain.ALIVE:
            self.applied += 1
            return
        if outcome.rejected is not None:
            self._reject(outcome.rejected)
        elif outcome.reregister is None:
            self.applied += 1
        for changed in outcome.events:
            try:
                self._outbox.put_nowait(changed)
            except asyncio.QueueFull:
                self._reject("outbox_full")
        if outcome.reregister is not None:
            self._notify(beat, "reregister", outcome.reregister)
        elif outcome.superseded is not None:
            self._notify(beat, "superseded", outcome.superseded)

    def _slow_beat(
        self, subject: bytes, data: bytes, beat: domain.Beat | None
    ) -> domain.Beat | None:
        """A heartbeat the fast path could not vouch for: its subject checked (and remembered
        when it belongs to its worker), or the full decode and checks."""
        text = subject.decode(errors="replace")
        if beat is not None and provenance.heartbeat_belongs(
            text, beat.job, beat.worker_id, beat.worker_id
        ):
            if len(self._senders) >= SENDERS_KEPT:
                self._senders.clear()  # strangers or garbage ids must not grow this forever
            self._senders[subject] = (beat.job, beat.worker_id)
            return beat
        return self._checked_beat(text, data)

    def _checked_beat(self, subject: str, data: bytes) -> domain.Beat | None:
        """The full decode and checks, for what the fast path left: a beat, or None (counted)."""
        try:
            event = decode_event(data)
        except StrataError as exc:
            self._reject(exc.code)
            return None
        if not isinstance(event, WorkerHeartbeat):
            self._reject("not_a_heartbeat")
            return None
        refused = provenance.heartbeat_refusal(subject, event)
        if refused is not None:
            self._reject(refused.code)
            return None
        return domain.Beat(
            event.job,
            event.worker_id,
            event.instance,
            event.seq,
            event.state,
            event.step,
            event.epoch,
        )

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

    async def _drain_outbox(self) -> None:
        """State changes seen in heartbeats, published in order, off the heartbeat path."""
        while True:
            event = await self._outbox.get()
            try:
                await self.bus.publish(event)
            except StrataError as exc:
                log.error("state_change_not_published", error=str(exc))


def world_spacing(world_size: int) -> float:
    """The least time between two world notices of a job of `world_size` workers: each notice
    reaches every worker, so a notice per coalescing window at 10,000 workers would be 200,000
    messages a second; spaced by size, it is at most 10,000 (a notice a second at 10,000)."""
    return max(WORLD_COALESCE_S, world_size * WORLD_SPACING_PER_WORKER)


# -- fast heartbeat decoding ----------------------------------------------------------------------

_MAX_FAST_BYTES: Final = 4096


def fast_beat(data: bytes) -> domain.Beat | None:
    """The `Beat` of a heartbeat in the exact shape the SDK sends, or None for anything else.

    `decode_event` validates the whole pydantic model (most of a heartbeat's cost); this takes
    the model's own fast path (`strata.events.models.plain_heartbeat`: the same verdicts, the
    same bounds) and leaves whatever it does not accept to the full decoder.
    """
    if len(data) > _MAX_FAST_BYTES:
        return None
    try:
        # msgpack's defaults are the codec's options (raw=False, strict_map_key=True); spelling
        # them out as keywords doubles the cost of this call.
        obj = msgpack.unpackb(data)
    except Exception:  # the full decoder reports what is wrong with it
        return None
    facts = plain_heartbeat(obj)
    return None if facts is None else domain.Beat(*facts)


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


def _fields(event: Event, *names: str) -> dict[str, Any]:
    return {name: getattr(event, name) for name in names}


def create() -> Registry:
    return Registry()
