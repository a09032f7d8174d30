"""The barrier protocol with a service that crashes at every point, as a model: no NATS.

The barrier service keeps its arrivals in memory and stores only openings and conclusions, before
it tells anyone an outcome (docs/barriers.md, "Crash recovery"). This machine checks that this is
enough. It drives the pure domain exactly as the service does (`domain.decide_arrivals` for a
batch, `member_gone`, `due`, `recover` after a restart) next to a model of the participants
(`Worker.barrier`: arrive, wait for the outcome event, re-send the arrival naming its generation
and what it last passed) and of the stream (what was stored survives a crash; ids dedup). The
service may crash before, in the middle of or after writing a batch's events, and lose every
outcome event on the way to some participants. Invariants: a generation is concluded once in the
stream; nobody passes a generation that the stream does not hold as released, or before every
live participant has arrived; a break reaches everyone; and after a crash, the re-sends bring
every live participant its outcome.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from strata.errors import StrataError
from strata.events import (
    BarrierBrokenEvent,
    BarrierReleased,
    BarrierTimedOut,
    Event,
    WorkerFailed,
    WorkerRegistered,
)
from strata.events.requests import ArriveRequest, BarrierOutcome
from strata.services.barrier import domain
from strata.services.barrier.domain import BarrierState

from tests.tiers import examples

JOB = "job-m"
NAME = "step"
WORKERS = ("w0", "w1", "w2")
SECOND = 10**9
TIMEOUT_S = 5.0
Conclusion = BarrierReleased | BarrierBrokenEvent | BarrierTimedOut
STATUS = {BarrierReleased: "released", BarrierBrokenEvent: "broken", BarrierTimedOut: "timed_out"}


@dataclass
class Participant:
    """One worker's `BarrierClient` at one name."""

    worker: str
    arrival: int = -1
    busy: bool = False
    """Inside `barrier()`: arrived, no outcome yet."""
    joined: int | None = None
    """The generation the service said this arrival joined."""
    passed: int | None = None
    concluded: int | None = None
    outcomes: list[tuple[int, str]] = field(default_factory=list)
    """(generation, status) of every call that returned."""
    seen: dict[int, str] = field(default_factory=dict)
    """Outcome events received, by generation (kept for a waiter that learns its generation
    after the event came)."""
    failed: bool = False

    def request(self) -> ArriveRequest:
        return ArriveRequest(
            job=JOB,
            name=NAME,
            worker_id=self.worker,
            arrival=self.arrival,
            timeout_s=TIMEOUT_S,
            instance=f"proc-{self.worker}",
            generation=self.joined,
            passed=self.passed,
            concluded=self.concluded,
        )

    def on_event(self, generation: int, status: str) -> None:
        self.seen[generation] = status
        if self.joined == generation:
            self.settle(generation, status)

    def on_waiting(self, generation: int) -> None:
        """An answer: this arrival joined `generation`, which is not concluded yet."""
        # An arrival counts in one generation, whatever crashed in between.
        assert self.joined in (None, generation), (self.worker, self.joined, generation)
        self.joined = generation
        if generation in self.seen:
            self.settle(generation, self.seen[generation])

    def settle(self, generation: int, status: str) -> None:
        """The outcome of this call, from the event or an answer."""
        if not self.busy:
            return
        self.busy, self.joined = False, None
        self.outcomes.append((generation, status))
        self.concluded = max(generation, self.concluded if self.concluded is not None else -1)
        if status == "released":
            self.passed = max(generation, self.passed if self.passed is not None else -1)


