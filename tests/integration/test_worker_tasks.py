"""A worker whose background task died says so on the next call: `strata.BackgroundTaskFailed`
(code `background_task_failed`) with the task's exception as its cause, logged once with the
traceback. Stopping still leaves the job, and a worker started again runs fresh tasks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import pytest
import strata
import structlog

from tests import support
from tests.integration.faulty_service import InjectedFault, fail_task
from tests.support import ServiceProcess

pytestmark = pytest.mark.nats

DEADLINE_S = 30.0


@pytest.fixture(scope="module")
def registry(nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[ServiceProcess]:
    process = ServiceProcess("registry", nats_url, tmp_path_factory.mktemp("registry"))
    process.start()
    yield process
    process.stop()


@pytest.fixture
async def worker(registry: ServiceProcess, nats_url: str) -> AsyncIterator[strata.aio.Worker]:
    made = strata.aio.Worker(job=support.new_job("tasks"), nats_url=nats_url)
    await made.start()
    yield made
    await made.stop()


def calls(worker: strata.aio.Worker) -> dict[str, Callable[[], Awaitable[Any]]]:
    """Every call that checks the worker's tasks first."""

    async def lease() -> Any:
        return worker.lease

    return {
        "set_state": lambda: worker.set_state("training", step=2),
        "log_metrics": lambda: worker.log_metrics({"loss": 0.5}),
        "flush_metrics": worker.flush_metrics,
        "barrier": lambda: worker.barrier("after-the-fault", timeout=5),
        "lease": lease,
    }


@pytest.mark.parametrize("task", ["heartbeat", "metrics"])
async def test_a_dead_task_is_raised_with_its_cause_by_the_next_call(
    worker: strata.aio.Worker, nats_url: str, task: str
) -> None:
    await worker.set_state("training", step=1)
    await worker.log_metrics({"loss": 1.0})
    victim = next(
        t for t in worker._tasks.tasks if t.get_name().startswith(f"strata-worker-{task}")
    )
    with structlog.testing.capture_logs() as logs:
        await fail_task(victim, lambda: InjectedFault(f"the {task} task's fault"))
        await asyncio.wait([victim], timeout=DEADLINE_S)
    assert victim.done()
    for name, call in calls(worker).items():
        with pytest.raises(strata.BackgroundTaskFailed) as raised:
            await call()
        assert raised.value.code == "background_task_failed", name
        assert isinstance(raised.value.__cause__, InjectedFault), name
        assert f"strata-worker-{task}-{worker.id}" in raised.value.message, name
    failed = [entry for entry in logs if entry["event"] == "task_failed"]
    assert len(failed) == 1
    assert isinstance(failed[0]["exc_info"], InjectedFault)

    job = worker.job
    await worker.stop()  # stopping does not raise it, and still leaves the job
    async with strata.aio.Worker(job=job, nats_url=nats_url) as other:
        members = await other.members()
        assert [m.worker_id for m in members.members] == [other.id]
    await worker.start()  # fresh tasks
    await worker.set_state("training", step=3)
    assert worker.lease is not None


def test_the_sync_worker_raises_it_too(registry: ServiceProcess, nats_url: str) -> None:
    with strata.Worker(job=support.new_job("tasks"), nats_url=nats_url) as worker:
        worker.set_state("training", step=1)
        victim = worker.aio._heartbeat_task
        assert victim is not None
        loop = victim.get_loop()
        injected = asyncio.run_coroutine_threadsafe(
            fail_task(victim, lambda: InjectedFault("the sync worker's heartbeats")), loop
        )
        injected.result(DEADLINE_S)
        # Seen dead by its supervisor on the worker's loop thread, which is not this one.
        support.wait_until(
            lambda: worker.aio._tasks.failure is not None, DEADLINE_S, "the death to be seen"
        )
        with pytest.raises(strata.BackgroundTaskFailed) as raised:
            worker.set_state("training", step=2)
        assert isinstance(raised.value.__cause__, InjectedFault)
