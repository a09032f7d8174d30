"""The torchrun rendezvous bucket on a secured nats-server: a worker credential of job B runs B's
rendezvous (state and store) and nothing else, and a credential of job A, used as an attacker
would, cannot read, write, delete, purge, watch or list B's keys, cannot create any consumer on
the bucket, cannot remove or change the bucket or another stream, and cannot reach beyond its own
keys with the headers of a message on them."""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Iterator
from datetime import timedelta
from pathlib import Path

import nats
import nats.errors
import nats.js.errors
import pytest
import torch.distributed as dist
from nats.js.errors import KeyDeletedError
from nats.js.kv import KeyValue
from strata._loop import LoopRunner
from strata.bus.server import NatsServer
from strata.bus.streams import TELEMETRY_MAX_BYTES, RendezvousQuota, ensure_streams
from strata.config import load_settings
from strata.errors import BusError, ConfigError
from strata.events import subjects
from strata.security import (
    Credential,
    authorization_config,
    by_role,
    generate_credentials,
    job_credential,
    job_user,
    worker_credentials,
)
from strata.torch import store as store_module
from strata.torch.rendezvous import JetStreamRendezvousBackend, _inbox_prefix
from strata.torch.store import KVStore, RendezvousBucket
from structlog.testing import capture_logs

from tests import natsprobe
from tests.rendezvous import rendezvous_state

pytestmark = pytest.mark.nats

ATTACKER, VICTIM = "job-a", "job-b"
STREAM = subjects.rendezvous_stream_name(VICTIM)
"""The victim job's own stream of the bucket: each job's keys are kept in a stream of its own."""
BUCKET = subjects.RENDEZVOUS_BUCKET
QUOTA = RendezvousQuota(max_bytes=256 * 1024, max_keys=200, max_value_bytes=16 * 1024)
"""Small, so that a test reaches each bound in a few writes."""


@pytest.fixture(autouse=True)
def quick_refusals(monkeypatch: pytest.MonkeyPatch) -> None:
    """NATS drops a request its user may not send, so a refused read is known only by timing
    out: the agent's probe gives up after 10 s; here, after 3."""
    monkeypatch.setattr(store_module, "PROBE_DEADLINE_S", 3.0)


@pytest.fixture
def credentials() -> list[Credential]:
    return [
        *generate_credentials(ATTACKER, ["worker-0"]),
        job_credential(ATTACKER),
        *worker_credentials(VICTIM, ["worker-0"]),
    ]


def of_job(credentials: list[Credential], job: str) -> Credential:
    return next(c for c in credentials if c.identity == (job, "worker-0"))


@pytest.fixture
def secured(tmp_path: Path, credentials: list[Credential]) -> Iterator[NatsServer]:
    with NatsServer(
        store_dir=tmp_path / "nats", extra_config=authorization_config(credentials)
    ) as server:
        yield server


@pytest.fixture
async def services(secured: NatsServer, credentials: list[Credential]) -> AsyncIterator[nats.NATS]:
    """The services' connection, which provisions the streams and the rendezvous bucket."""
    cred = by_role(credentials, "services")[0]
    nc = await nats.connect(secured.url, user=cred.user, password=cred.password)
    await ensure_streams(nc.jetstream(), 1, rendezvous_jobs=(ATTACKER, VICTIM), quota=QUOTA)
    yield nc
    await nc.close()


class Agent:
    """What one torchrun agent holds: the bucket on its own connection, its backend and store."""

    def __init__(self, server: NatsServer, credential: Credential, job: str) -> None:
        settings = load_settings(nats_user=credential.user, nats_password=credential.password)
        self.runner = LoopRunner(f"agent-{job}")
        self.bucket = self.runner.run(
            RendezvousBucket.open(
                [server.url], settings, job, inbox_prefix=_inbox_prefix(job, credential.user)
            )
        )
        self.backend = JetStreamRendezvousBackend(self.bucket, self.runner, job)
        self.store = KVStore(self.bucket, self.runner, job, timeout=timedelta(seconds=5))

    def close(self) -> None:
        self.backend.close()


@pytest.fixture
def victim(
    secured: NatsServer, credentials: list[Credential], services: nats.NATS
) -> Iterator[Agent]:
    agent = Agent(secured, of_job(credentials, VICTIM), VICTIM)
    yield agent
    agent.close()


