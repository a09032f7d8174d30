"""The barrier service's pure domain, driven with an injected clock: no NATS, no sleeping.

`Driver` composes the domain's functions exactly as the service does for an arrival (conclusions
due, the arrival, the conclusion it completes), for a departure and for a clock tick, and keeps
the log of every event it folded, as the stream would.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from strata.errors import ConflictError, NotFound, StrataError, WorkerSuperseded
from strata.events import (
    BarrierArrived,
    BarrierBrokenEvent,
    BarrierOpened,
    BarrierReleased,
    BarrierTimedOut,
    Event,
    WorkerFailed,
    WorkerLeft,
    WorkerRegistered,
)
from strata.events.ids import event_id
from strata.events.requests import ArriveRequest, BarrierOutcome
from strata.services.barrier import domain
from strata.services.barrier.domain import BarrierState, Generation, NamedBarrier

from tests.tiers import examples

JOB = "job-a"
START_NS = 1_700_000_000 * 10**9
SECOND = 10**9
Conclusion = BarrierReleased | BarrierBrokenEvent | BarrierTimedOut
FINAL = {BarrierReleased: "released", BarrierBrokenEvent: "broken", BarrierTimedOut: "timed_out"}


@dataclass
class Driver:
    """The service's composition of the domain, with a clock the test moves."""

    now: int = START_NS
    state: BarrierState = field(default_factory=BarrierState)
    log: list[Event] = field(default_factory=list)
    ranks: dict[str, int] = field(default_factory=dict)
    epoch: int = 0

    def fold(self, events: list[Event]) -> list[Event]:
        for event in events:
            domain.evolve(self.state, event)
            self.log.append(event)
        return events

    def register(self, worker: str, instance: str | None = None) -> None:
        self.epoch += 1
        rank = self.ranks.setdefault(worker, len(self.ranks))
        event = WorkerRegistered(
            job=JOB,
            source="registry",
            ts=self.now,
            worker_id=worker,
            instance=instance or f"proc-{worker}",
            rank=rank,
            world_size=max(1, len(self.ranks)),
            membership_epoch=self.epoch,
            heartbeat_interval=1.0,
            heartbeat_timeout=5.0,
        )
        self.fold([event])

    def gone(self, worker: str, how: str = "failed") -> list[Event]:
        """The registry's event, then the service's reaction to it."""
        self.epoch += 1
        rank = self.ranks[worker]
        departure: Event
        if how == "failed":
            departure = WorkerFailed(
                job=JOB,
                source="registry",
                ts=self.now,
                worker_id=worker,
                rank=rank,
                reason="missed heartbeats",
                last_heartbeat_ts=self.now - 6 * SECOND,
                membership_epoch=self.epoch,
            )
        else:
            departure = WorkerLeft(
                job=JOB,
                source="registry",
                ts=self.now,
                worker_id=worker,
                rank=rank,
                membership_epoch=self.epoch,
            )
        self.fold([departure])
        why = "failed" if how == "failed" else "left the job"
        return self.fold(domain.member_gone(self.state, JOB, worker, why, self.now))

    def arrive(
        self,
        worker: str,
        name: str,
        arrival: int,
        *,
        timeout: float = 60.0,
        expected: int | None = None,
        instance: str | None = None,
    ) -> BarrierOutcome | StrataError:
        request = ArriveRequest(
            job=JOB,
            name=name,
            worker_id=worker,
            arrival=arrival,
            timeout_s=timeout,
            expected_count=expected,
            instance=instance,
        )
        self.fold(domain.conclude(self.state, JOB, name, self.now))
        decision = domain.arrive(self.state, request, self.now)
        if decision.error is not None:
            return decision.error
        assert decision.result is not None
        self.fold(decision.events)
        self.fold(domain.conclude(self.state, JOB, name, self.now))
        try:
            return domain.outcome(self.state, JOB, name, decision.result)
        except NotFound as exc:  # a retry of an arrival whose generation is no longer kept
            return exc

    def tick(self, seconds: float) -> list[Event]:
        self.now += int(seconds * SECOND)
        return self.fold(domain.due(self.state, self.now))

    def generation(self, name: str, number: int) -> Generation:
        return self.state.jobs[JOB].barriers[name].generations[number]

    def current(self, name: str) -> Generation | None:
        job = self.state.jobs.get(JOB)
        named = job.barriers.get(name) if job is not None else None
        return named.current if named is not None else None


def ok(result: BarrierOutcome | StrataError) -> BarrierOutcome:
    assert isinstance(result, BarrierOutcome), result
    return result


