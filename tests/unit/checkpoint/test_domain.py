"""The checkpoint service's pure domain: participants, acks, commit, abort, retention."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from strata.errors import ConflictError, NotFound
from strata.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointShardSaved,
    CheckpointStarted,
    Event,
    WorkerFailed,
    WorkerRegistered,
)
from strata.events.requests import BeginCheckpointRequest
from strata.services.checkpoint import domain
from strata.services.checkpoint.domain import CheckpointState

JOB = "job-c"
ROOT = "/tmp/ckpt"
SECOND = 1_000_000_000


def fold(state: CheckpointState, events: list[Event]) -> None:
    for event in events:
        domain.evolve(state, event)


def with_workers(n: int) -> CheckpointState:
    state = CheckpointState()
    fold(
        state,
        [
            WorkerRegistered(
                job=JOB,
                source="registry",
                worker_id=f"w{i}",
                instance=f"i{i}",
                rank=i,
                world_size=i + 1,
                membership_epoch=i + 1,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
            for i in range(n)
        ],
    )
    return state


def begin(state: CheckpointState, step: int, worker: str = "w0", keep: int = 2) -> None:
    request = BeginCheckpointRequest(
        job=JOB, worker_id=worker, step=step, epoch=0, root_uri=ROOT, keep_count=keep
    )
    decision = domain.begin(state, request, step * SECOND)
    assert decision.error is None
    fold(state, decision.events)


def ack(step: int, rank: int, worker: str | None = None, epoch: int = 0) -> CheckpointShardSaved:
    worker = worker or f"w{rank}"
    key = f"{JOB}/step-{step:012d}/rank-{rank:05d}.bin"
    return CheckpointShardSaved(
        job=JOB,
        source=worker,
        step=step,
        epoch=epoch,
        rank=rank,
        worker_id=worker,
        uri=f"{ROOT}/{key}",
        key=key,
        bytes=100 + rank,
        checksum="xxh128:" + "ab" * 16,
    )


def commit(state: CheckpointState, step: int) -> None:
    opened = state.job(JOB).open[step]
    assert opened.complete()
    fold(state, [domain.committed(JOB, opened, f"{ROOT}/{JOB}/step/MANIFEST.json", step * SECOND)])


def test_participants_are_frozen_when_the_step_opens() -> None:
    state = with_workers(3)
    begin(state, 10)
    opened = state.job(JOB).open[10]
    assert opened.participants == {"w0": 0, "w1": 1, "w2": 2}
    again = domain.begin(
        state,
        BeginCheckpointRequest(job=JOB, worker_id="w2", step=10, epoch=0, root_uri=ROOT),
        11 * SECOND,
    )
    assert (again.events, again.error) == ([], None)


def test_commit_needs_every_participant_and_acks_count_once() -> None:
    state = with_workers(3)
    begin(state, 5)
    fold(state, [ack(5, 0), ack(5, 0), ack(5, 1)])
    opened = state.job(JOB).open[5]
    assert not opened.complete()
    assert opened.missing_ranks() == [2]
    fold(state, [ack(5, 2)])
    assert opened.complete()
    manifest = domain.manifest(opened, JOB, 6 * SECOND)
    assert [s.rank for s in manifest.shards] == [0, 1, 2]
    assert manifest.total_bytes == 100 + 101 + 102
    commit(state, 5)
    assert state.job(JOB).latest() is not None
    assert domain.info(state, JOB, 5).status == "committed"


def test_foreign_or_mismatched_acks_do_not_count() -> None:
    state = with_workers(2)
    begin(state, 7)
    opened = state.job(JOB).open[7]
    stranger = ack(7, 1, worker="nobody")
    wrong_rank = ack(7, 0, worker="w1")
    wrong_epoch = ack(7, 1, epoch=3)
    assert domain.ack_problem(opened, stranger) is not None
    assert domain.ack_problem(opened, wrong_rank) is not None
    assert domain.ack_problem(opened, wrong_epoch) is not None
    fold(state, [stranger, wrong_rank, wrong_epoch])
    assert opened.acks == {}


def test_failure_before_acking_aborts_and_after_acking_does_not() -> None:
    state = with_workers(3)
    begin(state, 3)
    fold(state, [ack(3, 0)])
    assert domain.member_gone(state, JOB, "w0", "failed", 4 * SECOND) == []
    events = domain.member_gone(state, JOB, "w1", "failed", 4 * SECOND)
    assert len(events) == 1
    assert isinstance(events[0], CheckpointAborted)
    assert events[0].missing_ranks == [1, 2]
    assert "w1" in events[0].reason
    fold(state, events)
    assert 3 not in state.job(JOB).open
    retry = domain.begin(
        state,
        BeginCheckpointRequest(job=JOB, worker_id="w0", step=3, epoch=0, root_uri=ROOT),
        5 * SECOND,
    )
    assert isinstance(retry.error, ConflictError)


def test_timeout_aborts_at_the_deadline_not_before() -> None:
    state = with_workers(2)
    begin(state, 1)
    deadline = state.job(JOB).open[1].deadline_ns
    assert domain.timeouts(state, deadline - 1) == []
    assert len(domain.timeouts(state, deadline)) == 1


def test_retention_keeps_the_newest_and_never_the_open_ones() -> None:
    state = with_workers(1)
    for step in (1, 2, 3, 4):
        begin(state, step, keep=2)
        fold(state, [ack(step, 0)])
        commit(state, step)
    begin(state, 5, keep=2)
    pruned = [c.step for c in domain.to_prune(state.job(JOB))]
    assert pruned == [2, 1]
    assert 5 in state.job(JOB).open


def test_a_worker_that_is_not_live_cannot_open_a_step() -> None:
    state = with_workers(1)
    fold(
        state,
        [
            WorkerFailed(
                job=JOB,
                source="registry",
                worker_id="w0",
                rank=0,
                reason="gone",
                last_heartbeat_ts=0,
                membership_epoch=2,
            )
        ],
    )
    decision = domain.begin(
        state,
        BeginCheckpointRequest(job=JOB, worker_id="w0", step=1, epoch=0, root_uri=ROOT),
        SECOND,
    )
    assert isinstance(decision.error, NotFound)


@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=30))
def test_evolve_is_idempotent_and_commits_only_complete_steps(acks: list[tuple[int, bool]]) -> None:
    state = with_workers(4)
    begin(state, 9)
    events: list[Event] = [ack(9, rank) for rank, _ in acks]
    fold(state, events)
    fold(state, events)
    opened = state.job(JOB).open[9]
    assert set(opened.acks) == {rank for rank, _ in acks}
    assert opened.complete() == (set(opened.acks) == {0, 1, 2, 3})
    started = [e for e in events if isinstance(e, CheckpointStarted | CheckpointCommitted)]
    assert started == []


def test_an_ack_pointing_outside_its_slot_is_refused() -> None:
    state = with_workers(1)
    begin(state, 2)
    opened = state.job(JOB).open[2]
    honest = ack(2, 0)
    for key, uri in (
        ("../../etc/passwd", f"{ROOT}/../../etc/passwd"),
        (honest.key, "/elsewhere/" + honest.key),
        (
            f"{JOB}/step-000000000002/rank-00001.bin",
            f"{ROOT}/{JOB}/step-000000000002/rank-00001.bin",
        ),
    ):
        forged = honest.model_copy(update={"key": key, "uri": uri})
        problem = domain.ack_problem(opened, forged)
        assert problem is not None
        assert "must be stored as" in problem
    assert domain.ack_problem(opened, honest) is None
