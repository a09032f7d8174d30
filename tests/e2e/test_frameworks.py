"""The framework examples of docs/frameworks.md as real jobs: 2 ranks on gloo under torchrun
against the real services. A rank SIGKILLed mid-epoch, torchrun restarting the group: every sample
exactly once per epoch (the model's own ledger, saved with it), the same weights on every rank,
resumed from a committed step. A framework's default that would split Strata's shards again stops
at the first batch with a clear error, before any progress is recorded."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from strata import procutil
from strata.bus.server import NatsServer
from strata.config import Env

from tests.docs import example, write_example
from tests.support import ServiceProcess, new_job, running_services, wait_until
from tests.torchrun import RESULT, Torchrun, committed_steps, verdict

RESUMED = re.compile(r"rank (\d+): resumed from step (\d+)")

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture
def gateway_port(stack: str, tmp_path: Path) -> Iterator[int]:
    port = procutil.free_port()
    gateway = ServiceProcess("gateway", stack, tmp_path / "logs", env={Env.HTTP_PORT: str(port)})
    gateway.start()
    try:
        yield port
    finally:
        gateway.stop()


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


@pytest.mark.parametrize(
    ("framework", "example"),
    [("lightning", "train_lightning.py"), ("accelerate", "train_accelerate.py")],
)
def test_a_two_rank_job_relaunched_as_one_process_goes_on_from_its_checkpoint(
    stack: str, tmp_path: Path, framework: str, example: str
) -> None:
    pytest.importorskip(framework)
    script = write_example("docs/frameworks.md", example, tmp_path)
    job = new_job(framework)
    first = Torchrun(script, stack, job, tmp_path, procs=2)
    try:
        wait_until(lambda: bool(committed_steps(tmp_path, job)), 180, "a first checkpoint")
    finally:
        first.kill_all()
    assert not RESULT.search(first.output()), "the first run finished before it was killed"
    second = Torchrun(script, stack, job, tmp_path, procs=1)
    try:
        assert second.wait(300) == 0, second.output()[-6000:]
    finally:
        second.kill_all()
    verdict(second, ranks=1)
    assert RESUMED.search(second.output()), "the one-process run did not resume"


# -- the frameworks' defaults ---------------------------------------------------------------------

DEFAULTS_PRELUDE = """
import torch
import strata
from strata.torch import ShardSampler
from torch.utils.data import DataLoader, TensorDataset

data = TensorDataset(torch.arange(400), torch.randn(400, 8), torch.randint(0, 2, (400,)))
"""

LIGHTNING_DEFAULTS = """
import lightning as L
import torch.nn.functional as F
from torch import nn


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = nn.Linear(8, 2)

    def training_step(self, batch, index):
        ids, x, y = batch
        return F.cross_entropy(self.net(x), y)

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.05)


class Data(L.LightningDataModule):
    def train_dataloader(self):
        rank = self.trainer.global_rank
        worker = strata.Worker(worker_id=f"rank-{rank}", rank=rank).start()
        registry = strata.DatasetRegistry(worker)
        registry.register_dataset("points", total_samples=400, shard_size=25)
        return DataLoader(data, batch_size=16, sampler=ShardSampler(registry, "points"))


trainer = L.Trainer(max_epochs=1, accelerator="cpu", strategy="ddp", devices=2,
                    enable_progress_bar=False, enable_checkpointing=False, logger=False)
trainer.fit(Model(), datamodule=Data())
"""

ACCELERATE_DEFAULTS = """
from accelerate import Accelerator
from torch import nn

accelerator = Accelerator(cpu=True)
rank = accelerator.process_index
worker = strata.Worker(worker_id=f"rank-{rank}", rank=rank).start()
registry = strata.DatasetRegistry(worker)
registry.register_dataset("points", total_samples=400, shard_size=25)
model = nn.Linear(8, 2)
optimiser = torch.optim.SGD(model.parameters(), lr=0.05)
loader = DataLoader(data, batch_size=16, sampler=ShardSampler(registry, "points"))
model, optimiser, loader = accelerator.prepare(model, optimiser, loader)
for ids, x, y in loader:
    accelerator.backward(torch.nn.functional.cross_entropy(model(x), y))
    optimiser.step()
"""

DONE_SHARDS = """
import strata

with strata.Worker(worker_id="checker") as worker:
    try:
        plan = strata.DatasetRegistry(worker).plan("points", 0)
    except strata.NotFound:
        print("done 0: the epoch was never planned")
    else:
        print(f"done {plan.done_shards} of {plan.total_shards}")
