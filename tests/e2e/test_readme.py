"""README.md's examples, run as written against a running stack."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.bus.server import NatsServer
from strata.config import Env

from tests.docs import write_example
from tests.support import new_job, running_services


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    """A stack of the test's own: the examples name their job ("resnet") as a user would."""
    with running_services(own_nats_server.url, tmp_path / "logs"):
        yield own_nats_server.url


def run(example: str, nats_url: str, directory: Path) -> str:
    script = write_example("README.md", example, directory)
    result = subprocess.run(
        [sys.executable, str(script)],
        cwd=directory,
        env={**os.environ, Env.NATS_URL: nats_url, Env.JOB: new_job("readme")},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_the_quickstart_commits_its_checkpoint(stack: str, tmp_path: Path) -> None:
    assert run("quickstart.py", stack, tmp_path).split() == [
        "committed",
        "5000",
        "with",
        "129",
        "shards",
        "read",
    ]
    assert list(tmp_path.glob("checkpoints/resnet/step-000000005000/MANIFEST.json"))


def test_the_implicit_worker_example_saves(stack: str, tmp_path: Path) -> None:
    assert run("implicit.py", stack, tmp_path).split()[:2] == ["saved", "by"]
    assert list(tmp_path.glob("checkpoints/*/step-000000005000/rank-00000.bin"))
