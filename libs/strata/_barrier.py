"""The worker side of barriers: arrive, then wait for the outcome without ever hanging.

The outcome normally comes as the `barrier.released|broken|timed_out` event itself (a core NATS
subscription sees it as it is stored). If that event is missed (a reconnect) or the barrier service
restarts, the waiter re-sends its arrival every second: arrivals are idempotent, the answer
carries the current outcome, and a re-sent arrival names the generation it joined so that a
restarted service, which keeps no arrivals, can rebuild the generation from the re-sends. Each
arrival also says which generation at the name this process last passed (its proof of release).
A local deadline (the barrier timeout plus a grace period) bounds every wait, whatever happens
to the services.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import OrderedDict
from typing import TYPE_CHECKING

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from strata.errors import BarrierBroken, BarrierTimeout, StrataError, ValidationError
from strata.events import (
    ID_PATTERN,
    BarrierBrokenEvent,
    BarrierReleased,
    BarrierTimedOut,
    decode_shared_event,
    subjects,
)
from strata.events.requests import ArriveRequest, BarrierOutcome

if TYPE_CHECKING:
    from strata.aio import Worker

log = structlog.get_logger("strata.barrier")

SERVICE = "barrier"
REPOLL_S = 1.0
GRACE_S = 5.0
KEEP_OUTCOMES = 1024
FINAL = ("barrier.released", "barrier.broken", "barrier.timed_out")
Key = tuple[str, int]


def _raise_for(outcome: BarrierOutcome) -> None:
    where = f"barrier {outcome.name!r} (generation {outcome.generation})"
    missing = ", ".join(outcome.missing[:10]) + (" ..." if len(outcome.missing) > 10 else "")
    if outcome.status == "broken":
        raise BarrierBroken(
            f"{where} is broken: {outcome.reason}; still missing: {missing or 'nobody'}",
            name=outcome.name,
            generation=outcome.generation,
            missing=outcome.missing,
        )
    if outcome.status == "timed_out":
        arrived = f"{outcome.arrived}/{outcome.expected}" if outcome.expected else outcome.arrived
        raise BarrierTimeout(
            f"{where} timed out with {arrived} arrived; missing: {missing or 'unknown'}",
            name=outcome.name,
            generation=outcome.generation,
            missing=outcome.missing,
        )


class BarrierClient:
    def __init__(self, worker: Worker) -> None:
        self._worker = worker
        self._arrivals: dict[str, int] = {}
        self._passed: dict[str, int] = {}
        self._concluded: dict[str, int] = {}
        """Name -> the last generation this process was released from there: sent with the next
        arrival as proof that it was released (a restarted service may not have it stored)."""
        self._outcomes: OrderedDict[Key, BarrierOutcome] = OrderedDict()
        self._waiters: dict[Key, asyncio.Future[BarrierOutcome]] = {}
        self._subs: list[Subscription] = []

    async def _subscribe(self) -> None:
        if self._subs:
            return
        nc = self._worker.bus.nc
        for event_type in FINAL:
            subject = subjects.event_subject(self._worker.job, event_type)
            self._subs.append(await nc.subscribe(subject, cb=self._on_event))

    async def close(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    async def _on_event(self, msg: Msg) -> None:
        try:
            event = decode_shared_event(msg.data)
        except StrataError:
            return
        if not isinstance(event, BarrierReleased | BarrierBrokenEvent | BarrierTimedOut):
            return
        # Each field read straight off its own event type: `getattr` with a default on a model
        # that lacks the field costs tens of microseconds (pydantic's __getattr__ raises), once
        # per in-process worker for every release.
        if isinstance(event, BarrierReleased):
            outcome = BarrierOutcome(
                job=event.job,
                name=event.name,
                generation=event.generation,
                status="released",
                arrived=event.participants,
                expected=event.participants,
            )
        elif isinstance(event, BarrierBrokenEvent):
            outcome = BarrierOutcome(
                job=event.job,
                name=event.name,
                generation=event.generation,
                status="broken",
                arrived=0,
                expected=0,
                missing=event.missing,
                reason=event.reason,
            )
        else:
            outcome = BarrierOutcome(
                job=event.job,
                name=event.name,
                generation=event.generation,
                status="timed_out",
                arrived=event.arrived,
                expected=0,
                missing=event.missing,
            )
        self._settle((event.name, event.generation), outcome)

    def _settle(self, key: Key, outcome: BarrierOutcome) -> None:
        self._outcomes[key] = outcome
        while len(self._outcomes) > KEEP_OUTCOMES:
            self._outcomes.popitem(last=False)
        waiter = self._waiters.get(key)
        if waiter is not None and not waiter.done():
            waiter.set_result(outcome)

    async def _arrive(self, request: ArriveRequest, remaining: float) -> BarrierOutcome:
        return await self._worker.bus.rpc.call(
            SERVICE,
            "arrive",
            request,
            result=BarrierOutcome,
            timeout=max(0.05, min(REPOLL_S * 5, remaining)),
            retry_for=max(0.0, remaining),
            idempotent=True,
        )

    async def wait(
        self, name: str, timeout: float, expected_count: int | None = None
    ) -> BarrierOutcome:
        """Arrive at `name` and return once released; raise BarrierBroken / BarrierTimeout."""
        if not isinstance(name, str) or not re.match(ID_PATTERN, name):
            raise ValidationError(
                f"barrier name {name!r} must match {ID_PATTERN} (letters, digits, _ . -)",
                field="name",
            )
        if not 0 < timeout <= 86_400:
            raise ValidationError(f"barrier timeout {timeout!r} must be in (0, 86400] s")
        await self._subscribe()
        arrival = self._arrivals.get(name, -1) + 1
        self._arrivals[name] = arrival
        request = ArriveRequest(
            job=self._worker.job,
            name=name,
            worker_id=self._worker.id,
            arrival=arrival,
            timeout_s=timeout,
            expected_count=expected_count,
            instance=self._worker.instance,
            passed=self._passed.get(name),
            concluded=self._concluded.get(name),
        )
        deadline = time.monotonic() + timeout + GRACE_S
        outcome = await self._arrive(request, deadline - time.monotonic())
        watched: list[Key] = []
        try:
            while outcome.status == "waiting":
                # Re-sent, the arrival names the generation it joined: a restarted service that
                # never stored it then answers that generation's outcome.
                if request.generation != outcome.generation:
                    request = request.model_copy(update={"generation": outcome.generation})
                # A re-sent arrival may answer for a later generation (an arrival the service lost
                # in a crash, at a barrier counted by arrivals that completed without it).
                key = (name, outcome.generation)
                known = self._outcomes.get(key)
                if known is not None:
                    outcome = known
                    break
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise BarrierTimeout(
                        f"barrier {name!r} (generation {outcome.generation}) gave no outcome "
                        f"within {timeout:g}s + {GRACE_S:g}s grace; is the barrier service up?",
                        name=name,
                        generation=outcome.generation,
                    )
                waiter = self._waiters.get(key)
                if waiter is None:
                    waiter = self._waiters[key] = asyncio.get_running_loop().create_future()
                    watched.append(key)
                await asyncio.wait((waiter,), timeout=min(REPOLL_S, remaining))
                if waiter.done():
                    outcome = waiter.result()
                else:
                    outcome = await self._arrive(request, deadline - time.monotonic())
        finally:
            for key in watched:
                self._waiters.pop(key, None)
        if outcome.status == "released":
            self._passed[name] = max(outcome.generation, self._passed.get(name, -1))
        self._concluded[name] = max(outcome.generation, self._concluded.get(name, -1))
        _raise_for(outcome)
        return outcome