async def victim_keys(services: nats.NATS) -> dict[str, bytes]:
    """Every key of the victim's job in the bucket and its value, as the services read them."""
    # The stream's own list of subjects, not `kv.keys()`: that one watches the bucket through a
    # consumer and may answer NoKeysError when its first look finds nothing pending yet.
    js = services.jetstream()
    prefix = subjects.kv_subject(BUCKET, "")
    kv = KeyValue(name=BUCKET, stream=STREAM, pre=prefix, js=js, direct=True)
    info = await js.stream_info(STREAM, subjects_filter=f"{prefix}{VICTIM}.>")
    found: dict[str, bytes] = {}
    for subject in sorted((info.state.subjects or {}).keys()):
        key = subject.removeprefix(prefix)
        with contextlib.suppress(KeyDeletedError):
            found[key] = (await kv.get(key)).value or b""
    return found


def test_a_worker_credential_runs_its_jobs_rendezvous(victim: Agent) -> None:
    first = victim.backend.set_state(rendezvous_state(0))
    assert first is not None
    assert first[2] is True
    assert victim.backend.set_state(rendezvous_state(1), first[1])[2] is True  # type: ignore[index]
    assert victim.backend.get_state()[0] == rendezvous_state(1)  # type: ignore[index]
    store = victim.store
    store.set("master", b"10.0.0.1")
    assert store.get("master") == b"10.0.0.1"
    assert store.add("counter", 2) == 2
    assert store.compare_set("flag", b"", b"on") == b"on"
    store.wait(["master", "flag"])
    assert store.check(["counter"])
    assert store.delete_key("flag")
    assert not store.check(["flag"])
    # Counting keys would list the bucket, which the credential may not: a clear error (torchrun
    # never counts them).
    with pytest.raises(dist.DistStoreError, match="worker credential may not"):
        store.num_keys()


async def test_another_jobs_credential_cannot_read_write_watch_or_list_its_keys(
    secured: NatsServer, credentials: list[Credential], services: nats.NATS, victim: Agent
) -> None:
    victim.backend.set_state(rendezvous_state(7))
    victim.store.set("master", b"10.0.0.1")
    before = await victim_keys(services)
    assert len(before) == 2
    consumers = (await services.jetstream().stream_info(STREAM)).state.consumer_count
    state_subject = subjects.kv_subject(BUCKET, subjects.rendezvous_state_key(VICTIM))
    store_subject = subjects.kv_subject(BUCKET, subjects.rendezvous_store_key(VICTIM, "master"))

    attacker_cred = of_job(credentials, ATTACKER)
    attacker = await natsprobe.connect(
        secured.url,
        attacker_cred.user,
        attacker_cred.password,
        inbox_prefix=subjects.worker_inbox_prefix(ATTACKER, "worker-0"),
    )
    forbidden = [
        # Write, delete or purge the victim's keys (a delete or purge is a message on the key).
        state_subject,
        store_subject,
        subjects.kv_subject(BUCKET, ">"),
        # Read them: by subject, or naming them in the body, or by sequence.
        subjects.rendezvous_read(VICTIM, subjects.rendezvous_state_key(VICTIM)),
        subjects.rendezvous_reads(VICTIM),
        subjects.rendezvous_read(VICTIM, ">"),
        # ... or through its own job's stream, which holds none of them.
        subjects.rendezvous_read(ATTACKER, subjects.rendezvous_state_key(VICTIM)),
        f"$JS.API.DIRECT.GET.{STREAM}",
        f"$JS.API.STREAM.MSG.GET.{STREAM}",
        # List or watch them: stream info lists subjects, a consumer delivers them, even one
        # whose filter is the attacker's own keys (its body could say where to deliver).
        f"$JS.API.STREAM.INFO.{STREAM}",
        "$JS.API.STREAM.NAMES",
        "$JS.API.STREAM.LIST",
        f"$JS.API.CONSUMER.CREATE.{STREAM}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.watch.{subjects.kv_subject(BUCKET, '>')}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.watch.{subjects.rendezvous_subjects(VICTIM)}",
        f"$JS.API.CONSUMER.CREATE.{STREAM}.watch.{subjects.rendezvous_subjects(ATTACKER)}",
        f"$JS.API.CONSUMER.DURABLE.CREATE.{STREAM}.watch",
        f"$JS.API.CONSUMER.LIST.{STREAM}",
        # Remove or change the bucket, its messages, or another stream.
        f"$JS.API.STREAM.DELETE.{STREAM}",
        f"$JS.API.STREAM.PURGE.{STREAM}",
        f"$JS.API.STREAM.UPDATE.{STREAM}",
        f"$JS.API.STREAM.MSG.DELETE.{STREAM}",
        f"$JS.API.STREAM.CREATE.{STREAM}",
        f"$JS.API.STREAM.DELETE.{subjects.EVENTS_STREAM}",
        f"$JS.API.STREAM.PURGE.{subjects.EVENTS_STREAM}",
        f"$JS.API.DIRECT.GET.{subjects.EVENTS_STREAM}",
        f"$KV.{subjects.SNAPSHOT_BUCKET}.registry",
        "$JS.API.INFO",
    ]
    body = json.dumps({"last_by_subj": state_subject, "seq": 1}).encode()
    try:
        for subject in forbidden:
            await attacker.nc.publish(subject, body, reply=attacker.nc.new_inbox())
        await attacker.nc.publish(
            state_subject, b"", headers={"KV-Operation": "PURGE", "Nats-Rollup": "sub"}
        )
        refused_subscriptions = await natsprobe.refused_subscriptions(
            attacker,
            [state_subject, subjects.rendezvous_subjects(VICTIM), subjects.kv_subject(BUCKET, ">")],
        )
        await natsprobe.settled(attacker)
    finally:
        await attacker.close()
    assert {s.lower() for s in forbidden} <= attacker.refused["publish"], attacker.errors
    assert len(refused_subscriptions) == 3
    # Nothing changed (no consumer was made), and the victim's agent goes on.
    info = await services.jetstream().stream_info(STREAM)
    assert info.state.consumer_count == consumers
    assert await victim_keys(services) == before
    assert victim.backend.get_state()[0] == rendezvous_state(7)  # type: ignore[index]


