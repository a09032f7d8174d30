"""Real torchrun runs of the examples, for the tests that kill their ranks: the run with its output
kept, its ranks' pids, the steps it committed, and the examples' own verdict (every sample once per
epoch, the same weights on every rank)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import pytest
from strata.config import Env

from tests.rendezvous import children, env_of, kill_tree

EPOCHS = 2
# Not anchored to lines: the ranks' last lines can reach torchrun's output run together.
RESULT = re.compile(r"rank (\d+): every sample (\d+) times: (True|False), weights (\[[^\]]*\])")


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
        python: Path = Path(sys.executable),
        environ: Mapping[str, str] = os.environ,
    ) -> None:
        """`python` and `environ`: the interpreter and environment it runs under (this test run's
        by default; an installed wheel's venv for the tests of what users install)."""
        self.log = data_dir / f"torchrun-{job}-{procs}-{time.monotonic_ns()}.log"
        env = {
            **environ,
            Env.NATS_URL: nats_url,
            Env.JOB: job,
            Env.DATA_DIR: str(data_dir),
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
            "OMP_NUM_THREADS": "1",
        }
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [
                    str(python),
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
