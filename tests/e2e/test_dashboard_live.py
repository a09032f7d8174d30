"""The dashboard's live group in headless Chromium, against a real registry, barrier service,
gateway and nats-server.

Three workers form a live group the way `LiveGroup` does (they meet at `live-<epoch>`), log a
loss by step, and report a discarded step; one leaves, the other two meet again (a shrink); a
replacement registers, the three meet and the replacement reports its heal from a peer. Every
event is recorded by the barrier service. The page shows the world size over time (3, 2, 3), the
changes listed with who and which step, and the loss chart marks the shrink, the growth and the
heal at their steps. It saves test-artifacts/dashboard/7-live-group.png.

Needs the built dashboard (`make dashboard`) and Chromium at /usr/bin/chromium.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest
import strata
from strata.bus.server import NatsServer
from strata.events.requests import LiveReportRequest, LiveReportResult, live_barrier

from tests.browser import chromium_page, dashboard_gateway, screenshot
from tests.support import new_job, wait_until

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'"
)

pytestmark = [pytest.mark.slow, pytest.mark.nats]

UI_TIMEOUT_MS = 20_000
DISCARDED = 41
HEALED_TO = 77


@pytest.fixture
def gateway_url(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with dashboard_gateway(own_nats_server.url, tmp_path, ("registry", "barrier")) as url:
        yield url


@pytest.fixture
def page() -> Iterator[Any]:
    with chromium_page() as page:
        yield page


def meet(group: list[strata.Worker]) -> tuple[int, int]:
    """The group meets as `LiveGroup` does, at the barrier of the newest epoch any of them knows
    (each waits until it has heard of that epoch); returns (membership epoch, generation)."""
    epoch = max(w.membership_epoch for w in group)
    wait_until(
        lambda: all(w.membership_epoch >= epoch for w in group), 30, "every member at the epoch"
    )
    name = live_barrier(epoch)
    with ThreadPoolExecutor(len(group)) as pool:
        generations = set(pool.map(lambda w: w.barrier(name, 30, expected=len(group)), group))
    (generation,) = generations
    return epoch, generation


def report(worker: strata.Worker, quorum: tuple[int, int], **fields: Any) -> None:
    request = LiveReportRequest(
        job=worker.job,
        worker_id=worker.id,
        membership_epoch=quorum[0],
        generation=quorum[1],
        lease=worker.lease,
        **fields,
    )
    worker.runner.run(
        worker.bus.rpc.call("barrier", "live", request, result=LiveReportResult, timeout=10.0)
    )


def live_view(gateway_url: str, job: str) -> dict[str, Any]:
    answer = httpx.get(f"{gateway_url}/api/dashboard", params={"job": job}, timeout=5)
    return answer.json()["live"] if answer.status_code == 200 else {"markers": [], "world": []}


def test_the_live_group_world_size_and_its_changes_on_the_dashboard(
    own_nats_server: NatsServer, gateway_url: str, page: Any
) -> None:
    expect = sync_api.expect
    job = new_job("live-dashboard")
    url = own_nats_server.url
    workers = [strata.Worker(job=job, nats_url=url, worker_id=f"w{i}") for i in range(3)]
    try:
        for worker in workers:
            worker.start()
        w0, w1, w2 = workers
        first = meet(workers)
        for step in range(0, HEALED_TO + 10):
            w0.log_metrics({"train_loss": 2.0 / (step + 1)}, step=step)
        # A peer was lost mid-step: the survivors discard it, and the group shrinks.
        report(w0, first, action="discarded", step=DISCARDED, reason="Connection closed by peer")
        report(w2, first, action="discarded", step=DISCARDED, reason="Connection closed by peer")
        w1.stop()
        meet([w0, w2])
        w3 = strata.Worker(job=job, nats_url=url, worker_id="w3")
        workers.append(w3)
        w3.start()
        grown = meet([w0, w2, w3])
        report(w3, grown, action="healed", step=HEALED_TO, from_step=0, source_worker="w0")

        wait_until(
            lambda: len(live_view(gateway_url, job)["markers"]) == 4, 30, "four live markers"
        )
        live = live_view(gateway_url, job)
        assert [p["world_size"] for p in live["world"]] == [3, 2, 3]
        assert [(m["kind"], m["step"]) for m in live["markers"]] == [
            ("discard", DISCARDED),
            ("shrink", DISCARDED - 1),
            ("grow", HEALED_TO),
            ("heal", HEALED_TO),
        ]

        page.goto(f"{gateway_url}/?job={job}")
        panel = page.get_by_test_id("live-group")
        expect(panel).to_contain_text("world 3", timeout=UI_TIMEOUT_MS)
        expect(panel).to_contain_text("3 groups formed · 1 heal · 1 step discarded")
        chart = page.get_by_test_id("live-world-chart")
        expect(chart).to_have_attribute("data-world-sizes", "3,2,3")
        expect(chart.get_by_test_id("live-dot")).to_have_count(4)
        changes = page.get_by_test_id("live-changes")
        expect(changes).to_contain_text(f"w1 left the group at step {DISCARDED - 1} (world 3 → 2")
        expect(changes).to_contain_text(f"w3 healed from w0: step 0 → {HEALED_TO}")
        expect(changes).to_contain_text(f"step {DISCARDED} discarded by w0, w2")

        loss_chart = page.get_by_test_id("training-chart-train_loss")
        markers = loss_chart.get_by_test_id("live-marker")
        expect(markers).to_have_count(3, timeout=UI_TIMEOUT_MS)
        expect(markers.nth(0)).to_have_attribute("data-kind", "shrink")
        expect(markers.nth(0)).to_have_attribute("data-step", str(DISCARDED - 1))
        expect(markers.nth(2)).to_have_attribute("data-kind", "heal")
        expect(markers.nth(2)).to_have_attribute("data-step", str(HEALED_TO))
        screenshot(page, "7-live-group")
    finally:
        for worker in workers:
            with contextlib.suppress(strata.StrataError):
                worker.stop()
