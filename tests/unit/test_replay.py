"""The read model behind the gateway and `strata replay`: fold, summaries, dashboard, files, CLI.

Histories are real event models. The properties: routing each event only to the domains it
concerns folds exactly like handing it to all four `evolve` functions, and the state does not
depend on how heartbeats interleave with events (so a replay equals the live view). Golden
histories recorded from a real job (`tests/golden/`) must rebuild to their recorded state.
"""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from pydantic import TypeAdapter
from strata.cli.main import main as cli
from strata.cli.replay import parse_time
from strata.errors import CodecError, ValidationError
from strata.events import (
    EVENT_MODELS,
    BarrierArrived,
    BarrierBrokenEvent,
    BarrierOpened,
    BarrierReleased,
    BarrierTimedOut,
    BarrierWithdrawn,
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointShardStarted,
    CheckpointStarted,
    DatasetRegistered,
    Event,
    LiveHealed,
    LiveQuorumFormed,
    LiveStepDiscarded,
    MetricSampled,
    Participant,
    RequestRejected,
    ShardOffset,
    ShardPlanChanged,
    ShardProgress,
    ShardProgressRestored,
    WorkerFailed,
    WorkerHeartbeat,
    WorkerLeft,
    WorkerRegistered,
)
from strata.history import read_records, record_from_json, summarize
from strata.services.gateway.live import RateWindow
from strata.services.readmodel import (
    DOMAINS,
    RECENT_EVENTS,
    REQUEST_TYPES,
    JobState,
    event_type,
    rebuild,
    render_dashboard,
    routes_for,
)
from strata.services.readmodel.views import Dashboard
from strata.storage.base import shard_key

from tests.replays import (
    GOLDEN,
    JOB,
    SECOND,
    T0,
    WORKERS,
    History,
    histories,
    instances,
    worker_ids,
)
from tests.tiers import examples

# -- building histories ---------------------------------------------------------------------------


def everything_once() -> History:
    """One history with every kind of event, in an order the services could have produced."""
    h = History()
    for rank, worker in enumerate(WORKERS):
        h.register(worker, rank)
    h.add(
        DatasetRegistered(
            job=JOB,
            source="sharding",
            dataset_id="ds",
            total_samples=1000,
            shard_size=100,
            shuffle=True,
            seed=3,
        )
    )
    h.add(
        ShardPlanChanged(
            job=JOB,
            source="sharding",
            dataset_id="ds",
            epoch=0,
            plan_version=0,
            members=list(WORKERS),
            membership_epoch=4,
            reason="first request of the epoch",
        )
    )
    for worker in WORKERS:
        h.state(worker, "training", step=5)
        h.beat(worker, step=7)
    h.add(
        ShardProgress(
            job=JOB,
            source="sharding",
            dataset_id="ds",
            epoch=0,
            worker_id="w0",
            completed=[0, 4],
            partial=[ShardOffset(shard_id=8, offset=10)],
        )
    )
    h.add(
        BarrierOpened(
            job=JOB,
            source="barrier",
            name="b",
            generation=0,
            expected=list(WORKERS),
            expected_count=4,
            timeout_s=30.0,
            deadline_ts=T0 + 30 * SECOND,
        )
    )
    for count, worker in enumerate(WORKERS, start=1):
        h.add(
            BarrierArrived(
                job=JOB, source="barrier", name="b", generation=0, worker_id=worker, arrived=count
            )
        )
    h.add(
        BarrierReleased(
            job=JOB,
            source="barrier",
            name="b",
            generation=0,
            participants=4,
            first_arrival_to_release_ms=12.0,
            last_arrival_to_release_ms=2.5,
        )
    )
    for step in (100, 200, 300):
        checkpoint(h, step, list(WORKERS), commit=True)
    h.add(CheckpointPruned(job=JOB, source="checkpoint", step=100, manifest_uri="file:///m/100"))
    checkpoint(h, 400, list(WORKERS), commit=False, saved=2)
    h.add(
        CheckpointAborted(
            job=JOB,
            source="checkpoint",
            step=400,
            epoch=0,
            reason="participant 'w3' (rank 3) failed before saving its shard",
            missing_ranks=[2, 3],
        )
    )
    checkpoint(h, 500, list(WORKERS), commit=False, saved=1)
    h.add(
        BarrierOpened(
            job=JOB,
            source="barrier",
            name="c",
            generation=0,
            expected=list(WORKERS),
            expected_count=4,
            timeout_s=30.0,
            deadline_ts=T0 + 30 * SECOND,
        )
    )
    h.add(
        WorkerFailed(
            job=JOB,
            source="registry",
            worker_id="w3",
            rank=3,
            reason="no heartbeat for 5.1s (timeout 5s)",
            last_heartbeat_ts=T0,
            membership_epoch=5,
        )
    )
    h.add(
        BarrierBrokenEvent(
            job=JOB,
            source="barrier",
            name="c",
            generation=0,
            reason="participant 'w3' failed",
            culprits=["w3"],
            missing=["w0", "w1", "w2", "w3"],
        )
    )
    h.add(
        ShardPlanChanged(
            job=JOB,
            source="sharding",
            dataset_id="ds",
            epoch=0,
            plan_version=1,
            members=["w0", "w1", "w2"],
            membership_epoch=5,
            reason="membership changed",
            moved_shards=2,
        )
    )
    h.add(WorkerLeft(job=JOB, source="registry", worker_id="w2", rank=2, membership_epoch=6))
    h.add(
        RequestRejected(
            job=JOB,
            source="barrier",
            service="barrier",
            subject="strata.rpc.barrier.arrive",
            code="not_found",
            message="worker 'w9' is not a live member",
        )
    )
    return h


