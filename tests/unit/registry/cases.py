"""The registry domain's shared cases: a job, its failure policy, and the steps that register
workers and run commands through `decide` and `evolve`.
"""

from __future__ import annotations

from strata.events.requests import RegisterRequest
from strata.services.domain import Decision
from strata.services.registry import domain
from strata.services.registry.domain import (
    Policy,
    Register,
    RegistryState,
)

POLICY = Policy(heartbeat_interval=1.0, heartbeat_timeout=5.0)
JOB = "job-a"


def ns(seconds: float) -> int:
    """The domain's clock (wall-clock ns) at `seconds`: the tests read better in seconds."""
    return round(seconds * 1e9)


def run(state: RegistryState, command: domain.Command, now: float) -> Decision[bool]:
    decision = domain.decide(state, command, ns(now), POLICY)
    for event in decision.events:
        domain.evolve(state, event)
    return decision


def register(
    state: RegistryState,
    worker: str,
    now: float,
    instance: str | None = None,
    rank: int | None = None,
) -> int:
    request = RegisterRequest(
        job=JOB, worker_id=worker, instance=instance or f"p-{worker}", rank=rank
    )
    decision = run(state, Register(request), now)
    assert decision.error is None, decision.error
    return state.jobs[JOB].members[worker].rank
