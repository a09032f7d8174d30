"""Training steps/s of a Lightning DDP job with Strata's integration, next to the same job with
Lightning's own DistributedSampler and ModelCheckpoint.

Both jobs train the same model on the same data, 2 ranks over gloo under torchrun, against a real
nats-server and the Strata services: one with `strata.lightning.StrataFit` (lockstep data from
the sharding service, a checkpoint from every rank every 10 steps through the two-phase commit,
metrics to the worker), the other with Lightning's defaults (a plain DataLoader that Lightning
wraps in its DistributedSampler, `ModelCheckpoint(every_n_train_steps=10)` on rank 0). Each run
times its training loop on rank 0 (from the first batch to the end of fit: start-up and the
first checkpoint's commit are outside); rounds alternate the two, and the figure is the median
steps/s of each with the spread (min-max), and the ratio of the medians.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from strata.bus.server import NatsServer
from strata.config import Env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.support import running_services  # noqa: E402

COMMON = """
import os, time
import lightning as L
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

SAMPLES, EPOCHS = {samples}, {epochs}
generator = torch.Generator().manual_seed(0)
inputs = torch.randn(SAMPLES, 64, generator=generator)
data = TensorDataset(torch.arange(SAMPLES), inputs, (inputs.sum(1) > 0).long())


class Timer(L.Callback):
    def on_train_batch_start(self, trainer, module, batch, index):
        if not hasattr(self, "start"):
            self.start, self.first = time.perf_counter(), trainer.global_step

    def on_fit_end(self, trainer, module):
        if trainer.global_rank == 0:
            steps = trainer.global_step - self.first
            print(f"timed {{steps}} steps in {{time.perf_counter() - self.start:.3f}} s")


class Model(L.LightningModule):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.net = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 2))

    def loss(self, x, y, scale):
        return F.cross_entropy(self.net(x), y, reduction="sum") * scale

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


options = dict(max_epochs=EPOCHS, accelerator="cpu", strategy="ddp",
               devices=int(os.environ["LOCAL_WORLD_SIZE"]), enable_progress_bar=False,
               enable_model_summary=False)
"""

STRATA = """
from strata.lightning import StrataFit


class StrataModel(Model):
    def training_step(self, step, index):
        ids, x, y = step.batch
        return self.loss(x, y, step.scale)


fit = StrataFit("points", data, shard_size=50, batch_size=16, every_n_steps=10)
trainer = L.Trainer(**options, **fit.trainer_options())
trainer.callbacks.append(Timer())
trainer.fit(StrataModel(), fit.loader(), ckpt_path=fit.ckpt_path())
"""

LIGHTNING = """
from lightning.pytorch.callbacks import ModelCheckpoint


class PlainModel(Model):
    def training_step(self, batch, index):
        ids, x, y = batch
        return self.loss(x, y, 1.0 / len(ids))


checkpoints = ModelCheckpoint(dirpath=os.environ["CKPT_DIR"], every_n_train_steps=10,
                              save_top_k=-1)
trainer = L.Trainer(**options, callbacks=[checkpoints, Timer()], logger=False)
trainer.fit(PlainModel(), DataLoader(data, batch_size=16, shuffle=True))
"""

TIMED = re.compile(r"timed (\d+) steps in ([\d.]+) s")


def run(script: Path, nats_url: str, job: str, work: Path, procs: int) -> float:
    env = {
        **os.environ,
        Env.NATS_URL: nats_url,
        Env.JOB: job,
        Env.DATA_DIR: str(work),
        "CKPT_DIR": str(work / f"lightning-{job}"),
        "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        "OMP_NUM_THREADS": "1",
    }
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={procs}",
            str(script),
        ],
        cwd=work,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    output = done.stdout + done.stderr
    found = TIMED.search(output)
    if done.returncode != 0 or found is None:
        raise SystemExit(f"{script.name} failed:\n{output[-4000:]}")
    return int(found[1]) / float(found[2])


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} steps/s ({min(values):.1f}-{max(values):.1f})"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each (default 3)")
    parser.add_argument("--samples", type=int, default=4000, help="samples (default 4000)")
    parser.add_argument("--epochs", type=int, default=2, help="epochs per run (default 2)")
    parser.add_argument("--procs", type=int, default=2, help="ranks (default 2)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="strata-bench-frameworks-") as tmp:
        work = Path(tmp)
        common = COMMON.format(samples=args.samples, epochs=args.epochs)
        scripts = {"strata": work / "strata_job.py", "lightning": work / "lightning_job.py"}
        scripts["strata"].write_text(common + STRATA, encoding="utf-8")
        scripts["lightning"].write_text(common + LIGHTNING, encoding="utf-8")
        rates: dict[str, list[float]] = {"strata": [], "lightning": []}
        with (
            NatsServer(store_dir=work / "nats") as server,
            running_services(server.url, work / "logs"),
        ):
            for round_ in range(args.rounds):
                order = ["strata", "lightning"] if round_ % 2 == 0 else ["lightning", "strata"]
                for name in order:
                    job = f"bench-{name}-{round_}-{time.monotonic_ns()}"
                    rates[name].append(run(scripts[name], server.url, job, work, args.procs))
                    print(f"round {round_} {name}: {rates[name][-1]:.1f} steps/s", flush=True)
        ratio = statistics.median(rates["strata"]) / statistics.median(rates["lightning"])
        per_round = [s / b for s, b in zip(rates["strata"], rates["lightning"], strict=True)]
        print(f"Strata integration: {spread(rates['strata'])}")
        print(f"Lightning's own:    {spread(rates['lightning'])}")
        print(
            f"ratio {ratio:.2f} (rounds {min(per_round):.2f}-{max(per_round):.2f}), "
            f"{args.procs} ranks, {args.rounds} rounds"
        )


if __name__ == "__main__":
    main()
