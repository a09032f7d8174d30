"""What a worker's say can make the gateway keep: 40,000 heartbeats each from a fresh process of
a registered worker, and 40,000 metric samples each from a made-up worker, leave the read model
holding one beat (and at most `UNCLAIMED_BEATS` beats of unknown processes) and no sample: what
it keeps (its beats, its metric history's bytes as `MetricHistory.bytes` counts them, measured
in `tests/unit/test_metric_history.py`) stays at what the one registered worker accounts for."""

from __future__ import annotations

import asyncio
import time
import uuid

import pytest
from strata.bus import Bus
from strata.events import MetricSampled, WorkerHeartbeat, WorkerRegistered, encode_event, subjects
from strata.services.gateway.live import LiveModel
from strata.services.readmodel.state import UNCLAIMED_BEATS

pytestmark = pytest.mark.nats

FLOOD = 40_000
"""Ten times the unclaimed beats kept, and below the telemetry stream's 50,000 messages a subject
(`TELEMETRY_MAX_MSGS_PER_SUBJECT`): a gateway lagging on a loaded machine must still see each."""


async def wait_for(condition: object, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.1)


async def test_heartbeats_of_fresh_instances_and_samples_of_made_up_workers_are_not_kept(
    bus: Bus,
) -> None:
    job = f"flood-{uuid.uuid4().hex[:8]}"
    live = await LiveModel().start(bus)
    try:
        registered = WorkerRegistered(
            job=job,
            source="registry",
            worker_id="w-0",
            instance="real-process",
            rank=0,
            world_size=1,
            membership_epoch=1,
            heartbeat_interval=1.0,
            heartbeat_timeout=5.0,
        )
        await bus.publish(registered)
        await wait_for(lambda: live.registered(job, "w-0"), 30, "the registration folded")
        state = live.job(job)
        assert state is not None
        history = live.metric_history

        beat_subject = subjects.heartbeat_subject(job, "w-0")
        for i in range(FLOOD):
            beat = WorkerHeartbeat(
                job=job,
                source="w-0",
                worker_id="w-0",
                instance=f"i{i}",
                seq=i,
                state="training",
                step=i,
            )
            await bus.nc.publish(beat_subject, encode_event(beat))
            made_up = f"ghost-{i}"
            sample = MetricSampled(
                job=job, source=made_up, worker_id=made_up, name="loss", value=1.0, step=i
            )
            await bus.nc.publish(
                subjects.metric_subject(job, made_up, "loss"), encode_event(sample)
            )
            if i % 5000 == 0:
                await bus.nc.flush()
        # The real process's beat, last: the one kept.
        last = WorkerHeartbeat(
            job=job,
            source="w-0",
            worker_id="w-0",
            instance="real-process",
            seq=FLOOD,
            state="training",
            step=7,
        )
        await bus.nc.publish(beat_subject, encode_event(last))
        await bus.nc.flush()
        await wait_for(
            lambda: state.beats_ignored >= FLOOD and history.unregistered >= FLOOD,
            300,
            "the gateway to fold both floods",
        )
        await wait_for(lambda: "w-0" in state.beats, 30, "the real process's beat")
        assert list(state.beats) == ["w-0"]
        assert len(state.unclaimed) <= UNCLAIMED_BEATS
        assert state.beats["w-0"][0] == "real-process"
        assert history.view(job) is None
        assert history.bytes == 0
        # The made-up workers' samples made no job, metric or series either.
        assert history.jobs.get(job) is None
        rows = live.static_dashboard(state)["workers"]
        assert [(row["id"], row["step"]) for row in rows] == [("w-0", 7)]
    finally:
        await live.stop()
