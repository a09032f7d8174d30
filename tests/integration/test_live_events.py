"""Live recovery's record, against a real registry and barrier service: the quorum the barrier
service records when a live group's meeting barrier is released, and the reports (`barrier.live`)
a member may make about its own quorum, and the ones it may not: for another worker, another
job, or a quorum it is not part of.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import strata
from strata.bus import Bus
from strata.errors import Forbidden, StrataError
from strata.events import LiveHealed, LiveQuorumFormed, LiveStepDiscarded
from strata.events.requests import LiveReportRequest, LiveReportResult, live_barrier

from tests.support import async_wait_until, job_events, new_job, running_services

pytestmark = pytest.mark.nats


@pytest.fixture
def stack(nats_url: str, tmp_path: Path) -> Iterator[str]:
    with running_services(nats_url, tmp_path / "logs", ("registry", "barrier")):
        yield nats_url


async def start(workers: list[strata.aio.Worker], job: str, url: str, ids: list[str]) -> None:
    for worker_id in ids:
        worker = strata.aio.Worker(job, url, worker_id=worker_id)
        workers.append(worker)
        await worker.start()


async def report(worker: strata.aio.Worker, epoch: int, **fields: Any) -> LiveReportResult:
    request = LiveReportRequest(
        job=fields.pop("job", worker.job),
        worker_id=fields.pop("worker_id", worker.id),
        membership_epoch=epoch,
        generation=0,
        lease=worker.lease,
        **fields,
    )
    return await worker.bus.rpc.call(
        "barrier", "live", request, result=LiveReportResult, timeout=10.0
    )


async def test_a_quorum_is_recorded_and_only_its_members_report_on_it(
    stack: str, bus: Bus, workers: list[strata.aio.Worker]
) -> None:
    job = new_job("live-events")
    await start(workers, job, stack, ["w0", "w1", "w2"])
    epoch = max(w.membership_epoch for w in workers)
    name = live_barrier(epoch)
    await asyncio.gather(*(w.barrier(name, 30, expected=3) for w in workers))
    await start(workers, job, stack, ["w3"])  # live, but not in that quorum
    w0, w1, _, w3 = workers

    healed = await report(w1, epoch, action="healed", step=7, from_step=2, source_worker="w0")
    discarded = await report(w0, epoch, action="discarded", step=8, reason="a peer was lost")
    refusals: list[StrataError] = []
    for attempt in (
        report(w3, epoch, action="discarded", step=8),  # not a member of the quorum
        report(w0, epoch, action="discarded", step=8, worker_id="w1"),  # speaks for w1
        report(w0, epoch, action="discarded", step=8, job=new_job("other")),  # another job
        report(w1, epoch, action="healed", step=7, source_worker="w3"),  # from a non-member
    ):
        with pytest.raises(Forbidden) as refused:
            await attempt
        refusals.append(refused.value)
    assert "not a member" in refusals[0].message
    assert "speaks only for itself" in refusals[1].message
    assert "its own job only" in refusals[2].message

    found: list[Any] = []

    async def recorded() -> bool:
        nonlocal found
        found = [
            e
            for e in await job_events(bus, job)
            if isinstance(e, LiveQuorumFormed | LiveHealed | LiveStepDiscarded)
        ]
        return len(found) >= 3

    await async_wait_until(recorded, 30, "the quorum and the two reports to be recorded")
    quorum, heal, discard = found
    assert isinstance(quorum, LiveQuorumFormed)
    assert (quorum.members, quorum.world_size, quorum.membership_epoch) == (
        ["w0", "w1", "w2"],
        3,
        epoch,
    )
    assert isinstance(heal, LiveHealed)
    assert heal.id == healed.event_id
    assert (heal.worker_id, heal.source_worker, heal.from_step, heal.to_step) == ("w1", "w0", 2, 7)
    assert isinstance(discard, LiveStepDiscarded)
    assert discard.id == discarded.event_id
    assert (discard.worker_id, discard.step, discard.source) == ("w0", 8, "barrier")
    # Nothing the refused reports asked for was recorded.
    assert len(found) == 3