async def test_headers_on_its_own_keys_reach_no_other_key(
    secured: NatsServer, credentials: list[Credential], services: nats.NATS, victim: Agent
) -> None:
    victim.store.set("master", b"10.0.0.1")
    before = await victim_keys(services)
    cred = of_job(credentials, ATTACKER)
    nc = await nats.connect(
        secured.url,
        user=cred.user,
        password=cred.password,
        inbox_prefix=subjects.worker_inbox_prefix(ATTACKER, "worker-0"),
    )
    try:
        js = nc.jetstream()
        own = subjects.kv_subject(BUCKET, subjects.rendezvous_state_key(ATTACKER))
        # A rollup of the whole stream (or of the subject) is refused by the bucket itself.
        for rollup in ("all", "sub"):
            with pytest.raises(nats.js.errors.APIError, match=r"(?i)rollup"):
                await js.publish(own, b"x", headers={"Nats-Rollup": rollup})
        # A direct get of its own keys that asks for more in its body is refused as well.
        answer = await nc.request(
            subjects.rendezvous_reads(ATTACKER),
            json.dumps({"multi_last": [subjects.kv_subject(BUCKET, ">")]}).encode(),
            timeout=5,
        )
        assert answer.headers is not None
        assert answer.headers.get("Status") == "408"
        assert VICTIM.encode() not in answer.data
        # Its own keys it may use.
        await js.publish(own, b"mine")
        reply = await nc.request(
            subjects.rendezvous_read(ATTACKER, subjects.rendezvous_state_key(ATTACKER))
        )
        assert reply.data == b"mine"
    finally:
        await nc.close()
    assert await victim_keys(services) == before


@pytest.mark.slow
async def test_a_worker_credential_cannot_make_a_missing_bucket(
    secured: NatsServer, credentials: list[Credential]
) -> None:
    cred = of_job(credentials, ATTACKER)
    settings = load_settings(nats_user=cred.user, nats_password=cred.password)
    with pytest.raises(ConfigError, match=r"does not exist.*start Strata's services"):
        await RendezvousBucket.open(
            [secured.url], settings, ATTACKER, inbox_prefix=_inbox_prefix(ATTACKER, cred.user)
        )


def test_an_agent_uses_its_credentials_own_inbox_and_job() -> None:
    assert _inbox_prefix("job-a", "worker-3@job-a") == subjects.worker_inbox_prefix(
        "job-a", "worker-3"
    )
    # The chart's shared user of the job (or no credential): an inbox of the job's.
    assert _inbox_prefix("job-a", "strata-workers-job-a").startswith(
        subjects.worker_inbox_prefix("job-a", "")
    )
    with pytest.raises(ConfigError, match="is for job 'job-b', but --rdzv-id is 'job-a'"):
        _inbox_prefix("job-a", "worker-0@job-b")
    with pytest.raises(ConfigError, match="shared by the workers of job 'job-b', but --rdzv-id"):
        _inbox_prefix("job-a", "strata-workers-job-b")


