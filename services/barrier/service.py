"""The barrier service's NATS adapter: arrivals over RPC, release/break/timeout as events.

Release latency is the product here, so decisions are applied to the state at once, before they
are stored (`Projection.apply_before_storage`: the domain's `evolve` is idempotent, and folds them
again unchanged when they come back from the stream), no lock is held across I/O, and arrival
events are published concurrently. Waiters are told an outcome only once the arrivals it rests on
are stored: a release can then always be derived again from the stream, so the release event
itself goes out without anyone waiting for its ack. Waiters
learn the outcome from the `barrier.released|broken|timed_out` event (core subscribers see it as
the server takes it) or, after a restart, by retrying their arrival.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from typing import Any

import structlog
from strata.bus import Bus, RpcServer
from strata.config import Settings
from strata.errors import StrataError
from strata.events import (
    BarrierBrokenEvent,
    BarrierReleased,
    BarrierTimedOut,
    WorkerFailed,
    WorkerLeft,
)
from strata.events.models import Event
from strata.events.requests import ARRIVE, ArriveRequest, BarrierOutcome
from strata.metrics import observe_decided
from strata.services.barrier import domain
from strata.services.barrier.domain import BarrierState
from strata.services.projection import Projection

log = structlog.get_logger("strata.barrier")

TIMEOUT_CHECK_S = 0.05
STOP_FLUSH_S = 5.0
Key = tuple[str, str, int]
Conclusion = BarrierReleased | BarrierBrokenEvent | BarrierTimedOut


class Barrier(Projection[BarrierState]):
    name = "barrier"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self._rpc: RpcServer | None = None
        self._unstored: dict[Key, list[asyncio.Task[None]]] = {}
        """Arrival publishes per generation, until the generation is concluded."""
        self._concluding: dict[Key, asyncio.Future[None]] = {}
        """Set once a concluded generation's arrivals are stored: its outcome may then be told."""
        self._background: set[asyncio.Task[None]] = set()

    def initial_state(self) -> BarrierState:
        return BarrierState()

    def evolve(self, state: BarrierState, event: Event) -> BarrierState:
        return domain.evolve(state, event)

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        # Conclusions decided before a crash but never stored are owed before new arrivals.
        async with self.lock:
            owed = domain.recover(self.state, self.now_ns())
            self.apply_before_storage(owed)
            self._conclude(owed)
        self._rpc = RpcServer(bus.nc, self.name, concurrency=256)
        self._rpc.serve(ARRIVE, self._arrive)
        await self._rpc.start()
        self.spawn(self._time_out(), "timeouts")

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=STOP_FLUSH_S)

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _publish(self, event: Event) -> None:
        try:
            await self.bus.publish(event)
        except StrataError as exc:
            log.error("barrier_event_not_published", event=event.type, error=str(exc))
            return
        observe_decided(event)

    def _conclude(self, events: list[Event], arrivals: Sequence[Event] = ()) -> None:
        """Send each conclusion, in the background, once the arrivals of its generation are
        stored: an outcome rests on arrivals the stream can prove after a restart. `arrivals` are
        the completing arrival's events, not yet published: the same task stores them and sends
        the conclusion right after, without waking anything in between."""
        for event in events:
            assert isinstance(event, Conclusion)
            key = (event.job, event.name, event.generation)
            in_flight = [task for task in self._unstored.pop(key, []) if not task.done()]
            stored = None
            if in_flight or arrivals:
                stored = self._concluding[key] = asyncio.get_running_loop().create_future()
            self._in_background(self._send_conclusion(key, event, arrivals, in_flight, stored))
            arrivals = ()

    async def _send_conclusion(
        self,
        key: Key,
        event: Conclusion,
        arrivals: Sequence[Event],
        in_flight: list[asyncio.Task[None]],
        stored: asyncio.Future[None] | None,
    ) -> None:
        try:
            if len(arrivals) == 1:
                await self._publish(arrivals[0])
            elif arrivals:
                await asyncio.gather(*(self._publish(arrival) for arrival in arrivals))
            if in_flight:
                await asyncio.gather(*in_flight)
        finally:
            if stored is not None:
                self._concluding.pop(key, None)
                stored.set_result(None)
        await self._publish(event)
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

    async def _arrive(self, request: ArriveRequest) -> BarrierOutcome:
        job = self.state.jobs.get(request.job)
        if (
            job is None
            or request.worker_id not in job.live
            or (
                request.instance is not None
                and job.instances.get(request.worker_id) != request.instance
            )
        ):
            # Its registration may be stored and not folded here yet: catch up, then decide.
            await self.sync()
        async with self.lock:
            outcome = self._decide(request)
        if isinstance(outcome, StrataError):
            raise outcome
        if outcome.status != "waiting":
            # Said only once the arrivals it rests on are stored (a retry can come that soon).
            stored = self._concluding.get((outcome.job, outcome.name, outcome.generation))
            if stored is not None:
                await asyncio.shield(stored)
        return outcome

    def _decide(self, request: ArriveRequest) -> BarrierOutcome | StrataError:
        """Apply the arrival and whatever it concludes; the answer, or the error to send."""
        now = self.now_ns()
        before = domain.conclude(self.state, request.job, request.name, now)
        self.apply_before_storage(before)
        self._conclude(before)
        decision = domain.arrive(self.state, request, now)
        if decision.error is not None:
            return decision.error
        assert decision.result is not None
        self.apply_before_storage(decision.events)
        key = (request.job, request.name, decision.result)
        after = domain.conclude(self.state, request.job, request.name, now)
        self.apply_before_storage(after)
        if after:
            self._conclude(after, arrivals=decision.events)
        else:
            for event in decision.events:
                task = asyncio.create_task(self._publish(event))
                self._unstored.setdefault(key, []).append(task)
        return domain.outcome(self.state, *key)

    async def on_applied(self, event: Event) -> None:
        if not isinstance(event, WorkerFailed | WorkerLeft):
            return
        why = "failed" if isinstance(event, WorkerFailed) else "left the job"
        async with self.lock:
            broken = domain.member_gone(self.state, event.job, event.worker_id, why, self.now_ns())
            self.apply_before_storage(broken)
            self._conclude(broken)

    async def _time_out(self) -> None:
        while True:
            await asyncio.sleep(TIMEOUT_CHECK_S)
            try:
                async with self.lock:
                    expired = domain.due(self.state, self.now_ns())
                    self.apply_before_storage(expired)
                    self._conclude(expired)
            except Exception:  # one bad generation must not stop every other one timing out
                log.exception("barrier_timeouts_failed")


def create() -> Barrier:
    return Barrier()
