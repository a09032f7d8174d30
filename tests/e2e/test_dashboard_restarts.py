"""The dashboard's restarts, steps and landing page in headless Chromium, against a real registry,
gateway and nats-server and real worker processes.

Two worker processes train a job by logging metrics only (`log_metrics(step=...)`, never
`set_state`); a newer job whose worker has left sits beside it. The page opened with no job lands
on the running one, shows the workers' steps from their metrics and the loss chart first. One
worker is SIGKILLed: the overview shows the rank lost; a replacement process registers and resumes
from an earlier step: the overview counts a restart, and the training charts mark it and shade the
steps trained again. It saves test-artifacts/dashboard/6-restart.png.

Needs the built dashboard (`make dashboard`) and Chromium at /usr/bin/chromium.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import strata
from strata import procutil
from strata.bus.server import NatsServer
from strata.config import Env

from tests.browser import chromium_page, dashboard_gateway, screenshot
from tests.support import (
    HEARTBEAT_INTERVAL,
    HEARTBEAT_TIMEOUT,
    new_job,
    wait_until,
)

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'"
)

pytestmark = [pytest.mark.slow, pytest.mark.nats]

UI_TIMEOUT_MS = 20_000
RESUMED_AT = 10
"""The step the replacement starts from, as if from a checkpoint of that step."""

# Training paced by the loop, logging metrics only: the step the dashboard shows comes from them.
WORKER_SCRIPT = """
import os, sys, time
import strata
worker_id, step = sys.argv[1], int(sys.argv[2])
with strata.Worker(job=os.environ["STRATA_JOB"], worker_id=worker_id) as worker:
    print("training as rank", worker.rank, flush=True)
    while True:
        worker.log_metrics({"epoch": 0, "lr": 0.01, "train_loss": 2.0 / (step + 1)}, step=step)
        step += 1
        time.sleep(0.05)
"""


class Workers:
    def __init__(self, nats_url: str, job: str, log_dir: Path) -> None:
        self.nats_url = nats_url
        self.job = job
        self.log_dir = log_dir
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, worker_id: str, first_step: int = 0) -> None:
        env = {
            **os.environ,
            Env.NATS_URL: self.nats_url,
            Env.JOB: self.job,
            Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL),
            Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT),
        }
        with (self.log_dir / f"{worker_id}.log").open("ab") as log:
            self.procs[worker_id] = subprocess.Popen(
                [sys.executable, "-c", WORKER_SCRIPT, worker_id, str(first_step)],
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                preexec_fn=procutil.child_preexec,
            )

    def check_running(self) -> None:
        for worker_id, proc in self.procs.items():
            if proc.poll() is not None and proc.returncode != -signal.SIGKILL:
                log = (self.log_dir / f"{worker_id}.log").read_text(errors="replace")[-3000:]
                pytest.fail(f"worker {worker_id} exited {proc.returncode}:\n{log}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            procutil.terminate(proc, timeout=10)


@pytest.fixture
def gateway_url(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with dashboard_gateway(own_nats_server.url, tmp_path, ("registry",)) as url:
        yield url


@pytest.fixture
def page() -> Iterator[Any]:
    with chromium_page() as page:
        yield page


def dashboard(gateway_url: str, job: str) -> dict[str, Any]:
    answer = httpx.get(f"{gateway_url}/api/dashboard", params={"job": job}, timeout=5)
    return answer.json() if answer.status_code == 200 else {"workers": [], "figures": None}


def steps(gateway_url: str, job: str) -> dict[str, tuple[str, int]]:
    return {w["id"]: (w["status"], w["step"]) for w in dashboard(gateway_url, job)["workers"]}


def test_restart_markers_lost_ranks_steps_from_metrics_and_the_landing_job(
    own_nats_server: NatsServer, gateway_url: str, page: Any, tmp_path: Path
) -> None:
    expect = sync_api.expect
    job = new_job("restarts")
    workers = Workers(own_nats_server.url, job, tmp_path)
    try:
        # One after the other, so that w0 registers first and holds rank 0, w1 rank 1.
        workers.start("w0")
        wait_until(lambda: "w0" in steps(gateway_url, job), 60, "w0 registered")
        workers.start("w1")

        def both_past_step_20() -> bool:
            workers.check_running()
            found = steps(gateway_url, job)
            return len(found) == 2 and all(step >= 20 for _, step in found.values())

        wait_until(both_past_step_20, 60, "both workers past step 20 from their metrics alone")
        # A newer job, no longer running: the landing page passes it by.
        with strata.Worker(job=new_job("finished"), nats_url=own_nats_server.url) as done:
            done.log_metrics({"loss": 1.0}, step=1)

        page.goto(gateway_url)
        expect(page.get_by_test_id("job-picker")).to_have_value(job, timeout=UI_TIMEOUT_MS)
        expect(page.get_by_test_id("card-step")).to_contain_text(
            re.compile(r"^Step · epoch\s*([2-9]\d|\d{3,}) · 0"), timeout=UI_TIMEOUT_MS
        )
        expect(page.get_by_test_id("card-restarts")).to_contain_text("no rank lost")
        charts = page.locator("[data-testid^=training-chart-]")
        expect(charts).to_have_count(3, timeout=UI_TIMEOUT_MS)
        expect(charts.first).to_have_attribute("data-testid", "training-chart-train_loss")
        expect(charts.nth(1)).to_have_attribute("data-testid", "training-chart-epoch")

        # Rank 1's process is killed: the registry fails it, the overview shows the rank lost.
        workers.procs["w1"].send_signal(signal.SIGKILL)
        workers.procs["w1"].wait()
        wait_until(lambda: steps(gateway_url, job)["w1"][0] == "failed", 30, "w1 failed in the API")
        restarts = page.get_by_test_id("card-restarts")
        expect(restarts).to_contain_text("0 · 1 rank lost", timeout=UI_TIMEOUT_MS)
        expect(restarts).to_contain_text(re.compile(r"rank 1 lost at step \d+"))
        lost_step = dashboard(gateway_url, job)["losses"][0]["step"]
        assert lost_step >= 20

        # A replacement takes the free rank and resumes from an earlier step.
        workers.start("w1-again", first_step=RESUMED_AT)
        expect(restarts).to_contain_text("1 · 1 rank lost", timeout=UI_TIMEOUT_MS)
        expect(restarts).to_contain_text(re.compile(r"rank 1 restarted .* resumed at step \d+"))
        (restart,) = dashboard(gateway_url, job)["restarts"]
        assert restart["ranks"] == [1]
        assert restart["step_reached"] == lost_step
        assert RESUMED_AT <= restart["resumed_step"] < lost_step

        loss_chart = page.get_by_test_id("training-chart-train_loss")
        expect(loss_chart.get_by_test_id("restart-marker")).to_have_count(1)
        shaded = loss_chart.get_by_test_id("retrained-steps")
        expect(shaded).to_have_attribute("data-from", str(restart["resumed_step"]))
        expect(shaded).to_have_attribute("data-to", str(lost_step))
        # The two processes of rank 1 are two lines, each named.
        legend = page.locator("figure", has=loss_chart).locator(".chart-legend")
        expect(legend).to_contain_text("rank 1 (w1)")
        expect(legend).to_contain_text("rank 1 (w1-again)")
        screenshot(page, "6-restart")
        workers.check_running()
    finally:
        workers.stop()
