"""Requests sorted into partitions by job, against a real nats-server: the server's subject
mapping puts a job's requests where `strata.events.subjects.rpc_partition_of` says, `RpcServer`
takes each partition on the connection given for it (cut from the socket's bytes by
`strata.bus.intake`) and answers there, and everything still works on a server without the
mapping."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from uuid import uuid4

import nats
import pytest
from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from strata.admission import AdmissionLimits
from strata.bus import Caller, RpcClient, RpcServer
from strata.bus.connection import connect
from strata.bus.intake import RequestIntakeClient
from strata.bus.server import NatsServer
from strata.errors import RateLimited
from strata.events import StrictModel, pack, subjects

from tests.support import async_wait_until

pytestmark = pytest.mark.nats

TIMEOUT = 5.0
PARTITIONS = 4
JOBS = [
    "a", "b", "job-1", "job-2", "llm.pretrain", "x_y", "Z9", "resnet-50.v2", "default",
    "0", "quiet-4f1c", "noisy-77aa", "a.b.c", "under_", "M", "mm", "mmm",
]  # fmt: skip


class JobRequest(StrictModel):
    job: str


def new_service() -> str:
    return f"part_{uuid4().hex[:8]}"


@pytest.mark.parametrize("partitions", [1, 8, 256])
async def test_the_server_moves_each_request_to_the_partition_the_code_computes(
    tmp_path: Path, partitions: int
) -> None:
    with NatsServer(store_dir=tmp_path / "nats", jetstream=False, rpc_partitions=partitions) as s:
        nc = await nats.connect(s.url)
        try:
            seen: list[str] = []

            async def note(msg: Msg) -> None:
                seen.append(msg.subject)

            await nc.subscribe(f"{subjects.RPC_PARTITIONED}.>", cb=note)
            await nc.subscribe(f"{subjects.RPC}.>", cb=note)
            await nc.flush()
            for job in JOBS:
                await nc.publish(subjects.rpc_subject("registry", "ping", job, "w-1"), b"")
            await nc.publish(subjects.rpc_subject("registry", "ping"), b"")  # an operator's

            async def all_in() -> bool:
                return len(seen) == len(JOBS) + 1

            await async_wait_until(all_in, 10, "every request to come through")
        finally:
            await nc.close()
    expected = [
        f"{subjects.RPC_PARTITIONED}.{subjects.rpc_partition_of(job, partitions)}"
        f".registry.ping.{subjects.token(job)}.w-1"
        for job in JOBS
    ]
    assert seen == [*expected, subjects.rpc_subject("registry", "ping")]
    assert [subjects.parse_rpc_subject(subject).job for subject in seen[:-1]] == JOBS


def jobs_in_partitions(count: int) -> list[str]:
    """One job for each of the first `count` partitions."""
    found: dict[int, str] = {}
    for i in range(10_000):
        found.setdefault(subjects.rpc_partition_of(f"job-{i}", PARTITIONS), f"job-{i}")
        if len(found) == count:
            break
    return [found[partition] for partition in range(count)]


@pytest.fixture
async def partitioned(tmp_path: Path) -> AsyncIterator[tuple[NatsServer, list[NATS]]]:
    with NatsServer(
        store_dir=tmp_path / "nats", jetstream=False, rpc_partitions=PARTITIONS
    ) as server:
        connections = [
            await connect(server.url, client=RequestIntakeClient) for _ in range(PARTITIONS)
        ]
        try:
            yield server, connections
        finally:
            for nc in connections:
                await nc.close()


async def test_each_partition_is_taken_and_answered_on_its_own_connection(
    partitioned: tuple[NatsServer, list[NATS]],
) -> None:
    server, connections = partitioned
    main = await nats.connect(server.url)
    client = await nats.connect(server.url)
    limits = AdmissionLimits(worker_rate=0.001, worker_burst=3)
    rpc = RpcServer(main, new_service(), admission=limits, partitions=connections)

    async def work(request: JobRequest) -> dict[str, str]:
        return {"job": request.job}

    rpc.route("work", JobRequest, work, scope="job")
    await rpc.start()
    try:
        jobs = jobs_in_partitions(PARTITIONS)
        before = [nc.stats["in_msgs"] for nc in connections]
        for job in jobs:
            answer = await RpcClient(client, timeout=TIMEOUT, caller=Caller(job, "w0")).call(
                rpc.service, "work", {"job": job}
            )
            assert answer == {"job": job}
        taken = [nc.stats["in_msgs"] - was for nc, was in zip(connections, before, strict=True)]
        assert taken == [1] * PARTITIONS
        # An operator's request comes on the unpartitioned subject, to the main connection.
        assert await RpcClient(main, timeout=TIMEOUT).call(rpc.service, "work", {"job": "x"}) == {
            "job": "x"
        }
        # Past its budget a caller is refused from the bytes, with an answer and counted.
        caller = RpcClient(client, timeout=TIMEOUT, caller=Caller(jobs[1], "w1"))
        for _ in range(3):
            assert await caller.call(rpc.service, "work", {"job": jobs[1]}) == {"job": jobs[1]}
        with pytest.raises(RateLimited):
            await caller.call(rpc.service, "work", {"job": jobs[1]})
        assert rpc.rejected["rate_limited"] == 1
        # A request nobody can be answered is dropped unseen.
        subject = subjects.rpc_subject(rpc.service, "work", jobs[2], "w0")
        await client.publish(subject, pack({"job": jobs[2]}))
        await client.flush()

        async def dropped() -> bool:
            return rpc.rejected["no_reply_subject"] == 1

        await async_wait_until(dropped, 10, "the request without a reply subject to be dropped")
    finally:
        await rpc.stop()
        await client.close()
        await main.close()


async def test_without_the_mapping_requests_are_taken_on_their_own_subjects(
    tmp_path: Path,
) -> None:
    with NatsServer(store_dir=tmp_path / "nats", jetstream=False, rpc_partitions=None) as server:
        main = await nats.connect(server.url)
        partitions = [await connect(server.url, client=RequestIntakeClient) for _ in range(2)]
        rpc = RpcServer(main, new_service(), admission=AdmissionLimits(), partitions=partitions)

        async def work(request: JobRequest) -> dict[str, str]:
            return {"job": request.job}

        rpc.route("work", JobRequest, work, scope="job")
        await rpc.start()
        try:
            caller = RpcClient(main, timeout=TIMEOUT, caller=Caller("j", "w0"))
            assert await caller.call(rpc.service, "work", {"job": "j"}) == {"job": "j"}
        finally:
            await rpc.stop()
            for nc in [*partitions, main]:
                await nc.close()


async def test_a_caller_refused_from_the_bytes_is_served_again_once_its_budget_refills(
    partitioned: tuple[NatsServer, list[NATS]],
) -> None:
    """A refusal by a worker's own budget is remembered for its subject until the budget has a
    token again: the requests meanwhile are refused without being decoded, the next after it is
    served, and every refusal is counted."""
    server, connections = partitioned
    main = await nats.connect(server.url)
    client = await nats.connect(server.url)
    rpc = RpcServer(
        main,
        new_service(),
        admission=AdmissionLimits(worker_rate=5, worker_burst=2),
        partitions=connections,
    )

    async def work(request: JobRequest) -> dict[str, str]:
        return {"job": request.job}

    rpc.route("work", JobRequest, work, scope="job")
    await rpc.start()
    try:
        job = jobs_in_partitions(PARTITIONS)[0]
        caller = RpcClient(client, timeout=TIMEOUT, caller=Caller(job, "w0"))
        refused = 0
        while not refused:  # the burst, then refusals (a slow machine may refill one between)
            try:
                await caller.call(rpc.service, "work", {"job": job})
            except RateLimited:
                refused += 1
        for _ in range(20):  # within the 0.2 s a token takes, or served once it came
            try:
                await caller.call(rpc.service, "work", {"job": job})
            except RateLimited:
                refused += 1
        # Served again once a token is back: the memory of the refusal ends with it.
        answer = await caller.call(rpc.service, "work", {"job": job}, retry_for=10.0)
        assert answer == {"job": job}
        assert rpc.rejected["rate_limited"] >= refused >= 1
    finally:
        await rpc.stop()
        await client.close()
        await main.close()
