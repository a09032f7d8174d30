"""Time travel through the gateway against a real nats-server: `/api/replay` from the live read
model's snapshots answers exactly what a fold of the stored history from its first event gives,
at seeded random points, by sequence and by stored time.
"""

from __future__ import annotations

import random
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from strata.bus import Bus
from strata.history import job_history
from strata.services.gateway.app import GatewayState, create_app
from strata.services.gateway.live import LiveModel
from strata.services.readmodel import JobState, SnapshotStore, render_dashboard

from tests import support
from tests.histories import hour_history

pytestmark = pytest.mark.nats


async def from_first_event(bus: Bus, job: str, **bounds: int) -> dict[str, Any]:
    state = JobState(job)
    async for record in job_history(bus.js, job, telemetry=False, **bounds):
        state.apply(record)
    return dict(render_dashboard(state))


@pytest.fixture
async def gateway(bus: Bus) -> AsyncIterator[tuple[LiveModel, httpx.AsyncClient]]:
    live = await LiveModel(snapshots=SnapshotStore(every=60, cost_factor=0)).start(bus)
    state = GatewayState()
    state.bus, state.live = bus, live
    transport = httpx.ASGITransport(create_app(state, dashboard_dir=None))
    try:
        async with httpx.AsyncClient(transport=transport, base_url="http://gateway") as http:
            yield live, http
    finally:
        await live.stop()


async def test_time_travel_from_snapshots_equals_a_fold_from_the_first_event(
    bus: Bus, gateway: tuple[LiveModel, httpx.AsyncClient]
) -> None:
    live, http = gateway
    job = support.new_job("travel")
    events = [r.event for r in hour_history(workers=12, minutes=24, job=job)]
    acks = []
    for first in range(0, len(events), 2000):
        acks += await bus.publish_many(events[first : first + 2000], window=512)
    last = acks[-1].seq

    async def folded() -> bool:
        state = live.job(job)
        return state is not None and state.seq == last

    await support.async_wait_until(folded, 30, "the gateway to fold the job")
    assert live.snapshots.count(job) >= len(events) // 60 - 1

    rng = random.Random(24)
    stored = [r async for r in job_history(bus.js, job, telemetry=False)]
    seqs = sorted({acks[0].seq, last, *(rng.choice(acks).seq for _ in range(20))})
    for seq in seqs:
        answer = await http.get("/api/replay", params={"job": job, "seq": seq})
        assert answer.status_code == 200, answer.text
        assert answer.json() == await from_first_event(bus, job, until_seq=seq), seq
    for record in rng.sample(stored, 8):
        at = record.stored_ns
        answer = await http.get("/api/replay", params={"job": job, "at": at})
        assert answer.status_code == 200, answer.text
        assert answer.json() == await from_first_event(bus, job, until_ns=at), at
    before = await http.get("/api/replay", params={"job": job, "at": stored[0].stored_ns - 1})
    assert before.status_code == 404
