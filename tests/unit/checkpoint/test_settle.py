"""Settling a checkpoint step: one decision (`domain.settle_commit`) makes the whole plan.

A complete step whose shards storage holds whole is committed: the manifest under the job's
root, `checkpoint.committed`, then the files and `checkpoint.pruned` of the steps retention no
longer keeps. A shard missing or cut short aborts the step and removes its files. The plan's
prunes are exactly those of folding the commit first and asking retention afterwards, as the
adapter did one step at a time before, and never the newest complete checkpoint.
"""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from strata.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    Event,
    WorkerRegistered,
)
from strata.events.requests import AckShardRequest, BeginCheckpointRequest
from strata.services.checkpoint import domain
from strata.services.checkpoint.domain import CheckpointState
from strata.storage.base import manifest_key, step_prefix

JOB = "job-settle"
ROOT = "/tmp/ckpt-settle"
STORED_ROOT = "file:///tmp/ckpt-settle"
SECOND = 1_000_000_000


def fold(state: CheckpointState, events: list[Event] | tuple[Event, ...]) -> None:
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
                worker_id=f"w{rank}",
                instance=f"proc-w{rank}",
                rank=rank,
                world_size=rank + 1,
                membership_epoch=rank + 1,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
            for rank in range(n)
        ],
    )
    return state


def save(state: CheckpointState, step: int, ranks: list[int], keep: int = 2) -> None:
    """Every rank in `ranks` begins and acks `step` (its shard is 100 + rank bytes)."""
    for rank in ranks:
        begun = domain.begin(
            state,
            BeginCheckpointRequest(
                job=JOB,
                worker_id=f"w{rank}",
                step=step,
                epoch=0,
                root_uri=ROOT,
                keep_count=keep,
                instance=f"proc-w{rank}",
                save_id=f"save-{rank}-{step}",
            ),
            step * SECOND,
        )
        assert begun.error is None
        fold(state, begun.events)
        acked = domain.ack(
            state,
            AckShardRequest(
                job=JOB,
                worker_id=f"w{rank}",
                step=step,
                epoch=0,
                rank=rank,
                bytes=100 + rank,
                checksum="xxh128:" + "ab" * 16,
                instance=f"proc-w{rank}",
            ),
            step * SECOND,
        )
        assert acked.error is None
        fold(state, acked.events)


def whole(check: domain.CommitCheck) -> dict[int, int | None]:
    """Storage's answer when every acked shard is there at its acked size."""
    return {rank: 100 + rank for rank in check.keys}


def settle(
    state: CheckpointState, step: int, sizes: dict[int, int | None] | None = None
) -> domain.StoragePlan:
    check = domain.commit_check(state, JOB, step)
    assert check is not None
    return domain.settle_commit(
        state, check, whole(check) if sizes is None else sizes, STORED_ROOT, step * SECOND
    )


def execute(state: CheckpointState, plan: domain.StoragePlan) -> None:
    """What the adapter records of a plan, folded back."""
    fold(state, plan.record)
    fold(state, plan.record_after)


def test_a_complete_step_commits_with_its_manifest_then_prunes_the_oldest() -> None:
    state = with_workers(2)
    for step in (1, 2):
        save(state, step, [0, 1])
        execute(state, settle(state, step))
    save(state, 3, [0, 1])
    check = domain.commit_check(state, JOB, 3)
    assert check is not None
    assert check.root_uri == ROOT
    assert check.keys == {0: f"{JOB}/step-000000000003/rank-00000.bin", 1: check.keys[1]}

    plan = domain.settle_commit(state, check, whole(check), STORED_ROOT, 3 * SECOND)

    assert plan.write is not None
    assert (plan.write.root_uri, plan.write.key) == (ROOT, manifest_key(JOB, 3))
    assert [s.rank for s in plan.write.manifest.shards] == [0, 1]
    assert plan.write.manifest.total_bytes == 201
    (done,) = plan.record
    assert isinstance(done, CheckpointCommitted)
    assert done.manifest_uri == f"{STORED_ROOT}/{manifest_key(JOB, 3)}"
    assert plan.delete == (domain.StepFiles(ROOT, step_prefix(JOB, 1)),)
    assert [(type(e), getattr(e, "step", None)) for e in plan.record_after] == [
        (CheckpointPruned, 1)
    ]
    # Deciding changed nothing: the state moves only by folding what was recorded.
    assert 3 in state.job(JOB).open
    assert sorted(state.job(JOB).committed) == [1, 2]
    execute(state, plan)
    assert sorted(state.job(JOB).committed) == [2, 3]
    assert state.job(JOB).pruned == {1}


