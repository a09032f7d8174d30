"""10,000+ malformed or random messages to every RPC and event subject of running services, and
well-formed forgeries from a worker of another job.

Payloads come from hypothesis: random bytes, random msgpack values, valid requests and events with
one field changed (to another valid value, a random one or one of a near type, dropped, or joined by
an unknown field), and now and then a bulky one (a list or map of up to a million bad items).
Every request must be answered at once with `ok` or an error code, no service (the gateway, which
reads the streams, included) may stop or stall, and every rejection must show in the consumers'
`strata_messages_rejected_total`, exactly. A forgery (a valid event of the wrong type, job, source
or worker, on every subject a worker credential may publish and on the event stream an unsecured
NATS leaves open, and a request about another job or worker) must be refused with its code,
counted, and change nothing any service says about the job it was aimed at.
"""

from __future__ import annotations

import asyncio
import time
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args, get_origin

import msgpack
import nats
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from pydantic import BaseModel
from strata.bus import Caller, RpcClient
from strata.bus.server import NatsServer
from strata.bus.streams import MAX_MSG_SIZE, TELEMETRY_MAX_MSG_SIZE
from strata.config import Env
from strata.errors import Forbidden, StrataError
from strata.events import (
    EVENT_TYPES,
    TELEMETRY_TYPES,
    CheckpointShardSaved,
    WorkerHeartbeat,
    decode_event,
    encode_event,
    subject_for,
    subjects,
    unpack,
)
from strata.events.provenance import AREA_OWNERS
from strata.events.requests import (
    AckShardRequest,
    ArriveRequest,
    BarrierOutcome,
    BeginCheckpointRequest,
    CheckpointAnswer,
    CheckpointInfo,
    CheckpointQuery,
    DatasetInfo,
    GetShardsRequest,
    Lease,
    MembersRequest,
    PlanRequest,
    RegisterDatasetRequest,
    RegisterRequest,
    Registration,
    ReportProgressRequest,
    ShardAssignment,
)
from strata.events.rpc import RPC_ENDPOINTS, RPC_SERVICES, ErrorReply, PingRequest, PingResult
from strata.services.gateway import metrics_history
from strata.storage import open_storage, shard_key

from tests.strategies import from_json_schema, simplest
from tests.support import POLL, ServiceProcess, new_job

pytestmark = [pytest.mark.nats, pytest.mark.slow]

SERVICES = RPC_SERVICES
"""The services that answer requests; each also follows the event stream."""
GATEWAY = "gateway"
"""A reader: it follows the event stream and the heartbeats, and answers no requests."""
JOB = "fuzz-job"
WORKER = "fuzz-worker"
ROUNDS = 3
"""Messages to each subject per hypothesis example (all sent at once), and one bulky message."""
BULK = 1_000_000
"""Most items in the list of a bulky message (a byte each: a megabyte); maps get a tenth."""
MESSAGES = 10_000
REPLY_TIMEOUT = 10.0
"""A request not answered in this long (under a flood, on a busy machine) counts as a stall."""
PROMPT = 5.0
"""Time a service has to answer a ping or a real request once the flood is over."""
SETTLE = 60.0
"""Time the consumers have to count every message the flood left in the streams."""
HEARTBEAT_TIMEOUT = 120.0
"""Long enough that a worker the fuzz registered stays a member (until a fuzzed leave)."""
REJECTED = "strata_messages_rejected_total"
HEARTBEAT_CONSUMER = "registry.heartbeats"
METRICS_CONSUMER = metrics_history.CONSUMER


# -- what is sent where ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Target:
    """A subject, and the model and valid message that mutants are made from."""

    subject: str
    model: type[BaseModel]
    template: dict[str, Any]
    service: str | None = None
    """The service that answers (a request); None for a subject that is published to."""
    consumers: tuple[str, ...] = ()
    """Consumers (the metric's label) reading the stream that must count each message published
    here as rejected, if the stream stores it (see `stored_up_to`)."""
    core_consumers: tuple[str, ...] = ()
    """Core NATS subscribers that must count each message published here, stored or not."""
    stored_up_to: int = MAX_MSG_SIZE
    """The stream's largest message: a larger one is refused by JetStream, so only the core
    subscribers see it."""


