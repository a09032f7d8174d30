"""docs/pytorch.md's live-recovery example run as a real job: each rank a process of its own,
its output in a file, and the epoch's plan read from the sharding service as an operator would.
Shared by the live-recovery scenarios (tests/e2e) and the fault tests (tests/faults)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from strata._loop import LoopRunner
from strata.bus import Bus
from strata.config import Env
from strata.events.requests import PlanRequest, PlanSummary

from tests.docs import write_example
from tests.support import wait_until

EPOCHS = 5
"""More than the example's 3: on a loaded machine the survivors must still be training when the
replacement (a new Python with torch to import) comes up."""
DATASET = "live-points"
RESULT = re.compile(
    r"(\S+): pid (\d+) every sample (\d+) times: (True|False), step (\d+), healed (True|False), "
    r"weights ([0-9a-f]+)"
)


class Rank:
    """One process of the example, its output in a file. `env`: more environment (a clock
    offset file, for instance)."""

    def __init__(
        self,
        script: Path,
        nats_url: str,
        job: str,
        worker_id: str,
        die_in_heal: str = "",
        env: dict[str, str] | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.log = script.parent / f"{worker_id}.log"
        full_env = {
            **os.environ,
            Env.NATS_URL: nats_url,
            Env.JOB: job,
            "WORKER_ID": worker_id,
            "OMP_NUM_THREADS": "1",
            "DIE_IN_HEAL": die_in_heal,
            **(env or {}),
        }
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, str(script)],
                cwd=script.parent,
                env=full_env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def result(self) -> re.Match[str] | None:
        return RESULT.search(self.output())

    def pause(self) -> None:
        """SIGSTOP: the process, its threads and its connections' ends all stand still."""
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)


class Plans:
    """Reads an epoch's plan from the sharding service, as an operator would."""

    def __init__(self, nats_url: str, job: str) -> None:
        self.job = job
        self.runner = LoopRunner(name="live-test-plans")
        self.bus = self.runner.run(Bus.connect(nats_url, deadline=10))

    def done(self, epoch: int) -> float:
        """The fraction of the epoch's shards done (0 before its plan exists)."""

        async def ask() -> PlanSummary:
            request = PlanRequest(job=self.job, dataset_id=DATASET, epoch=epoch)
            return await self.bus.rpc.call(
                "sharding", "plan", request, result=PlanSummary, timeout=5.0
            )

        try:
            summary = self.runner.run(ask())
        except Exception:
            return 0.0
        return summary.done_shards / max(1, summary.total_shards)

    def progress(self) -> float:
        """Epochs done, with the current one's fraction: 1.5 is half of epoch 1."""
        for epoch in range(EPOCHS):
            fraction = self.done(epoch)
            if fraction < 1.0:
                return epoch + fraction
        return float(EPOCHS)

    def close(self) -> None:
        self.runner.run(self.bus.close())
        self.runner.close()


HOLD = """
HOLD_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "hold")
_held = [-1, 0]  # the membership epoch last asked about, the workers registered then


def hold(step: int) -> None:
    \"\"\"While the test's hold file names a world size, wait after each committed step until
    that many workers are registered: survivors wait for a replacement instead of finishing
    the job before it comes up.\"\"\"
    import time

    from strata.torch.live import group_members

    while os.path.exists(HOLD_FILE):
        with open(HOLD_FILE, encoding="utf-8") as file:
            wanted = int(file.read() or 0)
        if _held[0] != worker.membership_epoch:
            members = worker.members()
            _held[:] = [members.membership_epoch, len(group_members(members.members))]
        if _held[1] >= wanted:
            return
        time.sleep(0.05)


"""
TRAINING = "live.train_epoch(registry, DATASET, data, loss_fn, batch_size=8, epoch=epoch)"


def example(directory: Path) -> Path:
    """The example with `EPOCHS` epochs, each committed step waiting while the test holds it
    (`hold_for`)."""
    script = write_example("docs/pytorch.md", "train_live.py", directory)
    text = script.read_text(encoding="utf-8")
    written = 'DATASET, SAMPLES, EPOCHS = "live-points", 3000, 3'
    assert written in text, "the example's constants changed: update this test"
    assert text.count(TRAINING) == 1, "the example's training call changed: update this test"
    assert text.count("\nlive.join()\n") == 1, "the example's join changed: update this test"
    text = text.replace(written, written[:-1] + str(EPOCHS))
    text = text.replace("\nlive.join()\n", "\n" + HOLD + "live.join()\n")
    text = text.replace(TRAINING, TRAINING[:-1] + ", on_commit=hold)")
    script.write_text(text, encoding="utf-8")
    return script


def hold_for(script: Path, workers: int) -> None:
    """From now on, the example's ranks wait after each committed step until `workers` are
    registered (a replacement on its way); `release` ends it."""
    (script.parent / "hold").write_text(str(workers), encoding="utf-8")


def release(script: Path) -> None:
    (script.parent / "hold").unlink(missing_ok=True)


def outputs(ranks: list[Rank]) -> str:
    return "\n".join(f"--- {r.worker_id}\n{r.output()[-4000:]}" for r in ranks)


def wait_with(ranks: list[Rank], condition: Callable[[], bool], timeout: float, what: str) -> None:
    """`wait_until`, failing with the ranks' output (a rank that crashed says why)."""
    try:
        wait_until(condition, timeout, what)
    except pytest.fail.Exception:
        pytest.fail(f"timed out after {timeout}s waiting for {what}:\n{outputs(ranks)}")


def finish(ranks: list[Rank], timeout: float) -> list[re.Match[str]]:
    for rank in ranks:
        try:
            rank.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pytest.fail(f"{rank.worker_id} still running after {timeout}s:\n{outputs(ranks)}")
    for rank in ranks:
        assert rank.proc.returncode == 0, outputs(ranks)
    found = [r.result() for r in ranks]
    assert all(found), outputs(ranks)
    return [m for m in found if m is not None]
