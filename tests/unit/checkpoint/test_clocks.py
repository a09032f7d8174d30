"""A checkpoint step's deadline on the monotonic clock: pure, with both clocks driven by hand.

The service folds `checkpoint.started` with its clocks read just before (`state.clock`): the
deadline is the time the event left (its wall stamp plus `timeout_s`, minus the wall clock now),
clamped to [0, timeout_s], on the monotonic clock; `timeouts` compares monotonic time only.
"""

from __future__ import annotations

from strata.clock import TimeBase
from strata.events import CheckpointAborted, CheckpointStarted, Participant
from strata.services.checkpoint import domain
from strata.services.checkpoint.domain import CheckpointState

JOB = "job-c"
SECOND = 10**9
WALL = 1_700_000_000 * SECOND
MONO = 3_000 * SECOND


def started(ts: int, timeout_s: float = 60.0) -> CheckpointStarted:
    return CheckpointStarted(
        job=JOB,
        source="checkpoint",
        ts=ts,
        step=7,
        epoch=0,
        root_uri="file:///ckpt",
        participants=[Participant(worker_id="w0", rank=0), Participant(worker_id="w1", rank=1)],
        keep_count=3,
        timeout_s=timeout_s,
        world_size=2,
    )


def folded(event: CheckpointStarted, clock: TimeBase) -> CheckpointState:
    state = CheckpointState(clock=clock)
    domain.evolve(state, event)
    return state


def test_a_wall_clock_stepped_forward_does_not_abort_a_step_early() -> None:
    state = folded(started(WALL), TimeBase(MONO, WALL))
    # Two seconds later on the monotonic clock; the wall clock jumped two minutes ahead.
    assert domain.timeouts(state, MONO + 2 * SECOND, WALL + 122 * SECOND) == []
    [abort] = domain.timeouts(state, MONO + 60 * SECOND, WALL + 180 * SECOND)
    assert isinstance(abort, CheckpointAborted)
    assert abort.ts == WALL + 180 * SECOND  # stamped with the wall clock
    assert "60s" in abort.reason


def test_after_a_restart_the_time_left_carries_over_and_never_exceeds_the_timeout() -> None:
    event = started(WALL)
    # A new process 20 s later (wall clock): 40 s left, on its own monotonic clock.
    later = folded(event, TimeBase(7 * SECOND, WALL + 20 * SECOND))
    assert domain.timeouts(later, 7 * SECOND + 39 * SECOND, WALL) == []
    assert len(domain.timeouts(later, 7 * SECOND + 40 * SECOND, WALL)) == 1
    # Its wall clock stepped an hour back: still at most the 60 s timeout.
    back = folded(event, TimeBase(7 * SECOND, WALL - 3600 * SECOND))
    assert domain.timeouts(back, 7 * SECOND + 59 * SECOND, WALL) == []
    assert len(domain.timeouts(back, 7 * SECOND + 60 * SECOND, WALL)) == 1
    # Stepped forward past the deadline while no process ran: due at once.
    ahead = folded(event, TimeBase(7 * SECOND, WALL + 600 * SECOND))
    assert len(domain.timeouts(ahead, 7 * SECOND, WALL)) == 1


def test_a_pure_replay_without_clocks_keeps_the_stamped_deadline() -> None:
    state = CheckpointState()
    domain.evolve(state, started(WALL))
    assert domain.timeouts(state, WALL + 59 * SECOND) == []
    assert len(domain.timeouts(state, WALL + 60 * SECOND)) == 1
