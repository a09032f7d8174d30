"""The registry's pure domain, driven with an injected clock: no NATS, no sleeping."""

from __future__ import annotations

import copy

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule
from strata.errors import ConflictError, NotFound, WorkerSuperseded
from strata.events import (
    WorkerFailed,
    WorkerHeartbeat,
    WorkerRegistered,
    WorkerStateChanged,
    subjects,
)
from strata.events.models import SUPERSEDED_REASON
from strata.events.requests import LeaveRequest, RegisterRequest, Registration
from strata.services.domain import Decision
from strata.services.registry import domain
from strata.services.registry import state as registry_state
from strata.services.registry.domain import (
    DetectFailures,
    Leave,
    Policy,
    Register,
    RegistryState,
)

from tests.tiers import examples
from tests.unit.registry.cases import JOB, POLICY, ns, register, run


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
    return domain.observe_heartbeat(state, hb, ns(now))


def test_ranks_are_dense_then_the_lowest_free_rank_is_reused() -> None:
    state = RegistryState()
    assert [register(state, f"w{i}", 100.0) for i in range(4)] == [0, 1, 2, 3]
    run(state, Leave(LeaveRequest(job=JOB, worker_id="w1", instance="p-w1")), 101.0)
    run(state, Leave(LeaveRequest(job=JOB, worker_id="w3", instance="p-w3")), 101.0)
    assert register(state, "new-a", 102.0) == 1
    assert register(state, "new-b", 102.0) == 3
    assert register(state, "new-c", 102.0) == 4
    assert state.jobs[JOB].world_size == 5


def test_registration_is_idempotent_for_one_process_and_superseded_by_another() -> None:
    state = RegistryState()
    register(state, "w0", 10.0, instance="first")
    register(state, "w1", 10.0)
    again = run(state, Register(RegisterRequest(job=JOB, worker_id="w0", instance="first")), 11.0)
    assert again.events == []
    assert again.error is None
    restart = RegisterRequest(job=JOB, worker_id="w0", instance="second", hostname="node-2")
    assert domain.takes_over(state, restart)
    other = run(state, Register(restart), 12.0)
    assert other.error is None
    failed, registered = other.events
    assert isinstance(failed, WorkerFailed)
    assert isinstance(registered, WorkerRegistered)
    assert (failed.worker_id, failed.rank, failed.membership_epoch) == ("w0", 0, 3)
    assert failed.reason.startswith(SUPERSEDED_REASON)
    assert "node-2" in failed.reason
    assert (registered.worker_id, registered.instance, registered.rank) == ("w0", "second", 0)
    assert (registered.world_size, registered.membership_epoch) == (2, 4)
    job = state.jobs[JOB]
    assert (job.membership_epoch, job.world_size) == (4, 2)
    assert (job.members["w0"].instance, job.members["w0"].status) == ("second", "idle")
    assert not domain.takes_over(state, restart)  # a retry of it is the same registration
    assert run(state, Register(restart), 13.0).events == []


def test_a_superseding_failure_has_the_id_a_timeout_of_that_registration_would_have() -> None:
    state = RegistryState()
    register(state, "w0", 10.0, instance="first")
    timed_out = domain.detect_failures(copy.deepcopy(state), ns(100.0), POLICY)
    superseded = domain.decide(
        state,
        Register(RegisterRequest(job=JOB, worker_id="w0", instance="second")),
        ns(11.0),
        POLICY,
    ).events[0]
    # One registration ends once: whichever decision of its end is stored first counts.
    assert [e.id for e in timed_out] == [superseded.id]


