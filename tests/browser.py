"""Headless Chromium for the dashboard's tests: where it and the built dashboard are, how it
is started, and where its screenshots go.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from strata import procutil
from strata.config import Env

from tests.support import ServiceProcess, running_services

ROOT = Path(__file__).resolve().parents[1]
DIST_INDEX = ROOT / "dashboard" / "dist" / "index.html"
ARTIFACTS = ROOT / "test-artifacts" / "dashboard"
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]


VIEWPORT = {"width": 1440, "height": 1100}


def screenshot(page: Any, name: str) -> Path:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    path = ARTIFACTS / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    return path


@contextlib.contextmanager
def dashboard_gateway(nats_url: str, tmp_path: Path, services: tuple[str, ...]) -> Iterator[str]:
    """A gateway serving the built dashboard beside `services`, on a free port: its URL."""
    if not DIST_INDEX.is_file():
        pytest.fail(f"{DIST_INDEX.relative_to(ROOT)} is missing: build it with `make dashboard`")
    port = procutil.free_port()
    with running_services(nats_url, tmp_path, services):
        gateway = ServiceProcess("gateway", nats_url, tmp_path, env={Env.HTTP_PORT: str(port)})
        gateway.start()
        try:
            yield f"http://127.0.0.1:{port}"
        finally:
            gateway.stop()


@contextlib.contextmanager
def chromium_page() -> Iterator[Any]:
    """A page of headless Chromium (skipped where Chromium or playwright is missing)."""
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    sync_api = pytest.importorskip(
        "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'"
    )
    with sync_api.sync_playwright() as playwright:
        browser = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield browser.new_page(viewport=VIEWPORT)
        finally:
            browser.close()