def checkpoint(h: History, step: int, workers: list[str], commit: bool, saved: int = 99) -> None:
    h.add(
        CheckpointStarted(
            job=JOB,
            source="checkpoint",
            step=step,
            epoch=0,
            root_uri="file:///m",
            participants=[Participant(worker_id=w, rank=r) for r, w in enumerate(workers)],
            keep_count=2,
            timeout_s=60.0,
            world_size=len(workers),
            membership_epoch=len(workers),
        )
    )
    for rank, worker in enumerate(workers[:saved]):
        h.add(
            CheckpointShardStarted(
                job=JOB,
                source="checkpoint",
                step=step,
                epoch=0,
                rank=rank,
                worker_id=worker,
                instance=f"proc-{worker}",
                save_id=f"save-{worker}-{step}",
            )
        )
        h.add(
            CheckpointShardSaved(
                job=JOB,
                source="checkpoint",
                step=step,
                epoch=0,
                rank=rank,
                worker_id=worker,
                uri=f"file:///m/{shard_key(JOB, step, rank)}",
                key=shard_key(JOB, step, rank),
                bytes=1_000_000 * (rank + 1),
                checksum="sha256:" + "0" * 64,
            )
        )
    if commit:
        h.add(
            CheckpointCommitted(
                job=JOB,
                source="checkpoint",
                step=step,
                epoch=0,
                manifest_uri=f"file:///m/{step}",
                total_bytes=10_000_000,
                shards=len(workers),
                duration_ms=500.0,
            )
        )


# -- fold semantics -------------------------------------------------------------------------------


def test_workers_come_from_the_registry_fold_and_progress_from_heartbeats() -> None:
    state = everything_once().fold()
    workers = {row["id"]: row for row in state.workers()}
    assert [row["id"] for row in state.workers()] == ["w0", "w1", "w2", "w3"]
    assert workers["w0"] == {
        "id": "w0",
        "rank": 0,
        "status": "training",
        "live": True,
        "step": 7,
        "epoch": 0,
        "last_heartbeat": workers["w0"]["last_heartbeat"],
        "shards": workers["w0"]["shards"],
        "hostname": "host-w0",
    }
    assert isinstance(workers["w0"]["last_heartbeat"], int)
    assert (workers["w2"]["status"], workers["w3"]["status"]) == ("left", "failed")
    # The plan after w3 failed is over w0..w2; w2 left later, with no plan change recorded.
    assert workers["w3"]["shards"] == 0
    assert sum(row["shards"] for row in workers.values()) == 10
    assert (state.live_workers(), state.known_workers()) == (2, 4)


