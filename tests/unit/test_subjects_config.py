"""Subjects are built in one place and reversible; settings read the documented variables."""

from __future__ import annotations

import hashlib

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strata.config import Env, load_settings
from strata.errors import ConfigError, NotFound, StrataError, error_from_code
from strata.events import ID_PATTERN, subjects

ids = st.from_regex(ID_PATTERN, fullmatch=True).filter(lambda s: "\n" not in s)


@given(job=ids, worker=ids)
def test_heartbeat_subject_round_trips_any_valid_ids(job: str, worker: str) -> None:
    subject = subjects.heartbeat_subject(job, worker)
    assert subject.count(".") == 4
    assert subjects.parse_heartbeat_subject(subject) == (job, worker)
    assert subject.split(".")[2] == hashlib.sha256(worker.encode()).hexdigest()[:2]


def _matches(pattern: str, subject: str) -> bool:
    """NATS's matching of a subject against a pattern of literal tokens and `*`."""
    want, have = pattern.split("."), subject.split(".")
    return len(want) == len(have) and all(w in ("*", h) for w, h in zip(want, have, strict=True))


@given(job=ids, worker=ids, partitions=st.integers(1, subjects.HEARTBEAT_BUCKETS))
def test_exactly_one_registry_partition_takes_each_heartbeat(
    job: str, worker: str, partitions: int
) -> None:
    subject = subjects.heartbeat_subject(job, worker)
    takers = [
        partition
        for partition in range(partitions)
        if any(_matches(p, subject) for p in subjects.partition_heartbeats(partition, partitions))
    ]
    assert takers == [subjects.partition_of(worker, partitions)]


def test_partitions_split_the_buckets_evenly_and_refuse_impossible_layouts() -> None:
    sizes = [len(subjects.partition_heartbeats(p, 3)) for p in range(3)]
    assert sizes == [86, 85, 85]
    assert subjects.partition_heartbeats(0, 1) == ["strata.hb.*.*.*"]
    with pytest.raises(ValueError, match="1 to 256"):
        subjects.partition_heartbeats(0, 257)
    with pytest.raises(ValueError, match=r"not in 0\.\.1"):
        subjects.partition_heartbeats(2, 2)
    # Simulated worker ids of one job spread over two partitions about evenly.
    shares = [subjects.partition_of(f"w-{i}", 2) for i in range(10_000)]
    assert 4_500 < sum(shares) < 5_500


@given(job=ids)
def test_event_subjects_have_five_tokens_and_parse_back(job: str) -> None:
    subject = subjects.event_subject(job, "barrier.timed_out")
    assert subject.split(".")[:2] == ["strata", "evt"]
    assert subjects.parse_event_subject(subject) == (job, "barrier.timed_out")


@given(job=ids, worker=ids)
def test_a_request_subject_names_its_caller_and_parses_back(job: str, worker: str) -> None:
    subject = subjects.rpc_subject("checkpoint", "ack", job, worker)
    assert subject.count(".") == 5
    assert subjects.parse_rpc_subject(subject) == ("checkpoint", "ack", job, worker)
    assert subject.startswith(subjects.service_rpcs("checkpoint").removesuffix(">"))


def test_an_operator_request_names_no_caller() -> None:
    assert subjects.rpc_subject("registry", "members") == "strata.rpc.registry.members"
    assert subjects.parse_rpc_subject("strata.rpc.registry.members") == (
        "registry",
        "members",
        None,
        None,
    )


@pytest.mark.parametrize(
    "subject",
    [
        "strata.rpc.registry",
        "strata.rpc.registry.register.job",
        "strata.rpc.registry.register.job.w.extra",
        "strata.rpc.registry.register.job.-bad",
        "strata.rpc.registry.Register.job.w",
        "strata.evt.registry.register.job.w",
    ],
)
def test_other_request_subjects_are_refused(subject: str) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        subjects.parse_rpc_subject(subject)


def test_a_worker_has_its_own_inbox_prefix_and_subject_patterns() -> None:
    assert subjects.worker_inbox_prefix("a.b", "w-1") == "_INBOX_strata.a~b.w-1"
    assert subjects.worker_inboxes("j", "*") == "_INBOX_strata.j.*.>"
    assert subjects.caller_rpcs("j", "w") == "strata.rpc.*.*.j.w"
    assert subjects.metric_subject("j", "w", "loss") == "strata.metric.j.w.loss"
    assert subjects.worker_metrics("j", "*") == "strata.metric.j.*.*"
    with pytest.raises(ValueError, match="both"):
        subjects.rpc_subject("registry", "register", "j", None)


