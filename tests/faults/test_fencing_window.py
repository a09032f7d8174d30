"""The fencing window, with real processes: a progress report decided while its reporter's
failure was being stored counts nothing, and its reporter is told so.

Two sharding replicas share the requests (one queue group). Replica A reaches NATS through a
proxy that holds its event connection (its feed and its writes) while its request connection
flows: it takes a report of worker w0 and decides it on a state without w0's failure, which is
stored meanwhile; replica B folds the failure, re-plans w0's shard to w1, and answers w1 where
to start reading it. After the heal, A's report is stored after the failure and the re-plan.
Counted, its samples would be counted twice: by w0's report and by w1, which reads them again.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.errors import RpcTimeout, StaleLease
from strata.events import ShardPlanChanged, WorkerFailed
from strata.events.requests import (
    GetShardsRequest,
    ProgressResult,
    RegisterDatasetRequest,
    ReportProgressRequest,
    ShardAssignment,
    ShardOffset,
)

from tests.faults.netproxy import Proxy
from tests.support import (
    ServiceProcess,
    job_events,
    new_job,
    record_registrations,
    recorded_lease,
)

pytestmark = [pytest.mark.nats, pytest.mark.slow]

WORKERS = ["w0", "w1"]
SHARD_SIZE = 1000
HELD_REPLY_S = 3.0
"""A report the held replica took is answered only after the heal: no answer within this long
means it took it (the other one answers in milliseconds, and a loaded machine in well under
this)."""
TRIES = 20


def _shards(bus: Bus, job: str, worker: str, timeout: float) -> asyncio.Future[ShardAssignment]:
    request = GetShardsRequest(
        job=job,
        dataset_id="ds",
        worker_id=worker,
        epoch=0,
        lease=recorded_lease(WORKERS, worker),
    )
    return asyncio.ensure_future(
        bus.rpc.call("sharding", "get_shards", request, result=ShardAssignment, timeout=timeout)
    )


def _report(job: str, shard: int, offset: int) -> ReportProgressRequest:
    return ReportProgressRequest(
        job=job,
        dataset_id="ds",
        epoch=0,
        worker_id="w0",
        partial=[ShardOffset(shard_id=shard, offset=offset)],
        lease=recorded_lease(WORKERS, "w0"),
    )


async def _answered_by_the_free_replica(bus: Bus, job: str, worker: str) -> ShardAssignment:
    """`worker`'s shards, asked until the replica that is not held answers."""
    deadline = time.monotonic() + 60
    while True:
        try:
            return await _shards(bus, job, worker, timeout=HELD_REPLY_S)
        except RpcTimeout:
            if time.monotonic() > deadline:
                pytest.fail(f"no replica answered {worker}'s shards within 60 s")


async def test_a_report_decided_during_its_reporters_failure_is_not_counted(
    tmp_path: Path, own_nats_server: NatsServer
) -> None:
    url = own_nats_server.url
    job = new_job("window")
    logs = tmp_path / "logs"
    logs.mkdir()
    with Proxy(own_nats_server.port) as proxy:
        held = ServiceProcess("sharding", proxy.url, logs).start()
        free = ServiceProcess("sharding", url, logs).start()
        async with await Bus.connect(url, deadline=10) as bus:
            try:
                await record_registrations(bus, job, WORKERS)
                dataset = RegisterDatasetRequest(
                    job=job, dataset_id="ds", total_samples=8 * SHARD_SIZE, shard_size=SHARD_SIZE
                )
                await bus.rpc.call("sharding", "register_dataset", dataset, timeout=30)
                mine = await _answered_by_the_free_replica(bus, job, "w0")
                reading = mine.shards[0].shard_id

                # The held replica's event connection carries nothing either way from here.
                proxy.cut(involving=b'"strata-sharding"')
                offset, late = 0, None
                for _ in range(TRIES):
                    offset += 10
                    call = asyncio.ensure_future(
                        bus.rpc.call(
                            "sharding",
                            "report_progress",
                            _report(job, reading, offset),
                            result=ProgressResult,
                            timeout=60,
                        )
                    )
                    done, _ = await asyncio.wait({call}, timeout=HELD_REPLY_S)
                    if not done:
                        late = call  # the held replica decided it, without w0's failure
                        break
                    call.result()  # the free replica counted it, before the failure
                assert late is not None, f"the held replica took none of {TRIES} reports"
                counted_before = offset - 10

                # w0's failure is stored; the free replica re-plans its shard to w1.
                await bus.publish(
                    WorkerFailed(
                        job=job,
                        source="registry",
                        worker_id="w0",
                        rank=0,
                        reason="no heartbeat for 3.2s (timeout 3s)",
                        last_heartbeat_ts=0,
                        membership_epoch=3,
                    )
                )
                deadline = time.monotonic() + 60
                while not any(
                    isinstance(e, ShardPlanChanged) and "w0" not in e.members
                    for e in await job_events(bus, job)
                ):
                    assert time.monotonic() < deadline, "w0's shards never re-planned"
                    await asyncio.sleep(0.1)
                theirs = await _answered_by_the_free_replica(bus, job, "w1")
                span = next(s for s in theirs.shards if s.shard_id == reading)
                # w1 reads the shard from what was counted before the failure.
                assert span.offset == counted_before

                proxy.heal()
                with pytest.raises(StaleLease, match="not counted"):
                    await late
                # Stored after the failure and the re-plan, the late report counted nothing:
                # what w1 was told to read from is still the shard's offset.
                events = await job_events(bus, job)
                failed_at = next(i for i, e in enumerate(events) if isinstance(e, WorkerFailed))
                stored_late = [
                    e
                    for e in events[failed_at:]
                    if e.type == "shard.progress" and e.partial[0].offset == offset
                ]
                assert len(stored_late) == 1
                again = await _answered_by_the_free_replica(bus, job, "w1")
                span = next(s for s in again.shards if s.shard_id == reading)
                assert span.offset == counted_before
            finally:
                proxy.heal()
                held.stop()
                free.stop()