def test_a_heartbeat_never_changes_status_and_only_its_instance_counts() -> None:
    h = History()
    h.register("w0", 0, instance="first")
    h.beat("w0", step=40, instance="first")
    h.add(
        WorkerFailed(
            job=JOB,
            source="registry",
            worker_id="w0",
            rank=0,
            reason="silent",
            last_heartbeat_ts=T0,
            membership_epoch=2,
        )
    )
    h.register("w0", 0, instance="second")
    h.beat("w0", step=99, instance="first")  # the old process, still talking
    row = h.fold().workers()[0]
    assert (row["status"], row["step"], row["last_heartbeat"]) == ("idle", 0, None)
    h.beat("w0", step=3, instance="second")
    row = h.fold().workers()[0]
    assert (row["status"], row["step"]) == ("idle", 3)
    assert row["last_heartbeat"] == h.records[-1].event.ts


def test_an_event_a_domain_cannot_take_is_counted_and_the_fold_goes_on() -> None:
    h = History()
    h.register("w0", 0)
    h.add(
        DatasetRegistered(
            job=JOB,
            source="sharding",
            dataset_id="ds",
            total_samples=10,
            shard_size=1,
            shuffle=False,
            seed=0,
        )
    )
    # The schema now refuses it, but a stored history may predate that rule: no plan can be made
    # over nobody, and the fold must go on past it.
    h.add(
        ShardPlanChanged.model_construct(
            job=JOB,
            source="sharding",
            dataset_id="ds",
            epoch=0,
            plan_version=0,
            members=[],
            membership_epoch=1,
            reason="odd",
            moved_shards=0,
            id="odd-plan",
            ts=0,
            v=1,
            type="shard.plan_changed",
        )
    )
    h.state("w0", "training", step=4)
    state = h.fold()
    assert state.fold_errors == 1
    assert state.last_fold_error.startswith("seq 3 (shard.plan_changed): ValidationError")
    assert (state.seq, state.workers()[0]["status"]) == (4, "training")


def test_without_heartbeats_progress_comes_from_state_changes() -> None:
    h = History()
    h.register("w0", 0)
    h.state("w0", "checkpointing", step=12)
    row = h.fold().workers()[0]
    assert (row["status"], row["step"], row["last_heartbeat"]) == ("checkpointing", 12, None)


def test_checkpoints_show_every_status_with_their_bytes_and_timing() -> None:
    state = everything_once().fold()
    rows = {row["step"]: row for row in state.checkpoint_rows()}
    assert [step for step in rows] == [100, 200, 300, 400, 500]
    assert rows[100]["status"] == "pruned"
    assert rows[100]["bytes"] == 10_000_000
    assert rows[100]["committed_at"] is not None
    committed = rows[300]
    assert committed["status"] == "committed"
    assert (committed["bytes"], committed["duration_ms"]) == (10_000_000, 500.0)
    assert rows[400]["status"] == "aborted"
    assert rows[400]["bytes"] == 3_000_000  # ranks 0 and 1 had saved
    assert "w3" in rows[400]["reason"]
    assert (rows[500]["status"], rows[500]["bytes"], rows[500]["committed_at"]) == (
        "open",
        1_000_000,
        None,
    )
    assert state.checkpoint_mb_s() == 20.0  # 10 MB in 0.5 s


def test_barriers_show_the_latest_generation_with_release_latency() -> None:
    h = everything_once()
    state = h.fold()
    rows = {row["name"]: row for row in state.barrier_rows()}
    # Measured with the stream's clock: the release was stored 100 ms after the completing
    # arrival (the service's own figure, 2.5 ms, cannot see the time to store either).
    assert rows["b"] == {
        "name": "b",
        "generation": 0,
        "arrived": 4,
        "expected": 4,
        "status": "released",
        "latency_ms": 100.0,
    }
    assert rows["c"]["status"] == "broken"
    assert rows["c"]["latency_ms"] is None
    assert state.barrier_p99_ms() == 100.0


