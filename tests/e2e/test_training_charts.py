"""The dashboard's training-metric charts in headless Chromium, against a real registry, gateway and
nats-server: two workers log a loss and a throughput per step; the page draws a line per rank and
the job's, draws them again after a reload (from the gateway's history: nothing is logged after
the reload, so nothing kept in the page could fill them), and a time-travel link shows only the
steps logged by the replayed event.

Needs the built dashboard (`make dashboard`; or set STRATA_TEST_DASHBOARD_DIST to another build,
served to the page in place of the gateway's) and Chromium at /usr/bin/chromium.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import strata
from strata import procutil
from strata.bus.server import NatsServer
from strata.config import Env

from tests.browser import ARTIFACTS, CHROMIUM, CHROMIUM_ARGS, VIEWPORT
from tests.support import ServiceProcess, new_job, running_services, wait_until

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'"
)

pytestmark = [pytest.mark.slow, pytest.mark.nats]

ROOT = Path(__file__).resolve().parents[2]
DIST = Path(os.environ.get("STRATA_TEST_DASHBOARD_DIST") or ROOT / "dashboard" / "dist")
UI_TIMEOUT_MS = 15_000


@pytest.fixture
def gateway_url(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    if not (DIST / "index.html").is_file():
        pytest.fail(f"{DIST} has no index.html: build the dashboard with `make dashboard`")
    port = procutil.free_port()
    with running_services(own_nats_server.url, tmp_path, ("registry",)):
        gateway = ServiceProcess(
            "gateway", own_nats_server.url, tmp_path, env={Env.HTTP_PORT: str(port)}
        )
        gateway.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            gateway.stop()


@pytest.fixture
def page(gateway_url: str) -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        opened = browser.new_page(viewport=VIEWPORT)
        if os.environ.get("STRATA_TEST_DASHBOARD_DIST"):
            opened.route(f"{gateway_url}/**", lambda route: serve_build(route, gateway_url))
        try:
            yield opened
        finally:
            browser.close()


def serve_build(route: Any, gateway_url: str) -> None:
    """The page's files from DIST; the API from the gateway."""
    path = route.request.url.removeprefix(gateway_url).split("?", 1)[0]
    if path.startswith("/api/"):
        route.continue_()
        return
    file = DIST / (path.lstrip("/") or "index.html")
    if not file.is_file():
        file = DIST / "index.html"
    types = {".js": "text/javascript", ".css": "text/css", ".html": "text/html"}
    route.fulfill(body=file.read_bytes(), content_type=types.get(file.suffix, "image/svg+xml"))


def log_steps(workers: list[strata.Worker], steps: range) -> None:
    for worker in workers:
        for step in steps:
            loss = 2.0 / (step + 1) + 0.1 * worker.rank
            worker.log_metrics({"loss": loss, "samples_per_s": 500.0 + worker.rank}, step=step)
        worker.flush_metrics()


def last_step(gateway_url: str, job: str) -> int | None:
    answer = httpx.get(f"{gateway_url}/api/jobs/{job}/metrics", timeout=5)
    if answer.status_code != 200 or "loss" not in answer.json()["metrics"]:
        return None
    steps: list[int] = answer.json()["metrics"]["loss"]["job"]["steps"]
    return steps[-1]


def state_change_seq(gateway_url: str, job: str) -> int | None:
    url = f"{gateway_url}/api/jobs/{job}/events"
    items = httpx.get(url, params={"type": "worker.state_changed"}, timeout=5).json()["items"]
    return items[0]["seq"] if items else None


def test_loss_and_throughput_charts_survive_a_reload_and_travel_in_time(
    own_nats_server: NatsServer, gateway_url: str, page: Any
) -> None:
    job = new_job("charts")
    url = own_nats_server.url
    with (
        strata.Worker(job=job, nats_url=url, worker_id="a", rank=0) as first,
        strata.Worker(job=job, nats_url=url, worker_id="b", rank=1) as second,
    ):
        workers = [first, second]
        log_steps(workers, range(30))
        wait_until(lambda: last_step(gateway_url, job) == 29, 15, "steps 0-29 at the gateway")
        # An event between the two halves, to travel back to.
        first.set_state("training", step=29)
        wait_until(lambda: state_change_seq(gateway_url, job) is not None, 15, "the event")
        travel_seq = state_change_seq(gateway_url, job)
        log_steps(workers, range(30, 60))
        wait_until(lambda: last_step(gateway_url, job) == 59, 15, "steps 30-59")

        loss = "[data-testid=training-chart-loss]"
        page.goto(f"{gateway_url}/?job={job}")
        page.wait_for_selector(f'{loss}[data-points="60"]', timeout=UI_TIMEOUT_MS)
        assert page.get_attribute(loss, "data-ranks") == "2"
        assert page.locator(f"{loss} path").count() == 3  # rank 0, rank 1, the job's mean
        throughput = page.locator("[data-testid=training-chart-samples_per_s]")
        assert throughput.get_attribute("data-last-step") == "59"
        assert "job total" in throughput.locator("xpath=..").inner_text()
        ARTIFACTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(ARTIFACTS / "training-metrics.png"), full_page=True)

        # Nothing is logged from here on: after a reload, only the gateway's history can
        # fill the charts.
        page.reload()
        page.wait_for_selector(f'{loss}[data-points="60"]', timeout=UI_TIMEOUT_MS)
        assert page.get_attribute(loss, "data-last-step") == "59"

        page.goto(f"{gateway_url}/?job={job}&seq={travel_seq}")
        page.wait_for_selector(f'{loss}[data-last-step="29"]', timeout=UI_TIMEOUT_MS)
        assert page.get_attribute(loss, "data-points") == "30"
        page.screenshot(path=str(ARTIFACTS / "training-metrics-replay.png"), full_page=True)
