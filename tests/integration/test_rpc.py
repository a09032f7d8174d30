"""Request/reply through `RpcServer` and `RpcClient` against a real nats-server: typed results,
errors mapped back to their classes, an error reply for every bad request, queue groups, timeouts.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any
from uuid import uuid4

import nats
import pytest
import strata
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.aio.client import Client as NATS
from strata.bus import Caller, RpcClient, RpcServer
from strata.events import StrictModel, pack, subjects, unpack
from strata.events.rpc import PingResult

from tests.tiers import examples

pytestmark = pytest.mark.nats

REPLY_TIMEOUT = 2.0


class EchoRequest(StrictModel):
    text: str
    times: int = 1


class EchoResult(StrictModel):
    text: str
    served_by: str


def new_service() -> str:
    return f"svc_{uuid4().hex[:8]}"


def echo_server(nc: NATS, service: str) -> RpcServer:
    server = RpcServer(nc, service)

    async def echo(request: EchoRequest) -> EchoResult:
        return EchoResult(text=request.text * request.times, served_by=server.instance)

    server.route("echo", EchoRequest, echo, scope="open")
    return server


async def raw_request(nc: NATS, subject: str, payload: bytes) -> dict[str, Any]:
    reply = await nc.request(subject, payload, timeout=REPLY_TIMEOUT)
    body = unpack(reply.data)
    assert isinstance(body, dict)
    return body


def error_of(body: dict[str, Any]) -> tuple[str, str]:
    assert body["ok"] is False
    assert set(body) == {"ok", "error"}
    error = body["error"]
    assert set(error) == {"code", "message"}
    return error["code"], error["message"]


@dataclass
class Peers:
    server_nc: NATS
    client_nc: NATS
    client: RpcClient


@pytest.fixture
async def peers(nats_url: str) -> AsyncIterator[Peers]:
    server_nc = await nats.connect(nats_url)
    client_nc = await nats.connect(nats_url)
    try:
        yield Peers(server_nc, client_nc, RpcClient(client_nc, timeout=REPLY_TIMEOUT))
    finally:
        await client_nc.close()
        await server_nc.close()


async def test_route_returns_a_typed_result(peers: Peers) -> None:
    service = new_service()
    server = await echo_server(peers.server_nc, service).start()
    try:
        result = await peers.client.call(
            service, "echo", EchoRequest(text="ab", times=3), result=EchoResult
        )
        untyped = await peers.client.call(service, "echo", {"text": "x"})
    finally:
        await server.stop()

    assert result == EchoResult(text="ababab", served_by=server.instance)
    assert untyped == {"text": "x", "served_by": server.instance}
    assert not server.rejected


async def test_handler_errors_come_back_as_their_exception_classes(peers: Peers) -> None:
    service = new_service()
    server = RpcServer(peers.server_nc, service)

    async def crash(_: EchoRequest) -> None:
        raise RuntimeError("disk on fire")

    async def missing(request: EchoRequest) -> None:
        raise strata.NotFound(f"dataset {request.text!r} is not registered")

    server.route("crash", EchoRequest, crash, scope="open")
    server.route("missing", EchoRequest, missing, scope="open")
    await server.start()
    try:
        with pytest.raises(strata.RpcError) as crashed:
            await peers.client.call(service, "crash", EchoRequest(text="x"))
        with pytest.raises(strata.NotFound) as not_found:
            await peers.client.call(service, "missing", EchoRequest(text="imagenet"))
        assert await peers.client.call(service, "ping", result=PingResult)
    finally:
        await server.stop()

    assert crashed.value.code == "internal"
    assert "RuntimeError: disk on fire" in crashed.value.message
    assert f"{service}.crash" in crashed.value.message
    assert not_found.value.code == "not_found"
    assert not_found.value.message == "dataset 'imagenet' is not registered"
    assert server.rejected == Counter({"internal": 1, "not_found": 1})


async def test_every_bad_request_gets_an_error_reply_and_the_server_keeps_serving(
    peers: Peers,
) -> None:
    service = new_service()
    server = await echo_server(peers.server_nc, service).start()
    echo = subjects.rpc_subject(service, "echo")
    nc = peers.client_nc
    try:
        garbage = await raw_request(nc, echo, b"\xc1\x00garbage")
        empty = await raw_request(nc, echo, b"")
        a_list = await raw_request(nc, echo, pack(["text", "hi"]))
        wrong_type = await raw_request(nc, echo, pack({"text": "hi", "times": "three"}))
        unknown_field = await raw_request(nc, echo, pack({"text": "hi", "colour": "red"}))
        missing_field = await raw_request(nc, echo, pack({"times": 2}))
        unknown_verb = await raw_request(nc, subjects.rpc_subject(service, "nope"), pack({}))
        still_serving = await peers.client.call(
            service, "echo", EchoRequest(text="ok"), result=EchoResult
        )
    finally:
        await server.stop()

    assert error_of(garbage)[0] == "malformed"
    assert error_of(empty)[0] == "malformed"
    assert error_of(a_list)[0] == "invalid_request"
    code, message = error_of(wrong_type)
    assert code == "invalid_request"
    assert "'times'" in message
    code, message = error_of(unknown_field)
    assert code == "invalid_request"
    assert "'colour'" in message
    code, message = error_of(missing_field)
    assert code == "invalid_request"
    assert "'text'" in message
    code, message = error_of(unknown_verb)
    assert code == "unknown_verb"
    assert "'nope'" in message
    assert "echo" in message
    assert "ping" in message
    assert still_serving.text == "ok"
    assert server.rejected == Counter({"malformed": 2, "invalid_request": 4, "unknown_verb": 1})


async def test_request_without_a_reply_subject_is_counted_not_answered(peers: Peers) -> None:
    service = new_service()
    server = await echo_server(peers.server_nc, service).start()
    try:
        await peers.client_nc.publish(subjects.rpc_subject(service, "echo"), pack({"text": "x"}))
        # Requests on one subscription are served in order, so once this one is answered
        # the one without a reply subject has been handled too.
        await peers.client.call(service, "ping")
    finally:
        await server.stop()

    assert server.rejected == Counter({"no_reply_subject": 1})


async def test_ping_is_built_in(peers: Peers) -> None:
    service = new_service()
    server = await RpcServer(peers.server_nc, service).start()
    try:
        pong = await peers.client.call(service, "ping", result=PingResult)
    finally:
        await server.stop()

    assert isinstance(pong, PingResult)
    assert pong.service == service
    assert pong.instance == server.instance
    assert pong.version == strata.__version__
    assert 0 <= pong.uptime_s < 60


async def test_replicas_in_the_queue_group_answer_each_request_exactly_once(
    peers: Peers, nats_url: str
) -> None:
    service = new_service()
    other_nc = await nats.connect(nats_url)
    seen: dict[str, list[int]] = {}

    def counting_server(nc: NATS) -> RpcServer:
        server = RpcServer(nc, service)
        seen[server.instance] = []

        async def echo(request: EchoRequest) -> EchoResult:
            seen[server.instance].append(request.times)
            return EchoResult(text=request.text, served_by=server.instance)

        server.route("echo", EchoRequest, echo, scope="open")
        return server

    replicas = [counting_server(peers.server_nc), counting_server(other_nc)]
    for replica in replicas:
        await replica.start()
    try:
        results = await asyncio.gather(
            *(
                peers.client.call(
                    service, "echo", EchoRequest(text="x", times=n), result=EchoResult
                )
                for n in range(50)
            )
        )
    finally:
        for replica in replicas:
            await replica.stop()
        await other_nc.close()

    handled = sorted(n for calls in seen.values() for n in calls)
    assert handled == list(range(50))
    assert Counter(r.served_by for r in results) == Counter(
        {instance: len(calls) for instance, calls in seen.items()}
    )
    assert all(seen.values()), f"one replica got no requests: {seen}"


async def test_calling_a_missing_service_fails_fast_and_retry_waits_for_it(peers: Peers) -> None:
    service = new_service()
    started = time.monotonic()
    with pytest.raises(strata.ServiceUnavailable) as unavailable:
        await peers.client.call(service, "ping")
    # At once (no responders), not after the 5 s call timeout; the margin holds on a loaded machine.
    assert time.monotonic() - started < 2.5
    assert unavailable.value.code == "unavailable"
    assert service in unavailable.value.message

    waiting = asyncio.create_task(
        peers.client.call(service, "ping", result=PingResult, retry_for=5)
    )
    # Keep the service down for a moment so the call has to go through its retries.
    await asyncio.sleep(0.3)
    assert not waiting.done()
    server = await RpcServer(peers.server_nc, service).start()
    try:
        pong = await asyncio.wait_for(waiting, 6)
    finally:
        await server.stop()

    assert pong.instance == server.instance


async def test_handler_slower_than_the_client_timeout_raises_rpc_timeout(peers: Peers) -> None:
    service = new_service()
    server = RpcServer(peers.server_nc, service)
    release = asyncio.Event()

    async def slow(_: EchoRequest) -> None:
        await release.wait()

    server.route("slow", EchoRequest, slow, scope="open")
    await server.start()
    try:
        started = time.monotonic()
        with pytest.raises(strata.RpcTimeout) as timed_out:
            await peers.client.call(service, "slow", EchoRequest(text="x"), timeout=0.3)
        elapsed = time.monotonic() - started
        release.set()
        pong = await peers.client.call(service, "ping", result=PingResult)
    finally:
        release.set()
        await server.stop()

    assert 0.3 <= elapsed < 1.5
    assert subjects.rpc_subject(service, "slow") in timed_out.value.message
    assert pong.service == service


@dataclass
class FuzzTarget:
    loop: asyncio.AbstractEventLoop
    nc: NATS
    server: RpcServer
    subjects: list[str]
    replies: Counter[str]


@pytest.fixture
def fuzz_target(nats_url: str) -> Iterator[FuzzTarget]:
    """One server and client on a loop of their own, shared by every hypothesis example."""
    loop = asyncio.new_event_loop()
    service = new_service()

    async def setup() -> tuple[NATS, NATS, RpcServer]:
        server_nc = await nats.connect(nats_url)
        client_nc = await nats.connect(nats_url)
        server = await echo_server(server_nc, service).start()
        return server_nc, client_nc, server

    server_nc, client_nc, server = loop.run_until_complete(setup())
    try:
        yield FuzzTarget(
            loop=loop,
            nc=client_nc,
            server=server,
            subjects=[subjects.rpc_subject(service, verb) for verb in ("echo", "ping", "nope")],
            replies=Counter(),
        )
    finally:
        loop.run_until_complete(server.stop())
        loop.run_until_complete(client_nc.close())
        loop.run_until_complete(server_nc.close())
        loop.close()


ERROR_CODES = {"malformed", "invalid_request", "unknown_verb"}
msgpack_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats()
    | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=10,
)


@settings(
    max_examples=examples(200),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(
    payload=st.binary(max_size=512) | msgpack_values.map(pack),
    verb=st.integers(min_value=0, max_value=2),
)
def test_random_bytes_always_get_an_envelope_reply(
    fuzz_target: FuzzTarget, payload: bytes, verb: int
) -> None:
    subject = fuzz_target.subjects[verb]
    try:
        body = fuzz_target.loop.run_until_complete(raw_request(fuzz_target.nc, subject, payload))
    except nats.errors.TimeoutError:
        pytest.fail(f"no reply within {REPLY_TIMEOUT}s to {payload!r} on {subject}")

    if body["ok"] is True:
        assert set(body) == {"ok", "result"}
        fuzz_target.replies["ok"] += 1
    else:
        code, message = error_of(body)
        assert code in ERROR_CODES
        assert message
        fuzz_target.replies[code] += 1
    pong = fuzz_target.loop.run_until_complete(
        RpcClient(fuzz_target.nc).call(
            fuzz_target.server.service, "ping", result=PingResult, timeout=REPLY_TIMEOUT
        )
    )
    assert pong.instance == fuzz_target.server.instance
    assert fuzz_target.server.rejected == Counter(
        {code: n for code, n in fuzz_target.replies.items() if code != "ok"}
    )


async def test_a_reply_past_one_megabyte_arrives_and_one_past_max_payload_is_an_error(
    peers: Peers,
) -> None:
    service = new_service()
    server = await echo_server(peers.server_nc, service).start()
    limit = peers.server_nc.max_payload
    try:
        big = await peers.client.call(
            service, "echo", EchoRequest(text="x" * 1000, times=3000), result=EchoResult
        )
        with pytest.raises(strata.StrataError) as too_large:
            await peers.client.call(service, "echo", EchoRequest(text="y", times=limit + 1))
        assert await peers.client.call(service, "ping", result=PingResult)
    finally:
        await server.stop()

    assert limit >= 8 * 1024 * 1024  # the embedded server's max_payload, as the Helm chart's
    assert len(big.text) == 3_000_000
    assert too_large.value.code == "reply_too_large"
    assert "max_payload" in too_large.value.message
    assert server.rejected == Counter({"reply_too_large": 1})


# -- the caller is the subject's ------------------------------------------------------------------


class ForWorker(StrictModel):
    job: str
    worker_id: str | None = None


async def test_a_request_may_speak_only_for_its_callers_job_and_worker(peers: Peers) -> None:
    service = new_service()
    server = RpcServer(peers.server_nc, service)
    handled: list[ForWorker] = []

    async def handle(request: ForWorker) -> ForWorker:
        handled.append(request)
        return request

    server.route("mine", ForWorker, handle, scope="worker")
    server.route("ours", ForWorker, handle, scope="job")
    await server.start()
    me = peers.client.bound(Caller("job-a", "w-1"))
    try:
        # Its own job and worker, or the worker left out (then it is the caller).
        assert await me.call(service, "mine", ForWorker(job="job-a", worker_id="w-1"))
        filled = await me.call(service, "mine", ForWorker(job="job-a"))
        assert filled == {"job": "job-a", "worker_id": "w-1"}
        # A job-wide verb may name any worker of the job, never another job.
        assert await me.call(service, "ours", ForWorker(job="job-a", worker_id="w-2"))
        refused = [
            ("mine", ForWorker(job="job-a", worker_id="w-2"), "speaks only for itself"),
            ("mine", ForWorker(job="job-b", worker_id="w-1"), "acts in its own job only"),
            ("ours", ForWorker(job="job-b"), "acts in its own job only"),
        ]
        for verb, request, says in refused:
            with pytest.raises(strata.Forbidden) as forbidden:
                await me.call(service, verb, request)
            assert forbidden.value.code == "forbidden"
            assert says in forbidden.value.message
        # An operator (no caller on the subject) may ask for anyone.
        assert await peers.client.call(service, "mine", ForWorker(job="job-b", worker_id="w-9"))
        # A subject that names its caller badly is refused as such.
        body = await raw_request(peers.client_nc, f"strata.rpc.{service}.mine.job-a", pack({}))
        assert error_of(body)[0] == "invalid_request"
    finally:
        await server.stop()
    assert [r.worker_id for r in handled] == ["w-1", "w-1", "w-2", "w-9"]
    assert server.rejected["forbidden"] == 3