def test_without_stored_times_a_release_keeps_the_services_own_latency() -> None:
    state = JobState(JOB)
    for record in everything_once().records:
        if record.stream == "events":
            state.apply_event(record.seq, record.event)
    rows = {row["name"]: row for row in state.barrier_rows()}
    assert rows["b"]["latency_ms"] == 2.5


def test_barrier_p99_is_the_nearest_rank_over_the_last_thousand_releases() -> None:
    h = History()
    for generation in range(1100):
        h.add(
            BarrierReleased(
                job=JOB,
                source="barrier",
                name="b",
                generation=generation,
                participants=2,
                first_arrival_to_release_ms=1.0,
                last_arrival_to_release_ms=float(generation),
            )
        )
    # The kept releases are 100..1099; nearest rank 990 of 1000 is 1089.
    assert h.fold().barrier_p99_ms() == 1089.0


def test_recent_events_keep_the_last_two_hundred_with_summaries() -> None:
    h = History()
    for i in range(RECENT_EVENTS + 50):
        h.register(f"w{i}", i)
    state = h.fold()
    rows = state.recent_rows()
    assert len(rows) == RECENT_EVENTS
    assert [row["seq"] for row in rows] == list(range(51, RECENT_EVENTS + 51))
    assert rows[-1]["type"] == "worker.registered"
    assert rows[-1]["summary"].startswith(f"w{RECENT_EVENTS + 49} registered as rank")
    assert state.recent_rows() == rows  # served again from the summaries already made


def every_event_type() -> History:
    """`everything_once` and the event types it leaves out: a timeout, a sample, a restore."""
    h = everything_once()
    h.add(
        BarrierOpened(
            job=JOB,
            source="barrier",
            name="d",
            generation=1,
            expected=["w1"],
            expected_count=1,
            timeout_s=5.0,
            deadline_ts=T0 + 5 * SECOND,
        )
    )
    h.add(
        BarrierTimedOut(
            job=JOB,
            source="barrier",
            name="d",
            generation=1,
            timeout_s=5.0,
            missing=["w1"],
            arrived=1,
        )
    )
    h.add(
        BarrierWithdrawn(
            job=JOB, source="barrier", name="d", worker_id="w1", arrival=1, generation=2
        )
    )
    h.add(MetricSampled(job=JOB, source="w0", name="loss", value=0.25))
    h.add(
        LiveQuorumFormed(
            job=JOB,
            source="barrier",
            membership_epoch=9,
            generation=0,
            members=["w0", "w2"],
            world_size=2,
            previous_epoch=8,
            left=["w1"],
        )
    )
    h.add(
        LiveHealed(
            job=JOB,
            source="barrier",
            membership_epoch=9,
            generation=0,
            worker_id="w2",
            source_worker="w0",
            from_step=40,
            to_step=41,
        )
    )
    h.add(
        LiveStepDiscarded(
            job=JOB,
            source="barrier",
            membership_epoch=9,
            generation=0,
            worker_id="w0",
            step=42,
            reason="Connection closed by peer",
        )
    )
    h.add(
        ShardProgressRestored(
            job=JOB,
            source="sharding",
            dataset_id="ds",
            epoch=0,
            checkpoint_step=300,
            completed=[0, 4],
        )
    )
    return h