async def test_the_jobs_shared_credential_runs_its_rendezvous_and_no_other(
    secured: NatsServer, credentials: list[Credential], services: nats.NATS, victim: Agent
) -> None:
    """`strata up --secure`'s credential for all of a job's workers (torchrun's ranks take it):
    its own job's rendezvous works; the victim's keys stay out of reach."""
    shared = next(c for c in credentials if c.user == job_user(ATTACKER))
    own = Agent(secured, shared, ATTACKER)
    try:
        assert own.backend.set_state(rendezvous_state(9)) is not None
        own.store.set("master", b"10.0.0.2")
        assert own.store.get("master") == b"10.0.0.2"
    finally:
        own.close()
    victim.backend.set_state(rendezvous_state(7))
    before = await victim_keys(services)
    assert rendezvous_state(7) in before.values()
    settings = load_settings(nats_user=shared.user, nats_password=shared.password)
    with pytest.raises(BusError, match=f"may not read the rendezvous keys of job '{VICTIM}'"):
        await RendezvousBucket.open(
            [secured.url], settings, VICTIM, inbox_prefix=_inbox_prefix(ATTACKER, shared.user)
        )
    thief = await nats.connect(secured.url, user=shared.user, password=shared.password)
    try:
        await thief.publish(subjects.kv_subject(BUCKET, f"{VICTIM}.state"), b"forged")
        await thief.flush()
    finally:
        await thief.close()
    assert await victim_keys(services) == before


async def test_a_credential_refused_the_jobs_keys_is_told_so(
    secured: NatsServer, credentials: list[Credential], services: nats.NATS
) -> None:
    # The attacker's own inbox, asking for the victim's job: NATS drops every read unanswered.
    cred = of_job(credentials, ATTACKER)
    settings = load_settings(nats_user=cred.user, nats_password=cred.password)
    with pytest.raises(BusError, match=f"may not read the rendezvous keys of job '{VICTIM}'"):
        await RendezvousBucket.open(
            [secured.url], settings, VICTIM, inbox_prefix=_inbox_prefix(ATTACKER, cred.user)
        )


# -- quotas ---------------------------------------------------------------------------------------


async def test_a_job_past_its_rendezvous_quota_is_refused_and_no_other_job_notices(
    tmp_path: Path, credentials: list[Credential]
) -> None:
    """Job A's credential writes its own keys past each bound of its quota: each write past it is
    refused with `quota_exceeded` (naming the quota and its setting), while job B's agent keeps
    writing its keys and the services keep recording events, on a store sized as `strata up`
    sizes it (the telemetry's and each bucket's bytes reserved)."""
    from strata.bus import Bus
    from strata.config import Env
    from strata.errors import QuotaExceeded
    from strata.events import WorkerLeft

    store_bytes = 2 * 1024**3
    with NatsServer(
        store_dir=tmp_path / "nats",
        extra_config=authorization_config(credentials),
        max_file_store=store_bytes,
    ) as server:
        cred = by_role(credentials, "services")[0]
        services = Bus(await nats.connect(server.url, user=cred.user, password=cred.password))
        try:
            outcomes = await ensure_streams(
                services.js, 1, rendezvous_jobs=(ATTACKER, VICTIM), quota=QUOTA
            )
            assert outcomes[subjects.rendezvous_stream_name(ATTACKER)] == "created"
            attacker = Agent(server, of_job(credentials, ATTACKER), ATTACKER)
            victim = Agent(server, of_job(credentials, VICTIM), VICTIM)
            try:
                # One value past the value-size bound.
                with pytest.raises(QuotaExceeded) as too_big:
                    attacker.store.set("big", b"x" * (QUOTA.max_value_bytes + 1))
                assert too_big.value.code == "quota_exceeded"
                assert Env.RENDEZVOUS_MAX_VALUE_BYTES in too_big.value.message
                # Keys of 8 KiB until the bytes bound refuses one.
                written = 0

                def fill() -> None:
                    nonlocal written
                    while written <= QUOTA.max_bytes // 8192:
                        attacker.store.set(f"fill-{written}", b"x" * 8192)
                        written += 1

                with pytest.raises(QuotaExceeded) as full:
                    fill()
                assert Env.RENDEZVOUS_MAX_BYTES in full.value.message
                assert f"job {ATTACKER!r}" in full.value.message
                assert 0 < written < QUOTA.max_bytes // 8192
                # A key it holds may still be rewritten in place: its old value makes room.
                attacker.store.set("fill-0", b"y" * 8192)
                assert attacker.store.get("fill-0") == b"y" * 8192
                # Job B writes as before, and so do the services.
                victim.backend.set_state(rendezvous_state(3))
                for i in range(20):
                    victim.store.set(f"key-{i}", b"v" * 8192)
                assert victim.store.get("key-19") == b"v" * 8192
                event = WorkerLeft(
                    job=VICTIM, source="registry", worker_id="w-1", rank=0, membership_epoch=1
                )
                assert (await services.publish(event)).seq > 0
            finally:
                attacker.close()
                victim.close()
            # The key count bound, on a job with only small keys.
            counted = Agent(server, of_job(credentials, VICTIM), VICTIM)
            try:

                def count() -> None:
                    for i in range(QUOTA.max_keys + 1):
                        counted.store.set(f"n-{i}", b"1")

                with pytest.raises(QuotaExceeded) as many:
                    count()
                assert Env.RENDEZVOUS_MAX_KEYS in many.value.message
            finally:
                counted.close()
            # What the store keeps for the event stream: all that the telemetry and the
            # buckets did not reserve, which no worker's write can take.
            reserved = 0
            async for name in _stream_names(services):
                reserved += max((await services.js.stream_info(name)).config.max_bytes or 0, 0)
            assert reserved == TELEMETRY_MAX_BYTES + 2 * QUOTA.max_bytes < store_bytes
        finally:
            await services.close()


