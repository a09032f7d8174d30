"""The barrier domain on two clocks, and withdrawn arrivals: pure, with the clocks driven by hand.

A service passes its monotonic clock as `now_ns` and its wall clock as `wall_ns`: the wall clock
may step (NTP) without moving a deadline, and a deadline carried across a restart in an event's
wall time is clamped to the generation's timeout. A waiter that gives up withdraws its arrival:
it leaves a generation still waiting and, delivered late, opens and completes nothing. An
arrival that says how long its waiter waits lapses then: no release counts it afterwards, even
when its withdrawal is still on its way. An arrival under an ended lease is refused.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from hypothesis import given, settings
from hypothesis import strategies as st
from strata.clock import TimeBase
from strata.errors import BarrierTimeout, StaleLease, StrataError
from strata.events import (
    BarrierReleased,
    BarrierTimedOut,
    BarrierWithdrawn,
    Event,
    WorkerFailed,
    WorkerRegistered,
)
from strata.events.requests import ArriveRequest, BarrierOutcome, Lease, WithdrawRequest
from strata.services.barrier import domain
from strata.services.barrier.domain import BarrierState

from tests.tiers import examples

JOB = "job-t"
SECOND = 10**9
MONO_START = 5_000 * SECOND
WALL_START = 1_700_000_000 * SECOND
WORKERS = ("w0", "w1", "w2")


@dataclass
class Service:
    """The service's composition of the domain, with a monotonic and a wall clock of its own."""

    mono: int = MONO_START
    wall: int = WALL_START
    state: BarrierState = field(default_factory=BarrierState)
    log: list[Event] = field(default_factory=list)
    withdrawn_status: str = ""

    def reading(self) -> TimeBase:
        return TimeBase(self.mono, self.wall)

    def fold(self, events: list[Event]) -> list[Event]:
        for event in events:
            self.state.clock = self.reading()  # as the adapter does before every fold
            domain.evolve(self.state, event)
            self.log.append(event)
        return events

    def register(self, *workers: str) -> None:
        for rank, worker in enumerate(workers):
            self.fold(
                [
                    WorkerRegistered(
                        job=JOB,
                        source="registry",
                        ts=self.wall - SECOND,
                        worker_id=worker,
                        instance=f"p-{worker}",
                        rank=rank,
                        world_size=len(workers),
                        membership_epoch=rank + 1,
                        heartbeat_interval=1.0,
                        heartbeat_timeout=5.0,
                    )
                ]
            )

    def arrive(
        self,
        worker: str,
        arrival: int,
        timeout: float = 60.0,
        name: str = "step",
        *,
        remaining: float | None = None,
        lease: Lease | None = None,
        sent_after_s: float | None = None,
    ) -> BarrierOutcome | StrataError:
        """`sent_after_s`: how long before now the request may have been sent (a stall)."""
        request = ArriveRequest(
            job=JOB,
            name=name,
            worker_id=worker,
            arrival=arrival,
            timeout_s=timeout,
            remaining_s=remaining,
            lease=lease,
        )
        sent_after = None if sent_after_s is None else self.mono - int(sent_after_s * SECOND)
        batch = domain.decide_arrivals(
            self.state, [request], *self.reading(), sent_after_ns=sent_after
        )
        self.log.extend(batch.told)
        self.log.extend(arrival.event() for arrival in batch.record)
        [joined] = batch.joined
        if isinstance(joined, StrataError):
            return joined
        return domain.outcome(self.state, *joined)

    def withdraw(self, worker: str, arrival: int, name: str = "step") -> list[Event]:
        request = WithdrawRequest(job=JOB, name=name, worker_id=worker, arrival=arrival)
        decision = domain.withdraw(self.state, request, *self.reading())
        assert decision.error is None
        assert decision.result is not None
        self.withdrawn_status = decision.result.status
        return self.fold(decision.events)

    def tick(self, seconds: float, *, wall_step: float = 0.0) -> list[Event]:
        self.mono += int(seconds * SECOND)
        self.wall += int((seconds + wall_step) * SECOND)
        return self.fold(domain.due(self.state, *self.reading()))

    def restarted(self, down_s: float, *, wall_step: float = 0.0) -> Service:
        """A new process (another monotonic clock) that replays the log and recovers."""
        fresh = Service(
            mono=17 * SECOND, wall=self.wall + int((down_s + wall_step) * SECOND), log=[]
        )
        fresh.fold(list(self.log))
        fresh.fold(domain.recover(fresh.state, *fresh.reading()))
        return fresh


def ok(result: BarrierOutcome | StrataError) -> BarrierOutcome:
    assert isinstance(result, BarrierOutcome), result
    return result


