"""Before a failure is recorded, the telemetry stream's record of the worker's heartbeats is
checked against the silence it was decided on (`stream_contradicts`): a heartbeat of that
registration the stream stored after the registry began to listen, and the registry never
applied, means the worker is unheard, not silent. Counted as a sign of life
(`heard_in_stream`), it gives the worker a fresh timeout, so a worker really gone is still
failed, one timeout later."""

from __future__ import annotations

from strata.services.registry import domain
from strata.services.registry.domain import Beat, DetectFailures, RegistryState

from tests.unit.registry.cases import JOB, POLICY, ns, register


def _beat(seq: int, instance: str = "p-w0") -> Beat:
    return Beat(JOB, "w0", instance, seq, "training", 0, 0)


def _state_with_beats(applied: int) -> RegistryState:
    state = RegistryState()
    register(state, "w0", 0.0)
    for seq in range(1, applied + 1):
        domain.observe_beat(state, _beat(seq), ns(seq * 0.5))
    return state


def test_a_heartbeat_stored_but_never_applied_contradicts_the_silence() -> None:
    member = _state_with_beats(applied=2).jobs[JOB].members["w0"]
    assert domain.stream_contradicts(
        member, _beat(3), stored_seq=120, listening_from=100, decided_on=member.last_beat_seq
    )


def test_the_last_heartbeat_applied_does_not() -> None:
    member = _state_with_beats(applied=2).jobs[JOB].members["w0"]
    assert not domain.stream_contradicts(
        member, _beat(2), stored_seq=120, listening_from=100, decided_on=member.last_beat_seq
    )
    assert not domain.stream_contradicts(
        member, None, stored_seq=0, listening_from=100, decided_on=member.last_beat_seq
    )


def test_a_heartbeat_stored_before_the_registry_listened_does_not() -> None:
    # After a restart the registry has applied none; what was stored before it could not hear.
    member = _state_with_beats(applied=0).jobs[JOB].members["w0"]
    assert member.last_beat_seq is None
    assert not domain.stream_contradicts(
        member, _beat(9), stored_seq=90, listening_from=100, decided_on=None
    )
    assert domain.stream_contradicts(
        member, _beat(9), stored_seq=101, listening_from=100, decided_on=None
    )


def test_another_processs_heartbeat_under_the_id_does_not() -> None:
    member = _state_with_beats(applied=2).jobs[JOB].members["w0"]
    other = _beat(7, instance="p-w0-elsewhere")
    assert not domain.stream_contradicts(
        member, other, stored_seq=120, listening_from=100, decided_on=member.last_beat_seq
    )


def test_a_contradicted_worker_gets_a_fresh_timeout_and_is_failed_after_it() -> None:
    state = _state_with_beats(applied=2)
    member = state.jobs[JOB].members["w0"]
    late = ns(1.0 + POLICY.heartbeat_timeout + 0.5)
    assert [e.type for e in domain.decide(state, DetectFailures(), late, POLICY).events] == [
        "worker.failed"
    ]

    domain.heard_in_stream(member, _beat(3), late)
    assert domain.decide(state, DetectFailures(), late, POLICY).events == []
    # Its last stored heartbeat is now one the registry knows: no longer a contradiction.
    assert not domain.stream_contradicts(
        member, _beat(3), stored_seq=120, listening_from=100, decided_on=member.last_beat_seq
    )
    later = late + ns(POLICY.heartbeat_timeout + 0.5)
    assert [e.type for e in domain.decide(state, DetectFailures(), later, POLICY).events] == [
        "worker.failed"
    ]


def test_a_heartbeat_applied_after_the_decision_still_contradicts_it() -> None:
    # A cut that heals while the stream is read: the heartbeats it held are applied meanwhile.
    # The stream's last one is then known to the registry, but not to the decision.
    state = _state_with_beats(applied=1)
    member = state.jobs[JOB].members["w0"]
    decided_on = member.last_beat_seq
    for seq in (2, 3, 4):
        domain.observe_beat(state, _beat(seq), ns(10.0))
    assert member.last_beat_seq == 4
    assert domain.stream_contradicts(
        member, _beat(4), stored_seq=120, listening_from=100, decided_on=decided_on
    )
    assert not domain.stream_contradicts(
        member, _beat(4), stored_seq=120, listening_from=100, decided_on=4
    )


def test_a_heartbeat_found_in_the_stream_never_moves_the_last_applied_back() -> None:
    state = _state_with_beats(applied=5)
    member = state.jobs[JOB].members["w0"]
    domain.heard_in_stream(member, _beat(3), ns(10.0))
    assert member.last_beat_seq == 5