def _template(model: type[BaseModel], checkpoints: Path) -> dict[str, Any]:
    """The simplest valid message, about the job and worker that every template names."""
    message = simplest(model).model_dump(mode="python")
    pinned = {"job": JOB, "worker_id": WORKER, "root_uri": checkpoints.as_uri()}
    message.update({name: value for name, value in pinned.items() if name in model.model_fields})
    return model.model_validate(message).model_dump(mode="python")


def _targets(checkpoints: Path) -> list[Target]:
    """Every request subject of the services (and a verb none has), every event subject."""
    targets = []
    for endpoint in RPC_ENDPOINTS:
        if endpoint.service in SERVICES:
            subject = subjects.rpc_subject(endpoint.service, endpoint.verb)
            template = _template(endpoint.request, checkpoints)
            targets.append(Target(subject, endpoint.request, template, service=endpoint.service))
    for service in SERVICES:
        subject = subjects.rpc_subject(service, "no_such_verb")
        targets.append(Target(subject, PingRequest, {}, service=service))
    for model in EVENT_TYPES.values():
        template = _template(model, checkpoints)
        subject = subject_for(model.model_validate(template))
        if subject.startswith(subjects.EVENTS + "."):
            targets.append(Target(subject, model, template, consumers=(*SERVICES, GATEWAY)))
        elif subject.startswith(subjects.HEARTBEATS + "."):
            targets.append(
                Target(
                    subject,
                    model,
                    template,
                    consumers=(GATEWAY,),
                    core_consumers=(HEARTBEAT_CONSUMER,),
                    stored_up_to=TELEMETRY_MAX_MSG_SIZE,
                )
            )
        else:  # samples: the gateway's training-metric history
            targets.append(
                Target(
                    subject,
                    model,
                    template,
                    consumers=(METRICS_CONSUMER,),
                    stored_up_to=TELEMETRY_MAX_MSG_SIZE,
                )
            )
    return targets


# -- payloads -------------------------------------------------------------------------------------

scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=12)
    | st.binary(max_size=8)
)
values = (
    scalars
    | st.lists(scalars, max_size=3)
    | st.dictionaries(st.text(max_size=6), scalars, max_size=3)
)
"""At most three keys in a map: no event has fewer than five, so a random map is never one."""


def _near_type(value: Any, how: int) -> Any:
    """A value of another type that a lenient decoder could take for `value`."""
    options: list[Any] = [
        str(value),
        [value],
        {"value": value},
        None,
        float(value) if isinstance(value, int) and not isinstance(value, bool) else 1.5,
        value.encode() if isinstance(value, str) else True,
    ]
    return options[how % len(options)]


def _changed(template: dict[str, Any], name: str, value: Any) -> dict[str, Any]:
    return {**template, name: value}


def _dropped(template: dict[str, Any], name: str) -> dict[str, Any]:
    return {k: v for k, v in template.items() if k != name}


