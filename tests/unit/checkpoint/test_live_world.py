"""A live group's checkpoint: the world of a step saved by a member of the job's live quorum
(`live.quorum_formed`) is that quorum, ranked as in the group, not the registry's membership.
"""

from __future__ import annotations

from strata.events import CheckpointAborted, CheckpointStarted, LiveQuorumFormed
from strata.services.checkpoint import domain

from tests.unit.checkpoint.cases import JOB, SECOND, failed, fold, registered, request, with_workers


def quorum(epoch: int, members: list[str], generation: int = 0) -> LiveQuorumFormed:
    return LiveQuorumFormed(
        job=JOB,
        source="barrier",
        membership_epoch=epoch,
        generation=generation,
        members=members,
        world_size=len(members),
    )


def test_a_save_after_a_shrink_is_the_survivors_world_and_commits_with_them_only() -> None:
    state = with_workers(3)
    fold(state, [quorum(3, ["w0", "w1", "w2"]), failed(1, 4), quorum(4, ["w0", "w2"])])
    # The survivors hold registry ranks 0 and 2; their view of the world is 2 workers.
    opened = domain.begin(state, request(20, "w2", world=(2, 4)), SECOND)
    assert opened.error is None
    started = opened.events[0]
    assert isinstance(started, CheckpointStarted)
    assert not any(isinstance(e, CheckpointAborted) for e in opened.events)
    assert (started.world_size, started.membership_epoch) == (2, 4)
    assert {(p.worker_id, p.rank) for p in started.participants} == {("w0", 0), ("w2", 1)}
    fold(state, opened.events)
    joined = domain.begin(state, request(20, "w0", world=(2, 4)), 2 * SECOND)
    assert joined.error is None
    assert [getattr(e, "rank", None) for e in joined.events] == [0]


def test_without_the_quorum_the_registry_world_has_a_hole_and_aborts() -> None:
    """What a live group's save met before its quorum was its world: the dead rank's hole."""
    state = with_workers(3)
    fold(state, [failed(1, 4)])
    opened = domain.begin(state, request(20, "w2", world=(2, 4)), SECOND)
    assert any(isinstance(e, CheckpointAborted) for e in opened.events)


def test_a_replacement_registered_before_the_group_takes_it_in_is_not_in_the_step() -> None:
    state = with_workers(3)
    fold(state, [quorum(3, ["w0", "w1", "w2"]), failed(1, 4), quorum(4, ["w0", "w2"])])
    fold(state, [registered(1, 5, worker="w3", instance="proc-w3")])
    # The survivors' view already counts w3 (3 workers); the step is still the group's.
    first = domain.begin(state, request(30, "w0", world=(3, 5)), SECOND)
    started = first.events[0]
    assert isinstance(started, CheckpointStarted)
    assert started.world_size == 2
    assert "w3" not in {p.worker_id for p in started.participants}
    fold(state, first.events)
    second = domain.begin(state, request(30, "w2", world=(3, 5)), 2 * SECOND)
    assert second.error is None, second.error
    refused = domain.begin(state, request(30, "w3", world=(3, 5)), 3 * SECOND)
    assert refused.error is not None
    assert "open for a world of 2" in refused.error.message


def test_a_member_lost_since_the_quorum_aborts_the_step_at_once() -> None:
    state = with_workers(3)
    fold(state, [quorum(3, ["w0", "w1", "w2"]), failed(2, 4)])
    opened = domain.begin(state, request(40, "w0", world=(2, 4)), SECOND)
    assert any(isinstance(e, CheckpointAborted) for e in opened.events)


def test_a_job_without_a_live_group_keeps_the_registry_world() -> None:
    state = with_workers(2)
    opened = domain.begin(state, request(5, "w1", world=(2, 2)), SECOND)
    started = opened.events[0]
    assert isinstance(started, CheckpointStarted)
    assert {(p.worker_id, p.rank) for p in started.participants} == {("w0", 0), ("w1", 1)}