def replayed(events: list[Event]) -> BarrierState:
    state = BarrierState()
    for event in events:
        domain.evolve(state, event)
    return state


def conclusions(log: list[Event]) -> list[Conclusion]:
    return [e for e in log if isinstance(e, Conclusion)]


@pytest.fixture
def driver() -> Driver:
    made = Driver()
    for worker in ("w0", "w1", "w2"):
        made.register(worker)
    return made


# -- examples -------------------------------------------------------------------------------------


def test_released_when_the_last_expected_participant_arrives_and_not_before(
    driver: Driver,
) -> None:
    first = ok(driver.arrive("w0", "step", 0))
    assert (first.status, first.generation, first.arrived, first.expected) == ("waiting", 0, 1, 3)
    assert ok(driver.arrive("w1", "step", 0)).status == "waiting"
    assert not conclusions(driver.log)
    driver.now += 2 * SECOND
    last = ok(driver.arrive("w2", "step", 0))
    assert (last.status, last.arrived, last.expected) == ("released", 3, 3)
    [released] = conclusions(driver.log)
    assert isinstance(released, BarrierReleased)
    assert (released.generation, released.participants) == (0, 3)
    assert released.first_arrival_to_release_ms == pytest.approx(2000.0)
    assert released.last_arrival_to_release_ms == 0.0
    assert [e.type for e in driver.log if e.type.startswith("barrier.")] == [
        "barrier.opened",
        "barrier.arrived",
        "barrier.arrived",
        "barrier.arrived",
        "barrier.released",
    ]


def test_a_name_reused_opens_generation_after_generation(driver: Driver) -> None:
    for step in range(6):
        outcomes = [ok(driver.arrive(w, "step", step)) for w in ("w2", "w0", "w1")]
        assert [o.generation for o in outcomes] == [step] * 3
        assert [o.status for o in outcomes] == ["waiting", "waiting", "released"]
    kept = driver.state.jobs[JOB].barriers["step"].generations
    assert sorted(kept) == [2, 3, 4, 5]  # the newest few are kept
    with pytest.raises(NotFound, match="no longer kept"):
        domain.outcome(driver.state, JOB, "step", 0)


def test_a_retried_arrival_counts_once_and_gets_the_same_answer(driver: Driver) -> None:
    assert ok(driver.arrive("w0", "step", 0)).arrived == 1
    again = ok(driver.arrive("w0", "step", 0))
    assert (again.generation, again.arrived, again.status) == (0, 1, "waiting")
    assert sum(isinstance(e, BarrierArrived) for e in driver.log) == 1
    ok(driver.arrive("w1", "step", 0))
    ok(driver.arrive("w2", "step", 0))
    late_retry = ok(driver.arrive("w0", "step", 0))
    assert (late_retry.generation, late_retry.status) == (0, "released")


def test_stale_and_overlapping_arrivals_are_refused(driver: Driver) -> None:
    for w in ("w0", "w1", "w2"):
        ok(driver.arrive(w, "step", 0))
    ok(driver.arrive("w0", "step", 1))
    backwards = driver.arrive("w0", "step", 0)
    assert isinstance(backwards, ConflictError)
    assert "older than its arrival 1" in backwards.message
    overlapping = driver.arrive("w0", "step", 2)
    assert isinstance(overlapping, ConflictError)
    assert "already waits" in overlapping.message
    # a count may skip numbers (a call that failed before reaching the service)
    assert ok(driver.arrive("w1", "step", 7)).generation == 1


def test_only_live_members_may_arrive(driver: Driver) -> None:
    stranger = driver.arrive("nobody", "step", 0)
    assert isinstance(stranger, NotFound)
    assert "not a live member" in stranger.message
    driver.gone("w2")
    assert isinstance(driver.arrive("w2", "step", 0), NotFound)


@pytest.mark.parametrize("how", ["failed", "left"])
def test_a_departed_participant_breaks_the_waiting_generation(driver: Driver, how: str) -> None:
    ok(driver.arrive("w0", "step", 0))
    ok(driver.arrive("w0", "other", 0))
    broken = driver.gone("w1", how)
    assert {e.name for e in broken if isinstance(e, BarrierBrokenEvent)} == {"step", "other"}
    event = broken[0]
    assert isinstance(event, BarrierBrokenEvent)
    assert event.culprits == ["w1"]
    assert event.missing == ["w1", "w2"]
    assert "'w1'" in event.reason
    outcome = ok(driver.arrive("w0", "step", 0))  # the waiter's retry learns it too
    assert (outcome.status, outcome.missing) == ("broken", ["w1", "w2"])
    # w2's arrival was for the broken generation: it gets the break, not a seat in the next
    late = ok(driver.arrive("w2", "step", 0))
    assert (late.generation, late.status) == (0, "broken")
    # the next generation expects only the live members
    ok(driver.arrive("w0", "step", 1))
    assert ok(driver.arrive("w2", "step", 1)).status == "released"