def mutants(model: type[BaseModel], template: dict[str, Any]) -> st.SearchStrategy[dict[str, Any]]:
    """`template` (valid) with one field changed: to another valid value of that field (half of
    the time, so that requests get past validation too), to a random value, to a value of a near
    type, dropped, or an unknown field added."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    own = {name: from_json_schema(sub, defs) for name, sub in schema["properties"].items()}
    changes = [st.tuples(st.text(max_size=8), values).map(lambda nv: _changed(template, *nv))]
    if template:
        names = sorted(template)
        changes += [
            st.tuples(st.sampled_from(names), values).map(lambda nv: _changed(template, *nv)),
            st.tuples(st.sampled_from(names), st.integers(0, 5)).map(
                lambda nh: _changed(template, nh[0], _near_type(template[nh[0]], nh[1]))
            ),
            st.sampled_from(names).map(lambda name: _dropped(template, name)),
        ]
    if not own:
        return st.one_of(changes)
    valid = st.sampled_from(sorted(own)).flatmap(
        lambda name: own[name].map(lambda value: _changed(template, name, value))
    )
    return st.one_of([valid] * len(changes) + changes)


def _pack(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)  # type: ignore[no-any-return]


def _refused_as_event(message: dict[str, Any]) -> bytes:
    """`message` packed, with an unknown field added if it would otherwise be a valid event."""
    data = _pack(message)
    try:
        decode_event(data)
    except StrataError:
        return data
    return _pack({**message, "unknown": 0})


def payloads(target: Target) -> st.SearchStrategy[tuple[str, bytes]]:
    """(kind, bytes) for `target`; on a published subject never a valid event (nothing forged)."""
    seal = _pack if target.service is not None else _refused_as_event
    return st.one_of(
        st.tuples(st.just("bytes"), st.binary(max_size=96)),
        st.tuples(st.just("value"), values.map(_pack)),
        st.tuples(st.just("mutant"), mutants(target.model, target.template).map(seal)),
    )


def _bulked(template: dict[str, Any], name: str, length: int, item: Any, as_map: bool) -> Any:
    bulk = {str(i): item for i in range(length // 10)} if as_map else [item] * length
    return _changed(template, name, bulk)


def _containers(model: type[BaseModel]) -> list[str]:
    """Fields of `model` that hold a list or a map."""
    found = []
    for name, info in model.model_fields.items():
        kinds = {get_origin(t) or t for t in (info.annotation, *get_args(info.annotation))}
        if kinds & {list, dict}:
            found.append(name)
    return found


def bulky(target: Target) -> st.SearchStrategy[bytes]:
    """`target`'s template with a list or map field (or any, or a new one) made long, of one
    repeated value: cheap to send, and as dear to refuse as the receiver makes it."""
    seal = _pack if target.service is not None else _refused_as_event
    return st.builds(
        _bulked,
        st.just(target.template),
        st.sampled_from(_containers(target.model) or sorted(target.template) or ["bulk"]),
        st.integers(min_value=1_000, max_value=BULK),
        st.none() | st.booleans() | st.integers(min_value=-32, max_value=127) | st.just(""),
        st.booleans(),
    ).map(seal)


# -- bookkeeping ----------------------------------------------------------------------------------


@dataclass
class Tally:
    sent: int = 0
    requests: int = 0
    kinds: Counter[str] = field(default_factory=Counter)
    subjects: Counter[str] = field(default_factory=Counter)
    replies: Counter[str] = field(default_factory=Counter)
    """Replies by outcome: ok or the error code."""
    errors: Counter[str] = field(default_factory=Counter)
    """Rejections each consumer must have counted: error replies under `rpc.<service>`, refused
    events under each service's name, refused heartbeats under the registry's heartbeat intake,
    both under the gateway's."""
    slowest: float = 0.0


def _outcome(subject: str, data: bytes, sent: bytes) -> str:
    """'ok' or the error code of a reply, which must be a Strata reply envelope."""
    body = unpack(data)
    assert isinstance(body, dict), (subject, sent, body)
    if body.get("ok") is True:
        assert set(body) == {"ok", "result"}, (subject, sent, body)
        return "ok"
    code = ErrorReply.model_validate(body).error.code
    assert code != "internal", f"{subject} failed on {sent!r}: {body}"
    return code


async def _send(nc: NATS, batch: list[tuple[Target, str, bytes]], tally: Tally) -> None:
    """Publish the batch's events and send its requests all at once; check every reply."""

    async def request(target: Target, data: bytes) -> None:
        assert target.service is not None
        started = time.monotonic()
        try:
            reply = await nc.request(target.subject, data, timeout=REPLY_TIMEOUT)
        except nats.errors.TimeoutError:
            pytest.fail(f"{target.subject} gave no reply within {REPLY_TIMEOUT}s to {data!r}")
        tally.slowest = max(tally.slowest, time.monotonic() - started)
        outcome = _outcome(target.subject, reply.data, data)
        tally.replies[outcome] += 1
        if outcome != "ok":
            tally.errors[f"rpc.{target.service}"] += 1

    requests = []
    for target, kind, data in batch:
        tally.sent += 1
        tally.kinds[kind] += 1
        tally.subjects[target.subject] += 1
        if target.service is None:
            await nc.publish(target.subject, data)
            tally.errors.update(target.core_consumers)
            if len(data) <= target.stored_up_to:
                tally.errors.update(target.consumers)
        else:
            tally.requests += 1
            requests.append(request(target, data))
    await asyncio.gather(*requests)
    await nc.flush()


# -- the stack ------------------------------------------------------------------------------------


