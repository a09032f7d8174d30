"""The barrier service's NATS adapter: arrivals over RPC, release/break/timeout as events.

Release latency is the product here, so decisions are applied to the state at once (the domain's
`evolve` is idempotent, and folds them again unchanged when they come back from the stream) and no
lock is held across I/O. Arrival events are published concurrently; a release first waits for the
arrival publishes of its own generation, so the stream keeps them in order. Waiters learn the
outcome from the `barrier.released|broken|timed_out` event itself (core subscribers see it as it
is stored) or, after a restart, by retrying their arrival.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import structlog
from strata.bus import Bus, RpcServer
from strata.config import Settings
from strata.errors import StrataError
from strata.events import BarrierArrived, BarrierOpened, WorkerFailed, WorkerLeft
from strata.events.models import Event
from strata.events.requests import ArriveRequest, BarrierOutcome
from strata.services.barrier import domain
from strata.services.barrier.domain import BarrierState
from strata.services.projection import Projection

log = structlog.get_logger("strata.barrier")

TIMEOUT_CHECK_S = 0.05
Key = tuple[str, str, int]


class Barrier(Projection[BarrierState]):
    name = "barrier"

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        super().__init__(clock)
        self._rpc: RpcServer | None = None
        self._pending: dict[Key, list[asyncio.Task[None]]] = {}

    def initial_state(self) -> BarrierState:
        return BarrierState()

    def evolve(self, state: BarrierState, event: Event) -> BarrierState:
        return domain.evolve(state, event)

    def now_ns(self) -> int:
        return int(self.clock() * 1e9)

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        self._rpc = RpcServer(bus.nc, self.name, concurrency=256)
        self._rpc.route("arrive", ArriveRequest, self._arrive)
        await self._rpc.start()
        self.spawn(self._time_out(), "timeouts")

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()

    def _apply(self, events: list[Event]) -> None:
        for event in events:
            self.state = domain.evolve(self.state, event)

    async def _publish(self, event: Event) -> None:
        try:
            await self.bus.publish(event)
        except StrataError as exc:
            log.error("barrier_event_not_published", event=event.type, error=str(exc))

    async def _finish(self, events: list[Event]) -> None:
        """Publish release/break/timeout events after the arrivals of their generation."""
        for event in events:
            key = (event.job, getattr(event, "name", ""), getattr(event, "generation", -1))
            pending = self._pending.pop(key, [])
            if pending:
                await asyncio.gather(*pending)
            await self._publish(event)
            log.info(
                event.type.replace(".", "_"),
                job=event.job,
                barrier=key[1],
                generation=key[2],
            )

    async def _arrive(self, request: ArriveRequest) -> BarrierOutcome:
        async with self.lock:
            decision = domain.arrive(self.state, request, self.now_ns())
            if decision.error is not None:
                raise decision.error
            assert decision.generation is not None
            self._apply(decision.events)
            finished = domain.release_if_complete(
                self.state, request.job, request.name, self.now_ns()
            )
            self._apply(finished)
            key = (request.job, request.name, decision.generation)
            for event in decision.events:
                assert isinstance(event, BarrierOpened | BarrierArrived)
                task = asyncio.create_task(self._publish(event))
                self._pending.setdefault(key, []).append(task)
            outcome = domain.outcome(self.state, request.job, request.name, decision.generation)
        if finished:
            await self._finish(finished)
        return outcome

    async def on_applied(self, event: Event) -> None:
        if not isinstance(event, WorkerFailed | WorkerLeft):
            return
        why = "failed" if isinstance(event, WorkerFailed) else "left the job"
        async with self.lock:
            broken = domain.member_gone(self.state, event.job, event.worker_id, why, self.now_ns())
            self._apply(broken)
        if broken:
            await self._finish(broken)

    async def _time_out(self) -> None:
        while True:
            await asyncio.sleep(TIMEOUT_CHECK_S)
            async with self.lock:
                expired = domain.timeouts(self.state, self.now_ns())
                self._apply(expired)
            if expired:
                await self._finish(expired)


def create() -> Barrier:
    return Barrier()
