"""The services' training-level Prometheus metrics, scraped from real service processes on a real
nats-server while a small job trains: workers by status (registry), the barrier wait (barrier),
checkpoint commit time and bytes and aborted checkpoints (checkpoint), shards moved (sharding).
Each is parsed with prometheus_client's own parser and checked against what the job did.
"""

from __future__ import annotations

import asyncio
import urllib.request
from pathlib import Path

import pytest
import strata.aio
from prometheus_client.parser import text_string_to_metric_families
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.events import BarrierArrived, ShardPlanChanged

from tests.support import (
    ServiceProcess,
    async_wait_until,
    job_events,
    new_job,
    running_services,
    start_workers,
)

pytestmark = [pytest.mark.nats, pytest.mark.slow]


def scrape(service: ServiceProcess) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of a service's /metrics: (sample name, labels) -> value."""
    url = f"http://127.0.0.1:{service.health_port}/metrics"
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def value(service: ServiceProcess, name: str, **labels: str) -> float | None:
    return scrape(service).get((name, frozenset(labels.items())))


def payload(rank: int, step: int) -> bytes:
    return bytes([rank]) * (10_000 + 1000 * rank + step)


async def test_services_export_what_the_job_did(
    own_nats_server: NatsServer, tmp_path: Path, workers: list[strata.aio.Worker]
) -> None:
    job = new_job("prom")
    with running_services(own_nats_server.url, tmp_path / "logs") as started:
        service = {process.name: process for process in started}
        made = await start_workers(workers, job, own_nats_server.url, ["r0", "r1", "r2"])
        await made[0].set_state("training", step=1)

        async def statuses_are(expected: dict[str, float]) -> bool:
            found = {
                status: value(service["registry"], "strata_workers", job=job, status=status)
                for status in expected
            }
            return found == expected

        await async_wait_until(
            lambda: statuses_are({"training": 1, "idle": 2, "left": 0, "failed": 0}),
            10,
            "the registry to count one training and two idle workers",
        )

        # Shards: a plan over three workers, then one leaves and its shards move.
        datasets = strata.aio.DatasetRegistry(made[0])
        await datasets.register_dataset("ds", total_samples=600, shard_size=10, seed=3)
        for worker in made:
            await strata.aio.DatasetRegistry(worker).assignment("ds", epoch=0)

        # A barrier whose last participant comes at least 0.3 s after the first: the service
        # records both first arrivals (their events stored) before the 0.3 s begin, and the last
        # is sent after they end, so its first-arrival-to-release time covers them.
        first = [asyncio.create_task(w.barrier("sync", timeout=20)) for w in made[:2]]
        async with await Bus.connect(own_nats_server.url, deadline=10) as watcher:

            async def both_arrived() -> bool:
                arrivals = [
                    e
                    for e in await job_events(watcher, job)
                    if isinstance(e, BarrierArrived) and e.name == "sync"
                ]
                return len(arrivals) == 2

            await async_wait_until(both_arrived, 20, "the barrier to record two arrivals")
        await asyncio.sleep(0.3)
        await asyncio.gather(made[2].barrier("sync", timeout=20), *first)
        wait_sum = value(service["barrier"], "strata_barrier_wait_seconds_sum", job=job)
        assert value(service["barrier"], "strata_barrier_wait_seconds_count", job=job) == 1
        assert wait_sum is not None
        assert 0.3 <= wait_sum < 10

        # One committed checkpoint, then one aborted by a participant leaving before its save.
        root = tmp_path / "checkpoints"
        managers = [strata.aio.CheckpointManager(w, str(root)) for w in made]
        for rank, manager in enumerate(managers):
            await manager.save(payload(rank, 1), step=1)
        await managers[0].wait_committed(1, timeout=30)
        await managers[0].save(payload(0, 2), step=2)
        await managers[0].wait()
        await made[2].stop()

        async def aborted() -> bool:
            answer = await managers[0].status(2)
            return bool(answer.checkpoint and answer.checkpoint.status == "aborted")

        await async_wait_until(aborted, 20, "step 2 to be aborted")
        checkpoint = service["checkpoint"]
        assert value(checkpoint, "strata_checkpoint_committed_bytes_total", job=job) == sum(
            len(payload(rank, 1)) for rank in range(3)
        )
        assert value(checkpoint, "strata_checkpoint_commit_seconds_count", job=job) == 1
        commit_s = value(checkpoint, "strata_checkpoint_commit_seconds_sum", job=job)
        assert commit_s is not None
        assert 0 < commit_s < 30
        assert value(checkpoint, "strata_checkpoints_aborted_total", job=job) == 1

        await async_wait_until(
            lambda: statuses_are({"training": 1, "idle": 1, "left": 1}),
            10,
            "the registry to count the worker that left",
        )

        bus = await Bus.connect(own_nats_server.url)
        try:

            async def replanned() -> list[ShardPlanChanged]:
                return [e for e in await job_events(bus, job) if isinstance(e, ShardPlanChanged)]

            async def moved_after_leave() -> bool:
                return any("r2" not in p.members for p in await replanned())

            await async_wait_until(moved_after_leave, 20, "the re-plan without r2")
            moved = sum(p.moved_shards for p in await replanned())
        finally:
            await bus.close()
        assert moved > 0
        assert value(service["sharding"], "strata_shards_moved_total", job=job) == moved