@dataclass
class Stack:
    url: str
    processes: dict[str, ServiceProcess]
    checkpoints: Path

    def alive(self) -> None:
        for name, process in self.processes.items():
            assert process.proc is not None
            if process.proc.poll() is not None:
                pytest.fail(f"{name} exited with {process.proc.returncode}:\n{process.log_tail()}")

    def ready(self, name: str) -> float:
        """Seconds `name`'s readiness probe takes to say yes (within `PROMPT`)."""
        asked = time.monotonic()
        url = f"http://127.0.0.1:{self.processes[name].health_port}/readyz"
        with urllib.request.urlopen(url, timeout=PROMPT) as answer:
            assert answer.status == 200
        return time.monotonic() - asked

    def rejected(self) -> Counter[tuple[str, str]]:
        """`strata_messages_rejected_total` of every service, by (consumer, code)."""
        counts: Counter[tuple[str, str]] = Counter()
        for process in self.processes.values():
            url = f"http://127.0.0.1:{process.health_port}/metrics"
            with urllib.request.urlopen(url, timeout=5) as answer:
                text = answer.read().decode()
            for line in text.splitlines():
                if line.startswith(REJECTED + "{"):
                    labels, value = line[len(REJECTED) + 1 :].rsplit("} ", 1)
                    pairs = dict(part.split("=", 1) for part in labels.split(","))
                    key = (pairs["consumer"].strip('"'), pairs["code"].strip('"'))
                    counts[key] += int(float(value))
        return counts


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    base = tmp_path_factory.mktemp("fuzz")
    with NatsServer(store_dir=base / "nats") as server:
        processes: dict[str, ServiceProcess] = {}
        try:
            for name in SERVICES:
                processes[name] = ServiceProcess(
                    name, server.url, base, heartbeat_timeout=HEARTBEAT_TIMEOUT
                ).start()
            gateway = ServiceProcess(GATEWAY, server.url, base, env={Env.HTTP_PORT: "0"})
            processes[GATEWAY] = gateway.start()
            yield Stack(server.url, processes, base / "checkpoints")
        finally:
            for process in processes.values():
                process.stop()


def _by_consumer(counts: Counter[tuple[str, str]]) -> Counter[str]:
    totals: Counter[str] = Counter()
    for (consumer, _), n in counts.items():
        totals[consumer] += n
    return totals


async def _pings(nc: NATS) -> dict[str, float]:
    """Seconds each service takes to answer a ping (within `PROMPT`)."""
    client = RpcClient(nc, timeout=PROMPT)
    took = {}
    for name in SERVICES:
        asked = time.monotonic()
        pong = await client.call(name, "ping", result=PingResult)
        took[name] = time.monotonic() - asked
        assert pong.service == name
    return took


async def _real_work(url: str) -> None:
    """A worker joins a fresh job, registers a dataset, passes a barrier, asks for checkpoints."""
    job = new_job("after-fuzz")
    nc = await nats.connect(url)
    client = RpcClient(nc, timeout=PROMPT)
    try:
        joined = await client.call(
            "registry", "register", RegisterRequest(job=job, instance="i"), result=Registration
        )
        assert (joined.rank, joined.world_size) == (0, 1)
        dataset = await client.call(
            "sharding",
            "register_dataset",
            RegisterDatasetRequest(job=job, dataset_id="d", total_samples=100, shard_size=10),
            result=DatasetInfo,
        )
        assert dataset.num_shards == 10
        arrived = await client.call(
            "barrier",
            "arrive",
            ArriveRequest(job=job, name="b", worker_id=joined.worker_id, arrival=0),
            result=BarrierOutcome,
        )
        assert arrived.status == "released"
        answer = await client.call(
            "checkpoint", "status", CheckpointQuery(job=job), result=CheckpointAnswer
        )
        assert not answer.found
    finally:
        await nc.close()


# -- the test -------------------------------------------------------------------------------------


