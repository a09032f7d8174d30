"""A small training job run for real against the services: what golden histories are made of.

Four workers register, load a sharded dataset, train, meet at barriers and (when the checkpoint
service is there) commit a checkpoint; then one worker goes silent, is failed by the registry,
breaks the barrier a survivor waits at, and its shards move. The survivors meet again and leave.
Every step goes through the SDK and the services, so every event in the stream is a real one.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import nats.js.errors
import strata
from strata.aio import DatasetRegistry as AsyncDatasetRegistry
from strata.events import BarrierArrived, decode_event, subjects

DATASET = "tokens"
WORKERS = ("w0", "w1", "w2", "w3")
VICTIM = "w3"
POLL_S = 0.02


def checkpoint_service_available() -> bool:
    """The checkpoint service and SDK import (they are optional in a partial checkout)."""
    try:
        importlib.import_module("strata.services.checkpoint.service")
        importlib.import_module("strata.checkpoint")
    except ImportError:
        return False
    return True


async def poll(condition: Callable[[], Awaitable[bool]], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not await condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(POLL_S)


@dataclass
class Scenario:
    job: str
    nats_url: str
    checkpoint_root: Path | None = None
    workers: dict[str, strata.aio.Worker] = field(default_factory=dict)

    async def start_workers(self) -> None:
        for index, worker_id in enumerate(WORKERS):
            self.workers[worker_id] = strata.aio.Worker(
                self.job,
                self.nats_url,
                worker_id=worker_id,
                hostname=f"node-{index // 2}",
                gpus=1,
            )
        await asyncio.gather(*(w.start() for w in self.workers.values()))

    async def load_and_train(self) -> None:
        first = self.workers[WORKERS[0]]
        await AsyncDatasetRegistry(first).register_dataset(
            DATASET, total_samples=4000, shard_size=100, shuffle=True, seed=7
        )

        async def one(worker: strata.aio.Worker) -> None:
            await worker.set_state("loading", step=0, epoch=0)
            registry = AsyncDatasetRegistry(worker)
            shards = (await registry.assignment(DATASET, epoch=0)).shards
            await worker.set_state("training", step=10, epoch=0)
            done = [span.shard_id for span in shards[:2]]
            await registry.report_progress(
                DATASET, 0, completed=done, partial={shards[2].shard_id: 40}
            )
            await worker.set_state("training", step=100, epoch=0)

        await asyncio.gather(*(one(w) for w in self.workers.values()))

    async def barrier(self, name: str, worker_ids: tuple[str, ...]) -> None:
        await asyncio.gather(*(self.workers[w].barrier(name, timeout=30) for w in worker_ids))

    async def checkpoint(self, step: int) -> None:
        if self.checkpoint_root is None:
            return
        from strata.aio import CheckpointManager as AsyncCheckpointManager

        managers = {
            worker_id: AsyncCheckpointManager(worker, str(self.checkpoint_root), keep_count=2)
            for worker_id, worker in self.workers.items()
        }

        async def save(worker_id: str) -> None:
            worker = self.workers[worker_id]
            await worker.set_state("checkpointing", step=step, epoch=0)
            await managers[worker_id].save(
                f"{worker_id}@{step}".encode() * 1000, step=step, epoch=0
            )
            await managers[worker_id].wait()
            await worker.set_state("training", step=step, epoch=0)

        await asyncio.gather(*(save(w) for w in self.workers))
        await managers[WORKERS[0]].wait_committed(step, timeout=30)
        for manager in managers.values():
            await manager.close()

    async def fail_victim(self) -> None:
        """The victim goes silent while a survivor waits at a barrier: failed, barrier broken."""
        waiter = self.workers[WORKERS[0]]
        waiting = asyncio.create_task(waiter.barrier("sync", timeout=30))
        arrivals = subjects.event_subject(self.job, "barrier.arrived")

        async def sync_opened() -> bool:
            # The barrier must be open (expecting the victim) before the victim goes silent.
            try:
                stored = await waiter.bus.js.get_last_msg(subjects.EVENTS_STREAM, arrivals)
            except nats.js.errors.NotFoundError:
                return False
            arrival = decode_event(stored.data or b"")
            return isinstance(arrival, BarrierArrived) and arrival.name == "sync"

        await poll(sync_opened, 10, "the survivor to wait at barrier 'sync'")
        self.workers[VICTIM]._suspend_heartbeats(True)
        with contextlib.suppress(strata.BarrierBroken):
            await waiting

    async def recover(self) -> None:
        survivors = [w for w in WORKERS if w != VICTIM]

        async def again(worker_id: str) -> None:
            worker = self.workers[worker_id]
            await worker.set_state("recovering", step=200, epoch=0)
            registry = AsyncDatasetRegistry(worker)
            await registry.assignment(DATASET, epoch=0)
            await worker.set_state("training", step=250, epoch=0)

        await asyncio.gather(*(again(w) for w in survivors))
        await self.barrier("epoch-end", tuple(survivors))

    async def stop(self) -> None:
        await asyncio.gather(*(w.stop() for w in self.workers.values()))

    async def run(self) -> None:
        """The whole story; the workers have left when it returns."""
        try:
            await self.start_workers()
            await self.load_and_train()
            await self.barrier("warmup", WORKERS)
            await self.checkpoint(step=100)
            await self.fail_victim()
            await self.recover()
        finally:
            await self.stop()
