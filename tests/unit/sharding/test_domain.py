"""The sharding service's pure domain: restoring an epoch's progress to a checkpoint's cursors."""

from __future__ import annotations

from strata.events import (
    Event,
    ShardPlanChanged,
    WorkerFailed,
)
from strata.events.requests import (
    ReportProgressRequest,
    RestoreProgressRequest,
)
from strata.services.sharding import domain
from strata.services.sharding.domain import ShardingState, restore, snapshot
from strata.sharding import shard_order

from tests.unit.sharding.cases import DATASET, JOB, NOW, WORKERS, apply, plan, started_job


def read_all(state: ShardingState, epoch: int) -> None:
    """Each worker reports every shard of its own done."""
    plan_of = state.jobs[JOB].plans[(DATASET, epoch)].plan
    for worker in WORKERS:
        request = ReportProgressRequest(
            job=JOB,
            dataset_id=DATASET,
            epoch=epoch,
            worker_id=worker,
            completed=plan_of.shards_of(worker),
            lease=domain.current_lease(state, JOB, worker),
        )
        apply(state, domain.report_progress(state, request, NOW))


def restore_to(state: ShardingState, completed: list[int], worker: str = "w0") -> list[Event]:
    request = RestoreProgressRequest(
        job=JOB,
        dataset_id=DATASET,
        epoch=0,
        worker_id=worker,
        checkpoint_step=6,
        completed=completed,
        lease=domain.current_lease(state, JOB, worker),
    )
    return apply(state, domain.restore_progress(state, request, NOW))


def done(state: ShardingState, epoch: int = 0) -> set[int]:
    return {int(s) for s in state.jobs[JOB].plans[(DATASET, epoch)].plan.done.nonzero()[0]}


def test_every_rank_restoring_the_same_checkpoint_resets_once() -> None:
    state = started_job()
    read_all(state, epoch=0)

    first = restore_to(state, [1, 2], worker="w0")
    again = restore_to(state, [1, 2], worker="w1")

    assert [e.type for e in first] == ["shard.progress_restored"]
    assert again == []
    assert done(state) == {1, 2}


def test_a_second_restart_from_the_same_checkpoint_undoes_the_progress_made_since() -> None:
    state = started_job()
    first = restore_to(state, [1, 2])
    read_all(state, epoch=0)  # the restarted job reads on, then fails before its next checkpoint
    assert done(state) == set(range(8))

    second = restore_to(state, [1, 2])

    assert [e.type for e in second] == ["shard.progress_restored"]
    assert second[0].id != first[0].id, "the stream would drop it as a duplicate"
    assert done(state) == {1, 2}


def test_a_later_epoch_planned_again_after_a_restore_goes_on_with_newer_versions() -> None:
    state = started_job()
    restore_to(state, [1, 2])
    read_all(state, epoch=0)
    (first_plan,) = plan(state, epoch=1)
    assert (DATASET, 1) in state.jobs[JOB].plans

    restore_to(state, [1, 2])
    assert (DATASET, 1) not in state.jobs[JOB].plans
    (second_plan,) = plan(state, epoch=1)

    assert isinstance(first_plan, ShardPlanChanged)
    assert isinstance(second_plan, ShardPlanChanged)
    # A worker that saw the dropped plan must see the new one as newer, never as older.
    assert second_plan.plan_version > first_plan.plan_version
    assert second_plan.id != first_plan.id
    assert state.jobs[JOB].plans[(DATASET, 1)].plan.version == second_plan.plan_version


def test_restore_counts_and_retired_versions_survive_a_snapshot() -> None:
    state = started_job()
    first = restore_to(state, [1, 2])
    read_all(state, epoch=0)
    plan(state, epoch=1)
    second = restore_to(state, [1, 2])

    rebuilt = restore(snapshot(state))
    read_all(rebuilt, epoch=0)
    third = restore_to(rebuilt, [1, 2])

    assert rebuilt.jobs[JOB].restores == {DATASET: 3}
    assert rebuilt.jobs[JOB].retired == {(DATASET, 1): 0}
    assert len({first[0].id, second[0].id, third[0].id}) == 3


def test_shards_done_by_a_worker_gone_since_the_checkpoint_get_a_live_reader_on_restore() -> None:
    state = started_job()
    read_all(state, epoch=0)  # w1 finishes its shards after the checkpoint, then fails
    w1_shards = state.jobs[JOB].plans[(DATASET, 0)].plan.shards_of("w1")
    domain.evolve(
        state,
        WorkerFailed(
            job=JOB,
            source="registry",
            worker_id="w1",
            rank=1,
            reason="killed",
            last_heartbeat_ts=0,
            membership_epoch=3,
        ),
    )
    for event in domain.replan_after_membership_change(state, JOB, NOW):
        domain.evolve(state, event)

    events = restore_to(state, [])

    assert [e.type for e in events] == ["shard.progress_restored", "shard.plan_changed"]
    assert isinstance(events[1], ShardPlanChanged)
    assert events[1].moved_shards == len(w1_shards)
    plan_of = state.jobs[JOB].plans[(DATASET, 0)].plan
    assert sorted(plan_of.shards_of("w0")) == list(range(8))
    assert plan_of.unowned() == 0


def test_the_reading_order_a_replan_made_survives_a_snapshot() -> None:
    state = started_job()
    before = state.jobs[JOB].plans[(DATASET, 0)].plan.shards_of("w0")
    domain.evolve(
        state,
        WorkerFailed(
            job=JOB,
            source="registry",
            worker_id="w1",
            rank=1,
            reason="killed",
            last_heartbeat_ts=0,
            membership_epoch=3,
        ),
    )
    for event in domain.replan_after_membership_change(state, JOB, NOW):
        domain.evolve(state, event)
    reading = state.jobs[JOB].plans[(DATASET, 0)].plan.shards_of("w0")
    # w1's shards are read after w0's own, not merged into them by epoch order.
    assert reading[: len(before)] == before
    epoch_order = shard_order(state.jobs[JOB].datasets[DATASET], 0).tolist()
    assert reading != [s for s in epoch_order if s in reading]

    rebuilt = restore(snapshot(state)).jobs[JOB].plans[(DATASET, 0)].plan

    assert rebuilt.shards_of("w0") == reading