def test_a_participant_that_arrived_and_then_failed_still_breaks_it(driver: Driver) -> None:
    ok(driver.arrive("w0", "step", 0))
    ok(driver.arrive("w1", "step", 0))
    [broken] = driver.gone("w0")
    assert isinstance(broken, BarrierBrokenEvent)
    assert (broken.culprits, broken.missing) == (["w0"], ["w2"])


def test_workers_outside_the_generation_do_not_break_it(driver: Driver) -> None:
    ok(driver.arrive("w0", "step", 0))
    driver.register("late")
    assert driver.gone("late") == []
    assert ok(driver.arrive("w1", "step", 0)).status == "waiting"
    assert ok(driver.arrive("w2", "step", 0)).status == "released"


def test_a_late_joiner_that_arrives_joins_the_open_generation(driver: Driver) -> None:
    ok(driver.arrive("w0", "step", 0))
    driver.register("late")
    joined = ok(driver.arrive("late", "step", 0))
    assert (joined.generation, joined.expected) == (0, 4)
    ok(driver.arrive("w1", "step", 0))
    assert ok(driver.arrive("w2", "step", 0)).status == "released"


def test_a_count_barrier_releases_whoever_arrives_first(driver: Driver) -> None:
    driver.register("w3")
    assert ok(driver.arrive("w3", "pair", 0, expected=2)).expected == 2
    assert ok(driver.arrive("w1", "pair", 0, expected=2)).status == "released"
    opened_next = ok(driver.arrive("w0", "pair", 0, expected=2))
    assert (opened_next.generation, opened_next.status) == (1, "waiting")
    # someone who never arrived leaving breaks it only once the count is out of reach
    assert driver.gone("w2") == []  # w1 or w3 can still make two with w0
    assert driver.gone("w1") == []
    [broken] = driver.gone("w3")  # now nobody is left to join w0
    assert isinstance(broken, BarrierBrokenEvent)
    assert (broken.generation, broken.culprits) == (1, ["w3"])


def test_a_count_barrier_is_broken_when_an_arrived_participant_fails(driver: Driver) -> None:
    ok(driver.arrive("w0", "trio", 0, expected=3))
    [broken] = driver.gone("w0")
    assert isinstance(broken, BarrierBrokenEvent)
    assert broken.culprits == ["w0"]


def test_timed_out_at_the_deadline_and_not_before(driver: Driver) -> None:
    ok(driver.arrive("w0", "step", 0, timeout=5.0))
    ok(driver.arrive("w1", "step", 0, timeout=5.0))
    assert driver.tick(4.99) == []
    [timed_out] = driver.tick(0.01)
    assert isinstance(timed_out, BarrierTimedOut)
    assert (timed_out.missing, timed_out.arrived, timed_out.timeout_s) == (["w2"], 2, 5.0)
    outcome = ok(driver.arrive("w0", "step", 0))
    assert (outcome.status, outcome.missing) == ("timed_out", ["w2"])
    assert "5s" in outcome.reason


def test_an_arrival_after_the_deadline_gets_the_time_out_and_never_opens_the_next(
    driver: Driver,
) -> None:
    ok(driver.arrive("w0", "step", 0, timeout=1.0))
    ok(driver.arrive("w1", "step", 0, timeout=1.0))
    driver.now += 2 * SECOND  # the periodic check has not run yet
    late = ok(driver.arrive("w2", "step", 0, timeout=1.0))
    assert (late.generation, late.status) == (0, "timed_out")
    assert driver.current("step") is driver.generation("step", 0)
    # The next arrival of anyone opens the next generation, expecting everyone again.
    nxt = ok(driver.arrive("w2", "step", 1, timeout=1.0))
    assert (nxt.generation, nxt.status) == (1, "waiting")