def test_the_superseded_process_is_fenced_off() -> None:
    state = RegistryState()
    register(state, "w0", 10.0, instance="old")
    register(state, "w0", 11.0, instance="new")
    member = state.jobs[JOB].members["w0"]
    stale = WorkerHeartbeat(
        job=JOB, source="w0", worker_id="w0", instance="old", seq=9, state="training"
    )
    outcome = domain.observe_heartbeat(state, stale, ns(12.0))
    # Told that it was superseded, never to register again (it would take the id back).
    assert (outcome.rejected, outcome.reregister, outcome.events) == ("instance_mismatch", None, [])
    assert outcome.superseded is not None
    assert "'w0'" in outcome.superseded
    assert (member.last_seen_ns, member.status) == (ns(11.0), "idle")
    leave = run(state, Leave(LeaveRequest(job=JOB, worker_id="w0", instance="old")), 12.0)
    assert isinstance(leave.error, WorkerSuperseded)
    rejoin = RegisterRequest(job=JOB, worker_id="w0", instance="old", rejoin=True)
    refused = run(state, Register(rejoin), 12.0)
    assert isinstance(refused.error, WorkerSuperseded)
    assert refused.events == []
    # Still refused once the newer process is gone: the id is no longer the old one's.
    run(state, DetectFailures(), 100.0)
    assert domain.observe_heartbeat(state, stale, ns(101.0)).reregister is None
    assert isinstance(run(state, Register(rejoin), 101.0).error, WorkerSuperseded)
    # A process that failed and was not replaced rejoins with its own instance as before.
    assert run(state, Register(rejoin.model_copy(update={"instance": "new"})), 102.0).error is None


def test_a_requested_rank_is_given_exactly_or_refused_naming_its_holder() -> None:
    state = RegistryState()
    assert register(state, "a", 1.0, rank=5) == 5
    assert register(state, "b", 1.0) == 0
    request = RegisterRequest(job=JOB, worker_id="c", instance="p-c", rank=0, hostname="n3")
    state.jobs[JOB].members["b"].hostname = "node-b"
    refused = run(state, Register(request), 2.0)
    assert isinstance(refused.error, ConflictError)
    assert not isinstance(refused.error, WorkerSuperseded)
    assert refused.events == []
    message = refused.error.message
    assert "rank 0" in message
    assert "'b'" in message
    assert "node-b" in message
    assert "ask for a free rank" in message
    assert refused.error.details == {"rank": 0, "holder": "b", "host": "node-b"}
    assert register(state, "c", 2.0) == 1  # without rank=, the lowest free one
    assert register(state, "d", 2.0, rank=2) == 2
    assert register(state, "e", 2.0) == 3
    assert register(state, "f", 2.0) == 4
    assert register(state, "g", 2.0) == 6  # 5 is a's
    assert state.jobs[JOB].world_size == 7
    # The same process asking for another rank than it has is refused; a retry is not.
    same = RegisterRequest(job=JOB, worker_id="a", instance="p-a", rank=5)
    assert run(state, Register(same), 3.0).events == []
    moved = run(state, Register(same.model_copy(update={"rank": 9})), 3.0)
    assert isinstance(moved.error, ConflictError)
    assert "rank 5" in moved.error.message


def test_a_restart_keeps_its_rank_unless_it_asks_for_another() -> None:
    state = RegistryState()
    register(state, "a", 1.0)
    register(state, "b", 1.0)
    assert register(state, "b", 2.0, instance="b-2") == 1
    restart = RegisterRequest(job=JOB, worker_id="b", instance="b-3", rank=7)
    failed, registered = run(state, Register(restart), 3.0).events
    assert isinstance(failed, WorkerFailed)
    assert isinstance(registered, WorkerRegistered)
    assert (failed.rank, registered.rank, registered.world_size) == (1, 7, 2)
    assert sorted(state.jobs[JOB].ranks) == [0, 7]
    # Superseding never takes another worker's rank.
    taken = RegisterRequest(job=JOB, worker_id="b", instance="b-4", rank=0)
    refused = run(state, Register(taken), 4.0)
    assert isinstance(refused.error, ConflictError)
    assert refused.events == []
    assert state.jobs[JOB].members["b"].instance == "b-3"


def test_a_rejoin_asks_for_its_rank_again() -> None:
    state = RegistryState()
    register(state, "a", 0.0, rank=3)
    register(state, "b", 0.0)
    run(state, DetectFailures(), 10.0)
    rejoin = RegisterRequest(job=JOB, worker_id="a", instance="p-a", rank=3, rejoin=True)
    assert domain.takes_over(state, rejoin)
    assert run(state, Register(rejoin), 10.0).error is None
    assert state.jobs[JOB].members["a"].rank == 3
    # Taken by another worker meanwhile: refused, and free again once that one is gone.
    run(state, DetectFailures(), 20.0)
    assert register(state, "c", 20.0, rank=3) == 3
    assert isinstance(run(state, Register(rejoin), 21.0).error, ConflictError)
    run(state, Leave(LeaveRequest(job=JOB, worker_id="c", instance="p-c")), 22.0)
    assert run(state, Register(rejoin), 23.0).error is None
    assert state.jobs[JOB].members["a"].rank == 3