async def test_the_services_replace_the_one_bucket_of_earlier_releases(
    secured: NatsServer, credentials: list[Credential]
) -> None:
    """A data directory of an earlier release holds one rendezvous stream for every job, on
    subjects each job's own stream needs: the services remove it and make the jobs' own."""
    cred = by_role(credentials, "services")[0]
    nc = await nats.connect(secured.url, user=cred.user, password=cred.password)
    try:
        js = nc.jetstream()
        await js.add_stream(
            name=subjects.SHARED_RENDEZVOUS_STREAM,
            subjects=[subjects.kv_subject(BUCKET, ">")],
            max_msgs_per_subject=1,
        )
        outcomes = await ensure_streams(js, 1, rendezvous_jobs=(VICTIM,), quota=QUOTA)
        assert outcomes[subjects.SHARED_RENDEZVOUS_STREAM] == "removed"
        info = await js.stream_info(STREAM)
        assert (info.config.max_bytes, info.config.max_msgs, info.config.max_msg_size) == (
            QUOTA.max_bytes,
            QUOTA.max_keys,
            QUOTA.max_value_bytes,
        )
    finally:
        await nc.close()


async def _stream_names(bus: object) -> AsyncIterator[str]:
    from strata.bus import Bus

    assert isinstance(bus, Bus)
    for name in await bus.js.streams_info():
        yield name.config.name


async def test_a_bucket_the_store_cannot_reserve_is_refused_and_the_others_are_made(
    tmp_path: Path,
) -> None:
    """The store keeps what it reserved: a job's bucket that would not fit is not made (an
    error in the log says which setting to change), and provisioning goes on."""
    quota = RendezvousQuota(max_bytes=384 * 1024**2)
    with NatsServer(
        store_dir=tmp_path / "nats", max_file_store=TELEMETRY_MAX_BYTES + 512 * 1024**2
    ) as server:
        nc = await nats.connect(server.url)
        try:
            with capture_logs() as logs:
                outcomes = await ensure_streams(
                    nc.jetstream(), 1, rendezvous_jobs=("first", "second"), quota=quota
                )
            assert outcomes[subjects.rendezvous_stream_name("first")] == "created"
            assert outcomes[subjects.rendezvous_stream_name("second")] == "refused"
            assert outcomes[subjects.EVENTS_STREAM] == "created"
            (refused,) = [e for e in logs if e["event"] == "rendezvous_bucket_refused"]
            assert refused["job"] == "second"
            assert "STRATA_RENDEZVOUS_MAX_BYTES" in refused["fix"]
        finally:
            await nc.close()
