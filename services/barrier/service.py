"""The barrier service's NATS adapter: arrivals over RPC, decided in batches; outcomes as events.

Release latency is the product here, so nothing waits for JetStream on the way to a release. The
arrivals waiting at a moment are decided by one task, as a batch, in memory
(`Projection.apply_before_storage`: the domain's `evolve` is idempotent and folds them again,
unchanged, when they come back from the stream). The batch's openings and conclusions
(`barrier.opened|released|broken|timed_out`) are then written to the connection, in order, and
only after that are the callers answered, on the same connection: whoever learns an outcome
learns it from a message the server received after the event that records it. Their
acknowledgements are collected in the background. `barrier.arrived` events are a record for the
dashboard and `strata replay`, not a proof: they are written after the generation's conclusion,
or once no arrival came for `barrier_record_arrivals_s` (so that writing them, and folding them
back from the stream, does not delay the decisions of a burst). After a crash, waiters re-send their
arrivals and the generation is rebuilt from them (see docs/barriers.md, "Crash recovery").
Deadlines run on this process's monotonic clock; the wall clock only stamps events (and carries
a deadline's remaining time across a restart: docs/barriers.md, "Time"). A waiter that gives up
withdraws its arrival (`withdraw`), decided under the same lock as the arrivals.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import nats.errors
import structlog
from nats.js.api import PubAck
from strata import clock
from strata.bus import Bus, RpcServer
from strata.bus.publish import MSG_ID, publish_bytes
from strata.config import Settings
from strata.errors import ServiceUnavailable, StrataError
from strata.events import (
    BarrierBrokenEvent,
    BarrierReleased,
    BarrierTimedOut,
    WorkerFailed,
    WorkerLeft,
    encode_event,
    subject_for,
)
from strata.events.models import Event
from strata.events.requests import (
    ARRIVE,
    LIVE_REPORT,
    WITHDRAW,
    ArriveRequest,
    LiveReportRequest,
    WithdrawRequest,
    WithdrawResult,
)
from strata.metrics import observe_decided
from strata.services.barrier import domain
from strata.services.barrier.domain import BarrierState
from strata.services.projection import Projection

log = structlog.get_logger("strata.barrier")

TIMEOUT_CHECK_S = 0.05
STALL_S = 0.5
"""A gap this long between two deadline checks means the process was stopped (SIGSTOP, swap)
or starved, and one this long without hearing its own pulse (a message it sends itself with
each check) that its connection held everything (a black-holed link): requests read just after
may have been sent when the gap began."""
CATCH_UP_S = 0.5
"""How long after a stall the requests read are taken as possibly sent when it began."""
STOP_FLUSH_S = 5.0
ACK_WAIT_S = 2.0
MAX_BATCH = 1024
RECORD_AT_LATEST = 8
RECORD_AFTER_CONCLUSION_S = 0.01
RECORD_SLICE = 64
Key = tuple[str, str, int]
Sent = tuple[Event, bytes, "asyncio.Future[PubAck] | None"]
Conclusion = BarrierReleased | BarrierBrokenEvent | BarrierTimedOut
Request = ArriveRequest | WithdrawRequest


class Barrier(Projection[BarrierState]):
    name = "barrier"

    def __init__(self, wall: Callable[[], float] = clock.wall) -> None:
        super().__init__(wall)
        self._rpc: RpcServer | None = None
        self._queue: list[tuple[Request, asyncio.Future[dict[str, Any]]]] = []
        self._wakeup = asyncio.Event()
        self._unrecorded: list[domain.Arrival] = []
        """`barrier.arrived` events decided and not written yet, in decision order."""
        self._unrecorded_since = 0.0
        self._last_arrival_at = 0.0
        self._concluded_at = math.inf
        self._record_after_s = 1.0
        self._background: set[asyncio.Task[None]] = set()
        self._stopped_deciding = ""
        """Why the service decides nothing more (a decision it could not store), if it stopped."""
        self.batches = 0
        self.arrivals = 0
        self._checked_ns = clock.monotonic_ns()
        """When the deadline check last ran (monotonic): a long gap since is a stall."""
        self._stall: tuple[int, int] | None = None
        """The last stall seen: (when it began, when it ended), monotonic."""
        self._heard_ns = self._checked_ns
        """When this process last heard its own pulse (monotonic)."""
        self._pulse = ""

    def initial_state(self) -> BarrierState:
        return BarrierState()

    def reading(self) -> clock.TimeBase:
        """Both clocks now: the monotonic one for deadlines, the wall one (`clock`) for stamps."""
        return clock.TimeBase(clock.monotonic_ns(), self.now_ns())

    def evolve(self, state: BarrierState, event: Event) -> BarrierState:
        # A folded event's wall-clock deadline is placed on this process's monotonic clock.
        state.clock = self.reading()
        return domain.evolve(state, event)

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        self._record_after_s = settings.barrier_record_arrivals_s
        self._checked_ns = self._heard_ns = clock.monotonic_ns()  # catching up is no stall
        self._pulse = bus.nc.new_inbox()
        await bus.nc.subscribe(self._pulse, cb=self._heard)
        # Conclusions decided before a crash but never stored are owed before new arrivals.
        async with self.lock:
            owed = domain.recover(self.state, *self.reading())
            self.apply_before_storage(owed)
            await self._send(owed)
            self._concluded(owed)
        self.spawn(self._decide_batches(), "arrivals")
        self._rpc = await self.rpc_server(bus, settings, concurrency=MAX_BATCH)
        self._rpc.serve(ARRIVE, self._arrive)
        self._rpc.serve(WITHDRAW, self._withdraw)
        self._rpc.serve(LIVE_REPORT, self._live_report)
        await self._rpc.start()
        self.spawn(self._time_out(), "timeouts")

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()
        await self._record_arrivals()
        if self._background:
            await asyncio.wait(self._background, timeout=STOP_FLUSH_S)

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = self.spawn(coro, "acks")
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    # -- writing events ----------------------------------------------------------------------------

    async def _send(self, events: Sequence[Event], *, record: bool = False) -> None:
        """Write `events` to the connection, in order, and return without waiting for their
        acknowledgements (a background task collects them, re-sending what got none: each id
        makes a re-send harmless). Anything written to the connection after this returns
        reaches the server after these events."""
        if not events:
            return
        js = self.bus.js
        sent: list[Sent] = []
        for event in events:
            payload = encode_event(event)
            try:
                ack: asyncio.Future[PubAck] | None = await js.publish_async(
                    subject_for(event), payload, headers={MSG_ID: event.id}
                )
            except (TimeoutError, nats.errors.Error):
                # Not even written (the connection's buffer is full, or it is closed): store a
                # decision now, through the usual retries, before anything is said about it (a
                # record is left to the background re-send).
                if not record:
                    await self._store_or_stop(event, payload)
                ack = None
            sent.append((event, payload, ack))
        self._in_background(self._settle_acks(sent, record=record))

    async def _store_or_stop(self, event: Event, payload: bytes) -> None:
        try:
            await publish_bytes(
                self.bus.js, subject_for(event), payload, event.id, options=self.bus.publish_options
            )
        except StrataError as exc:
            # The state holds a decision the stream may never get: stop deciding, so that
            # nobody is told it, until a restart rebuilds the state from the stream.
            self._stopped_deciding = f"could not store {event.type} ({exc.message})"
            log.error("barrier_decision_not_stored", event=event.type, error=exc.message)
            raise ServiceUnavailable(self._stopped_message()) from exc

    def _stopped_message(self) -> str:
        return (
            f"the barrier service {self._stopped_deciding} and decides nothing more: restart it "
            "(it rebuilds its state from the stream; waiters re-send their arrivals)"
        )

    def ready(self) -> tuple[bool, str]:
        if self._stopped_deciding:
            return False, self._stopped_deciding
        return super().ready()

    async def _settle_acks(self, sent: list[Sent], *, record: bool) -> None:
        futures = [ack for _, _, ack in sent if ack is not None]
        if futures:
            await asyncio.wait(futures, timeout=ACK_WAIT_S)
        journal = self.bus.publish_options.journal
        for event, payload, ack in sent:
            try:
                if ack is not None and ack.done() and not ack.cancelled() and not ack.exception():
                    if journal is not None:
                        journal.record(event.id, ack.result())
                else:
                    if ack is not None:
                        ack.cancel()
                    await publish_bytes(
                        self.bus.js,
                        subject_for(event),
                        payload,
                        event.id,
                        options=self.bus.publish_options,
                    )
            except StrataError as exc:
                log.error("barrier_event_not_published", event=event.type, error=str(exc))
                if not record:  # a decision the stream refused: see _store_or_stop
                    self._stopped_deciding = f"could not store {event.type} ({exc.message})"
                continue
            observe_decided(event)
            if isinstance(event, Conclusion):
                self._log_conclusion(event)

    @staticmethod
    def _log_conclusion(event: Conclusion) -> None:
        latency = {}
        if isinstance(event, BarrierReleased):
            latency = {
                "participants": event.participants,
                "last_arrival_to_release_ms": round(event.last_arrival_to_release_ms, 3),
                "first_arrival_to_release_ms": round(event.first_arrival_to_release_ms, 3),
            }
        log.info(
            event.type.replace(".", "_"),
            job=event.job,
            barrier=event.name,
            generation=event.generation,
            **latency,
        )

    def _take_unrecorded(self) -> list[domain.Arrival]:
        arrivals, self._unrecorded = self._unrecorded, []
        self._concluded_at = math.inf
        return arrivals

    async def _record_arrivals(self) -> None:
        """Write the `barrier.arrived` events decided so far."""
        await self._record(self._take_unrecorded())

    async def _record(self, arrivals: list[domain.Arrival]) -> None:
        """Write `arrivals` as `barrier.arrived` events (the record, not the proof), a slice at
        a time so that arrivals and answers go on meanwhile."""
        for start in range(0, len(arrivals), RECORD_SLICE):
            records = arrivals[start : start + RECORD_SLICE]
            await self._send([arrival.event() for arrival in records], record=True)
            await asyncio.sleep(0)

    # -- arrivals ----------------------------------------------------------------------------------

    async def _arrive(self, request: ArriveRequest) -> dict[str, Any]:
        """The arrival's outcome (a `BarrierOutcome`'s fields)."""
        job = self.state.jobs.get(request.job)
        if (
            job is None
            or request.worker_id not in job.live
            or (
                request.instance is not None
                and job.instances.get(request.worker_id) != request.instance
            )
            or (
                request.lease is not None
                and job.leases.current.get(request.worker_id)
                != (request.lease.instance, request.lease.epoch)
            )
        ):
            # Its registration may be stored and not folded here yet: catch up, then decide.
            await self.sync()
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        self._wakeup.set()
        return await future

    async def _withdraw(self, request: WithdrawRequest) -> dict[str, Any]:
        """Take back an arrival its sender gave up on: queued with the arrivals and decided in
        the order it came, so an arrival sent after it never finds the withdrawn one counted."""
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._queue.append((request, future))
        self._wakeup.set()
        return await future

    async def _live_report(self, request: LiveReportRequest) -> dict[str, Any]:
        """Record a live group member's heal or discarded step, once checked against the quorum
        it names; answered after the event is written."""
        job = self.state.jobs.get(request.job)
        if (
            job is None
            or request.worker_id not in job.live
            or (request.membership_epoch, request.generation) not in job.quorums
        ):
            await self.sync()  # its registration, or the quorum, may be stored and not folded yet
        async with self.lock:
            decision = domain.report_live(self.state, request, *self.reading())
            if decision.error is not None:
                raise decision.error
            self.apply_before_storage(decision.events)
            await self._send(decision.events)
        assert decision.result is not None
        return decision.result.model_dump(mode="python")

    async def _decide_batches(self) -> None:
        """One batch after another: decide every arrival waiting now, write the openings and
        conclusions, then answer. Arrivals are recorded in between, when no batch waits."""
        while True:
            if self._unrecorded:
                linger = self._record_at() - time.monotonic()
                if linger <= 0:
                    # On a task of its own: batches go on being decided meanwhile.
                    self._in_background(self._record(self._take_unrecorded()))
                    continue
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), linger)
            else:
                await self._wakeup.wait()
            self._wakeup.clear()
            while self._queue:
                batch = self._queue[:MAX_BATCH]
                rest = self._queue[MAX_BATCH:]
                # Every withdrawal waiting goes with this batch (decided before its arrivals):
                # a given-up arrival must not complete a generation here while its withdrawal
                # waits for the next batch. Deciding one early is harmless: its sender sends no
                # new arrival at the name before the withdrawal is answered.
                batch += [item for item in rest if isinstance(item[0], WithdrawRequest)]
                self._queue = [item for item in rest if not isinstance(item[0], WithdrawRequest)]
                try:
                    await self._decide_batch(batch)
                except Exception as exc:  # nothing of it was told: every caller retries
                    log.exception("barrier_batch_failed", arrivals=len(batch))
                    for _, future in batch:
                        if not future.done():
                            future.set_exception(exc)

    def _record_at(self) -> float:
        """When the arrivals decided so far are recorded (monotonic): once no arrival came for
        `barrier_record_arrivals_s` (the barrier waits for stragglers, the service is idle), at
        the latest RECORD_AT_LATEST times that after the first, and just after a conclusion
        (once its waiters are answered: recording a thousand arrivals takes milliseconds)."""
        return min(
            self._last_arrival_at + self._record_after_s,
            self._unrecorded_since + RECORD_AT_LATEST * self._record_after_s,
            self._concluded_at + RECORD_AFTER_CONCLUSION_S,
        )

    def _concluded(self, events: Sequence[Event]) -> None:
        """Record the arrivals soon after a conclusion among `events`."""
        if any(isinstance(event, Conclusion) for event in events):
            self._concluded_at = min(self._concluded_at, time.monotonic())
            self._wakeup.set()

    async def _decide_batch(
        self, batch: list[tuple[Request, asyncio.Future[dict[str, Any]]]]
    ) -> None:
        self.batches += 1
        self.arrivals += len(batch)
        if self._stopped_deciding:
            raise ServiceUnavailable(self._stopped_message())
        async with self.lock:
            decided = domain.decide_arrivals(
                self.state,
                [request for request, _ in batch],
                *self.reading(),
                sent_after_ns=self._sent_after_ns(),
            )
            self._last_arrival_at = time.monotonic()
            if decided.record and not self._unrecorded:
                self._unrecorded_since = self._last_arrival_at
            self._unrecorded.extend(decided.record)
            await self._send(decided.told)
            self._concluded(decided.told)
        # One answer per generation, as plain data: the whole batch is decided, so they are all
        # alike, and the RPC server packs a dict without validating or dumping a model.
        outcomes: dict[domain.Joined, dict[str, Any] | StrataError] = {}
        for (_, future), joined in zip(batch, decided.joined, strict=True):
            if future.done():
                continue
            if isinstance(joined, StrataError):
                future.set_exception(joined)
                continue
            if isinstance(joined, WithdrawResult):
                future.set_result(joined.model_dump(mode="python"))
                continue
            answer = outcomes.get(joined)
            if answer is None:
                try:
                    outcome = domain.outcome(self.state, *joined)
                    answer = outcomes[joined] = outcome.model_dump(mode="python")
                except StrataError as exc:
                    answer = outcomes[joined] = exc
            if isinstance(answer, StrataError):
                future.set_exception(answer)
            else:
                future.set_result(answer)

    # -- failures and deadlines --------------------------------------------------------------------

    async def on_applied(self, event: Event) -> None:
        if not isinstance(event, WorkerFailed | WorkerLeft):
            return
        why = "failed" if isinstance(event, WorkerFailed) else "left the job"
        async with self.lock:
            broken = domain.member_gone(
                self.state, event.job, event.worker_id, why, *self.reading()
            )
            self.apply_before_storage(broken)
            await self._send(broken)
            self._concluded(broken)

    async def _checked(self) -> None:
        """Note a deadline check (a long gap since the last one was a stall) and send the pulse
        that proves, when it comes back, that the connection delivers."""
        now = clock.monotonic_ns()
        if now - self._checked_ns > STALL_S * 1e9:
            self._stalled(self._checked_ns, now)
        self._checked_ns = now
        if self._pulse:
            with contextlib.suppress(nats.errors.Error):  # reconnecting: heard of no more
                await self.bus.nc.publish(self._pulse, b"")

    async def _heard(self, _msg: object) -> None:
        now = clock.monotonic_ns()
        if now - self._heard_ns > STALL_S * 1e9:
            self._stalled(self._heard_ns, now)
        self._heard_ns = now

    def _stalled(self, began_ns: int, ended_ns: int) -> None:
        if self._stall is not None and ended_ns - self._stall[1] < CATCH_UP_S * 1e9:
            began_ns = min(began_ns, self._stall[0])  # one stall, seen by check and pulse
        self._stall = (began_ns, ended_ns)

    def _sent_after_ns(self) -> int:
        """The earliest the requests read now can have been sent (monotonic). During or just
        after a stall (this process stopped or starved, or its connection held everything),
        they may have waited all along: an arrival's remaining wait is then counted from the
        stall's beginning (domain `_lapses`)."""
        now = clock.monotonic_ns()
        since = now
        for last in (self._checked_ns, self._heard_ns):
            if now - last > STALL_S * 1e9:
                since = min(since, last)  # in a stall not noticed yet
        if self._stall is not None and now - self._stall[1] < CATCH_UP_S * 1e9:
            since = min(since, self._stall[0])
        return since

    async def _time_out(self) -> None:
        while True:
            await asyncio.sleep(TIMEOUT_CHECK_S)
            await self._checked()
            try:
                async with self.lock:
                    expired = domain.due(self.state, *self.reading())
                    self.apply_before_storage(expired)
                    await self._send(expired)
                    self._concluded(expired)
            except Exception:  # one bad generation must not stop every other one timing out
                log.exception("barrier_timeouts_failed")


def create() -> Barrier:
    return Barrier()