def service() -> Service:
    made = Service()
    made.register(*WORKERS)
    return made


def test_a_wall_clock_stepped_forward_never_ends_a_deadline_early() -> None:
    svc = service()
    ok(svc.arrive("w0", 0, timeout=60.0))
    assert svc.tick(0.5, wall_step=120.0) == []  # NTP steps the wall clock 2 minutes ahead
    ok(svc.arrive("w1", 0, timeout=60.0))
    assert svc.tick(30.0) == []
    released = ok(svc.arrive("w2", 0, timeout=60.0))
    assert (released.status, released.arrived) == ("released", 3)


def test_a_wall_clock_stepped_back_never_extends_a_deadline() -> None:
    svc = service()
    ok(svc.arrive("w0", 0, timeout=3.0))
    assert svc.tick(1.0, wall_step=-120.0) == []
    assert svc.tick(1.9) == []
    [timed_out] = svc.tick(0.1)
    assert isinstance(timed_out, BarrierTimedOut)
    assert timed_out.ts < WALL_START  # stamped with the (stepped) wall clock, as events are


def test_the_time_left_carries_over_a_restart() -> None:
    svc = service()
    ok(svc.arrive("w0", 0, timeout=10.0))
    svc.tick(4.0)
    after = svc.restarted(down_s=2.0)  # 6 s of the 10 used: 4 s left
    assert after.tick(3.9) == []
    [timed_out] = after.tick(0.2)
    assert isinstance(timed_out, BarrierTimedOut)


def test_a_wall_clock_stepped_back_over_a_restart_leaves_at_most_the_timeout() -> None:
    svc = service()
    ok(svc.arrive("w0", 0, timeout=10.0))
    after = svc.restarted(down_s=1.0, wall_step=-3600.0)  # an hour back: 3609 s "left"
    assert after.tick(9.9) == []
    [timed_out] = after.tick(0.2)
    assert isinstance(timed_out, BarrierTimedOut)


def test_a_wall_clock_stepped_forward_over_a_restart_shortens_the_deadline() -> None:
    svc = service()
    ok(svc.arrive("w0", 0, timeout=10.0))
    after = svc.restarted(down_s=1.0, wall_step=120.0)
    [timed_out] = [e for e in after.log if isinstance(e, BarrierTimedOut)]
    assert timed_out.generation == 0  # due at once on recovery: the documented cost


def test_a_withdrawn_arrival_leaves_its_waiting_generation() -> None:
    svc = service()
    ok(svc.arrive("w0", 0))
    ok(svc.arrive("w1", 0))
    [withdrawn] = svc.withdraw("w1", 0)
    assert isinstance(withdrawn, BarrierWithdrawn)
    assert withdrawn.generation == 0
    assert svc.withdraw("w1", 0) == []  # idempotent
    # w2 arriving no longer completes it: w1 is not at the barrier.
    assert ok(svc.arrive("w2", 0)).status == "waiting"
    # w1 comes back with its next arrival: now it is complete.
    released = ok(svc.arrive("w1", 1))
    assert (released.generation, released.status, released.arrived) == (0, "released", 3)


def test_an_arrival_delivered_after_its_withdrawal_opens_and_completes_nothing() -> None:
    svc = service()
    # w0's arrival is on its way to a paused service; w0 gives up and withdraws it first.
    [withdrawn] = svc.withdraw("w0", 0)
    assert isinstance(withdrawn, BarrierWithdrawn)
    assert withdrawn.generation == 0  # the generation it was for: the next to open
    late = svc.arrive("w0", 0)
    assert isinstance(late, BarrierTimeout)
    assert "withdrawn" in late.message
    assert svc.state.jobs[JOB].barriers["step"].current is None  # nothing opened
    ok(svc.arrive("w1", 0))
    ok(svc.arrive("w2", 0))
    assert [e for e in svc.log if isinstance(e, BarrierReleased)] == []
    # w0's next arrival joins the generation the others wait at: not refused, not its outcome.
    released = ok(svc.arrive("w0", 1))
    assert (released.generation, released.status, released.arrived) == (0, "released", 3)


def test_after_a_withdrawal_the_next_arrival_is_not_answered_with_the_missed_outcome() -> None:
    svc = service()
    svc.withdraw("w0", 0)  # gave up before its arrival reached the service
    ok(svc.arrive("w1", 0, timeout=2.0))
    ok(svc.arrive("w2", 0, timeout=2.0))
    [timed_out] = svc.tick(2.0)  # generation 0 times out without w0
    assert isinstance(timed_out, BarrierTimedOut)
    fresh = ok(svc.arrive("w0", 1))  # a new arrival: a seat in the next generation
    assert (fresh.generation, fresh.status) == (1, "waiting")