def test_a_new_process_with_the_same_worker_id_counts_from_zero(driver: Driver) -> None:
    for arrival in range(3):
        for w in ("w0", "w1", "w2"):
            ok(driver.arrive(w, "step", arrival))
    driver.gone("w1")
    driver.register("w1", instance="proc-w1-restarted")
    ok(driver.arrive("w0", "step", 3))
    fresh = ok(driver.arrive("w1", "step", 0))
    assert (fresh.generation, fresh.arrived) == (3, 2)
    # the same process coming back (a re-registration after a pause) keeps its count
    driver.gone("w2")
    assert driver.generation("step", 3).status == "broken"
    driver.register("w2")
    assert ok(driver.arrive("w2", "step", 2)).generation == 2  # a retry of its last arrival
    assert isinstance(driver.arrive("w2", "step", 0), ConflictError)
    # Its next arrival was for the generation its absence broke: it gets the break.
    assert (ok(driver.arrive("w2", "step", 3)).generation, driver.current("step").status) == (
        3,
        "broken",
    )
    assert ok(driver.arrive("w2", "step", 4)).generation == 4


def test_a_superseded_process_breaks_its_generation_and_never_counts_for_the_next(
    driver: Driver,
) -> None:
    ok(driver.arrive("w0", "step", 0, instance="proc-w0"))
    ok(driver.arrive("w1", "step", 0, instance="proc-w1"))
    # w1 restarts faster than the heartbeat timeout: the registry fails the old process, then
    # registers the new one under the same id.
    [broken] = driver.gone("w1")
    assert isinstance(broken, BarrierBrokenEvent)
    assert broken.culprits == ["w1"]
    driver.register("w1", instance="proc-w1-restarted")
    # The old process's retry, or its next arrival, would otherwise open the next generation.
    for arrival in (0, 1):
        refused = driver.arrive("w1", "step", arrival, instance="proc-w1")
        assert isinstance(refused, WorkerSuperseded), refused
        assert "'w1'" in refused.message
    assert driver.current("step") is driver.generation("step", 0)
    fresh = ok(driver.arrive("w1", "step", 0, instance="proc-w1-restarted"))
    assert (fresh.generation, fresh.arrived) == (1, 1)
    assert isinstance(driver.arrive("w1", "step", 0, instance="proc-w1"), WorkerSuperseded)
    ok(driver.arrive("w0", "step", 1, instance="proc-w0"))
    # w2's first arrival was for generation 0, which broke before it came: the break.
    late = ok(driver.arrive("w2", "step", 0))  # an arrival naming no process is not checked
    assert (late.generation, late.status) == (0, "broken")
    last = ok(driver.arrive("w2", "step", 1))
    assert (last.generation, last.status, last.arrived) == (1, "released", 3)
    assert sorted(driver.generation("step", 1).arrived) == ["w0", "w1", "w2"]


def test_a_release_lost_in_a_crash_is_derived_again_with_the_same_id(driver: Driver) -> None:
    for w in ("w0", "w1", "w2"):
        ok(driver.arrive(w, "step", 0))
    *stored, released = driver.log
    assert isinstance(released, BarrierReleased)
    restarted = replayed(stored)
    assert restarted.jobs[JOB].barriers["step"].generations[0].status == "waiting"
    [again] = domain.recover(restarted, driver.now + SECOND)
    assert isinstance(again, BarrierReleased)
    assert (again.id, again.generation) == (released.id, 0)
    # a member leaving after completing it does not turn the release into a break
    assert domain.member_gone(restarted, JOB, "w1", "failed", driver.now) == []


def test_a_break_lost_in_a_crash_is_decided_again_on_recovery(driver: Driver) -> None:
    ok(driver.arrive("w0", "step", 0))
    [broken] = driver.gone("w2")
    restarted = replayed(driver.log[:-1])
    [again] = domain.recover(restarted, driver.now)
    assert isinstance(again, BarrierBrokenEvent)
    assert (again.id, again.culprits, again.missing) == (broken.id, ["w2"], ["w1", "w2"])


def request(
    worker: str,
    arrival: int,
    *,
    generation: int | None = None,
    passed: int | None = None,
    concluded: int | None = None,
) -> ArriveRequest:
    """An arrival as the SDK sends it: a process that passed a generation returned from it."""
    return ArriveRequest(
        job=JOB,
        name="step",
        worker_id=worker,
        arrival=arrival,
        generation=generation,
        passed=passed,
        concluded=passed if concluded is None else concluded,
    )


def test_a_re_sent_arrival_the_service_never_stored_gets_its_generations_outcome(
    driver: Driver,
) -> None:
    for w in ("w0", "w1", "w2"):
        ok(driver.arrive(w, "step", 0))
    # A restart that kept the opening and the release, and none of the arrivals.
    kept = [e for e in driver.log if not isinstance(e, BarrierArrived)]
    restarted = replayed(kept)
    batch = domain.decide_arrivals(restarted, [request("w1", 0, generation=0)], driver.now)
    assert batch.joined == [(JOB, "step", 0)]
    assert batch.told == []
    assert domain.outcome(restarted, JOB, "step", 0).status == "released"
    # Without naming its generation it is bound to the same one: the first that expected w1.
    blind = domain.decide_arrivals(replayed(kept), [request("w1", 0)], driver.now)
    assert blind.joined == [(JOB, "step", 0)]
    assert blind.told == []


