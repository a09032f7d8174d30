"""One id for a registration's end by failure, whoever decides it: a heartbeat timeout, a
heartbeat partition's report confirmed by the leader, or a restart that supersedes it. So the
first of those decisions stored is the one that counts, and the others are dropped as
duplicates of it."""

from __future__ import annotations

import copy

from strata.events import Event, WorkerFailed
from strata.events.requests import RegisterRequest
from strata.services.registry import domain
from strata.services.registry.domain import DetectFailures, Register, RegistryState

from tests.unit.registry.cases import JOB, POLICY, ns, register, run


def _failure_ids(events: list[Event]) -> list[str]:
    return [e.id for e in events if isinstance(e, WorkerFailed) and e.worker_id == "w0"]


def test_a_timeout_a_partitions_report_and_a_restart_end_a_registration_under_one_id() -> None:
    state = RegistryState()
    register(state, "w0", 0.0)
    register(state, "w1", 0.0)
    expected = domain.failure_id(JOB, state.jobs[JOB].members["w0"])

    late = ns(POLICY.heartbeat_timeout + 1)
    timed_out = domain.decide(state, DetectFailures(), late, POLICY).events
    assert _failure_ids(timed_out) == [expected]

    found = [e for e in timed_out if isinstance(e, WorkerFailed)]
    assert _failure_ids(domain.confirm_failures(state, found)) == [expected]

    restart = RegisterRequest(job=JOB, worker_id="w0", instance="p-w0-restarted")
    superseded = run(copy.deepcopy(state), Register(restart), 1.0)
    assert _failure_ids(superseded.events) == [expected]


def test_a_new_registration_of_the_same_id_ends_under_another_id() -> None:
    state = RegistryState()
    register(state, "w0", 0.0)
    first = domain.failure_id(JOB, state.jobs[JOB].members["w0"])
    register(state, "w0", 1.0, instance="p-w0-restarted")
    second = domain.failure_id(JOB, state.jobs[JOB].members["w0"])
    assert first != second
    # A report judged on the first registration no longer ends the second one.
    stale = WorkerFailed(
        id=first,
        job=JOB,
        source=domain.SOURCE,
        worker_id="w0",
        rank=0,
        reason="no heartbeat",
        last_heartbeat_ts=0,
        membership_epoch=1,
    )
    assert domain.confirm_failures(state, [stale]) == []


def test_a_probed_suspect_ends_its_registration_under_the_same_id_and_only_that_one() -> None:
    state = RegistryState()
    register(state, "w0", 0.0)
    register(state, "w1", 0.0)
    member = state.jobs[JOB].members["w0"]
    failure = domain.suspect_failure(state, JOB, "w0", member.instance, "reported", ns(0.5))
    assert failure is not None
    assert failure.id == domain.failure_id(JOB, member)
    assert failure.membership_epoch == state.jobs[JOB].membership_epoch + 1
    assert (failure.rank, failure.reason) == (member.rank, "reported")
    # Another instance of the id (the probe was of an older registration), or no such worker:
    # nothing is failed.
    assert domain.suspect_failure(state, JOB, "w0", "another", "reported", ns(0.5)) is None
    assert domain.suspect_failure(state, JOB, "w9", member.instance, "reported", ns(0.5)) is None
    assert domain.suspect_failure(state, "other", "w0", member.instance, "r", ns(0.5)) is None
    # Once that registration ended, a second report fails nothing.
    state = domain.evolve(state, failure)
    assert domain.suspect_failure(state, JOB, "w0", member.instance, "reported", ns(0.6)) is None