def test_withdrawing_from_a_concluded_generation_changes_nothing() -> None:
    svc = service()
    for worker in WORKERS:
        ok(svc.arrive(worker, 0))
    request = WithdrawRequest(job=JOB, name="step", worker_id="w0", arrival=0)
    decision = domain.withdraw(svc.state, request, *svc.reading())
    assert decision.events == []
    assert decision.result is not None
    assert (decision.result.status, decision.result.generation) == ("released", 0)


def test_a_withdrawn_arrival_recorded_after_its_withdrawal_is_not_counted_on_replay() -> None:
    svc = service()
    ok(svc.arrive("w0", 0))
    ok(svc.arrive("w1", 0))
    svc.withdraw("w1", 0)
    # The arrival's record went out after the withdrawal: replayed, it must not count again.
    records = [e for e in svc.log if e.type == "barrier.arrived"]
    rest = [e for e in svc.log if e.type != "barrier.arrived"]
    after = Service(mono=SECOND, wall=svc.wall, log=[])
    after.fold(rest + records)
    assert sorted(after.state.jobs[JOB].barriers["step"].generations[0].arrived) == ["w0"]


def test_a_withdrawal_decided_with_its_late_arrival_goes_first() -> None:
    """A paused service resumes with w0's arrival, w1's and w2's, and w0's withdrawal behind
    them, all in one batch: w0 gave up, so nothing is released."""
    svc = service()
    batch = domain.decide_arrivals(
        svc.state,
        [
            ArriveRequest(job=JOB, name="step", worker_id="w0", arrival=0, timeout_s=5.0),
            ArriveRequest(job=JOB, name="step", worker_id="w1", arrival=0, timeout_s=5.0),
            ArriveRequest(job=JOB, name="step", worker_id="w2", arrival=0, timeout_s=5.0),
            WithdrawRequest(job=JOB, name="step", worker_id="w0", arrival=0),
        ],
        *svc.reading(),
    )
    assert not [e for e in batch.told if isinstance(e, BarrierReleased)]
    refused, *_, answer = batch.joined
    assert isinstance(refused, BarrierTimeout)
    assert getattr(answer, "status", None) == "withdrawn"
    assert sorted(svc.state.jobs[JOB].barriers["step"].generations[0].arrived) == ["w1", "w2"]


@settings(max_examples=examples(150), deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["arrive", "withdraw", "late", "tick"]),
            st.sampled_from(WORKERS),
        ),
        max_size=40,
    )
)
def test_no_generation_is_released_with_a_worker_that_gave_up(ops: list[tuple[str, str]]) -> None:
    """Workers arrive, give up (withdraw), have their given-up arrivals delivered late, and time
    passes: every release holds only workers whose arrival in it was never withdrawn (a
    withdrawal after the generation concluded changes nothing: that worker was released)."""
    svc = service()
    sent: dict[str, int] = {}
    given_up: dict[str, set[int]] = {w: set() for w in WORKERS}
    joined: dict[tuple[str, int], int] = {}  # (worker, arrival) -> generation
    for op, worker in ops:
        if op == "arrive":
            sent[worker] = sent.get(worker, -1) + 1
            answer = svc.arrive(worker, sent[worker], timeout=5.0)
            if isinstance(answer, BarrierOutcome):
                joined[(worker, sent[worker])] = answer.generation
        elif op == "withdraw" and worker in sent:
            svc.withdraw(worker, sent[worker])
            if svc.withdrawn_status == "withdrawn":  # else its generation concluded with it
                given_up[worker].add(sent[worker])
        elif op == "late" and given_up[worker]:
            answer = svc.arrive(worker, max(given_up[worker]), timeout=5.0)
            assert isinstance(answer, BarrierTimeout)
        elif op == "tick":
            svc.tick(2.0)
        for release in [e for e in svc.log if isinstance(e, BarrierReleased)]:
            gen = svc.state.jobs[JOB].barriers["step"].generations.get(release.generation)
            if gen is None:
                continue
            for member in gen.arrived:
                counted = [a for (w, a), g in joined.items() if w == member and g == gen.generation]
                assert any(a not in given_up[member] for a in counted), (member, gen)


def lease_of(worker: str, epoch: int) -> Lease:
    return Lease(worker_id=worker, instance=f"p-{worker}", epoch=epoch)