def test_a_full_job_still_takes_a_restart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(domain, "MAX_WORKERS", 2)
    state = RegistryState()
    register(state, "a", 0.0)
    register(state, "b", 0.0)
    full = run(state, Register(RegisterRequest(job=JOB, worker_id="c", instance="p-c")), 1.0)
    assert isinstance(full.error, ConflictError)
    assert register(state, "b", 1.0, instance="b-2") == 1


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
    assert domain.observe_heartbeat(state, stranger, ns(1.0)).reregister is not None
    impostor = WorkerHeartbeat(
        job=JOB, source="x", worker_id="w0", instance="fake", seq=1, state="idle"
    )
    outcome = domain.observe_heartbeat(state, impostor, ns(1.0))
    assert outcome.rejected == "instance_mismatch"
    assert state.jobs[JOB].members["w0"].last_seen_ns == 0


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
    domain.begin_grace(restored, ns(100.0))
    assert run(restored, DetectFailures(), 100.0 + POLICY.heartbeat_timeout).events == []
    assert run(restored, DetectFailures(), 106.0).events != []


def test_a_snapshot_of_the_seconds_era_restores_in_ns() -> None:
    state = RegistryState()
    register(state, "w0", 12.5)
    snapshot = domain.snapshot(state)
    assert snapshot["v"] == 2
    assert snapshot["jobs"][0]["members"][0][10] == ns(12.5)
    # Version 1 kept the last sign of life in wall seconds.
    old = copy.deepcopy(snapshot)
    old["v"] = 1
    old["jobs"][0]["members"][0][10] = 12.5
    assert domain.restore(old).jobs[JOB].members["w0"].last_seen_ns == ns(12.5)
    with pytest.raises(ValueError, match="version 3"):
        domain.restore({**snapshot, "v": 3})