def test_wildcards_and_names() -> None:
    assert subjects.job_events("a.b") == "strata.evt.a~b.>"
    assert subjects.area_events("*", "worker") == "strata.evt.*.worker.*"
    assert subjects.job_heartbeats("j") == "strata.hb.*.j.*"
    assert subjects.heartbeat_subject("j", "*") == "strata.hb.*.j.*"
    assert subjects.rpc_subject("registry", "register") == "strata.rpc.registry.register"
    assert subjects.rpc_queue_group("registry") == "strata-registry"
    assert subjects.durable_name("registry", "job.1") == "registry_job~1"


@pytest.mark.parametrize(
    "call",
    [
        lambda: subjects.event_subject("j", "Worker.Registered"),
        lambda: subjects.event_subject("j", "worker"),
        lambda: subjects.rpc_subject("registry", "do.it"),
        lambda: subjects.rpc_subject("Registry", "ping"),
        lambda: subjects.parse_event_subject("strata.hb.j.w"),
        lambda: subjects.parse_heartbeat_subject("strata.evt.j.worker.left"),
    ],
)
def test_bad_subject_parts_are_refused(call: object) -> None:
    with pytest.raises(ValueError):  # noqa: PT011 - each case has its own message
        call()  # type: ignore[operator]


def test_settings_defaults_match_the_design(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in vars(Env).values():
        if isinstance(name, str) and name.isupper():
            monkeypatch.delenv(name, raising=False)
    settings = load_settings()
    assert settings.nats_url == "nats://127.0.0.1:4222"
    assert settings.stream_replicas == 1
    assert settings.heartbeat_interval == 1.0
    assert settings.heartbeat_timeout == 5.0
    assert str(settings.data_dir) == ".strata"
    assert settings.storage_backend == "local"


def test_settings_read_prefixed_and_seed_variables(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(Env.NATS_URL, "nats://a:1,nats://b:2")
    monkeypatch.setenv(Env.STREAM_REPLICAS, "3")
    monkeypatch.setenv(Env.STORAGE_BACKEND, "s3")
    monkeypatch.setenv(Env.CHECKPOINT_BUCKET, "models")
    monkeypatch.setenv(Env.AWS_REGION, "eu-west-1")
    monkeypatch.setenv(Env.S3_ENDPOINT_URL, "http://127.0.0.1:9000")
    settings = load_settings()
    assert settings.nats_servers == ["nats://a:1", "nats://b:2"]
    assert settings.stream_replicas == 3
    assert settings.storage_backend == "s3"
    assert settings.checkpoint_bucket == "models"
    assert settings.aws_region == "eu-west-1"
    assert settings.s3_endpoint_url == "http://127.0.0.1:9000"


@pytest.mark.parametrize(
    ("variable", "value", "fragment"),
    [
        (Env.NATS_URL, "http://x:1", "STRATA_NATS_URL"),
        (Env.STREAM_REPLICAS, "0", "STRATA_STREAM_REPLICAS"),
        (Env.HEARTBEAT_INTERVAL, "abc", "STRATA_HEARTBEAT_INTERVAL"),
        (Env.STORAGE_BACKEND, "gcs", "STORAGE_BACKEND"),
    ],
)
def test_bad_settings_raise_config_error_naming_the_variable(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, fragment: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(ConfigError) as caught:
        load_settings()
    assert fragment in caught.value.message
    assert caught.value.code == "config_invalid"


def test_timeout_shorter_than_interval_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(Env.HEARTBEAT_INTERVAL, "2")
    monkeypatch.setenv(Env.HEARTBEAT_TIMEOUT, "1")
    with pytest.raises(ConfigError, match="longer than the heartbeat interval"):
        load_settings()


def test_a_registry_partition_outside_the_partitions_is_refused(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(Env.REGISTRY_PARTITIONS, "2")
    monkeypatch.setenv(Env.REGISTRY_PARTITION, "1")
    assert (load_settings().registry_partition, load_settings().registry_partitions) == (1, 2)
    monkeypatch.setenv(Env.REGISTRY_PARTITION, "2")
    with pytest.raises(ConfigError, match="numbered 0 to 1"):
        load_settings()


def test_error_codes_round_trip_to_their_classes() -> None:
    error = error_from_code("not_found", "no such job")
    assert isinstance(error, NotFound)
    assert str(error) == "[not_found] no such job"
    unknown = error_from_code("brand_new", "later code")
    assert type(unknown) is StrataError
    assert unknown.code == "brand_new"