def test_random_and_malformed_messages_are_refused_counted_and_never_stall_a_service(
    stack: Stack,
) -> None:
    targets = _targets(stack.checkpoints)
    strategies = [payloads(target) for target in targets]
    bulky_strategies = [bulky(target) for target in targets]
    before = stack.rejected()
    tally = Tally()
    loop = asyncio.new_event_loop()
    nc = loop.run_until_complete(nats.connect(stack.url))
    started = time.monotonic()
    try:

        @given(st.data())
        @settings(
            max_examples=-(-MESSAGES // (ROUNDS * len(targets))) + 1,
            derandomize=True,
            database=None,
            deadline=None,
            # A failing batch is reported as it is: shrinking it would resend it to a stack that
            # may be stalled, for minutes.
            phases=[Phase.generate],
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
        )
        def fuzz(data: st.DataObject) -> None:
            # Each subject in turn, so that every one gets its share whatever hypothesis draws.
            batch = []
            for _ in range(ROUNDS):
                for target, strategy in zip(targets, strategies, strict=True):
                    kind, payload = data.draw(strategy)
                    batch.append((target, kind, payload))
            chosen = data.draw(st.integers(min_value=0, max_value=len(targets) - 1))
            batch.append((targets[chosen], "bulky", data.draw(bulky_strategies[chosen])))
            loop.run_until_complete(_send(nc, batch, tally))

        fuzz()
        fuzzed = time.monotonic() - started
        stack.alive()
        # Right after the flood, while its events may still be worked through.
        ping_s = loop.run_until_complete(_pings(nc))
        ping_s[GATEWAY] = stack.ready(GATEWAY)
    finally:
        loop.run_until_complete(nc.close())
        loop.close()

    assert tally.sent >= MESSAGES, tally
    assert set(tally.subjects) == {target.subject for target in targets}
    assert min(tally.kinds[kind] for kind in ("bytes", "value", "mutant")) > MESSAGES // 10
    assert tally.kinds["bulky"] > 0

    deadline = time.monotonic() + SETTLE
    while True:
        counts = stack.rejected() - before
        counted = _by_consumer(counts)
        if all(counted[consumer] >= n for consumer, n in tally.errors.items()):
            break
        if time.monotonic() >= deadline:
            pytest.fail(f"after {SETTLE}s, rejections counted {counted}, sent {tally.errors}")
        time.sleep(POLL)
    settled = time.monotonic() - started
    expected_consumers = {f"rpc.{s}" for s in SERVICES} | {
        *SERVICES,
        HEARTBEAT_CONSUMER,
        GATEWAY,
        METRICS_CONSUMER,
    }
    assert set(tally.errors) == expected_consumers
    assert counted == tally.errors
    assert not [key for key in counts if key[1] == "not_folded"], counts
    stack.alive()

    asyncio.run(_real_work(stack.url))
    stack.alive()
    print(
        f"\n{tally.sent} messages ({tally.requests} requests) sent in {fuzzed:.1f}s, every "
        f"rejection counted after {settled:.1f}s; slowest reply {tally.slowest * 1000:.0f} ms; "
        f"pings after the flood: {', '.join(f'{n} {s * 1000:.0f} ms' for n, s in ping_s.items())}; "
        f"replies {dict(tally.replies)}"
    )


# -- well-formed forgeries from a worker of another job -------------------------------------------

VICTIM = "fuzz-victim"
VICTIMS = ("v-0", "v-1")
INTRUDER = Caller("fuzz-intruder", "mallory")
DATASET = "d"
FORGED_CODES = frozenset(
    {
        "forbidden",
        "wrong_source",
        "wrong_subject",
        "not_a_heartbeat",
        "not_a_sample",
        "subject_mismatch",
    }
)


def _forged(model: type[BaseModel], job: str, worker: str, source: str) -> BaseModel:
    """A valid instance of `model` about `worker` of `job`, claiming `source`."""
    message = simplest(model).model_dump(mode="python")
    pinned = {"job": job, "worker_id": worker, "source": source}
    message.update({name: value for name, value in pinned.items() if name in model.model_fields})
    return model.model_validate(message)


def _owner(event_type: str) -> str:
    """The source that may emit `event_type` about the victim's first worker."""
    if event_type in TELEMETRY_TYPES:
        return VICTIMS[0]
    return AREA_OWNERS[event_type.split(".")[0]][0]


async def _set_up_victim(url: str, root: Path) -> None:
    """Two workers of the victim's job, a dataset planned and begun, a barrier passed and a
    checkpoint committed: state that forgeries could change."""
    nc = await nats.connect(url)
    try:
        clients = [RpcClient(nc, timeout=PROMPT, caller=Caller(VICTIM, w)) for w in VICTIMS]
        leases = {}
        for worker, client in zip(VICTIMS, clients, strict=True):
            registration = Registration.model_validate(
                await client.call(
                    "registry", "register", RegisterRequest(job=VICTIM, instance=f"i-{worker}")
                )
            )
            leases[worker] = Lease(
                worker_id=worker, instance=registration.instance, epoch=registration.lease_epoch
            )
        await clients[0].call(
            "sharding",
            "register_dataset",
            RegisterDatasetRequest(job=VICTIM, dataset_id=DATASET, total_samples=40, shard_size=4),
        )
        for worker, client in zip(VICTIMS, clients, strict=True):
            shards = await client.call(
                "sharding",
                "get_shards",
                GetShardsRequest(
                    job=VICTIM,
                    dataset_id=DATASET,
                    worker_id=worker,
                    epoch=0,
                    lease=leases[worker],
                ),
                result=ShardAssignment,
            )
            done = [shards.shards[0].shard_id]
            await client.call(
                "sharding",
                "report_progress",
                ReportProgressRequest(
                    job=VICTIM,
                    dataset_id=DATASET,
                    epoch=0,
                    worker_id=worker,
                    completed=done,
                    lease=leases[worker],
                ),
            )
        arrivals = [
            client.call(
                "barrier", "arrive", ArriveRequest(job=VICTIM, name="b", worker_id=w, arrival=0)
            )
            for w, client in zip(VICTIMS, clients, strict=True)
        ]
        await asyncio.gather(*arrivals)
        storage = open_storage(root.as_uri())
        for rank, (worker, client) in enumerate(zip(VICTIMS, clients, strict=True)):
            info = await client.call(
                "checkpoint",
                "begin",
                BeginCheckpointRequest(
                    job=VICTIM,
                    worker_id=worker,
                    step=1,
                    epoch=0,
                    root_uri=storage.root_uri,
                    world_size=len(VICTIMS),
                    instance=f"i-{worker}",
                ),
                result=CheckpointInfo,
            )
            written = await storage.write(shard_key(VICTIM, 1, rank, info.attempt), b"shard")
            await client.call(
                "checkpoint",
                "ack",
                AckShardRequest(
                    job=VICTIM,
                    worker_id=worker,
                    step=1,
                    epoch=0,
                    rank=rank,
                    bytes=written.bytes,
                    checksum=written.checksum,
                    instance=f"i-{worker}",
                ),
            )
        operator = RpcClient(nc, timeout=PROMPT)
        deadline = time.monotonic() + SETTLE
        while True:
            answer = await operator.call(
                "checkpoint", "status", CheckpointQuery(job=VICTIM), result=CheckpointAnswer
            )
            if answer.found:
                break
            assert time.monotonic() < deadline, "the victim's checkpoint never committed"
            await asyncio.sleep(POLL)
        await storage.close()
    finally:
        await nc.close()


def _files(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in root.rglob("*") if p.is_file()}


async def _victim_state(url: str, root: Path) -> dict[str, Any]:
    """What every service says about the victim's job (as an operator asks), and its files."""
    nc = await nats.connect(url)
    operator = RpcClient(nc, timeout=PROMPT)
    try:
        return {
            "members": await operator.call(
                "registry", "members", MembersRequest(job=VICTIM, include_gone=True)
            ),
            "plan": await operator.call(
                "sharding", "plan", PlanRequest(job=VICTIM, dataset_id=DATASET, epoch=0)
            ),
            "checkpoint": await operator.call("checkpoint", "status", CheckpointQuery(job=VICTIM)),
            "files": await asyncio.to_thread(_files, root),
        }
    finally:
        await nc.close()


async def _forge(url: str, root: Path) -> Counter[tuple[str, str]]:
    """Every well-formed forgery, sent from the intruder's own subjects (as its credential
    allows) and, as an unsecured NATS allows anyone, on the event stream; what each consumer
    must count."""
    expected: Counter[tuple[str, str]] = Counter()
    nc = await nats.connect(url)
    intruder = RpcClient(nc, timeout=PROMPT, caller=INTRUDER)
    try:
        # Requests about the victim's job, and for another worker of its own: refused.
        for endpoint in RPC_ENDPOINTS:
            if endpoint.service not in SERVICES or endpoint.scope == "open":
                continue
            bodies = [_forged(endpoint.request, VICTIM, VICTIMS[0], "-")]
            if endpoint.scope == "worker":
                bodies.append(_forged(endpoint.request, INTRUDER.job, VICTIMS[0], "-"))
            for body in bodies:
                with pytest.raises(Forbidden):
                    await intruder.call(endpoint.service, endpoint.verb, body)
                expected[(f"rpc.{endpoint.service}", "forbidden")] += 1
        own_beat = subjects.heartbeat_subject(INTRUDER.job, INTRUDER.worker)
        own_sample = subjects.metric_subject(INTRUDER.job, INTRUDER.worker, "x")
        for event_type, model in EVENT_TYPES.items():
            owned = _forged(model, VICTIM, VICTIMS[0], _owner(event_type))
            data = encode_event(owned)  # type: ignore[arg-type]
            # On its own telemetry subjects: stored, and left unfolded.
            await nc.publish(own_beat, data)
            await nc.publish(own_sample, data)
            code = "subject_mismatch" if event_type == "worker.heartbeat" else "not_a_heartbeat"
            expected[(HEARTBEAT_CONSUMER, code)] += 1
            expected[(GATEWAY, "not_a_heartbeat")] += 1
            # A sample of the victim's job on the intruder's sample subject: not its subject.
            sample_code = "wrong_subject" if event_type == "metric.sampled" else "not_a_sample"
            expected[(METRICS_CONSUMER, sample_code)] += 1
            if event_type in TELEMETRY_TYPES:
                continue
            # On the event stream: as itself on the event's own subject, as the owner on its
            # own job's subject or on the subject workers once published acks on.
            stray = owned.model_copy(update={"source": INTRUDER.worker})
            wrong_subjects = [subjects.event_subject(INTRUDER.job, event_type)]
            if event_type != "checkpoint.shard_saved":
                wrong_subjects.append(subjects.event_subject(VICTIM, "checkpoint.shard_saved"))
            await nc.publish(subject_for(stray), encode_event(stray))  # type: ignore[arg-type]
            for subject in wrong_subjects:
                await nc.publish(subject, data)
            for consumer in (*SERVICES, GATEWAY):
                expected[(consumer, "wrong_source")] += 1
                expected[(consumer, "wrong_subject")] += len(wrong_subjects)
        # Its own heartbeat, claiming another source.
        beat = _forged(WorkerHeartbeat, INTRUDER.job, INTRUDER.worker, VICTIMS[0])
        await nc.publish(own_beat, encode_event(beat))  # type: ignore[arg-type]
        expected[(HEARTBEAT_CONSUMER, "wrong_source")] += 1
        expected[(GATEWAY, "not_a_heartbeat")] += 1
        # The ack that once made the checkpoint service delete the file it named.
        precious = shard_key(VICTIM, 1, 0)
        ack = CheckpointShardSaved(
            job=VICTIM,
            source=INTRUDER.worker,
            step=999,
            epoch=0,
            rank=0,
            worker_id=INTRUDER.worker,
            uri=(root / precious).as_uri(),
            key=precious,
            bytes=5,
            checksum="xxh128:" + "0" * 32,
        )
        await nc.publish(subject_for(ack), encode_event(ack))
        for consumer in (*SERVICES, GATEWAY):
            expected[(consumer, "wrong_source")] += 1
        await nc.flush()
    finally:
        await nc.close()
    return expected


def test_well_formed_forgeries_are_refused_counted_and_change_nothing(stack: Stack) -> None:
    root = stack.checkpoints / "victim-root"
    root.mkdir(parents=True)
    asyncio.run(_set_up_victim(stack.url, root))
    state_before = asyncio.run(_victim_state(stack.url, root))
    assert state_before["checkpoint"]["found"]
    before = stack.rejected()
    expected = asyncio.run(_forge(stack.url, root))

    deadline = time.monotonic() + SETTLE
    while True:
        counts = stack.rejected() - before
        forged = Counter({key: n for key, n in counts.items() if key[1] in FORGED_CODES})
        if all(forged[key] >= n for key, n in expected.items()):
            break
        if time.monotonic() >= deadline:
            pytest.fail(f"after {SETTLE}s, forgeries counted {forged}, sent {expected}")
        time.sleep(POLL)
    assert forged == expected
    assert not [key for key in counts if key not in expected], counts
    stack.alive()
    assert asyncio.run(_victim_state(stack.url, root)) == state_before
