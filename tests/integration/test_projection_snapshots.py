"""A projection's snapshot is stored job by job: one job whose part is larger than a message may
be is left out (logged), the others' parts are kept, and a restart restores those and folds the
large job's events again from the stream, each event of each job exactly once."""

from __future__ import annotations

from typing import Any

import pytest
from strata.bus import Bus
from strata.bus.snapshots import job_key, load_job_snapshots, snapshot_bucket
from strata.config import load_settings
from strata.events import WorkerRegistered
from strata.events.ids import event_id
from strata.events.models import Event
from strata.services.projection import Projection
from structlog.testing import capture_logs

from tests.support import new_job

pytestmark = pytest.mark.nats

State = dict[str, list[str]]


class PerJob(Projection[State]):
    """The registrations of a few jobs, as each job's list of worker ids; `big` pads its
    job's part of the snapshot past any message size."""

    def __init__(self, name: str, jobs: set[str], big: str) -> None:
        super().__init__()
        self.name = name
        self.jobs = jobs
        self.big = big

    def initial_state(self) -> State:
        return {}

    def evolve(self, state: State, event: Event) -> State:
        if isinstance(event, WorkerRegistered) and event.job in self.jobs:
            state.setdefault(event.job, []).append(event.worker_id)
        return state

    def snapshot(self, state: State) -> dict[str, Any]:
        return {
            "v": 1,
            "jobs": [
                {
                    "job": job,
                    "workers": workers,
                    "padding": b"x" * (9 * 1024 * 1024 if job == self.big else 0),
                }
                for job, workers in state.items()
            ],
        }

    def restore(self, data: dict[str, Any]) -> State:
        assert data["v"] == 1
        return {part["job"]: list(part["workers"]) for part in data["jobs"]}


def registered(job: str, index: int) -> WorkerRegistered:
    return WorkerRegistered(
        id=event_id("test-snapshot", job, index),
        job=job,
        source="registry",
        ts=1,
        worker_id=f"w{index}",
        instance=f"p{index}",
        rank=index,
        world_size=index + 1,
        membership_epoch=index + 1,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )


async def test_an_oversized_jobs_part_is_left_out_and_the_others_restored(
    nats_url: str, bus: Bus
) -> None:
    small, large = new_job("small"), new_job("large")
    name = f"test-snapshots-{small}"
    settings = load_settings(nats_url=nats_url)
    first = PerJob(name, {small, large}, big=large)
    await first.start(bus, settings)
    try:
        await first.publish_all([registered(small, i) for i in range(30)])
        await first.publish_all([registered(large, i) for i in range(20)])
        with capture_logs() as logs:
            await first.save_snapshot()
        assert [e["job"] for e in logs if e["event"] == "snapshot_part_too_large"] == [large]
        # Events after the snapshot: folded from the stream at the next start.
        await first.publish_all([registered(small, i) for i in range(30, 40)])
        await first.publish_all([registered(large, i) for i in range(20, 25)])
        expected = {small: [f"w{i}" for i in range(40)], large: [f"w{i}" for i in range(25)]}
        assert first.state == expected
    finally:
        first._kv = None  # stopped without a snapshot of its own: the one above is restored
        await first.stop()

    kv = await snapshot_bucket(bus.js)
    stored = await load_job_snapshots(kv, name)
    assert stored is not None
    assert stored.replay == {large}
    assert [part["job"] for part in stored.data["jobs"]] == [small]
    assert (await kv.get(job_key(name, small))).value

    second = PerJob(name, {small, large}, big=large)
    await second.start(bus, settings)
    try:
        assert second.state == expected  # each event once, the large job's all from the stream
    finally:
        second._kv = None
        await second.stop()
