"""The fencing window: a report decided while the reporter's failure was being stored.

The sharding service decides a report on the state it has folded. A worker's failure stored a
moment before that state caught up is not in it yet, so the report is decided under a lease
the stream has already ended, and its event is stored after the failure. Meanwhile the failure
moved the worker's unfinished shards to another worker, which reads them from the offsets
recorded before the report. Were the report counted when folded, its samples would be counted
twice: once as the failed worker's report, once by the new owner. So the stream's order
decides: a report stored after its reporter's lease ended counts nothing, for every fold (the
service, the dashboard, a replay), and the reporter is told so (`stale_lease`, "not counted").
"""

from __future__ import annotations

import pytest
from strata.errors import StaleLease
from strata.events import ShardProgress
from strata.events.requests import GetShardsRequest
from strata.services.sharding import domain
from strata.services.sharding.domain import ShardingState

from tests.unit.sharding.cases import (
    DATASET,
    JOB,
    NOW,
    failed,
    lease,
    registered,
    report,
    shards_of,
    started_job,
)


def _offset(state: ShardingState, shard: int) -> int:
    return state.jobs[JOB].plans[(DATASET, 0)].offsets.get(shard, 0)


def _reads_from(state: ShardingState, worker: str, shard: int) -> int:
    """Where `worker`'s assignment tells it to start reading `shard` (its offset in it)."""
    request = GetShardsRequest(
        job=JOB, dataset_id=DATASET, worker_id=worker, epoch=0, lease=lease(worker)
    )
    spans = domain.assignment(state, request).shards
    return next(span.offset for span in spans if span.shard_id == shard)


def _report_decided_before_the_failure_was_folded() -> tuple[ShardingState, ShardProgress, int]:
    state = started_job()
    reading = shards_of(state, "w0")[0]
    decision = domain.report_progress(state, report("w0", lease("w0"), partial={reading: 5}), NOW)
    assert decision.error is None
    (progress,) = decision.events
    assert isinstance(progress, ShardProgress)
    return state, progress, reading


def test_a_report_stored_after_its_reporters_failure_counts_nothing() -> None:
    state, progress, reading = _report_decided_before_the_failure_was_folded()
    # Stored in this order: the failure, the re-plan it causes, then the report.
    domain.evolve(state, failed("w0", 3))
    for event in domain.replan_after_membership_change(state, JOB, NOW):
        domain.evolve(state, event)
    assert reading in shards_of(state, "w1")
    new_owner_starts_at = _reads_from(state, "w1", reading)

    domain.evolve(state, progress)

    # The samples the late report names are read by the new owner, and only by it.
    assert new_owner_starts_at == 0
    assert _offset(state, reading) == 0
    with pytest.raises(StaleLease, match="not counted"):
        domain.progress_answer(state, report("w0", lease("w0"), partial={reading: 5}), progress)


def test_a_report_stored_after_a_newer_registration_of_its_worker_counts_nothing() -> None:
    state, progress, reading = _report_decided_before_the_failure_was_folded()
    domain.evolve(state, failed("w0", 3))
    domain.evolve(state, registered("w0", "p-w0-again", 4))
    domain.evolve(state, progress)
    assert _offset(state, reading) == 0
    with pytest.raises(StaleLease):
        domain.progress_answer(state, report("w0", lease("w0"), partial={reading: 5}), progress)


def test_a_report_stored_before_the_failure_counts_and_moves_with_the_shard() -> None:
    state, progress, reading = _report_decided_before_the_failure_was_folded()
    domain.evolve(state, progress)
    answer = domain.progress_answer(
        state, report("w0", lease("w0"), partial={reading: 5}), progress
    )
    assert answer.total_shards > 0
    domain.evolve(state, failed("w0", 3))
    for event in domain.replan_after_membership_change(state, JOB, NOW):
        domain.evolve(state, event)
    # The new owner goes on from where the report left the shard: nothing is read twice.
    assert _reads_from(state, "w1", reading) == 5
