"""Silence is measured on the liveness clock alone: the wall clock, stepped anywhere, only stamps
the events (the pure domain, with both clocks passed in)."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from strata.events import WorkerFailed
from strata.events.requests import RegisterRequest
from strata.services.registry import domain
from strata.services.registry.domain import DetectFailures, Policy, Register, RegistryState

POLICY = Policy(heartbeat_interval=1.0, heartbeat_timeout=3.0)
JOB = "job-clock"
S = 1_000_000_000
WALL = 1_800_000_000 * S
"""Some wall-clock time in ns; the liveness clock (monotonic) starts near 0."""


def registered(workers: list[str]) -> RegistryState:
    state = RegistryState()
    for worker in workers:
        request = RegisterRequest(job=JOB, worker_id=worker, instance=f"p-{worker}")
        for event in domain.decide(state, Register(request), WALL, POLICY).events:
            domain.evolve(state, event)
    domain.begin_grace(state, 0)  # as the service does once live: seen at liveness 0
    return state


def beat(state: RegistryState, worker: str, wall_ns: int, seen_ns: int) -> None:
    member = state.jobs[JOB].members[worker]
    outcome = domain.observe_beat(
        state,
        domain.Beat(JOB, worker, member.instance, 1, "idle", 0, 0),
        wall_ns,
        seen_ns,
    )
    assert outcome.rejected is None


def failed(state: RegistryState, wall_ns: int, liveness_ns: int) -> dict[str, WorkerFailed]:
    command = DetectFailures(liveness_ns=liveness_ns)
    events = domain.decide(state, command, wall_ns, POLICY).events
    return {e.worker_id: e for e in events if isinstance(e, WorkerFailed)}


@given(
    step_s=st.integers(min_value=-3600, max_value=3600),
    silent_s=st.floats(min_value=0.0, max_value=10.0),
)
def test_only_the_liveness_clock_decides_who_is_late(step_s: int, silent_s: float) -> None:
    state = registered(["w0", "w1"])
    # w0 heartbeats at liveness 10 s while the wall clock is stepped by `step_s`; w1 went
    # silent at liveness 0.
    beat(state, "w0", WALL + (10 + step_s) * S, 10 * S)
    now = 10 * S + round(silent_s * S)
    found = failed(state, WALL + step_s * S + now, now)
    assert ("w0" in found) == (silent_s > POLICY.heartbeat_timeout)
    assert "w1" in found  # silent for more than 10 s
    assert all(event.ts == WALL + step_s * S + now for event in found.values())


def test_a_heartbeat_keeps_its_wall_stamp_and_its_liveness_reading_apart() -> None:
    state = registered(["w0"])
    beat(state, "w0", WALL + 5 * S, 2 * S)
    member = state.jobs[JOB].members["w0"]
    assert member.last_seen_ns == 2 * S
    assert member.last_heartbeat_ts == WALL + 5 * S


def test_a_grace_period_replaces_a_sign_of_life_stamped_ahead_of_the_liveness_clock() -> None:
    state = RegistryState()
    request = RegisterRequest(job=JOB, worker_id="w0", instance="p-w0")
    for event in domain.decide(state, Register(request), WALL + 30 * S, POLICY).events:
        domain.evolve(state, event)  # registered by a registry whose wall clock ran 30 s ahead
    domain.begin_grace(state, 100 * S)
    assert state.jobs[JOB].members["w0"].last_seen_ns == 100 * S
    assert "w0" in failed(state, WALL, 104 * S)
