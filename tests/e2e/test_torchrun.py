"""The DDP example of docs/sdk.md under real torchrun: a rank SIGKILLed mid-epoch, and a 3-rank job
relaunched with 2 ranks. Both must finish with every sample of every epoch in the model exactly
once and the same parameters on every rank (the example checks its own `seen` ledger; this test
reads its verdict and compares the weights).
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.bus.server import NatsServer

from tests.docs import write_example
from tests.support import new_job, running_services, wait_until
from tests.torchrun import RESULT, Torchrun, committed_steps, verdict

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with running_services(own_nats_server.url, tmp_path / "logs"):
        yield own_nats_server.url


@pytest.fixture
def example(tmp_path: Path) -> Path:
    return write_example("docs/sdk.md", "train_ddp.py", tmp_path)


def test_a_rank_killed_mid_epoch_restarts_the_group_and_every_sample_counts_once(
    stack: str, example: Path, tmp_path: Path
) -> None:
    job = new_job("ddp")
    run = Torchrun(example, stack, job, tmp_path, procs=3)
    try:
        wait_until(lambda: bool(committed_steps(tmp_path, job)), 180, "a first checkpoint")
        victim = run.rank_pid(1)
        assert victim is not None, run.output()
        os.kill(victim, signal.SIGKILL)
        assert run.wait(300) == 0, run.output()[-6000:]
    finally:
        run.kill_all()
    # torchrun notes the killed rank, then restarts the group (it logs nothing about that).
    assert "exitcode: -9" in run.output(), "torchrun never saw the rank die"
    verdict(run, ranks=3)


def test_a_three_rank_job_relaunched_with_two_ranks_goes_on_from_its_checkpoint(
    stack: str, example: Path, tmp_path: Path
) -> None:
    job = new_job("ddp")
    first = Torchrun(example, stack, job, tmp_path, procs=3)
    try:
        wait_until(lambda: bool(committed_steps(tmp_path, job)), 180, "a first checkpoint")
    finally:
        first.kill_all()
    assert not RESULT.search(first.output()), "the first run finished before it was killed"
    second = Torchrun(example, stack, job, tmp_path, procs=2)
    try:
        assert second.wait(300) == 0, second.output()[-6000:]
    finally:
        second.kill_all()
    verdict(second, ranks=2)