def test_a_generation_rebuilt_from_re_sends_keeps_its_number_and_releases_once(
    driver: Driver,
) -> None:
    for w in ("w0", "w1", "w2"):
        ok(driver.arrive(w, "step", 0))
    ok(driver.arrive("w0", "step", 1))
    ok(driver.arrive("w1", "step", 1))
    # Lost in the crash: generation 1's arrivals and even its opening.
    kept = [
        e
        for e in driver.log
        if not isinstance(e, BarrierArrived) and getattr(e, "generation", None) != 1
    ]
    restarted = replayed(kept)
    re_sent = [request("w0", 1, generation=1, passed=0), request("w1", 1, generation=1, passed=0)]
    first = domain.decide_arrivals(restarted, re_sent, driver.now)
    assert first.joined == [(JOB, "step", 1)] * 2
    assert [e.type for e in first.told] == ["barrier.opened"]
    last = domain.decide_arrivals(restarted, [request("w2", 1, passed=0)], driver.now)
    [released] = last.told
    assert isinstance(released, BarrierReleased)
    assert (released.generation, released.participants) == (1, 3)
    assert released.id == event_id("released", JOB, "step", 1)  # as decided before the crash
    assert domain.decide_arrivals(restarted, re_sent, driver.now).told == []  # retries: nothing


def test_an_arrival_that_passed_a_generation_proves_a_release_the_stream_lost(
    driver: Driver,
) -> None:
    for w in ("w0", "w1", "w2"):
        ok(driver.arrive(w, "step", 0))
    *stored, released = driver.log
    assert isinstance(released, BarrierReleased)
    # The stream kept the opening but neither the arrivals nor the release (a replicated stream
    # that lost it); w0 passed generation 0 and now arrives at the next one.
    restarted = replayed([e for e in stored if not isinstance(e, BarrierArrived)])
    assert domain.recover(restarted, driver.now) == []  # the new instance goes live
    batch = domain.decide_arrivals(restarted, [request("w0", 1, passed=0)], driver.now)
    proven, opened = batch.told
    assert isinstance(proven, BarrierReleased)
    assert (proven.id, proven.generation) == (released.id, 0)
    assert isinstance(opened, BarrierOpened)
    assert opened.generation == 1
    assert batch.joined == [(JOB, "step", 1)]
    # Proof of a generation that is concluded already changes nothing.
    again = domain.decide_arrivals(restarted, [request("w1", 1, passed=0)], driver.now)
    assert again.told == []
    assert again.joined == [(JOB, "step", 1)]


def test_a_late_retry_of_a_first_send_after_a_restart_gets_its_generations_outcome(
    driver: Driver,
) -> None:
    """w1 arrived (generation 0 opened), the service crashed before recording the arrival, and
    w0 failed, breaking generation 0 for w1. A retry of w1's first send, still in flight, then
    reaches the restarted service: it must get generation 0's outcome, not open generation 1
    and count there for an arrival w1 never made (releasing it, as w1 is alone now)."""
    ok(driver.arrive("w1", "step", 0))
    restarted = replayed([e for e in driver.log if not isinstance(e, BarrierArrived)])
    assert domain.recover(restarted, driver.now) == []
    driver.now += SECOND
    for worker in ("w0", "w2"):
        driver.gone(worker)
        departure = [e for e in driver.log if isinstance(e, WorkerFailed)][-1]
        domain.evolve(restarted, departure)
        for event in domain.member_gone(restarted, JOB, worker, "failed", driver.now):
            domain.evolve(restarted, event)
    assert domain.outcome(restarted, JOB, "step", 0).status == "broken"
    late = domain.decide_arrivals(restarted, [request("w1", 0)], driver.now)
    assert late.joined == [(JOB, "step", 0)]
    assert not any(isinstance(e, BarrierReleased | BarrierOpened) for e in late.told)
    # Its next arrival, having returned from generation 0, opens generation 1.
    nxt = domain.decide_arrivals(restarted, [request("w1", 1, concluded=0)], driver.now)
    assert nxt.joined == [(JOB, "step", 1)]