def test_summaries_name_who_and_what_for_every_event_type() -> None:
    h = every_event_type()
    seen = {}
    for record in h.records:
        seen[record.event.type] = summarize(record.event)
    missing = {model.model_fields["type"].default for model in EVENT_MODELS} - set(seen)
    assert not missing, f"give {missing} a line in strata.history.summarize and an example here"
    assert all(text != kind for kind, text in seen.items())
    assert seen["worker.failed"] == "w3 (rank 3) failed: no heartbeat for 5.1s (timeout 5s)"
    assert seen["checkpoint.committed"] == (
        "checkpoint of step 300 committed: 10.0 MB in 4 shards, 500 ms"
    )
    assert seen["barrier.released"].startswith("barrier b#0 released: 4 participants")
    assert seen["checkpoint.started"] == (
        "checkpoint of step 500 (epoch 0) started for a world of 4 with 4 participants"
    )
    assert seen["checkpoint.shard_started"] == "rank 0 (w0) began its shard of step 500"
    assert seen["metric.sampled"] == "loss = 0.25"
    assert seen["live.quorum_formed"] == (
        "live group of membership 9 formed: 2 (w0, w2), was 3 at membership 8: w1 left"
    )
    assert seen["live.healed"] == (
        "w2 healed from w0 in the live group of membership 9: step 40 -> 41"
    )
    assert seen["live.step_discarded"] == (
        "w0 discarded step 42 in the live group of membership 9 (Connection closed by peer): no "
        "rank committed it; the group trains it again after step 41"
    )
    assert seen["shard.progress_restored"] == (
        "ds epoch 0: progress restored from the checkpoint of step 300 "
        "(2 shards done, 0 in progress)"
    )
    assert all(text and "\n" not in text for text in seen.values())


def test_the_dashboard_has_exactly_the_contract_shape() -> None:
    document = render_dashboard(everything_once().fold())
    TypeAdapter(Dashboard).validate_python(
        document
    )  # extra fields are forbidden, so none is added or lost
    assert list(document) == [
        "job",
        "seq",
        "ts",
        "figures",
        "workers",
        "losses",
        "restarts",
        "live",
        "datasets",
        "checkpoints",
        "barriers",
        "metrics",
        "recent_events",
    ]
    metrics = document["metrics"]
    assert (metrics["events_per_s"], metrics["requests_per_s"], metrics["heartbeats_per_s"]) == (
        None,
        None,
        None,
    )
    assert metrics["shard_distribution"] == {"max_over_mean": 1.2, "min": 3, "max": 4}
    assert document["datasets"] == [
        {
            "id": "ds",
            "total_samples": 1000,
            "shard_size": 100,
            "num_shards": 10,
            "epoch": 0,
            "plan_version": 1,
            "done_shards": 2,
            "loads": {"w0": 3, "w1": 4, "w2": 3},
        }
    ]
    assert json.loads(json.dumps(document)) == document


def test_an_empty_job_renders_with_nulls() -> None:
    document = render_dashboard(JobState("nobody"))
    TypeAdapter(Dashboard).validate_python(document)
    assert document["workers"] == document["datasets"] == document["recent_events"] == []
    assert document["metrics"]["checkpoint_mb_s"] is None
    assert document["metrics"]["shard_distribution"]["max_over_mean"] is None


def test_rebuild_stops_at_a_sequence_and_ignores_other_jobs() -> None:
    h = everything_once()
    failed_at = next(r.seq for r in h.records if isinstance(r.event, WorkerFailed))
    before = rebuild(h.records, JOB, until_seq=failed_at - 1)
    assert {row["id"]: row["status"] for row in before.workers()}["w3"] == "training"
    assert before.seq == failed_at - 1
    other = rebuild(h.records, "another-job")
    assert (other.events, other.workers()) == (0, [])


# -- properties -----------------------------------------------------------------------------------


@st.composite
def heartbeats(draw: st.DrawFn) -> list[WorkerHeartbeat]:
    return [
        WorkerHeartbeat(
            job=JOB,
            source=worker,
            ts=T0 + i,
            worker_id=worker,
            instance=draw(instances),
            seq=i,
            state="training",
            step=draw(st.integers(0, 1000)),
        )
        for i, worker in enumerate(draw(st.lists(worker_ids, max_size=20)))
    ]


def fold_events(events: list[Event], state: JobState) -> JobState:
    for seq, event in enumerate(events, start=1):
        state.apply_event(seq, event)  # type: ignore[arg-type]
    return state


