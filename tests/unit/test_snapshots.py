"""Time travel through snapshots: the state at any point of a history, restored from the nearest
snapshot and folded on from there, is exactly the state a fold from the first event gives.

Checked at many seeded random points of a generated hour of a training job, of the recorded
golden history, and of arbitrary event sequences (hypothesis); with a memory budget that forces
snapshots to be thinned out; and by stored time as well as by stream sequence.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import given, settings
from strata.events import Event, WorkerHeartbeat
from strata.history import Record, read_records
from strata.services.readmodel import (
    JobState,
    SnapshotStore,
    freeze,
    rebuild,
    render_dashboard,
    thaw,
)

from tests.histories import hour_history
from tests.replays import GOLDEN, JOB, T0, histories
from tests.tiers import examples

SEED = 20261124


def events_only(records: list[Record]) -> list[Record]:
    return [record for record in records if record.stream == "events"]


def fold_live(records: list[Record], store: SnapshotStore) -> JobState:
    """Fold as the gateway does: every event, then a chance for the store to snapshot."""
    state = JobState(records[0].event.job)
    for record in records:
        state.apply(record)
        store.folded(state, record.stored_ns)
    return state


def travel(records: list[Record], store: SnapshotStore, job: str, **point: int) -> JobState:
    """The state at `seq=` or `at_ns=` through the store: nearest snapshot, then fold on."""
    state = store.nearest(job, seq=point.get("seq"), at_ns=point.get("at_ns"))
    for record in records:
        if record.seq <= state.seq and state.events:
            continue
        if "seq" in point and record.seq > point["seq"]:
            break
        if "at_ns" in point and record.stored_ns > point["at_ns"]:
            break
        state.apply(record)
    return state


def from_scratch(records: list[Record], job: str, **point: int) -> dict[str, Any]:
    if "seq" in point:
        return dict(render_dashboard(rebuild(records, job, until_seq=point["seq"])))
    kept = [record for record in records if record.stored_ns <= point["at_ns"]]
    return dict(render_dashboard(rebuild(kept, job)))


def points(records: list[Record], store: SnapshotStore, job: str, count: int) -> list[int]:
    """Random sequences, the ends, and every snapshot's sequence with its neighbours."""
    rng = random.Random(SEED)
    last = records[-1].seq
    chosen = {0, 1, last, last + 5}
    for seq in store._jobs[job].seqs:
        chosen |= {seq - 1, seq, seq + 1}
    chosen |= {rng.randint(1, last) for _ in range(count)}
    return sorted(chosen)


@pytest.fixture(scope="module")
def hour() -> list[Record]:
    return events_only(hour_history(workers=40, minutes=30, job=JOB))


def test_any_point_of_an_hour_of_a_job_equals_a_fold_from_the_first_event(
    hour: list[Record],
) -> None:
    store = SnapshotStore(every=97, cost_factor=0)
    live = fold_live(hour, store)
    assert store.count(JOB) == len(hour) // 97
    for seq in points(hour, store, JOB, examples(150)):
        assert render_dashboard(travel(hour, store, JOB, seq=seq)) == from_scratch(
            hour, JOB, seq=seq
        ), seq
    # The live state itself is left as it was by every snapshot and every restore.
    assert render_dashboard(live) == render_dashboard(rebuild(hour, JOB))


def test_a_point_in_time_restores_the_snapshot_stored_before_it(hour: list[Record]) -> None:
    store = SnapshotStore(every=150, cost_factor=0)
    fold_live(hour, store)
    rng = random.Random(SEED)
    first, last = hour[0].stored_ns, hour[-1].stored_ns
    moments = [first - 1, first, last, *(rng.randint(first, last) for _ in range(60))]
    moments += [hour[i].stored_ns for i in (149, 150, 299, 300)]
    for at_ns in moments:
        state = travel(hour, store, JOB, at_ns=at_ns)
        assert render_dashboard(state) == from_scratch(hour, JOB, at_ns=at_ns), at_ns