def test_an_arrival_joins_the_same_generation_whether_or_not_the_service_restarts(
    driver: Driver,
) -> None:
    """The crash model's counterexample: w0 and w1 arrive; the service takes w0's arrival
    (generation 0 opens, expecting all three); w0 fails, breaking generation 0; then w1's
    arrival reaches the service; the service crashes and restarts; a late retry of w1's first
    send (naming no generation: it was sent before any answer) reaches the restarted service.
    Both services must place w1's arrival in the same generation: before, the live one opened
    generation 1 for it and the restarted one answered generation 0's break."""
    driver.now += 2 * SECOND  # the service started before the barrier opened
    domain.recover(driver.state, driver.now - SECOND)
    first = domain.decide_arrivals(driver.state, [request("w0", 0)], driver.now)
    driver.log.extend(first.told)
    driver.gone("w0")
    live = domain.decide_arrivals(driver.state, [request("w1", 0)], driver.now)
    driver.log.extend(live.told)
    assert live.joined == [(JOB, "step", 0)]
    assert domain.outcome(driver.state, JOB, "step", 0).status == "broken"
    assert not any(isinstance(e, BarrierOpened) for e in live.told)  # no generation 1
    restarted = replayed(driver.log)
    assert domain.recover(restarted, driver.now) == []
    retried = domain.decide_arrivals(restarted, [request("w1", 0)], driver.now)
    assert retried.joined == live.joined
    # Having returned from generation 0, w1's next arrival opens generation 1 on both.
    for state in (driver.state, restarted):
        nxt = domain.decide_arrivals(state, [request("w1", 1, concluded=0)], driver.now)
        assert nxt.joined == [(JOB, "step", 1)]


def test_a_claim_to_have_passed_proves_nothing_the_service_saw_open_itself(
    driver: Driver,
) -> None:
    """`passed` repairs only a release lost across a restart: a live instance that opened the
    generation itself, a non-participant, or a generation opened after the restart are refused,
    so a worker cannot release a barrier the others have not reached by claiming it passed."""
    ok(driver.arrive("w0", "step", 0))
    # Never restarted: a claim about the waiting generation 0 changes nothing.
    forged = domain.decide_arrivals(driver.state, [request("w1", 0, passed=0)], driver.now)
    assert not any(isinstance(e, BarrierReleased) for e in forged.told)
    assert domain.outcome(driver.state, JOB, "step", 0).status == "waiting"
    # Restarted with generation 0 open: a worker that is no participant of it proves nothing.
    restarted = replayed([e for e in driver.log if not isinstance(e, BarrierArrived)])
    domain.recover(restarted, driver.now)
    driver.register("w9")
    domain.evolve(restarted, driver.log[-1])
    outsider = domain.decide_arrivals(restarted, [request("w9", 0, passed=0)], driver.now)
    assert not any(isinstance(e, BarrierReleased) for e in outsider.told)
    # A generation the new instance opened itself cannot have lost its release either.
    driver.now += SECOND
    for w in ("w0", "w1", "w2"):
        domain.decide_arrivals(restarted, [request(w, 0, generation=0)], driver.now)
    assert domain.outcome(restarted, JOB, "step", 0).status == "released"
    opened = domain.decide_arrivals(restarted, [request("w0", 1)], driver.now)
    assert opened.joined == [(JOB, "step", 1)]
    late = domain.decide_arrivals(restarted, [request("w1", 1, passed=1)], driver.now + 1)
    assert not any(isinstance(e, BarrierReleased) for e in late.told)
    assert domain.outcome(restarted, JOB, "step", 1).status == "waiting"


def test_evolve_is_idempotent_over_a_whole_history(driver: Driver) -> None:
    for w in ("w0", "w1", "w2"):
        ok(driver.arrive(w, "step", 0))
    ok(driver.arrive("w0", "step", 1, timeout=1.0))
    driver.gone("w1")
    ok(driver.arrive("w0", "step", 2, timeout=1.0))
    driver.tick(2.0)
    once = replayed(driver.log)
    twice = BarrierState()
    for event in driver.log:
        domain.evolve(twice, event)
        domain.evolve(twice, event)
    assert twice == once == driver.state


# -- the state machine ----------------------------------------------------------------------------

WORKERS = ("w0", "w1", "w2", "w3")
NAMES = ("step", "epoch")