@settings(max_examples=examples(150))
@given(histories())
def test_routing_folds_exactly_like_giving_every_event_to_every_domain(events: list[Event]) -> None:
    routed = fold_events(events, JobState(JOB))
    everyone = JobState(JOB)
    every_domain = list(everyone._evolvers.values())
    everyone._routes = {model.model_fields["type"].default: every_domain for model in EVENT_MODELS}
    fold_events(events, everyone)
    assert render_dashboard(routed) == render_dashboard(everyone)


def test_each_event_type_goes_to_the_domains_that_declare_it() -> None:
    assert routes_for("worker.registered") == tuple(DOMAINS)
    assert routes_for("barrier.arrived") == ("barrier",)
    assert routes_for("metric.sampled") == ()
    assert routes_for("worker.teleported") == ()
    catalogue = {event_type(model) for model in EVENT_MODELS}
    for domain in DOMAINS.values():
        assert {event_type(model) for model in domain.FOLDS} <= catalogue
        assert set(domain.REQUESTED) <= set(domain.FOLDS)
    assert {
        "worker.registered",
        "worker.left",
        "dataset.registered",
        "barrier.arrived",
        "checkpoint.shard_saved",
        "shard.progress",
    } == REQUEST_TYPES


def test_a_domain_declares_exactly_the_event_types_its_evolve_changes_its_state_on() -> None:
    history = every_event_type()
    assert {record.event.type for record in history.records} == {
        event_type(model) for model in EVENT_MODELS
    }
    evolvers = JobState(JOB)._evolvers
    changed: dict[str, set[str]] = {name: set() for name in DOMAINS}
    for record in history.records:
        for name, (evolve, state) in evolvers.items():
            before = pickle.dumps(state)
            evolve(state, record.event)
            if pickle.dumps(state) != before:
                changed[name].add(record.event.type)
    for name, domain in DOMAINS.items():
        assert changed[name] == {event_type(model) for model in domain.FOLDS}, name


@settings(max_examples=examples(150))
@given(histories(), heartbeats(), st.randoms(use_true_random=False))
def test_the_state_does_not_depend_on_how_heartbeats_interleave_with_events(
    events: list[Event], beats: list[WorkerHeartbeat], rng: Any
) -> None:
    in_order = fold_events(events, JobState(JOB))
    for beat in beats:
        in_order.apply_heartbeat(beat)
    shuffled = JobState(JOB)
    pending = list(beats)
    for seq, event in enumerate(events, start=1):
        while pending and rng.random() < 0.5:
            shuffled.apply_heartbeat(pending.pop(0))
        shuffled.apply_event(seq, event)  # type: ignore[arg-type]
    for beat in pending:
        shuffled.apply_heartbeat(beat)
    assert render_dashboard(shuffled) == render_dashboard(in_order)


def test_a_beat_heard_before_repeated_registrations_of_one_instance_resumes_the_same_restarts() -> (
    None
):
    """A counterexample the property above found: w0 registers, fails, and registers again
    twice under one instance, and its one heartbeat (step 1) is heard before all of it or after
    all of it. Either way the beat is its newest restart's."""
    events: list[Event] = []
    for i, kind in enumerate(("registered", "failed", "registered", "failed", "registered")):
        base: dict[str, Any] = {"job": JOB, "source": "registry", "ts": T0 + (i + 1) * SECOND}
        if kind == "registered":
            events.append(
                WorkerRegistered(
                    **base,
                    worker_id="w0",
                    instance="a",
                    rank=0,
                    world_size=4,
                    membership_epoch=i + 1,
                    heartbeat_interval=1.0,
                    heartbeat_timeout=5.0,
                )
            )
        else:
            events.append(
                WorkerFailed(
                    **base,
                    worker_id="w0",
                    rank=0,
                    reason="silent",
                    last_heartbeat_ts=base["ts"],
                    membership_epoch=i + 1,
                )
            )
    beat = WorkerHeartbeat(
        job=JOB, source="w0", ts=T0, worker_id="w0", instance="a", seq=0, state="training", step=1
    )
    last = fold_events(events, JobState(JOB))
    last.apply_heartbeat(beat)
    first = JobState(JOB)
    first.apply_heartbeat(beat)
    fold_events(events, first)
    restarts = render_dashboard(last)["restarts"]
    assert render_dashboard(first)["restarts"] == restarts
    assert [restart["resumed_step"] for restart in restarts] == [None, 1]


