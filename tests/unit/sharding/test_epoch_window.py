"""What a worker can make the sharding service keep: the plans of a few epochs, a few datasets.

A worker asks for shards of any epoch it names. Planned on demand without a bound, every epoch
up to 2^31 would stay in memory and in every snapshot; the domain keeps the plans of each
dataset's newest `EPOCHS_KEPT` epochs, plans an epoch only from the oldest kept to one past the
latest, and leaves going back (or far ahead) to a restore.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strata.errors import EpochOutOfRange, LimitExceeded, NotFound
from strata.events import DatasetRegistered, ShardPlanChanged
from strata.events.models import MAX_EPOCH
from strata.events.requests import (
    GetShardsRequest,
    Lease,
    RegisterDatasetRequest,
    ReportProgressRequest,
    RestoreProgressRequest,
)
from strata.services.domain import Decision
from strata.services.sharding import domain
from strata.services.sharding.domain import EPOCHS_KEPT, ShardingState, restore, snapshot

from tests.tiers import examples
from tests.unit.sharding.cases import DATASET, JOB, NOW, apply, plan, started_job


def lease(state: ShardingState) -> Lease | None:
    return domain.current_lease(state, JOB, "w0")


def planned_epochs(state: ShardingState) -> list[int]:
    return sorted(epoch for (ds, epoch) in state.jobs[JOB].plans if ds == DATASET)


def get_shards(state: ShardingState, epoch: int) -> Decision[None]:
    request = GetShardsRequest(
        job=JOB, dataset_id=DATASET, worker_id="w0", epoch=epoch, lease=lease(state)
    )
    return domain.get_shards(state, request, NOW)


def restore_epoch(state: ShardingState, epoch: int, step: int = 6) -> list[ShardPlanChanged]:
    request = RestoreProgressRequest(
        job=JOB,
        dataset_id=DATASET,
        epoch=epoch,
        worker_id="w0",
        checkpoint_step=step,
        lease=lease(state),
    )
    events = apply(state, domain.restore_progress(state, request, NOW))
    return [e for e in events if isinstance(e, ShardPlanChanged)]


def test_epochs_in_order_keep_only_the_newest_plans() -> None:
    state = started_job()
    for epoch in range(1, 100):
        plan(state, epoch)
        assert len(state.jobs[JOB].plans) <= EPOCHS_KEPT
    assert planned_epochs(state) == list(range(100 - EPOCHS_KEPT, 100))
    assert state.jobs[JOB].epoch_window(DATASET) == (100 - EPOCHS_KEPT, 100)


def test_an_epoch_far_ahead_is_refused_with_what_to_ask_instead() -> None:
    state = started_job()
    plan(state, 1)

    refused = get_shards(state, MAX_EPOCH).error

    assert isinstance(refused, EpochOutOfRange)
    assert refused.code == "epoch_out_of_range"
    assert "the next is 2" in refused.message
    assert "restore_progress" in refused.message
    assert planned_epochs(state) == [0, 1]
    assert get_shards(state, 2).error is None


def test_a_dropped_epoch_is_refused_and_says_which_are_kept() -> None:
    state = started_job()
    for epoch in range(1, 10):
        plan(state, epoch)

    refused = get_shards(state, 0).error

    assert isinstance(refused, EpochOutOfRange)
    assert f"({10 - EPOCHS_KEPT}..9)" in refused.message
    progress = ReportProgressRequest(
        job=JOB, dataset_id=DATASET, epoch=0, worker_id="w0", completed=[0], lease=lease(state)
    )
    assert isinstance(domain.report_progress(state, progress, NOW).error, EpochOutOfRange)
    with pytest.raises(EpochOutOfRange):
        domain.plan_summary(state, JOB, DATASET, 0)
    # An epoch inside the window that was never planned is still just "not planned yet".
    inside = ReportProgressRequest(
        job=JOB, dataset_id=DATASET, epoch=10, worker_id="w0", completed=[0], lease=lease(state)
    )
    assert isinstance(domain.report_progress(state, inside, NOW).error, NotFound)


def test_the_first_plan_of_a_dataset_may_be_at_any_epoch() -> None:
    # A job that resumes without a checkpoint of its sampler starts at whatever epoch it is in.
    state = started_job()
    state.jobs[JOB].plans.clear()
    assert get_shards(state, 41).error is None


def test_a_restore_goes_back_to_a_dropped_epoch_and_the_job_goes_on_from_there() -> None:
    state = started_job()
    original_zero = state.jobs[JOB].plans[(DATASET, 0)].plan.version
    first_ids = {e.id for epoch in range(1, 8) for e in plan(state, epoch)}
    assert (DATASET, 0) not in state.jobs[JOB].plans

    replanned = restore_epoch(state, 0)

    assert planned_epochs(state) == [0]
    assert replanned, "the dropped epoch is planned again"
    # Versions go on from the dropped plan's: workers see a newer plan, the stream a new id.
    assert replanned[0].plan_version > original_zero
    for epoch in range(1, 8):
        again = plan(state, epoch)
        assert not {e.id for e in again} & first_ids
    assert planned_epochs(state) == list(range(8 - EPOCHS_KEPT, 8))


def test_a_restore_far_ahead_replaces_every_plan_and_stays_bounded() -> None:
    state = started_job()
    plan(state, 1)
    restore_epoch(state, MAX_EPOCH - 1)
    assert planned_epochs(state) == [MAX_EPOCH - 1]
    plan(state, MAX_EPOCH)
    assert planned_epochs(state) == [MAX_EPOCH - 1, MAX_EPOCH]


def test_the_window_and_the_dropped_versions_survive_a_snapshot() -> None:
    state = started_job()
    for epoch in range(1, 12):
        plan(state, epoch)

    rebuilt = restore(snapshot(state))

    assert planned_epochs(rebuilt) == planned_epochs(state)
    assert rebuilt.jobs[JOB].retired == state.jobs[JOB].retired
    assert isinstance(get_shards(rebuilt, 0).error, EpochOutOfRange)
    assert get_shards(rebuilt, 12).error is None


@settings(max_examples=examples(60), deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["get_shards", "restore"]),
            st.one_of(st.integers(0, 20), st.integers(0, MAX_EPOCH)),
        ),
        max_size=30,
    )
)
def test_whatever_epochs_are_asked_for_the_plans_stay_bounded(
    asks: list[tuple[str, int]],
) -> None:
    state = started_job()
    for verb, epoch in asks:
        window = state.jobs[JOB].epoch_window(DATASET)
        if verb == "get_shards":
            decision = get_shards(state, epoch)
            assert window is not None
            allowed = window[0] <= epoch <= window[1]
            assert (decision.error is None) == allowed, (epoch, window, decision.error)
            if allowed:
                apply(state, decision)
        else:
            restore_epoch(state, epoch)
            assert max(planned_epochs(state)) == epoch
        job = state.jobs[JOB]
        assert len(job.plans) <= EPOCHS_KEPT
        assert len(job.retired) <= 2 * domain.VERSIONS_REMEMBERED + EPOCHS_KEPT + 1
        latest = max(planned_epochs(state))
        assert all(latest - EPOCHS_KEPT < e <= latest for e in planned_epochs(state))
    # Whatever happened, the epoch after the latest can be read.
    after = max(planned_epochs(state)) + 1
    if after <= MAX_EPOCH:
        assert get_shards(state, after).error is None


def test_a_job_registers_a_bounded_number_of_datasets() -> None:
    state = ShardingState()

    def register(name: str) -> Decision[None]:
        request = RegisterDatasetRequest(
            job=JOB, dataset_id=name, total_samples=10, shard_size=5, shuffle=False, seed=0
        )
        return domain.register_dataset(state, request, NOW)

    for index in range(domain.MAX_DATASETS):
        for event in apply(state, register(f"ds-{index}")):
            assert isinstance(event, DatasetRegistered)

    refused = register("one-more").error
    assert isinstance(refused, LimitExceeded)
    assert refused.code == "quota_exceeded"  # a LimitExceeded: retrying does not help
    assert register("ds-0").error is None  # the same registration again is still fine
    other = RegisterDatasetRequest(
        job="another-job", dataset_id="ds", total_samples=10, shard_size=5, shuffle=False, seed=0
    )
    assert domain.register_dataset(state, other, NOW).error is None


def test_plan_summary_of_a_kept_epoch_still_answers() -> None:
    state = started_job()
    for epoch in range(1, 6):
        plan(state, epoch)
    summary = domain.plan_summary(state, JOB, DATASET, 5 - EPOCHS_KEPT + 1)
    assert summary.epoch == 5 - EPOCHS_KEPT + 1