class BarrierMachine(RuleBasedStateMachine):
    """Random membership changes, arrivals, retries, departures and clock moves."""

    def __init__(self) -> None:
        super().__init__()
        self.driver = Driver()
        self.processes = itertools.count()
        self.instance: dict[str, str] = {}
        self.live: set[str] = set()
        self.next_arrival: dict[tuple[str, str], int] = {}
        self.joined: dict[tuple[str, str, str, int], int] = {}
        """(instance, worker, name, arrival) -> the generation that arrival joined."""
        self.final: dict[tuple[str, int], str] = {}
        self.since: dict[str, int] = {}
        """Worker id -> when its current process registered."""

    # -- rules

    @precondition(lambda self: len(self.live) < len(WORKERS))
    @rule(data=st.data(), new_process=st.booleans())
    def register(self, data: st.DataObject, new_process: bool) -> None:
        worker = data.draw(st.sampled_from(sorted(set(WORKERS) - self.live)))
        if new_process or worker not in self.instance:
            self.instance[worker] = f"proc-{next(self.processes)}"
            self.since[worker] = self.driver.now
            for name in NAMES:
                self.next_arrival[(worker, name)] = 0
        self.driver.register(worker, self.instance[worker])
        self.live.add(worker)

    @precondition(lambda self: bool(self.live))
    @rule(
        data=st.data(),
        name=st.sampled_from(NAMES),
        timeout=st.sampled_from([1.0, 5.0]),
        count=st.none() | st.integers(min_value=1, max_value=3),
    )
    def arrive(self, data: st.DataObject, name: str, timeout: float, count: int | None) -> None:
        worker = data.draw(st.sampled_from(sorted(self.live)))
        arrival = self.next_arrival[(worker, name)]
        before = self.driver.current(name)
        if before is None:
            number = 0
        elif before.status == "waiting" and not self._due(before):
            number = before.generation
        else:
            number = before.generation + 1
        bound = self._bound(worker, name)
        if bound is not None:
            number = bound
        previous = self._waiting_arrival(worker, name)
        result = self.driver.arrive(worker, name, arrival, timeout=timeout, expected=count)
        if previous is not None:
            # its earlier arrival still waits in the current generation
            assert isinstance(result, ConflictError), result
            return
        outcome = ok(result)
        self.next_arrival[(worker, name)] = arrival + 1
        self.joined[(self.instance[worker], worker, name, arrival)] = outcome.generation
        assert outcome.generation == number
        gen = self.driver.generation(name, outcome.generation)
        assert worker in gen.arrived
        assert outcome.status == gen.status
        if bound is not None:
            # an arrival for a generation that concluded without it: that outcome, never a seat
            assert gen.status in ("broken", "timed_out")
            return
        # released exactly when complete, never before
        assert (gen.status == "released") == gen.complete()

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), name=st.sampled_from(NAMES))
    def retry(self, data: st.DataObject, name: str) -> None:
        worker = data.draw(st.sampled_from(sorted(self.live)))
        arrival = self.next_arrival[(worker, name)] - 1
        key = (self.instance[worker], worker, name, arrival)
        if key not in self.joined:
            return
        sizes = self._arrived_sizes()
        result = self.driver.arrive(worker, name, arrival)
        if isinstance(result, NotFound):  # its generation is no longer kept
            return
        assert ok(result).generation == self.joined[key]
        assert self._arrived_sizes() == sizes

    @precondition(lambda self: bool(self.live))
    @rule(data=st.data(), how=st.sampled_from(["failed", "left"]))
    def depart(self, data: st.DataObject, how: str) -> None:
        worker = data.draw(st.sampled_from(sorted(self.live)))
        waiting = [
            gen
            for name in NAMES
            if (gen := self.driver.current(name)) is not None
            and gen.status == "waiting"
            and not gen.completed_in_time()
        ]
        involved = [
            gen
            for gen in waiting
            if (worker in gen.arrived if gen.by_count else worker in gen.expected)
        ]
        events = self.driver.gone(worker, how)
        self.live.discard(worker)
        for gen in involved:
            assert gen.status == "broken", (gen.name, gen.generation)
        broken = [e for e in events if isinstance(e, BarrierBrokenEvent)]
        assert all(e.culprits == [worker] for e in broken)
        for gen in waiting:
            if gen not in involved and not gen.by_count:
                assert gen.status == "waiting"

    @rule(seconds=st.sampled_from([0.1, 0.5, 1.0, 3.0]))
    def tick(self, seconds: float) -> None:
        self.driver.tick(seconds)
        for _, gen in self.driver.state.waiting():
            assert gen.deadline_ns > self.driver.now

    @precondition(lambda self: bool(self.driver.log))
    @rule(data=st.data())
    def fold_again(self, data: st.DataObject) -> None:
        """The service folds its own decisions twice: at once, and when the stream returns them
        (later decisions may be applied in between); membership events it folds once."""
        decisions = [e for e in self.driver.log if e.type.startswith("barrier.")]
        event = data.draw(st.sampled_from([*decisions, self.driver.log[-1]]))
        before = copy.deepcopy(self.driver.state)
        domain.evolve(self.driver.state, event)
        assert self.driver.state == before

    @precondition(
        lambda self: bool(self.driver.log) and isinstance(self.driver.log[-1], Conclusion)
    )
    @rule()
    def restart_losing_the_last_conclusion(self) -> None:
        *stored, lost = self.driver.log
        assert isinstance(lost, Conclusion)
        restarted = replayed(stored)
        owed = domain.recover(restarted, self.driver.now)
        gen = self.driver.generation(lost.name, lost.generation)
        if (
            isinstance(lost, BarrierBrokenEvent)
            and gen.by_count
            and not set(lost.culprits) & set(gen.arrived)
        ):
            return  # put out of reach by a departure: recovery leaves it to its deadline
        assert lost.id in {e.id for e in owed}
        assert type(next(e for e in owed if e.id == lost.id)) is type(lost)

    # -- invariants

    @invariant()
    def replay_rebuilds_the_same_state(self) -> None:
        assert replayed(self.driver.log) == self.driver.state

    @invariant()
    def generations_never_mix(self) -> None:
        kept = {(gen.name, gen.generation): gen for gen in self._generations()}
        joined_by: dict[tuple[str, int], set[str]] = {}
        for (instance, worker, name, _), number in self.joined.items():
            joined_by.setdefault((name, number), set()).add(worker)
            gen = kept.get((name, number))
            if gen is not None and self.instance.get(worker) == instance:
                assert worker in gen.arrived
        for key, gen in kept.items():
            assert set(gen.arrived) <= joined_by.get(key, set())

    @invariant()
    def released_exactly_when_complete(self) -> None:
        for named in self._named():
            numbers = sorted(named.generations)
            assert numbers == list(range(numbers[0], numbers[-1] + 1))
            for gen in named.generations.values():
                if gen.status == "released":
                    assert gen.complete()
                if gen.status == "waiting":
                    assert not gen.completed_in_time()
                    assert gen is named.current

    @invariant()
    def each_generation_concludes_once_and_for_good(self) -> None:
        seen: dict[tuple[str, int], str] = {}
        for event in conclusions(self.driver.log):
            key = (event.name, event.generation)
            assert key not in seen, f"{key} concluded twice"
            seen[key] = FINAL[type(event)]
        for key, status in self.final.items():
            assert seen[key] == status
        self.final = seen
        for gen in self._generations():
            assert gen.status == seen.get((gen.name, gen.generation), "waiting")

    # -- helpers

    def _waiting_arrival(self, worker: str, name: str) -> int | None:
        """The arrival of this process that still waits in the current generation, if any."""
        gen = self.driver.current(name)
        if gen is None or gen.status != "waiting" or worker not in gen.arrived:
            return None
        if self._due(gen):
            return None  # concluded first, then the arrival opens the next generation
        return self.next_arrival[(worker, name)] - 1

    def _bound(self, worker: str, name: str) -> int | None:
        """The generation a new arrival of `worker` was for, if it concluded without it: the
        first after every generation the worker's arrivals joined, opened since its process
        registered, that expected it (or, counted by arrivals, that it arrived at)."""
        after = max(
            (number for (_, w, n, _), number in self.joined.items() if (w, n) == (worker, name)),
            default=-1,
        )
        job = self.driver.state.jobs.get(JOB)
        named = job.barriers.get(name) if job is not None else None
        for number in sorted(named.generations if named is not None else ()):
            gen = named.generations[number] if named is not None else None
            assert gen is not None
            if number <= after or gen.opened_ns < self.since[worker]:
                continue
            if gen.status == "waiting" and not self._due(gen):
                return None
            if worker in (gen.arrived if gen.by_count else gen.expected):
                return number
        return None

    def _due(self, gen: Generation) -> bool:
        return gen.completed_in_time() or gen.deadline_ns <= self.driver.now

    def _named(self) -> list[NamedBarrier]:
        job = self.driver.state.jobs.get(JOB)
        return list(job.barriers.values()) if job is not None else []

    def _generations(self) -> list[Generation]:
        return [gen for named in self._named() for gen in named.generations.values()]

    def _arrived_sizes(self) -> dict[tuple[str, int], int]:
        return {(gen.name, gen.generation): len(gen.arrived) for gen in self._generations()}


BarrierMachine.TestCase.settings = settings(max_examples=examples(80), stateful_step_count=30)
TestBarrierMachine = BarrierMachine.TestCase
