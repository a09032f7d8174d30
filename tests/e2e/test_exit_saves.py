"""A script that saves a checkpoint through the implicit worker and simply ends: the interpreter's
exit waits for the save, so the checkpoint commits (the seeds' three lines, in a real process
against the real services)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.bus.server import NatsServer
from strata.config import Env

from tests.support import new_job, running_services

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with running_services(own_nats_server.url, tmp_path / "logs"):
        yield own_nats_server.url


def run_script(
    source: str, nats_url: str, job: str, tmp_path: Path
) -> subprocess.CompletedProcess[str]:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(source), encoding="utf-8")
    env = {**os.environ, Env.NATS_URL: nats_url, Env.JOB: job}
    env.pop(Env.RANK, None)
    return subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


def test_the_implicit_workers_save_commits_when_the_script_just_ends(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("exit")
    store = tmp_path / "checkpoints"
    done = run_script(
        f"""
        import strata

        checkpoints = strata.CheckpointManager(path={str(store)!r}, keep_count=5)
        checkpoints.save(b"weights" * 1_000_000, step=1, epoch=0)
        """,
        stack,
        job,
        tmp_path,
    )
    assert done.returncode == 0, done.stderr
    check = run_script(
        f"""
        import strata

        checkpoints = strata.CheckpointManager(path={str(store)!r})
        latest = checkpoints.latest()
        print("latest", None if latest is None else latest.step)
        print("bytes", len(checkpoints.load(step=1, rank=0)))
        """,
        stack,
        job,
        tmp_path,
    )
    assert check.returncode == 0, check.stderr
    assert "latest 1" in check.stdout, (done.stderr, check.stdout)
    assert f"bytes {7_000_000}" in check.stdout


def test_a_save_that_cannot_finish_by_the_exit_is_reported_loudly(
    stack: str, tmp_path: Path
) -> None:
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the checkpoints' directory should be", encoding="utf-8")
    done = run_script(
        f"""
        import strata

        checkpoints = strata.CheckpointManager(path={str(blocker / "ckpt")!r}, keep_count=5)
        checkpoints.save(b"weights" * 1_000, step=1, epoch=0)
        """,
        stack,
        new_job("exit"),
        tmp_path,
    )
    assert "checkpoint_save_lost_at_exit" in done.stderr, done.stderr
    assert "step of that save aborts" in done.stderr
