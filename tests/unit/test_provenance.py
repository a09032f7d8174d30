"""The provenance rule: an event counts only on its own subject and from a source that may emit it.

Every service, the gateway and `strata replay` apply this one function, so a forged event is left
out of every state alike.
"""

from __future__ import annotations

import pytest
from strata.events import (
    EVENT_MODELS,
    TELEMETRY_TYPES,
    CheckpointShardSaved,
    MetricSampled,
    RequestRejected,
    WorkerFailed,
    WorkerHeartbeat,
    subject_for,
    subjects,
)
from strata.events.provenance import (
    AREA_OWNERS,
    BAD_SUBJECT,
    SUBJECT_MISMATCH,
    WRONG_SOURCE,
    WRONG_SUBJECT,
    heartbeat_belongs,
    heartbeat_refusal,
    refusal,
)
from strata.events.rpc import RPC_SERVICES
from strata.services.readmodel import JobState

JOB = "victim"


def failed(source: str = "registry", job: str = JOB) -> WorkerFailed:
    return WorkerFailed(
        job=job,
        source=source,
        worker_id="w0",
        rank=0,
        reason="forged",
        last_heartbeat_ts=0,
        membership_epoch=1,
    )


def test_every_event_type_has_an_owner_or_is_a_workers_telemetry() -> None:
    for model in EVENT_MODELS:
        event_type = str(model.model_fields["type"].default)
        if event_type in TELEMETRY_TYPES:
            continue
        assert AREA_OWNERS.get(event_type.split(".")[0]), event_type
    assert set(AREA_OWNERS["request"]) == set(RPC_SERVICES)


def test_an_event_counts_on_its_own_subject_from_its_owner() -> None:
    event = failed()
    assert refusal(subject_for(event), event) is None


@pytest.mark.parametrize(
    "subject",
    [
        subjects.event_subject(JOB, "checkpoint.shard_saved"),  # the old ack subject
        subjects.event_subject("attacker", "worker.failed"),  # another job's subject
        subjects.heartbeat_subject(JOB, "w0"),
        "strata.evt.victim.worker.left",
    ],
)
def test_an_event_stored_on_another_subject_does_not_count(subject: str) -> None:
    refused = refusal(subject, failed())
    assert refused is not None
    assert refused.code == WRONG_SUBJECT
    assert subjects.event_subject(JOB, "worker.failed") in refused.message


@pytest.mark.parametrize("source", ["w0", "sharding", "checkpoint", "gateway", "test"])
def test_an_event_claiming_another_source_than_its_owner_does_not_count(source: str) -> None:
    event = failed(source)
    refused = refusal(subject_for(event), event)
    assert refused is not None
    assert refused.code == WRONG_SOURCE
    assert "only the registry service records it" in refused.message


def test_a_shard_saved_counts_only_as_the_checkpoint_service_recorded_it() -> None:
    fields = {
        "job": JOB,
        "step": 1,
        "epoch": 0,
        "rank": 0,
        "worker_id": "w0",
        "uri": "file:///c/x",
        "key": "x",
        "bytes": 1,
        "checksum": "xxh128:" + "0" * 32,
    }
    by_service = CheckpointShardSaved(source="checkpoint", **fields)  # type: ignore[arg-type]
    by_worker = CheckpointShardSaved(source="w0", **fields)  # type: ignore[arg-type]
    assert refusal(subject_for(by_service), by_service) is None
    refused = refusal(subject_for(by_worker), by_worker)
    assert refused is not None
    assert refused.code == WRONG_SOURCE


def test_requests_rejected_may_come_from_any_service_and_telemetry_from_its_worker() -> None:
    for service in RPC_SERVICES:
        rejected = RequestRejected(
            job=JOB, source=service, service=service, subject="s", code="x", message="m"
        )
        assert refusal(subject_for(rejected), rejected) is None
    beat = WorkerHeartbeat(job=JOB, source="w0", worker_id="w0", instance="i", seq=1, state="idle")
    assert refusal(subject_for(beat), beat) is None
    for_another = beat.model_copy(update={"source": "w1"})
    refused = refusal(subject_for(for_another), for_another)
    assert refused is not None
    assert refused.code == WRONG_SOURCE
    sample = MetricSampled(job=JOB, source="w0", name="loss", value=1.0)
    assert subject_for(sample) == subjects.metric_subject(JOB, "w0", "loss")
    assert refusal(subject_for(sample), sample) is None
    other = MetricSampled(job=JOB, source="w0", worker_id="w1", name="loss", value=1.0)
    assert refusal(subject_for(other), other) is not None


def test_the_read_model_leaves_out_and_counts_an_event_from_the_wrong_source() -> None:
    state = JobState(JOB)
    state.apply_event(1, failed("w0"))
    assert (state.rejected, state.events, state.version) == (1, 0, 0)
    assert not state.registry.jobs


@pytest.mark.parametrize(
    ("subject", "source", "code"),
    [
        (subjects.heartbeat_subject(JOB, "w.0"), "w.0", None),
        (subjects.heartbeat_subject(JOB, "w.1"), "w.0", SUBJECT_MISMATCH),
        (subjects.heartbeat_subject("other", "w.0"), "w.0", SUBJECT_MISMATCH),
        ("strata.hb.victim", "w.0", BAD_SUBJECT),
        (subjects.event_subject(JOB, "worker.heartbeat"), "w.0", BAD_SUBJECT),
        (subjects.heartbeat_subject(JOB, "w.0"), "w.1", WRONG_SOURCE),
    ],
)
def test_a_heartbeat_belongs_to_its_subject_and_its_worker(
    subject: str, source: str, code: str | None
) -> None:
    beat = WorkerHeartbeat(
        job=JOB, source=source, worker_id="w.0", instance="i", seq=1, state="training"
    )
    refused = heartbeat_refusal(subject, beat)
    assert (refused.code if refused else None) == code
    assert heartbeat_belongs(subject, beat.job, beat.worker_id, beat.source) == (code is None)
    # The general rule agrees on whether it counts (with its own, coarser codes).
    assert (refusal(subject, beat) is None) == (code is None)
