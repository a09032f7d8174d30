"""A worker credential names its job and worker: what the SDK takes from it, and what NATS lets it
do (the permissions `strata up --secure` writes; `tests/integration/test_security.py` runs them)."""

from __future__ import annotations

import pytest
import strata.aio
from strata.config import Env, load_settings
from strata.errors import ConfigError
from strata.events import subjects
from strata.launch import LaunchedAs, launched_as
from strata.security import (
    WORKER_DENY,
    job_credential,
    job_of_shared_user,
    job_user,
    permissions,
    rendezvous_permissions,
    worker_identity,
    worker_permissions,
    worker_user,
)


def test_a_worker_user_names_its_worker_and_job() -> None:
    assert worker_user("resnet.a", "rank-3") == "rank-3@resnet.a"
    assert worker_identity("rank-3@resnet.a") == ("resnet.a", "rank-3")
    for user in (None, "", "worker-0", "strata-workers-j", "a@b@c", "@j", "w@", "w@bad job"):
        assert worker_identity(user) is None, user


def test_a_worker_may_publish_and_hear_only_as_itself_in_its_job() -> None:
    mine = permissions("worker", "w-1@job")
    assert mine.publish_allow == (
        subjects.heartbeat_subject("job", "w-1"),
        subjects.worker_metrics("job", "w-1"),
        subjects.caller_rpcs("job", "w-1"),
        # Its answers to its own probes (`registry.suspect`), nobody else's.
        subjects.probe_answer_subject("job", "w-1", "*"),
        # Its requests where the server's mapping moves them: its job's partition only.
        subjects.caller_partition_rpcs("job", "w-1", subjects.DEFAULT_RPC_PARTITIONS),
        # The job's torchrun rendezvous keys, written and read by subject.
        subjects.rendezvous_subjects("job"),
        subjects.rendezvous_reads("job"),
    )
    assert not any(p.startswith(subjects.EVENTS) for p in mine.publish_allow)
    assert subjects.worker_inboxes("job", "w-1") in mine.subscribe_allow
    assert "_INBOX.>" not in mine.subscribe_allow
    shared = worker_permissions("job", "*")
    assert subjects.caller_rpcs("job", "*") in shared.publish_allow
    with pytest.raises(ConfigError, match="names no job and worker"):
        permissions("worker", "worker-0")


def test_the_jobs_shared_credential_acts_for_any_worker_of_its_job_only() -> None:
    assert job_user("resnet.a") == "strata-workers-resnet.a"
    assert job_of_shared_user("strata-workers-resnet.a") == "resnet.a"
    for user in (None, "", "strata-workers-", "strata-workers-a@b", "w@j", "strata-workers-x y"):
        assert job_of_shared_user(user) is None, user
    assert permissions("worker", job_user("job")) == worker_permissions("job", "*")
    shared = job_credential("job")
    assert (shared.role, shared.job, shared.identity) == ("worker", "job", None)
    assert job_credential("job").password != shared.password
    with pytest.raises(ConfigError, match="of a worker credential must match"):
        job_credential("bad job")
    # The SDK takes the job from it, and the worker id from the caller (torchrun: rank-N).
    settings = load_settings(nats_user=job_user("llm"), nats_password="x")
    worker = strata.aio.Worker(worker_id="rank-2", settings=settings)
    assert (worker.job, worker.id) == ("llm", "rank-2")
    with pytest.raises(ConfigError, match="shared by the workers of job 'llm'"):
        strata.aio.Worker("other", settings=settings)


def test_a_worker_may_use_its_jobs_rendezvous_keys_and_no_other_jetstream_api() -> None:
    mine = rendezvous_permissions("job.a")
    # Every key of the job starts with the job's prefix; a job named like it with more parts
    # does not share it.
    assert mine.publish_allow == (
        "$KV.STRATA_RENDEZVOUS.job=a.>",
        "$JS.API.DIRECT.GET.KV_STRATA_RENDEZVOUS_job=a.$KV.STRATA_RENDEZVOUS.job=a.>",
    )
    assert mine.subscribe_allow == ("$KV.STRATA_RENDEZVOUS.job=a.>",)
    for key in (
        subjects.rendezvous_state_key("job.a"),
        subjects.rendezvous_store_key("job.a", "torch.rendezvous.job.a.0/MASTER_ADDR"),
    ):
        assert key.startswith("job=a.")
    assert not subjects.rendezvous_state_key("job.a.b").startswith("job=a.")
    # What manages streams and consumers stays denied, whatever the allow list says.
    for denied in ("$JS.API.STREAM.>", "$JS.API.CONSUMER.>", "$KV.STRATA_SNAPSHOTS.>"):
        assert denied in WORKER_DENY


def test_the_sdk_takes_its_job_and_id_from_its_credential(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    settings = load_settings(nats_user="w-7@llm", nats_password="x")
    worker = strata.aio.Worker(settings=settings)
    assert (worker.job, worker.id) == ("llm", "w-7")
    assert strata.aio.Worker("llm", worker_id="w-7", settings=settings).id == "w-7"
    with pytest.raises(ConfigError, match="is for worker 'w-7' of job 'llm'"):
        strata.aio.Worker("other", settings=settings)
    with pytest.raises(ConfigError, match="worker id 'w-8' was asked for"):
        strata.aio.Worker(worker_id="w-8", settings=settings)
    # STRATA_JOB set to another job contradicts it too; left at its default, it does not.
    with pytest.raises(ConfigError, match="job 'elsewhere' was asked for"):
        strata.aio.Worker(settings=load_settings(nats_user="w-7@llm", job="elsewhere"))


def test_under_torchrun_the_credential_names_the_implicit_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(Env.RANK, raising=False)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    monkeypatch.delenv(Env.NATS_USER, raising=False)
    assert launched_as() == LaunchedAs(3, "rank-3")
    monkeypatch.setenv(Env.NATS_USER, "w-7@llm")
    assert launched_as() == LaunchedAs(3, None)
