"""The registry's side of fencing: a rejoin is a new instance, and the reply carries the lease.

A worker failed by the registry that comes back registers as a new instance replacing the one it
was (`RegisterRequest.replaces`): a new lease. It may take the id only from that instance; if
another process registered the id since, it is superseded.
"""

from __future__ import annotations

from strata.errors import WorkerSuperseded
from strata.events import WorkerRegistered
from strata.events.requests import RegisterRequest
from strata.services.registry import domain
from strata.services.registry.domain import DetectFailures, Register, RegistryState

from tests.unit.registry.cases import JOB, POLICY, register, run


def rejoin(worker: str, instance: str, replaces: str) -> Register:
    return Register(
        RegisterRequest(
            job=JOB, worker_id=worker, instance=instance, rejoin=True, replaces=replaces
        )
    )


def test_a_rejoin_as_a_new_instance_replacing_the_failed_one_is_a_new_lease() -> None:
    state = RegistryState()
    register(state, "a", 0.0)
    register(state, "b", 0.0)
    first = domain.registration(state.jobs[JOB], "a", POLICY, rejoined=False)
    assert first.lease_epoch == 1
    run(state, DetectFailures(), 10.0)
    assert state.jobs[JOB].members["a"].status == "failed"

    decision = run(state, rejoin("a", "p-a-2", "p-a"), 11.0)

    assert decision.error is None
    registered = [e for e in decision.events if isinstance(e, WorkerRegistered)]
    assert [(e.worker_id, e.instance) for e in registered] == [("a", "p-a-2")]
    again = domain.registration(state.jobs[JOB], "a", POLICY, rejoined=True)
    assert (again.instance, again.lease_epoch) == ("p-a-2", registered[0].membership_epoch)
    assert again.lease_epoch > first.lease_epoch


def test_a_rejoin_replacing_a_live_registration_of_its_own_supersedes_it() -> None:
    """The worker gave up its lease before the registry failed it: its new instance takes over."""
    state = RegistryState()
    register(state, "a", 0.0)
    decision = run(state, rejoin("a", "p-a-2", "p-a"), 1.0)
    assert decision.error is None
    assert [e.type for e in decision.events] == ["worker.failed", "worker.registered"]
    assert state.jobs[JOB].members["a"].instance == "p-a-2"


def test_a_rejoin_cannot_take_the_id_from_a_process_registered_since() -> None:
    state = RegistryState()
    register(state, "a", 0.0)
    register(state, "b", 0.0)
    run(state, DetectFailures(), 10.0)
    register(state, "a", 10.5, instance="restarted")  # a restart under the same id

    decision = run(state, rejoin("a", "p-a-2", "p-a"), 11.0)

    assert isinstance(decision.error, WorkerSuperseded)
    assert decision.events == []
    assert state.jobs[JOB].members["a"].instance == "restarted"


def test_a_retried_rejoin_is_the_same_registration() -> None:
    state = RegistryState()
    register(state, "a", 0.0)
    run(state, DetectFailures(), 10.0)
    assert run(state, rejoin("a", "p-a-2", "p-a"), 11.0).events
    retry = run(state, rejoin("a", "p-a-2", "p-a"), 11.5)
    assert retry.error is None
    assert retry.events == []
