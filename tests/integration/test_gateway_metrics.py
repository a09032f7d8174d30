"""The gateway's training-metrics history against a real registry, gateway process and
nats-server: workers' `log_metrics` samples become per-rank and job series at
`/api/jobs/{job}/metrics`, the same after a gateway restart (what a page reload sees is server-side
history, rebuilt from the telemetry stream), and time travel shows only what was stored by then.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import strata
from strata import procutil
from strata.bus.server import NatsServer
from strata.config import Env

from tests.support import ServiceProcess, new_job, running_services, wait_until

pytestmark = pytest.mark.nats


class GatewayProcess(ServiceProcess):
    def __init__(self, nats_url: str, log_dir: Path) -> None:
        self.http_port = procutil.free_port()
        super().__init__("gateway", nats_url, log_dir, env={Env.HTTP_PORT: str(self.http_port)})

    def metrics(self, job: str, **params: Any) -> httpx.Response:
        url = f"http://127.0.0.1:{self.http_port}/api/jobs/{job}/metrics"
        return httpx.get(url, params=params, timeout=10)


@pytest.fixture
def gateway(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[GatewayProcess]:
    """A registry (which provisions the streams the gateway waits for) and a gateway."""
    with running_services(own_nats_server.url, tmp_path / "logs", ("registry",)):
        process = GatewayProcess(own_nats_server.url, tmp_path)
        process.start()
        yield process
        process.stop()


def steps_seen(gateway: GatewayProcess, job: str, name: str = "loss") -> list[int]:
    answer = gateway.metrics(job)
    if answer.status_code != 200:
        return []
    series = answer.json()["metrics"].get(name)
    return series["job"]["steps"] if series else []


def train(worker: strata.Worker, steps: range) -> None:
    for step in steps:
        rank = worker.rank
        worker.log_metrics(
            {"loss": 10.0 / (step + 1) + rank, "samples_per_s": 100.0 * (rank + 1)}, step=step
        )
    worker.flush_metrics()


def test_history_per_rank_survives_a_restart_and_travels_in_time(
    own_nats_server: NatsServer, tmp_path: Path, gateway: GatewayProcess
) -> None:
    job = new_job("curves")
    url = own_nats_server.url
    with (
        strata.Worker(job=job, nats_url=url, worker_id="a", rank=0) as first,
        strata.Worker(job=job, nats_url=url, worker_id="b", rank=1) as second,
    ):
        for worker in (first, second):
            train(worker, range(0, 50))
        wait_until(lambda: steps_seen(gateway, job)[-1:] == [49], 15, "steps 0-49 at the gateway")
        cut = time.time_ns()
        for worker in (first, second):
            train(worker, range(50, 100))
        wait_until(lambda: steps_seen(gateway, job)[-1:] == [99], 15, "steps 50-99")

        answer = gateway.metrics(job)
        assert answer.status_code == 200
        live = answer.json()
        loss = live["metrics"]["loss"]
        assert [(w["worker"], w["rank"]) for w in loss["workers"]] == [("a", 0), ("b", 1)]
        assert loss["stride"] == 1
        assert loss["workers"][1]["values"][:2] == [10.0 + 1, 5.0 + 1]
        assert loss["job"]["mean"][0] == 10.5  # ranks 0 and 1 at step 0: 10 and 11
        throughput = live["metrics"]["samples_per_s"]["job"]
        assert set(throughput["total"]) == {300.0}  # 100 + 200 samples/s every step

        # Time travel: the history as stored when the first 50 steps were in.
        then = gateway.metrics(job, until_ns=cut).json()
        assert then["metrics"]["loss"]["job"]["steps"] == list(range(50))

        # A restarted gateway rebuilds the same history from the telemetry stream.
        gateway.stop()
        gateway.start()
        wait_until(lambda: steps_seen(gateway, job)[-1:] == [99], 15, "the rebuilt history")
        assert gateway.metrics(job).json() == live
        assert gateway.metrics(job, until_ns=cut).json() == then

        only = gateway.metrics(job, names="samples_per_s").json()
        assert list(only["metrics"]) == ["samples_per_s"]
        refused = gateway.metrics(job, until_ns=-1)
        assert refused.status_code == 422
        assert refused.json()["code"] == "invalid_field"
        openapi = httpx.get(f"http://127.0.0.1:{gateway.http_port}/openapi.json").json()
        route = openapi["paths"]["/api/jobs/{job}/metrics"]["get"]
        assert route["responses"]["200"]["content"]["application/json"]["schema"] == {
            "$ref": "#/components/schemas/MetricsHistoryView"
        }
        missing = gateway.metrics(new_job("none"))
        assert missing.status_code == 404
        assert missing.json()["code"] == "not_found"