def test_the_golden_history_at_every_point(hour: list[Record]) -> None:
    path = next(iter(sorted(GOLDEN.glob("*.jsonl"))))
    records = list(read_records(path))
    job = records[0].event.job
    events = events_only(records)
    store = SnapshotStore(every=5, cost_factor=0)
    fold_live(events, store)
    assert store.count(job) >= 5
    for seq in range(0, events[-1].seq + 2):
        assert render_dashboard(travel(events, store, job, seq=seq)) == from_scratch(
            events, job, seq=seq
        ), seq


@settings(max_examples=examples(60), deadline=None)
@given(histories())
def test_any_history_at_any_point(events: list[Event]) -> None:
    records = [
        Record(seq, T0 + seq, event)  # type: ignore[arg-type]
        for seq, event in enumerate(events, start=1)
    ]
    store = SnapshotStore(every=3, cost_factor=0)
    fold_live(records, store)
    for seq in range(len(records) + 1):
        assert render_dashboard(travel(records, store, JOB, seq=seq)) == from_scratch(
            records, JOB, seq=seq
        )


def test_a_memory_budget_thins_snapshots_out_over_the_whole_history(hour: list[Record]) -> None:
    one = len(freeze(rebuild(hour, JOB)))
    store = SnapshotStore(budget_bytes=4 * one, every=50, cost_factor=0)
    fold_live(hour, store)
    kept = store._jobs[JOB]
    assert store.held <= store.budget_bytes
    assert store.held == sum(len(blob) for blob in kept.blobs)
    assert 2 <= len(kept.seqs) <= 5
    assert kept.every > 50  # the spacing grew as snapshots were given up
    assert kept.seqs[0] < hour[-1].seq // 2  # the early history keeps one
    for seq in points(hour, store, JOB, examples(40)):
        assert render_dashboard(travel(hour, store, JOB, seq=seq)) == from_scratch(
            hour, JOB, seq=seq
        ), seq


def test_a_snapshot_leaves_the_live_heartbeats_out(hour: list[Record]) -> None:
    state = rebuild(hour[:200], JOB)
    member = next(iter(state.registry.jobs[JOB].members.values()))
    state.apply_heartbeat(
        WorkerHeartbeat(
            job=JOB,
            source=member.worker_id,
            worker_id=member.worker_id,
            instance=member.instance,
            seq=1,
            state="training",
            step=77,
        )
    )
    restored = thaw(freeze(state))
    assert restored.beats == {}
    assert restored.heartbeats == 0
    assert render_dashboard(restored) == render_dashboard(rebuild(hour[:200], JOB))
    # Restored states are independent of each other and of the one frozen.
    restored.apply(hour[200])
    assert state.seq == hour[199].seq


def test_no_snapshot_before_the_point_starts_from_nothing(hour: list[Record]) -> None:
    store = SnapshotStore(every=1000, cost_factor=0)
    fold_live(hour, store)
    assert store.nearest(JOB, seq=999).events == 0
    assert store.nearest(JOB, seq=1000).seq == 1000
    assert store.nearest("another-job", seq=5000).events == 0


def test_snapshots_wait_while_the_last_one_is_recent(hour: list[Record]) -> None:
    now = [0.0]

    def clock() -> float:
        now[0] += 0.001  # every call a millisecond later: each snapshot "costs" 1 ms
        return now[0]

    store = SnapshotStore(every=10, cost_factor=1000.0, clock=clock)
    fold_live(hour[:3000], store)
    # Each snapshot waits a thousand times its cost (1 s, ~1,000 clock calls) after the last.
    assert 1 <= store.count(JOB) <= 4


def test_a_state_that_cannot_be_pickled_stops_snapshots_of_its_job_only(
    hour: list[Record],
) -> None:
    store = SnapshotStore(every=10, cost_factor=0)
    state = JobState(JOB)
    state.last_fold_error = lambda: None  # type: ignore[assignment]
    for record in hour[:50]:
        state.apply(record)
        store.folded(state, record.stored_ns)
    assert store.count(JOB) == 0
    assert store.nearest(JOB, seq=40).events == 0