def test_a_job_forgets_its_oldest_gone_members_past_the_cap(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(registry_state, "MAX_GONE_PER_JOB", 3)
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

    @rule(
        n=st.integers(0, 9),
        same_process=st.booleans(),
        wanted=st.none() | st.integers(0, 11),
        rejoin=st.booleans(),
    )
    def register(self, n: int, same_process: bool, wanted: int | None, rejoin: bool) -> None:
        worker = f"w{n}"
        generation = self.instances.get(worker, 0) + (0 if same_process else 1)
        instance = f"{worker}-{generation}"
        job = self.state.jobs.get(JOB)
        free = job.lowest_free_rank() if job else 0
        existing = job.members.get(worker) if job else None
        was_live = existing is not None and existing.live
        holder = job.ranks.get(wanted) if job is not None and wanted is not None else None
        request = RegisterRequest(
            job=JOB, worker_id=worker, instance=instance, rank=wanted, rejoin=rejoin
        )
        decision = run(self.state, Register(request), self.now)
        kinds = [type(e) for e in decision.events]
        if existing is not None and was_live and existing.instance == instance:
            # A retry: nothing new, unless it asks for another rank than it has.
            assert kinds == []
            refused = wanted is not None and wanted != existing.rank
            assert isinstance(decision.error, ConflictError) == refused
        elif rejoin and existing is not None and existing.instance != instance:
            assert (kinds, type(decision.error)) == ([], WorkerSuperseded)
        elif holder is not None and holder != worker:
            assert kinds == []
            assert isinstance(decision.error, ConflictError)
            assert repr(holder) in decision.error.message
        elif was_live:
            assert existing is not None
            old_rank = existing.rank
            assert kinds == [WorkerFailed, WorkerRegistered]
            assert decision.events[0].reason.startswith(SUPERSEDED_REASON)  # type: ignore[attr-defined]
            assert self.state.jobs[JOB].members[worker].rank == (
                old_rank if wanted is None else wanted
            )
        else:
            assert kinds == [WorkerRegistered]
            assert self.state.jobs[JOB].members[worker].rank == (free if wanted is None else wanted)
        if decision.events:
            self.instances[worker] = generation

    @rule(n=st.integers(0, 9), now=st.floats(0.0, 1.0))
    def stale_beat(self, n: int, now: float) -> None:
        """A heartbeat of a process that a later registration replaced changes nothing."""
        job = self.state.jobs.get(JOB)
        worker = f"w{n}"
        member = job.members.get(worker) if job else None
        generation = self.instances.get(worker, 0)
        if member is None or generation == 0:
            return
        seen = member.last_seen_ns
        hb = WorkerHeartbeat(
            job=JOB,
            source=worker,
            worker_id=worker,
            instance=f"{worker}-{generation - 1}",
            seq=1,
            state="training",
        )
        outcome = domain.observe_heartbeat(self.state, hb, ns(self.now + now))
        assert outcome.reregister is None
        assert outcome.superseded is not None
        assert outcome.events == []
        assert member.last_seen_ns == seen

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
        before = {m.worker_id: m.last_seen_ns for m in job.live_members()} if job else {}
        failed = run(self.state, DetectFailures(), self.now).events
        failed_ids = {e.worker_id for e in failed if isinstance(e, WorkerFailed)}
        for worker, last_seen in before.items():
            late = ns(self.now) - last_seen > ns(POLICY.heartbeat_timeout)
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
TestMembership.settings = settings(
    max_examples=examples(150), stateful_step_count=40, deadline=None
)


@pytest.mark.parametrize("timeout", [0.5, 5.0, 30.0])
def test_detection_boundary_for_any_timeout(timeout: float) -> None:
    policy = Policy(heartbeat_interval=timeout / 5, heartbeat_timeout=timeout)
    state = RegistryState()
    domain.evolve(
        state,
        domain.decide(
            state, Register(RegisterRequest(job=JOB, worker_id="w", instance="i")), ns(50.0), policy
        ).events[0],
    )
    assert domain.detect_failures(state, ns(50.0 + timeout), policy) == []
    assert len(domain.detect_failures(state, ns(50.0 + timeout * 1.0001), policy)) == 1


# -- group commit ---------------------------------------------------------------------------------

_batch_command = st.one_of(
    st.builds(
        lambda w, p, r: Register(
            RegisterRequest(job=JOB, worker_id=f"w{w}", instance=f"p{p}", rank=r)
        ),
        st.integers(0, 5),
        st.integers(0, 2),
        st.one_of(st.none(), st.integers(0, 4)),
    ),
    st.builds(
        lambda w, p: Leave(LeaveRequest(job=JOB, worker_id=f"w{w}", instance=f"p{p}")),
        st.integers(0, 5),
        st.integers(0, 2),
    ),
)


def _outcome(decision: Decision[bool]) -> tuple[object, ...]:
    error = decision.error
    return (decision.events, error and (type(error), str(error)), decision.result)


@settings(max_examples=examples(200), deadline=None)
@given(before=st.lists(_batch_command, max_size=8), batch=st.lists(_batch_command, max_size=12))
def test_a_batch_decides_as_the_same_commands_one_at_a_time_and_leaves_the_state_alone(
    before: list[Register | Leave], batch: list[Register | Leave]
) -> None:
    state = RegistryState()
    for command in before:
        run(state, command, 10.0)
    untouched = copy.deepcopy(state)
    one_at_a_time = copy.deepcopy(state)

    decisions = domain.decide_all(state, batch, ns(11.0), POLICY)

    expected = [run(one_at_a_time, command, 11.0) for command in batch]
    assert [_outcome(d) for d in decisions] == [_outcome(d) for d in expected]
    assert state == untouched
    for decision in decisions:
        for event in decision.events:
            domain.evolve(state, event)
    assert state == one_at_a_time


def test_a_job_start_in_one_batch_gives_every_worker_its_own_rank_and_epoch() -> None:
    state = RegistryState()
    batch: list[Register | Leave] = [
        Register(RegisterRequest(job=JOB, worker_id=f"w{i}", instance=f"p{i}")) for i in range(50)
    ]
    decisions = domain.decide_all(state, batch, ns(1.0), POLICY)
    registered = [event for d in decisions for event in d.events]
    assert [e.rank for e in registered] == list(range(50))  # type: ignore[attr-defined]
    assert [e.membership_epoch for e in registered] == list(range(1, 51))  # type: ignore[attr-defined]
    assert [e.world_size for e in registered] == list(range(1, 51))  # type: ignore[attr-defined]
    assert len({e.id for e in registered}) == 50
    assert state.jobs == {}


# -- partitioned heartbeat intake -----------------------------------------------------------------


def test_a_partition_judges_only_the_workers_whose_heartbeats_it_takes_in() -> None:
    state = RegistryState()
    workers = [f"w{i}" for i in range(12)]
    for worker in workers:
        register(state, worker, 100.0)
    owner = {w: subjects.partition_of(w, 2) for w in workers}
    assert set(owner.values()) == {0, 1}
    every = {e.worker_id for e in domain.detect_failures(state, ns(200.0), POLICY)}
    assert every == set(workers)
    for partition in (0, 1):
        found = domain.decide(state, DetectFailures(partition, 2), ns(200.0), POLICY).events
        assert {e.worker_id for e in found} == {w for w in workers if owner[w] == partition}


def test_the_leader_lists_the_progress_a_partition_reports_of_its_live_workers() -> None:
    leader, partition = RegistryState(), RegistryState()
    for state in (leader, partition):
        for worker in ("a", "b", "c"):
            register(state, worker, 100.0)
    for worker in ("a", "b", "c"):
        heartbeat(partition, worker, 101.0)
    reported = [
        (job, worker, instance, heard, 9, epoch)
        for job, worker, instance, heard, _, epoch in domain.progress_since(partition, 0, 0, 1)
    ]
    assert {entry[1] for entry in reported} == {"a", "b", "c"}
    assert domain.progress_since(partition, ns(101.0), 0, 1) == []  # nothing heard since
    mine = domain.progress_since(partition, 0, 1, 2)
    assert {e[1] for e in mine} == {w for w in "abc" if subjects.partition_of(w, 2) == 1}
    # `b` restarted meanwhile (another instance): its old registration's progress is ignored.
    run(leader, Register(RegisterRequest(job=JOB, worker_id="b", instance="b-again")), 101.5)
    assert domain.apply_progress(leader, reported) == 2
    members = leader.jobs[JOB].members
    assert (members["a"].last_heartbeat_ts, members["a"].step) == (ns(101.0), 9)
    assert members["b"].last_heartbeat_ts is None
    assert domain.apply_progress(leader, reported) == 0  # an old report changes nothing


def test_the_leader_records_a_partitions_failures_with_its_own_epochs_and_only_live_ones() -> None:
    leader, partition = RegistryState(), RegistryState()
    for state in (leader, partition):
        for worker in ("a", "b", "c"):
            register(state, worker, 100.0)
    found = [
        e
        for e in domain.detect_failures(partition, ns(200.0), POLICY)
        if isinstance(e, WorkerFailed) and e.worker_id in ("a", "c")
    ]
    # Meanwhile the leader recorded a leave of `b` and a restart (a new registration) of `c`.
    run(leader, Leave(LeaveRequest(job=JOB, worker_id="b", instance="p-b")), 150.0)
    restart = RegisterRequest(job=JOB, worker_id="c", instance="c-again")
    run(leader, Register(restart), 150.0)
    epoch = leader.jobs[JOB].membership_epoch
    confirmed = domain.confirm_failures(leader, [*found, *found])
    # `c`'s failure was judged on its old registration: the live one is not failed for it.
    assert [(e.worker_id, e.membership_epoch) for e in confirmed] == [("a", epoch + 1)]
    assert confirmed[0].id == found[0].id
    assert confirmed[0].reason == found[0].reason
    for event in confirmed:
        domain.evolve(leader, event)
    assert domain.confirm_failures(leader, found) == []  # a repeated report changes nothing


def test_the_registration_reply_is_the_registration_model_as_plain_data() -> None:
    state = RegistryState()
    decisions = domain.decide_all(
        state,
        [Register(RegisterRequest(job=JOB, worker_id=f"w{i}", instance=f"p{i}")) for i in range(3)],
        ns(1.0),
        POLICY,
    )
    for decision in decisions:
        for event in decision.events:
            domain.evolve(state, event)
    job = state.job(JOB)
    for rejoined in (False, True):
        reply = domain.registration_reply(job, "w1", POLICY, rejoined)
        assert Registration.model_validate(reply).model_dump() == reply
        assert reply == domain.registration(job, "w1", POLICY, rejoined).model_dump()
        assert (reply["rank"], reply["world_size"], reply["rejoined"]) == (1, 3, rejoined)
