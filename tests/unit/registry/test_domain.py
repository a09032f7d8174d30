"""The registry's pure domain, driven with an injected clock: no NATS, no sleeping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from strata.errors import ConflictError, NotFound
from strata.events import WorkerFailed, WorkerHeartbeat, WorkerRegistered, WorkerStateChanged
from strata.events.requests import LeaveRequest, RegisterRequest
from strata.services.registry import domain
from strata.services.registry.domain import (
    DetectFailures,
    Leave,
    Policy,
    Register,
    RegistryState,
)

POLICY = Policy(heartbeat_interval=1.0, heartbeat_timeout=5.0)
JOB = "job-a"


def run(state: RegistryState, command: domain.Command, now: float) -> domain.Decision:
    decision = domain.decide(state, command, now, POLICY)
    for event in decision.events:
        domain.evolve(state, event)
    return decision


def register(state: RegistryState, worker: str, now: float, instance: str | None = None) -> int:
    request = RegisterRequest(job=JOB, worker_id=worker, instance=instance or f"p-{worker}")
    decision = run(state, Register(request), now)
    assert decision.error is None, decision.error
    return state.jobs[JOB].members[worker].rank


def heartbeat(
    state: RegistryState, worker: str, now: float, status: str = "training", seq: int = 1
) -> domain.HeartbeatOutcome:
    member = state.jobs[JOB].members[worker]
    hb = WorkerHeartbeat(
        job=JOB,
        source=worker,
        worker_id=worker,
        instance=member.instance,
        seq=seq,
        state=status,  # type: ignore[arg-type]
    )
    return domain.observe_heartbeat(state, hb, now)


def test_ranks_are_dense_then_the_lowest_free_rank_is_reused() -> None:
    state = RegistryState()
    assert [register(state, f"w{i}", 100.0) for i in range(4)] == [0, 1, 2, 3]
    run(state, Leave(LeaveRequest(job=JOB, worker_id="w1", instance="p-w1")), 101.0)
    run(state, Leave(LeaveRequest(job=JOB, worker_id="w3", instance="p-w3")), 101.0)
    assert register(state, "new-a", 102.0) == 1
    assert register(state, "new-b", 102.0) == 3
    assert register(state, "new-c", 102.0) == 4
    assert state.jobs[JOB].world_size == 5


def test_registration_is_idempotent_for_one_process_and_refused_for_another() -> None:
    state = RegistryState()
    register(state, "w0", 10.0, instance="first")
    again = run(state, Register(RegisterRequest(job=JOB, worker_id="w0", instance="first")), 11.0)
    assert again.events == []
    assert again.error is None
    other = run(state, Register(RegisterRequest(job=JOB, worker_id="w0", instance="second")), 11.0)
    assert isinstance(other.error, ConflictError)
    assert "'w0'" in other.error.message
    assert state.jobs[JOB].membership_epoch == 1


def test_worker_id_is_derived_from_the_instance_when_absent() -> None:
    state = RegistryState()
    decision = run(state, Register(RegisterRequest(job=JOB, instance="abc123")), 1.0)
    registered = decision.events[0]
    assert isinstance(registered, WorkerRegistered)
    assert registered.worker_id == "w-abc123"


def test_failed_exactly_after_the_timeout() -> None:
    state = RegistryState()
    register(state, "w0", 1000.0)
    heartbeat(state, "w0", 1002.0)
    assert run(state, DetectFailures(), 1002.0 + POLICY.heartbeat_timeout).events == []
    failed = run(state, DetectFailures(), 1002.0 + POLICY.heartbeat_timeout + 0.001).events
    assert len(failed) == 1
    assert isinstance(failed[0], WorkerFailed)
    assert failed[0].worker_id == "w0"
    assert "no heartbeat for 5.0s" in failed[0].reason
    assert state.jobs[JOB].world_size == 0
    assert state.jobs[JOB].members["w0"].status == "failed"


def test_a_failed_worker_that_comes_back_is_told_to_reregister_and_may_rejoin() -> None:
    state = RegistryState()
    register(state, "w0", 0.0)
    register(state, "w1", 0.0)
    run(state, DetectFailures(), 10.0)
    outcome = heartbeat(state, "w0", 11.0)
    assert outcome.reregister is not None
    assert "failed" in outcome.reregister
    assert register(state, "w0", 11.0) == 0
    assert state.jobs[JOB].members["w0"].status == "idle"


def test_heartbeat_of_a_stranger_or_an_impostor() -> None:
    state = RegistryState()
    register(state, "w0", 0.0, instance="real")
    stranger = WorkerHeartbeat(
        job=JOB, source="x", worker_id="ghost", instance="i", seq=1, state="idle"
    )
    assert domain.observe_heartbeat(state, stranger, 1.0).reregister is not None
    impostor = WorkerHeartbeat(
        job=JOB, source="x", worker_id="w0", instance="fake", seq=1, state="idle"
    )
    outcome = domain.observe_heartbeat(state, impostor, 1.0)
    assert outcome.rejected == "instance_mismatch"
    assert state.jobs[JOB].members["w0"].last_seen == 0.0


def test_state_change_is_announced_once() -> None:
    state = RegistryState()
    register(state, "w0", 0.0)
    first = heartbeat(state, "w0", 1.0, "training", seq=1)
    assert [type(e) for e in first.events] == [WorkerStateChanged]
    assert heartbeat(state, "w0", 1.1, "training", seq=2).events == []
    domain.evolve(state, first.events[0])
    assert state.jobs[JOB].members["w0"].status == "training"


def test_leave_rules() -> None:
    state = RegistryState()
    missing = run(state, Leave(LeaveRequest(job=JOB, worker_id="nobody", instance="i")), 0.0)
    assert isinstance(missing.error, NotFound)
    register(state, "w0", 0.0)
    run(state, Leave(LeaveRequest(job=JOB, worker_id="w0", instance="p-w0")), 1.0)
    twice = run(state, Leave(LeaveRequest(job=JOB, worker_id="w0", instance="p-w0")), 2.0)
    assert (twice.events, twice.error) == ([], None)


def test_restart_grace_fails_nobody() -> None:
    state = RegistryState()
    register(state, "w0", 0.0)
    restored = domain.restore(domain.snapshot(state))
    domain.begin_grace(restored, 100.0)
    assert run(restored, DetectFailures(), 100.0 + POLICY.heartbeat_timeout).events == []
    assert run(restored, DetectFailures(), 106.0).events != []


def test_a_job_forgets_its_oldest_gone_members_past_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(domain, "MAX_GONE_PER_JOB", 3)
    state = RegistryState()
    for i in range(6):
        register(state, f"w{i}", float(i))
    for i in (4, 0, 2, 5):
        run(state, Leave(LeaveRequest(job=JOB, worker_id=f"w{i}", instance=f"p-w{i}")), 10.0 + i)
    job = state.jobs[JOB]
    assert list(job.gone) == ["w0", "w2", "w5"]  # w4 left first: forgotten
    assert set(job.members) == {"w0", "w1", "w2", "w3", "w5"}
    register(state, "w2", 20.0)  # back: live again, no longer counted as gone
    assert list(job.gone) == ["w0", "w5"]
    listed = domain.members(state, JOB, include_gone=True)
    listed_ids = [m.worker_id for m in listed.members]
    assert set(listed_ids[:3]) == {"w1", "w2", "w3"}  # live first, then the remembered gone
    assert set(listed_ids[3:]) == {"w0", "w5"}
    restored = domain.restore(domain.snapshot(state))
    assert list(restored.jobs[JOB].gone) == ["w0", "w5"]
    assert domain.snapshot(restored) == domain.snapshot(state)


def test_jobs_are_isolated() -> None:
    state = RegistryState()
    for job in ("a", "b"):
        decision = run(state, Register(RegisterRequest(job=job, instance="same")), 0.0)
        assert decision.error is None
    assert state.jobs["a"].members["w-same"].rank == 0
    assert state.jobs["b"].members["w-same"].rank == 0
    assert state.jobs["a"].membership_epoch == state.jobs["b"].membership_epoch == 1


@given(st.lists(st.tuples(st.sampled_from(["reg", "leave", "fail"]), st.integers(0, 7))))
def test_snapshot_round_trips_any_history(ops: list[tuple[str, int]]) -> None:
    state = RegistryState()
    now = 0.0
    for op, n in ops:
        now += 1.0
        worker = f"w{n}"
        if op == "reg":
            run(state, Register(RegisterRequest(job=JOB, worker_id=worker, instance=worker)), now)
        elif op == "leave":
            run(state, Leave(LeaveRequest(job=JOB, worker_id=worker, instance=worker)), now)
        else:
            run(state, DetectFailures(), now + 100)
            now += 100
    assert domain.snapshot(domain.restore(domain.snapshot(state))) == domain.snapshot(state)


class Membership(RuleBasedStateMachine):
    """Random registrations, leaves, heartbeats and clock moves; the invariants always hold."""

    @initialize()
    def setup(self) -> None:
        self.state = RegistryState()
        self.now = 1_000.0
        self.epoch_seen = 0
        self.instances: dict[str, int] = {}

    @rule(n=st.integers(0, 9), same_process=st.booleans())
    def register(self, n: int, same_process: bool) -> None:
        worker = f"w{n}"
        generation = self.instances.get(worker, 0) + (0 if same_process else 1)
        self.instances[worker] = generation
        job = self.state.jobs.get(JOB)
        free = job.lowest_free_rank() if job else 0
        was_live = job is not None and worker in job.members and job.members[worker].live
        request = RegisterRequest(job=JOB, worker_id=worker, instance=f"{worker}-{generation}")
        decision = run(self.state, Register(request), self.now)
        if decision.events:
            assert not was_live
            assert self.state.jobs[JOB].members[worker].rank == free
        elif decision.error is not None:
            assert was_live
            assert isinstance(decision.error, ConflictError)

    @rule(n=st.integers(0, 9))
    def leave(self, n: int) -> None:
        worker = f"w{n}"
        request = LeaveRequest(
            job=JOB, worker_id=worker, instance=f"{worker}-{self.instances.get(worker, 0)}"
        )
        run(self.state, Leave(request), self.now)

    @rule(n=st.integers(0, 9))
    def beat(self, n: int) -> None:
        job = self.state.jobs.get(JOB)
        worker = f"w{n}"
        if job and worker in job.members:
            heartbeat(self.state, worker, self.now)

    @rule(dt=st.floats(0.0, 8.0))
    def tick(self, dt: float) -> None:
        self.now += dt
        job = self.state.jobs.get(JOB)
        before = {m.worker_id: m.last_seen for m in job.live_members()} if job else {}
        failed = run(self.state, DetectFailures(), self.now).events
        failed_ids = {e.worker_id for e in failed if isinstance(e, WorkerFailed)}
        for worker, last_seen in before.items():
            late = self.now - last_seen > POLICY.heartbeat_timeout
            assert (worker in failed_ids) == late

    @invariant()
    def ranks_are_unique_and_match_live_members(self) -> None:
        job = self.state.jobs.get(JOB)
        if job is None:
            return
        live = [m for m in job.members.values() if m.live]
        assert sorted(m.rank for m in live) == sorted(job.ranks)
        assert len({m.rank for m in live}) == len(live)
        assert all(job.ranks[m.rank] == m.worker_id for m in live)

    @invariant()
    def membership_epoch_never_goes_back(self) -> None:
        job = self.state.jobs.get(JOB)
        epoch = job.membership_epoch if job else 0
        assert epoch >= self.epoch_seen
        self.epoch_seen = epoch


TestMembership = Membership.TestCase
TestMembership.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


@pytest.mark.parametrize("timeout", [0.5, 5.0, 30.0])
def test_detection_boundary_for_any_timeout(timeout: float) -> None:
    policy = Policy(heartbeat_interval=timeout / 5, heartbeat_timeout=timeout)
    state = RegistryState()
    domain.evolve(
        state,
        domain.decide(
            state, Register(RegisterRequest(job=JOB, worker_id="w", instance="i")), 50.0, policy
        ).events[0],
    )
    assert domain.detect_failures(state, 50.0 + timeout, policy) == []
    assert len(domain.detect_failures(state, 50.0 + timeout * 1.0001, policy)) == 1