def test_a_release_never_counts_an_arrival_whose_waiter_gave_up() -> None:
    """w0 waits 1 s at a generation w1 opened for 60 s; its withdrawal is held up on the way.
    w2 completes the generation after w0 gave up: w0's arrival is withdrawn for it instead."""
    svc = service()
    ok(svc.arrive("w1", 0, remaining=60.0))
    ok(svc.arrive("w0", 0, timeout=1.0, remaining=1.0))
    svc.tick(1.5)
    waiting = ok(svc.arrive("w2", 0, remaining=60.0))
    assert (waiting.status, waiting.arrived) == ("waiting", 2)
    [lapsed] = [e for e in svc.log if isinstance(e, BarrierWithdrawn)]
    assert (lapsed.worker_id, lapsed.arrival, lapsed.generation) == ("w0", 0, 0)
    assert [e for e in svc.log if isinstance(e, BarrierReleased)] == []
    # Its re-send, had its waiter not given up yet, hears that it timed out.
    assert isinstance(svc.arrive("w0", 0, timeout=1.0, remaining=0.0), BarrierTimeout)
    svc.withdraw("w0", 0)  # the held-up withdrawal lands: already done
    assert svc.withdrawn_status == "withdrawn"
    released = ok(svc.arrive("w0", 1, remaining=60.0))  # w0 at the barrier again
    assert (released.generation, released.status, released.arrived) == (0, "released", 3)


def test_an_arrival_released_before_it_lapses_counts() -> None:
    svc = service()
    ok(svc.arrive("w0", 0, timeout=1.0, remaining=1.0))
    ok(svc.arrive("w1", 0, timeout=1.0, remaining=1.0))
    svc.mono += int(0.9 * SECOND)
    released = ok(svc.arrive("w2", 0, timeout=1.0, remaining=1.0))
    assert released.status == "released"
    assert [e for e in svc.log if isinstance(e, BarrierWithdrawn)] == []


def test_a_time_out_is_not_turned_into_withdrawals() -> None:
    """A generation that times out names everyone who did not come, not those who did."""
    svc = service()
    ok(svc.arrive("w0", 0, timeout=2.0, remaining=2.0))
    ok(svc.arrive("w1", 0, timeout=2.0, remaining=2.0))
    [timed_out] = svc.tick(2.5)
    assert isinstance(timed_out, BarrierTimedOut)
    assert timed_out.missing == ["w2"]


def test_a_re_send_shortens_the_wait_and_never_lengthens_it() -> None:
    svc = service()
    ok(svc.arrive("w1", 0, remaining=60.0))
    ok(svc.arrive("w0", 0, timeout=30.0, remaining=30.0))
    svc.tick(0.5)
    ok(svc.arrive("w0", 0, timeout=30.0, remaining=0.2))  # its waiter has 0.2 s left
    ok(svc.arrive("w0", 0, timeout=30.0, remaining=50.0))  # no re-send can lengthen it
    svc.tick(0.5)
    waiting = ok(svc.arrive("w2", 0, remaining=60.0))
    assert waiting.status == "waiting"
    assert [(e.worker_id, e.arrival) for e in svc.log if isinstance(e, BarrierWithdrawn)] == [
        ("w0", 0)
    ]


def test_a_request_read_after_a_stall_counts_its_wait_from_the_stall() -> None:
    """A paused service reads w0's 1 s arrival 3 s after it was sent: it lapsed already, and
    the arrival that completes the generation releases nothing."""
    svc = service()
    ok(svc.arrive("w1", 0, remaining=60.0))
    svc.tick(3.0)
    ok(svc.arrive("w0", 0, timeout=1.0, remaining=1.0, sent_after_s=3.0))
    waiting = ok(svc.arrive("w2", 0, remaining=60.0, sent_after_s=3.0))
    assert waiting.status == "waiting"
    assert [e for e in svc.log if isinstance(e, BarrierReleased)] == []


def test_an_arrival_under_an_ended_lease_is_refused() -> None:
    svc = service()
    assert ok(svc.arrive("w0", 0, lease=lease_of("w0", 1))).status == "waiting"
    refused = svc.arrive("w1", 0, lease=lease_of("w1", 1))  # w1's lease is epoch 2
    assert isinstance(refused, StaleLease), refused
    assert "registered again" in refused.message
    failed = WorkerFailed(
        job=JOB,
        source="registry",
        worker_id="w2",
        rank=2,
        reason="no heartbeat",
        last_heartbeat_ts=svc.wall - 5 * SECOND,
        membership_epoch=4,
    )
    svc.fold([failed])
    zombie = svc.arrive("w2", 0, lease=lease_of("w2", 3))
    assert isinstance(zombie, StaleLease), zombie
    assert "failed" in zombie.message