# -- records and files ----------------------------------------------------------------------------


def test_records_round_trip_through_export_lines() -> None:
    for record in everything_once().records:
        assert record_from_json(record.to_json()) == record


def test_a_bad_line_is_refused_naming_where_it_is(tmp_path: Path) -> None:
    good = everything_once().records[0].to_json()
    path = tmp_path / "bad.jsonl"
    path.write_text(good + "\n\n" + good.replace('"rank":0', '"rank":-1') + "\n")
    with pytest.raises(ValidationError, match=r"line 3 of .*bad\.jsonl.*rank"):
        list(read_records(path))
    path.write_text("{not json\n")
    with pytest.raises(CodecError, match="line 1"):
        list(read_records(path))


def test_times_are_iso_relative_or_nanoseconds() -> None:
    assert parse_time("2026-11-21T10:00:00Z") == 1_795_255_200 * SECOND
    assert parse_time("2026-11-21T11:00:00+01:00") == 1_795_255_200 * SECOND
    assert parse_time("10m", now=1_000.0) == 400 * SECOND
    assert parse_time("1.5h", now=10_000.0) == 4_600 * SECOND
    assert parse_time("1795255200000000000") == 1_795_255_200 * SECOND
    with pytest.raises(Exception, match="is not a time"):
        parse_time("yesterday")


def test_rates_count_the_last_ten_whole_seconds() -> None:
    window = RateWindow()
    for second in range(100, 120):
        for _ in range(second - 100):  # 0, 1, 2, ... per second
            window.add(second * SECOND + 5)
    # At 120.4 the window is seconds 110..119: 10 + 11 + ... + 19 = 145 messages.
    assert window.rate(120.4) == 14.5
    assert window.rate(200.0) == 0.0


# -- golden histories -----------------------------------------------------------------------------


def golden_histories() -> Iterator[Path]:
    yield from sorted(GOLDEN.glob("*.jsonl"))


@pytest.mark.parametrize("history", list(golden_histories()), ids=lambda p: p.stem)
def test_a_recorded_history_rebuilds_to_its_recorded_state(history: Path) -> None:
    expected = json.loads(history.with_suffix(".json").read_text())
    records = list(read_records(history))
    assert render_dashboard(rebuild(records, expected["job"])) == expected


def test_there_is_a_golden_history() -> None:
    assert list(golden_histories()), "record one: python -m tests.golden.record"


def test_strata_replay_state_prints_the_golden_state_with_no_server(tmp_path: Path) -> None:
    history = next(golden_histories())
    expected = json.loads(history.with_suffix(".json").read_text())
    printed = subprocess.run(
        [sys.executable, "-m", "strata", "replay", "--file", str(history), "--state"],
        capture_output=True,
        text=True,
        check=True,
        env={"PATH": "/usr/bin:/bin", "STRATA_NATS_URL": "nats://127.0.0.1:1"},
    )
    assert json.loads(printed.stdout) == expected


def test_strata_replay_prints_a_timeline_and_stops_where_asked(
    capsys: pytest.CaptureFixture[str],
) -> None:
    history = next(golden_histories())
    assert cli(["replay", "--file", str(history), "--until-seq", "3"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 3
    assert "worker.registered" in lines[0]
    assert cli(["replay", "--file", str(history), "--type", "barrier."]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines
    assert all("barrier." in line for line in lines)


def test_strata_replay_refuses_state_from_the_middle(capsys: pytest.CaptureFixture[str]) -> None:
    history = next(golden_histories())
    assert cli(["replay", "--file", str(history), "--state", "--from-seq", "5"]) == 1
    assert "rebuilds from the first event" in capsys.readouterr().err