def test_a_shard_missing_or_cut_short_aborts_the_step_and_removes_its_files() -> None:
    for sizes in ({0: 100, 1: None}, {0: 100, 1: 7}):
        state = with_workers(2)
        save(state, 4, [0, 1])
        plan = settle(state, 4, sizes)
        assert plan.write is None
        (abort,) = plan.record
        assert isinstance(abort, CheckpointAborted)
        assert "rank 1" in abort.reason
        assert plan.delete == (domain.StepFiles(ROOT, step_prefix(JOB, 4)),)
        assert plan.record_after == ()
        execute(state, plan)
        assert 4 in state.job(JOB).aborted
        assert state.job(JOB).committed == {}


def test_nothing_to_settle_before_every_rank_acked_or_once_settled() -> None:
    state = with_workers(2)
    save(state, 5, [0])
    assert domain.commit_check(state, JOB, 5) is None
    save(state, 5, [1])
    check = domain.commit_check(state, JOB, 5)
    assert check is not None
    execute(state, domain.settle_commit(state, check, whole(check), STORED_ROOT, 5 * SECOND))
    assert domain.commit_check(state, JOB, 5) is None
    assert domain.settle_commit(state, check, whole(check), STORED_ROOT, 6 * SECOND) == (
        domain.StoragePlan()
    )


def test_recording_removes_the_files_of_the_steps_it_aborts_only() -> None:
    state = with_workers(2)
    save(state, 6, [0])
    save(state, 7, [0])
    abort = domain.member_gone(state, JOB, "w1", "failed", 8 * SECOND)
    plan = domain.recording(state, abort)
    assert [getattr(e, "step", None) for e in plan.record] == [6, 7]
    assert plan.delete == tuple(domain.StepFiles(ROOT, step_prefix(JOB, s)) for s in (6, 7))
    assert plan.write is None
    assert plan.record_after == ()


@given(
    keep=st.integers(1, 4),
    steps=st.lists(st.booleans(), min_size=1, max_size=8),
)
def test_the_plans_prunes_are_retentions_after_the_commit_is_folded(
    keep: int, steps: list[bool]
) -> None:
    """Each step commits complete (True) or without rank 1 of its world of 2 (False, committed
    through the history as an older service recorded it); the plan of every complete one prunes
    what `to_prune` names once its commit is folded, and never the newest complete checkpoint."""
    state = with_workers(2)
    for index, complete in enumerate(steps):
        step = index + 1
        save(state, step, [0, 1] if complete else [0], keep=keep)
        if not complete:
            opened = state.job(JOB).open[step]
            fold(state, [domain.committed(JOB, opened, f"{STORED_ROOT}/m", step * SECOND)])
            continue
        plan = settle(state, step)
        after = CheckpointState({JOB: state.job(JOB).fork()})
        fold(after, plan.record)
        expected = [c.step for c in domain.to_prune(after.job(JOB))]
        assert [e.step for e in plan.record_after if isinstance(e, CheckpointPruned)] == expected
        assert [f.prefix for f in plan.delete] == [step_prefix(JOB, s) for s in expected]
        newest_complete = after.job(JOB).latest()
        assert newest_complete is not None
        assert newest_complete.step == step
        assert step not in expected
        execute(state, plan)
        assert len(state.job(JOB).committed) <= keep
