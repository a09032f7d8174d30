"""The worker side of barriers: arrive, then wait for the outcome without ever hanging.

The outcome normally comes as the `barrier.released|broken|timed_out` event itself (a core NATS
subscription sees it as it is stored). If that event is missed (a reconnect) or the barrier service
restarts, the waiter re-sends its arrival every second: arrivals are idempotent, the answer
carries the current outcome, and a re-sent arrival names the generation it joined so that a
restarted service, which keeps no arrivals, can rebuild the generation from the re-sends. Each
arrival also says which generation at the name this process last passed (its proof of release).
A local deadline (the barrier timeout plus `GRACE_S`, on the monotonic clock) bounds every wait,
whatever happens to the service (paused, dead or unreachable): each request inside the wait is
bounded by the time left, and a wait that runs out raises `BarrierTimeout`, never `RpcTimeout`.
A waiter that gives up that way withdraws its arrival (in the background), so that the arrival,
if it reaches the service later, opens and completes nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import OrderedDict
from typing import NoReturn

import structlog
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from strata.aio._core import _WorkerCore
from strata.errors import (
    BarrierBroken,
    BarrierTimeout,
    RpcTimeout,
    ServiceUnavailable,
    StrataError,
    ValidationError,
)
from strata.events import (
    ID_PATTERN,
    BarrierBrokenEvent,
    BarrierReleased,
    BarrierTimedOut,
    decode_shared_event,
    subjects,
)
from strata.events.requests import (
    ArriveRequest,
    BarrierOutcome,
    WithdrawRequest,
    WithdrawResult,
)

log = structlog.get_logger("strata.barrier")

SERVICE = "barrier"
REPOLL_S = 1.0
GRACE_S = 1.0
"""How long past its timeout a waiter waits for the service's outcome before giving up itself."""
ATTEMPT_S = 1.0
"""The longest a single request inside a wait may take (less when less time is left)."""
MIN_ATTEMPT_S = 0.05
WITHDRAW_FOR_S = 60.0
"""How long a given-up waiter keeps trying to withdraw its arrival (in the background)."""
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
    def __init__(self, worker: _WorkerCore) -> None:
        self._worker = worker
        self._arrivals: dict[str, int] = {}
        self._passed: dict[str, int] = {}
        self._concluded: dict[str, int] = {}
        """Name -> the last generation this process was released from there: sent with the next
        arrival as proof that it was released (a restarted service may not have it stored)."""
        self._outcomes: OrderedDict[Key, BarrierOutcome] = OrderedDict()
        self._waiters: dict[Key, asyncio.Future[BarrierOutcome]] = {}
        self._subs: list[Subscription] = []
        self._withdrawals: dict[str, asyncio.Task[None]] = {}
        """Name -> the withdrawal of a given-up arrival there, while it is on its way."""

    async def _subscribe(self) -> None:
        if self._subs:
            return
        nc = self._worker.bus.nc
        for event_type in FINAL:
            subject = subjects.event_subject(self._worker.job, event_type)
            self._subs.append(await nc.subscribe(subject, cb=self._on_event))

    async def close(self) -> None:
        for task in self._withdrawals.values():
            task.cancel()
        if self._withdrawals:
            await asyncio.gather(*self._withdrawals.values(), return_exceptions=True)
        self._withdrawals.clear()
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

    async def _arrive(self, request: ArriveRequest, deadline: float) -> BarrierOutcome | None:
        """The arrival's answer, or None if none came by `deadline` (monotonic). Each attempt
        is bounded by the time left; a service that does not answer (paused, restarting,
        unreachable) is asked again until then. An error the service answers is raised.
        Each attempt says how much longer this waiter waits (`remaining_s`, its grace left
        out): the service lets the arrival lapse then rather than count it in a release."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return None
            try:
                return await self._worker.bus.rpc.call(
                    SERVICE,
                    "arrive",
                    request.model_copy(update={"remaining_s": max(0.0, remaining - GRACE_S)}),
                    result=BarrierOutcome,
                    timeout=max(MIN_ATTEMPT_S, min(ATTEMPT_S, remaining)),
                    idempotent=True,
                )
            except (RpcTimeout, ServiceUnavailable):  # no reply or no responder: ask again
                pass
            await asyncio.sleep(min(MIN_ATTEMPT_S, max(0.0, deadline - time.monotonic())))

    def _withdraw(self, request: ArriveRequest) -> None:
        """Take back an arrival this waiter gave up on, in the background: the service may be
        paused or unreachable now, and the waiter's error must not wait for it."""
        withdrawal = WithdrawRequest(
            job=request.job,
            name=request.name,
            worker_id=request.worker_id,
            arrival=request.arrival,
            instance=request.instance,
        )

        async def send() -> None:
            try:
                answer = await self._worker.bus.rpc.call(
                    SERVICE,
                    "withdraw",
                    withdrawal,
                    result=WithdrawResult,
                    timeout=ATTEMPT_S,
                    retry_for=WITHDRAW_FOR_S,
                    idempotent=True,
                )
            except StrataError as exc:
                log.warning(
                    "barrier_withdraw_failed",
                    barrier=request.name,
                    arrival=request.arrival,
                    error=exc.message,
                )
                return
            if answer.generation is not None:
                self._concluded[request.name] = max(
                    answer.generation, self._concluded.get(request.name, -1)
                )

        task = self._worker._spawn(send(), "barrier-withdraw")
        self._withdrawals[request.name] = task
        task.add_done_callback(
            lambda done: (
                self._withdrawals.pop(request.name, None)
                if self._withdrawals.get(request.name) is done
                else None
            )
        )

    def _give_up(self, request: ArriveRequest, timeout: float, generation: int | None) -> NoReturn:
        self._withdraw(request)
        where = f"barrier {request.name!r}" + (
            "" if generation is None else f" (generation {generation})"
        )
        raise BarrierTimeout(
            f"{where} gave no outcome within its {timeout:g}s timeout + {GRACE_S:g}s: the "
            "barrier service did not answer in time (paused, down or unreachable?); this "
            "arrival is withdrawn",
            name=request.name,
            generation=generation,
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
        deadline = time.monotonic() + timeout + GRACE_S
        withdrawing = self._withdrawals.get(name)
        if withdrawing is not None:
            # The arrival given up on last time goes first: decided after this one, it would
            # find this one counted in its place.
            await asyncio.wait((withdrawing,), timeout=max(0.0, deadline - time.monotonic()))
            if not withdrawing.done():
                raise BarrierTimeout(
                    f"barrier {name!r}: the arrival given up on earlier could not be withdrawn "
                    f"within this wait's {timeout:g}s timeout + {GRACE_S:g}s (is the barrier "
                    "service up?); nothing was sent",
                    name=name,
                )
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
            lease=self._worker.lease,
            passed=self._passed.get(name),
            concluded=self._concluded.get(name),
        )
        answer = await self._arrive(request, deadline)
        if answer is None:
            self._give_up(request, timeout, None)
        outcome = answer
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
                    self._give_up(request, timeout, outcome.generation)
                waiter = self._waiters.get(key)
                if waiter is None:
                    waiter = self._waiters[key] = asyncio.get_running_loop().create_future()
                    watched.append(key)
                await asyncio.wait((waiter,), timeout=min(REPOLL_S, remaining))
                if waiter.done():
                    outcome = waiter.result()
                else:
                    answer = await self._arrive(request, deadline)
                    if answer is None:
                        self._give_up(request, timeout, outcome.generation)
                    outcome = answer
        finally:
            for key in watched:
                self._waiters.pop(key, None)
        if outcome.status == "released":
            self._passed[name] = max(outcome.generation, self._passed.get(name, -1))
        self._concluded[name] = max(outcome.generation, self._concluded.get(name, -1))
        _raise_for(outcome)
        return outcome
