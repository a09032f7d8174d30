"""The DDP example of docs/sdk.md under real torchrun: a rank SIGKILLed mid-epoch, and a 3-rank job
relaunched with 2 ranks. Both must finish with every sample of every epoch in the model exactly
once and the same parameters on every rank (the example checks its own `seen` ledger; this test
reads its verdict and compares the weights).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.bus.server import NatsServer
from strata.config import Env

from tests.docs import write_example
from tests.rendezvous import children, env_of, kill_tree
from tests.support import new_job, running_services, wait_until

pytestmark = pytest.mark.timeout(600)

EPOCHS = 2
# Not anchored to lines: the ranks' last lines can reach torchrun's output run together.
RESULT = re.compile(r"rank (\d+): every sample (\d+) times: (True|False), weights (\[[^\]]*\])")


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with running_services(own_nats_server.url, tmp_path / "logs"):
        yield own_nats_server.url


def rank_of(pid: int) -> int | None:
    rank = env_of(pid, "RANK")
    return None if rank is None else int(rank)


class Torchrun:
    """`torchrun --standalone` of the example, with its output kept for the verdict."""

    def __init__(
        self,
        script: Path,
        nats_url: str,
        job: str,
        data_dir: Path,
        procs: int,
        max_restarts: int = 2,
    ) -> None:
        self.log = data_dir / f"torchrun-{job}-{procs}-{time.monotonic_ns()}.log"
        env = {
            **os.environ,
            Env.NATS_URL: nats_url,
            Env.JOB: job,
            Env.DATA_DIR: str(data_dir),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
        }
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "torch.distributed.run",
                    "--standalone",
                    f"--nproc-per-node={procs}",
                    f"--max-restarts={max_restarts}",
                    "--monitor-interval=0.2",
                    str(script),
                ],
                cwd=script.parent,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def rank_pid(self, rank: int) -> int | None:
        return next((p for p in children(self.proc.pid) if rank_of(p) == rank), None)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill_all()
            pytest.fail(f"torchrun still running after {timeout}s:\n{self.output()[-6000:]}")

    def kill_all(self) -> None:
        """SIGKILL the agent and every rank at once, as losing the node would (torchrun starts
        each rank in a session of its own: the agent's process group alone is not all of it)."""
        kill_tree(self.proc)


def committed_steps(data_dir: Path, job: str) -> list[int]:
    root = data_dir / "checkpoints" / job
    if not root.is_dir():
        return []
    return sorted(
        int(path.parent.name.removeprefix("step-")) for path in root.glob("step-*/MANIFEST.json")
    )


def verdict(run: Torchrun, ranks: int) -> None:
    """Exit 0, and every rank says each sample went into the model once per epoch, with the
    same weights everywhere."""
    output = run.output()
    results = {int(m[1]): m for m in RESULT.finditer(output)}
    assert sorted(results) == list(range(ranks)), output[-6000:]
    for match in results.values():
        assert int(match[2]) == EPOCHS
        assert match[3] == "True", f"rank {match[1]} did not see every sample once:\n{output}"
    assert len({match[4] for match in results.values()}) == 1, "ranks ended with other weights"


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
