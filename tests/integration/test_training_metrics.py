"""Training metrics from the SDK against a real registry and nats-server: `log_metrics` returns
at once, its samples land on the telemetry stream as `metric.sampled` events carrying their step,
published in batches (not one publish per call), and the last ones go out when the worker stops.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import strata
from strata.bus import Bus
from strata.events import MetricSampled, subjects
from strata.history import stream_records

from tests import support
from tests.support import async_wait_until, running_services

pytestmark = pytest.mark.nats


@pytest.fixture(scope="module")
def registry(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    with running_services(nats_url, tmp_path_factory.mktemp("metrics"), ("registry",)):
        yield


async def samples(bus: Bus, job: str, worker: str = "*") -> list[MetricSampled]:
    """The `metric.sampled` events of `job` stored on the telemetry stream, oldest first."""
    found: list[MetricSampled] = []
    records = stream_records(bus.js, "telemetry", subjects.worker_metrics(job, worker))
    async for record in records:
        assert isinstance(record.event, MetricSampled)
        found.append(record.event)
    return found


async def test_sync_worker_logs_batched_samples_with_their_step(
    registry: None, nats_url: str, bus: Bus
) -> None:
    job = support.new_job("metrics")
    steps = 300
    slowest = 0.0
    with strata.Worker(job=job, nats_url=nats_url, worker_id="w0") as worker:
        for step in range(steps):
            began = time.perf_counter()
            worker.log_metrics({"loss": 1.0 / (step + 1), "samples_per_s": 800 + step}, step=step)
            slowest = max(slowest, time.perf_counter() - began)
        batches_while_training = worker.aio._metrics.batches
    assert worker.metrics_published == 2 * steps
    # Never a round trip per call: the training thread only appends to a buffer.
    assert slowest < 0.05, f"a log_metrics call took {slowest * 1000:.1f} ms"
    # 600 samples in at most a few flushes (a tick may fall inside the loop), then one at stop.
    assert batches_while_training <= 3
    stored = await samples(bus, job)
    assert len(stored) == 2 * steps
    loss = {s.step: s.value for s in stored if s.name == "loss"}
    assert loss == {step: 1.0 / (step + 1) for step in range(steps)}
    throughput = sorted((s.step, s.value) for s in stored if s.name == "samples_per_s")
    assert throughput[-1] == (steps - 1, 800.0 + steps - 1)
    assert {(s.source, s.worker_id) for s in stored} == {("w0", "w0")}


async def test_async_worker_publishes_within_a_second_without_a_flush(
    registry: None, nats_url: str, bus: Bus
) -> None:
    job = support.new_job("metrics")
    async with strata.aio.Worker(job, nats_url, worker_id="w1") as worker:
        await worker.set_state("training", step=41)
        await worker.log_metrics({"loss": 0.5})  # the step recorded with set_state
        await worker.log_metrics({"loss": 0.25}, step=42)

        async def landed() -> bool:
            return len(await samples(bus, job, "w1")) == 2

        began = time.monotonic()
        await async_wait_until(landed, 5.0, "the samples on the telemetry stream")
        assert time.monotonic() - began < 3.0
        stored = await samples(bus, job, "w1")
        assert [(s.step, s.value) for s in stored] == [(41, 0.5), (42, 0.25)]
        assert worker.metrics_published == 2


async def test_log_metrics_before_start_says_to_start(nats_url: str) -> None:
    worker = strata.aio.Worker(support.new_job("metrics"), nats_url, worker_id="w2")
    with pytest.raises(strata.aio.WorkerNotStarted, match="start"):
        await worker.log_metrics({"loss": 1.0}, step=1)