"""


@pytest.mark.parametrize(
    ("framework", "source", "fix"),
    [
        ("lightning", LIGHTNING_DEFAULTS, "Trainer(use_distributed_sampler=False)"),
        ("accelerate", ACCELERATE_DEFAULTS, "leave the DataLoader out of accelerator.prepare"),
    ],
)
def test_a_frameworks_default_wrapping_stops_before_any_progress_is_recorded(
    stack: str, tmp_path: Path, framework: str, source: str, fix: str
) -> None:
    pytest.importorskip(framework)
    script = tmp_path / f"defaults_{framework}.py"
    script.write_text(DEFAULTS_PRELUDE + source, encoding="utf-8")
    job = new_job(framework)
    run = Torchrun(script, stack, job, tmp_path, procs=2, max_restarts=0)
    try:
        assert run.wait(240) != 0, run.output()[-6000:]
    finally:
        run.kill_all()
    output = run.output()
    assert "[wrapped_data]" in output, output[-6000:]
    assert fix in output
    check = tmp_path / "done_shards.py"
    check.write_text(DONE_SHARDS, encoding="utf-8")
    done = subprocess.run(
        [sys.executable, str(check)],
        env={**os.environ, Env.NATS_URL: stack, Env.JOB: job},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # Nothing recorded as read: no shard done (or, refused before any shard was asked for, no
    # plan of the epoch at all).
    assert re.search(r"^done 0\b", done.stdout, re.M), done.stdout


def test_lightning_under_its_own_launcher_gives_each_rank_its_torch_rank(
    stack: str, gateway_port: int, tmp_path: Path
) -> None:
    """`python train_lightning.py` with devices=2: Lightning starts the second process itself
    (no torchrun, no RANK in the environment); the workers are made after the process group,
    with torch's global rank, the job trains every sample once per epoch, and what the model
    logs reaches the gateway's metric history."""
    pytest.importorskip("lightning")
    script = write_example("docs/frameworks.md", "train_lightning.py", tmp_path)
    job = new_job("lightning")
    env = {
        **os.environ,
        Env.NATS_URL: stack,
        Env.JOB: job,
        Env.DATA_DIR: str(tmp_path),
        "LOCAL_WORLD_SIZE": "2",
        "OMP_NUM_THREADS": "1",
    }
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", Env.RANK):
        env.pop(name, None)
    done = subprocess.run(
        [sys.executable, str(script)],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    results = {int(m[1]): m for m in RESULT.finditer(output)}
    assert sorted(results) == [0, 1], output[-6000:]
    assert all(m[3] == "True" for m in results.values()), output[-6000:]
    assert len({m[4] for m in results.values()}) == 1, "ranks ended with other weights"
    check = tmp_path / "members.py"
    check.write_text(
        "import strata\n"
        "with strata.Worker(worker_id='checker') as w:\n"
        "    for m in w.members(include_gone=True).members:\n"
        "        print('member', m.worker_id, m.rank)\n",
        encoding="utf-8",
    )
    members = subprocess.run(
        [sys.executable, str(check)],
        env={**os.environ, Env.NATS_URL: stack, Env.JOB: job},
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert members.returncode == 0, members.stderr
    assert "member rank-0 0" in members.stdout, members.stdout
    assert "member rank-1 1" in members.stdout, members.stdout

    def logged_loss() -> bool:
        answer = httpx.get(f"http://127.0.0.1:{gateway_port}/api/jobs/{job}/metrics", timeout=5)
        return answer.status_code == 200 and "train_loss" in answer.json()["metrics"]

    wait_until(logged_loss, 60, "train_loss in the gateway's metric history")


def test_accelerate_launch_with_the_strata_rendezvous(stack: str, tmp_path: Path) -> None:
    """docs/frameworks.md's `accelerate launch --multi_gpu --rdzv_backend strata` (torchrun
    underneath; on CPU here, the script asks for `Accelerator(cpu=True)`): the rendezvous is
    Strata's, for the job in STRATA_JOB (accelerate passes no --rdzv-id), and the job trains
    every sample once per epoch."""
    pytest.importorskip("accelerate")
    write_example("docs/frameworks.md", "train_accelerate.py", tmp_path)
    job = new_job("accelerate")
    command = (
        example("docs/frameworks.md", "accelerate-launch.sh")
        .replace("nats://127.0.0.1:4222", stack)
        .replace("accelerate-example", job)
    )
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        Env.DATA_DIR: str(tmp_path),
        "OMP_NUM_THREADS": "1",
        "CUDA_VISIBLE_DEVICES": "",
        "LOGLEVEL": "INFO",  # torchrun's agent logs its launch configuration
    }
    done = subprocess.run(
        ["bash", "-e", "-c", command],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    # Strata's backend (not the standalone c10d one accelerate falls back to when its port is
    # taken), under torchrun's default id, which Strata reads as the job in STRATA_JOB.
    assert re.search(r"rdzv_backend\s*:\s*strata", output), output[-6000:]
    assert re.search(r"run_id\s*:\s*none", output), output[-6000:]
    results = {int(m[1]): m for m in RESULT.finditer(output)}
    assert sorted(results) == [0, 1], output[-6000:]
    assert all(m[3] == "True" for m in results.values()), output[-6000:]
    assert len({m[4] for m in results.values()}) == 1, "ranks ended with other weights"