class CrashingBarrier(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.now = 1_700_000_000 * SECOND
        self.stream: list[Event] = []
        self.ids: set[str] = set()
        self.participants = {w: Participant(w) for w in WORKERS}
        self.state: BarrierState | None = None
        self.unrecorded: list[domain.Arrival] = []
        self.inflight: list[ArriveRequest] = []
        """Requests sent and not yet taken by the service (a crash loses the ones it took)."""
        for rank, worker in enumerate(WORKERS):
            self._store(
                [
                    WorkerRegistered(
                        job=JOB,
                        source="registry",
                        ts=self.now,
                        worker_id=worker,
                        instance=f"proc-{worker}",
                        rank=rank,
                        world_size=rank + 1,
                        membership_epoch=rank + 1,
                        heartbeat_interval=1.0,
                        heartbeat_timeout=5.0,
                    )
                ]
            )
        self.start()

    # -- the stream and the service ---------------------------------------------------------------

    def _store(self, events: list[Event], deliver_to: frozenset[str] | None = None) -> None:
        """Events the service wrote: the server stores them (dropping a known id) and routes
        each conclusion to the participants' subscriptions, to `deliver_to` only if given."""
        for event in events:
            if event.id not in self.ids:
                self.ids.add(event.id)
                self.stream.append(event)
                if isinstance(event, BarrierReleased):
                    self._check_release(event)
            # A duplicate is not stored again, but core subscribers still get it.
            if isinstance(event, Conclusion):
                for p in self.participants.values():
                    if not p.failed and (deliver_to is None or p.worker in deliver_to):
                        p.on_event(event.generation, STATUS[type(event)])

    def _check_release(self, event: BarrierReleased) -> None:
        """Released never before every live participant has arrived."""
        for p in self.participants.values():
            if not p.failed:
                assert p.busy, f"{p.worker} had not arrived when {event.generation} was released"

    def start(self) -> None:
        """A fresh service: everything it knows comes from the stream, then what it owes."""
        state = BarrierState()
        for event in self.stream:
            domain.evolve(state, event)
        self.state = state
        self.unrecorded = []
        owed = domain.recover(state, self.now)
        for event in owed:
            domain.evolve(state, event)
        self._store(owed)

    def crash(self) -> None:
        self.state = None
        self.unrecorded = []

    # -- rules ------------------------------------------------------------------------------------

    @rule(data=st.data())
    def arrive(self, data: st.DataObject) -> None:
        idle = [p for p in self.participants.values() if not p.failed and not p.busy]
        if not idle:
            return
        p = data.draw(st.sampled_from(idle))
        p.arrival += 1
        p.busy, p.joined = True, None
        self.inflight.append(p.request())

    @rule(data=st.data())
    def resend(self, data: st.DataObject) -> None:
        """A waiter's re-send (every second, or after a lost reply)."""
        waiting = [p for p in self.participants.values() if not p.failed and p.busy]
        if waiting:
            self.inflight.append(data.draw(st.sampled_from(waiting)).request())

    @precondition(lambda self: self.state is not None and bool(self.inflight))
    @rule(data=st.data())
    def decide_a_batch(self, data: st.DataObject) -> None:
        """The service takes some of the requests in flight and decides them as one batch; it
        may crash before writing, after writing some of the events, or before answering; and
        the outcome events may miss some participants."""
        assert self.state is not None
        size = data.draw(st.integers(1, len(self.inflight)))
        batch, self.inflight = self.inflight[:size], self.inflight[size:]
        decided = domain.decide_arrivals(self.state, batch, self.now)
        self.unrecorded.extend(decided.record)
        # Where it crashes, if it does: before writing anything, between two events, or once
        # all are written and before the answers and the arrivals' record (the riskiest point).
        crash = data.draw(st.sampled_from(["no", "no", "before", "after", "between"]))
        crash_at = {"no": None, "before": 0, "after": len(decided.told)}.get(crash)
        if crash == "between":
            crash_at = data.draw(st.integers(0, len(decided.told)))
        reached = frozenset(data.draw(st.sets(st.sampled_from(WORKERS))))
        if crash_at is not None:
            self._store(decided.told[:crash_at], reached)
            self.crash()
            return
        self._store(decided.told, reached)
        if any(isinstance(e, Conclusion) for e in decided.told):
            self._record()
        answered = data.draw(st.sets(st.integers(0, len(batch) - 1)))
        for index in sorted(answered):
            self._answer(batch[index], decided.joined[index])

    def _answer(self, request: ArriveRequest, joined: domain.Joined | StrataError) -> None:
        assert self.state is not None
        p = self.participants[request.worker_id]
        if p.failed or not p.busy or p.arrival != request.arrival:
            return  # an answer to an earlier call, or to a process that is gone
        assert not isinstance(joined, StrataError), joined
        outcome: BarrierOutcome = domain.outcome(self.state, *joined)
        if outcome.status == "waiting":
            p.on_waiting(outcome.generation)
        else:
            assert p.joined in (None, outcome.generation), (p.worker, p.joined, outcome)
            p.settle(outcome.generation, outcome.status)

    def _record(self) -> None:
        self._store([arrival.event() for arrival in self.unrecorded])
        self.unrecorded = []

    @precondition(lambda self: self.state is not None)
    @rule()
    def crash_and_restart(self) -> None:
        self.crash()
        self.start()

    @precondition(lambda self: self.state is None)
    @rule()
    def restart(self) -> None:
        self.start()

    @rule(data=st.data())
    def fail(self, data: st.DataObject) -> None:
        """The registry fails a worker; a live service reacts to it (a crashed one recovers it)."""
        live = [p for p in self.participants.values() if not p.failed]
        if len(live) <= 1:
            return
        p = data.draw(st.sampled_from(live))
        p.failed, p.busy = True, False
        self.inflight = [r for r in self.inflight if r.worker_id != p.worker]
        departure = WorkerFailed(
            job=JOB,
            source="registry",
            ts=self.now,
            worker_id=p.worker,
            rank=WORKERS.index(p.worker),
            reason="missed heartbeats",
            last_heartbeat_ts=self.now,
            membership_epoch=10 + len(self.stream),
        )
        self._store([departure])
        if self.state is not None:
            domain.evolve(self.state, departure)
            broken = domain.member_gone(self.state, JOB, p.worker, "failed", self.now)
            for event in broken:
                domain.evolve(self.state, event)
            self._store(broken)

    @rule(seconds=st.sampled_from([0.5, 2.0, 6.0]))
    def tick(self, seconds: float) -> None:
        self.now += int(seconds * SECOND)
        if self.state is not None and seconds > 5:  # quiet long enough: arrivals recorded
            self._record()
        if self.state is not None:
            expired = domain.due(self.state, self.now)
            for event in expired:
                domain.evolve(self.state, event)
            self._store(expired)

    # -- invariants -------------------------------------------------------------------------------

    def _conclusions(self) -> dict[int, str]:
        found: dict[int, str] = {}
        for event in self.stream:
            if isinstance(event, Conclusion):
                assert event.generation not in found, f"generation {event.generation} twice"
                found[event.generation] = STATUS[type(event)]
        return found

    @invariant()
    def concluded_once_and_nobody_passes_what_the_stream_does_not_hold(self) -> None:
        concluded = self._conclusions()
        for p in self.participants.values():
            for generation, status in p.outcomes:
                assert concluded.get(generation) == status, (p.worker, generation, status)

    @invariant()
    def a_live_service_agrees_with_the_stream(self) -> None:
        if self.state is None:
            return
        concluded = self._conclusions()
        named = self.state.jobs[JOB].barriers.get(NAME)
        for gen in named.generations.values() if named is not None else ():
            assert gen.status == concluded.get(gen.generation, "waiting")

    def teardown(self) -> None:
        """Liveness: with the service up, re-sends and time bring every live participant an
        outcome, and a break reaches everyone who was part of it."""
        for _ in range(40):
            if self.state is None:
                self.start()
            waiting = [p for p in self.participants.values() if not p.failed and p.busy]
            if not waiting:
                break
            batch = [p.request() for p in waiting]
            self.inflight = []
            assert self.state is not None
            decided = domain.decide_arrivals(self.state, batch, self.now)
            self.unrecorded.extend(decided.record)
            self._store(decided.told)
            for request, joined in zip(batch, decided.joined, strict=True):
                self._answer(request, joined)
            self.tick(2.0)
        stuck = [p.worker for p in self.participants.values() if not p.failed and p.busy]
        assert not stuck, f"{stuck} never got an outcome"
        self.concluded_once_and_nobody_passes_what_the_stream_does_not_hold()
        # A break reaches everyone: no live participant passed a broken generation's successor
        # without having been told of the break (each call's outcome is the stream's).
        concluded = self._conclusions()
        for p in self.participants.values():
            for generation, status in p.outcomes:
                assert concluded[generation] == status


CrashingBarrier.TestCase.settings = settings(
    max_examples=examples(600), stateful_step_count=30, deadline=None
)
TestCrashingBarrier = CrashingBarrier.TestCase
