"""The framework examples of docs/frameworks.md as real jobs: 2 ranks on gloo under torchrun
against the real services. A rank SIGKILLed mid-epoch, torchrun restarting the group: every sample
exactly once per epoch (the model's own ledger, saved with it), the same weights on every rank,
resumed from a committed step. A framework's default that would split Strata's shards again stops
at the first batch with a clear error, before any progress is recorded."""

from __future__ import annotations

import os
import re
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.bus.server import NatsServer

from tests.docs import write_example
from tests.e2e.test_torchrun import Torchrun, committed_steps, verdict
from tests.support import new_job, running_services, wait_until

RESUMED = re.compile(r"rank (\d+): resumed from step (\d+)")

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with running_services(own_nats_server.url, tmp_path / "logs"):
        yield own_nats_server.url


@pytest.mark.parametrize(
    ("framework", "example"),
    [("lightning", "train_lightning.py"), ("accelerate", "train_accelerate.py")],
)
def test_a_rank_killed_mid_epoch_resumes_and_every_sample_counts_once(
    stack: str, tmp_path: Path, framework: str, example: str
) -> None:
    pytest.importorskip(framework)
    script = write_example("docs/frameworks.md", example, tmp_path)
    job = new_job(framework)
    run = Torchrun(script, stack, job, tmp_path, procs=2)
    try:
        wait_until(lambda: bool(committed_steps(tmp_path, job)), 180, "a first checkpoint")
        victim = run.rank_pid(1)
        assert victim is not None, run.output()
        os.kill(victim, signal.SIGKILL)
        assert run.wait(300) == 0, run.output()[-6000:]
    finally:
        run.kill_all()
    assert "exitcode: -9" in run.output(), "torchrun never saw the rank die"
    verdict(run, ranks=2)
    resumed = {int(m[1]): int(m[2]) for m in RESUMED.finditer(run.output())}
    assert sorted(resumed) == [0, 1], "the restarted group did not resume from a checkpoint"
    assert len(set(resumed.values())) == 1
    # A step of a committed checkpoint (saved every 10 steps; retention may have pruned it since).
    step = next(iter(resumed.values()))
    assert step > 0
    assert step % 10 == 0
