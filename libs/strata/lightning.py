"""PyTorch Lightning with Strata: elastic exactly-once data, checkpoints through Strata's
two-phase commit from every rank, resume from Strata's latest, metrics on the dashboard.

    strata_fit = StrataFit("points", data, total_samples=3000, shard_size=50, batch_size=16,
                           every_n_steps=10)
    trainer = L.Trainer(max_epochs=2, strategy="ddp", **strata_fit.trainer_options())
    trainer.fit(model, strata_fit.loader(), ckpt_path=strata_fit.ckpt_path())

The model's `training_step(step, i)` gets a `strata.torch.Step`: `step.batch` is the collated
batch (empty on a rank with none left, after a re-plan), and a loss summed over it times
`step.scale` averages over every sample of the step.

What it does, on every rank:
- `setup` (after Lightning made the process group): a `strata.Worker` with torch's global rank as
  its rank and `rank-N` as its id (a process restarted by the launcher supersedes its dead
  predecessor at once), the dataset registered, and, when resuming, the data progress reset to
  the checkpoint's cursors (every rank's, merged).
- the data: a `strata.torch.Lockstep` (every rank steps together, the epoch ends when the service
  says so, a step counts as trained at `on_train_batch_end`, whatever Lightning fetched ahead).
- checkpoints every `every_n_steps` global steps, by every rank (not rank 0 alone, as DDP's own
  saves are): Lightning's whole checkpoint (model, optimisers, loops) with the data cursor, which
  commits once every rank saved.
- `ckpt_path()`: `"strata://latest"` when the job has a committed checkpoint in storage, else
  None; the checkpoint plugin reads it back through Strata.
- the logger: what `self.log(...)` records goes to `Worker.log_metrics` at the global step, and the
  worker's step follows it.

Lightning is an optional extra: `pip install 'strata-ctl[lightning]'`.
"""

from __future__ import annotations

import asyncio
import io
import os
from argparse import Namespace
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Final

from strata.extras import require

require("lightning", what="strata.lightning")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from lightning.pytorch import Callback, LightningModule, Trainer  # noqa: E402
from lightning.pytorch.loggers import Logger  # noqa: E402
from lightning.pytorch.plugins.io import CheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, IterableDataset  # noqa: E402
from torch.utils.data._utils.collate import default_collate  # noqa: E402

from strata._metric_names import figures  # noqa: E402
from strata.checkpoint import CheckpointManager  # noqa: E402
from strata.config import Env  # noqa: E402
from strata.datasets import DatasetRegistry  # noqa: E402
from strata.errors import ConfigError, NotFound, StrataError  # noqa: E402
from strata.events import DataCursor  # noqa: E402
from strata.events.requests import Manifest  # noqa: E402
from strata.storage import manifest_key, open_storage  # noqa: E402
from strata.torch.lockstep import Lockstep, Step  # noqa: E402
from strata.worker import Worker  # noqa: E402

__all__ = ["LATEST", "StrataCheckpointIO", "StrataFit", "StrataLogger"]

LATEST: Final = "strata://latest"
"""The `ckpt_path` that names the job's latest complete checkpoint in Strata."""


class StrataFit(Callback):
    """Everything a Lightning job needs from Strata, as one callback (see the module)."""

    def __init__(
        self,
        dataset_id: str,
        data: Sequence[Any],
        *,
        total_samples: int | None = None,
        shard_size: int,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        every_n_steps: int = 0,
        keep_count: int = 3,
        path: str | None = None,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
    ) -> None:
        self.dataset_id = dataset_id
        self.data = data
        self._total = len(data) if total_samples is None else total_samples
        self._shard_size = shard_size
        self._batch_size = batch_size
        self._shuffle, self._seed = shuffle, seed
        self._every = every_n_steps
        self._keep = keep_count
        self._path = path
        self._collate = collate_fn
        self.worker: Worker | None = None
        self.registry: DatasetRegistry | None = None
        self.checkpoints: CheckpointManager | None = None
        self.lockstep: Lockstep | None = None
        self.manifest: Manifest | None = None
        """The checkpoint this run resumed from, if any."""
        self._carried: DataCursor | None = None
        self._resuming = False
        self.io = StrataCheckpointIO(self)
        self.logger = StrataLogger(lambda: self.worker)

    # -- what the user calls ----------------------------------------------------------------------

    def trainer_options(self) -> dict[str, Any]:
        """Trainer arguments: this callback, the checkpoint plugin, the logger; Lightning's own
        sampler replacement and rank-0 ModelCheckpoint off (Strata shards and saves)."""
        return {
            "callbacks": [self],
            "plugins": [self.io],
            "logger": self.logger,
            "use_distributed_sampler": False,
            "enable_checkpointing": False,
        }

    def loader(self) -> DataLoader[Step]:
        """The training DataLoader (in the main process; the data is read in lockstep)."""
        return DataLoader(_Deferred(self), batch_size=None)

    def ckpt_path(self) -> str | None:
        """`"strata://latest"` when the job has a committed complete checkpoint, else None."""
        self._resuming = _latest_in_storage(self._path) is not None
        return LATEST if self._resuming else None

    # -- Lightning hooks --------------------------------------------------------------------------

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage != "fit" or self.worker is not None:
            return
        rank = trainer.global_rank
        self.worker = Worker(worker_id=f"rank-{rank}", rank=rank).start()
        self.registry = DatasetRegistry(self.worker)
        self.registry.register_dataset(
            self.dataset_id,
            total_samples=self._total,
            shard_size=self._shard_size,
            shuffle=self._shuffle,
            seed=self._seed,
        )
        self.checkpoints = CheckpointManager(self.worker, self._path, keep_count=self._keep)
        if self._resuming or trainer.ckpt_path == LATEST:
            self.manifest = self.checkpoints.latest()
        # The data progress of that checkpoint (every rank's cursor), or from scratch.
        self._carried = self.registry.restore_from(self.manifest, self.dataset_id)
        self.lockstep = Lockstep(
            self.registry,
            self.dataset_id,
            self.data,
            batch_size=self._batch_size,
            epoch=self._carried.epoch,
            collate_fn=self._collate,
        )
        if dist.is_available() and dist.is_initialized():
            dist.barrier()  # every rank restored before any reads

    def on_train_epoch_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        assert self.lockstep is not None
        if trainer.current_epoch != self.lockstep.epoch:
            self.lockstep.set_epoch(trainer.current_epoch)
            self._carried = None  # it was the restored epoch's

    def on_train_batch_end(
        self,
        trainer: Trainer,
        pl_module: LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        assert self.lockstep is not None
        assert self.worker is not None
        if isinstance(batch, Step):
            self.lockstep.trained(batch)
        step = trainer.global_step
        self.worker.set_state("training", step=step, epoch=trainer.current_epoch)
        if self._every and step % self._every == 0:
            self.save(trainer, step)

    def on_fit_end(self, trainer: Trainer, pl_module: LightningModule) -> None:
        if self.checkpoints is not None:
            self.checkpoints.wait()
        if self.worker is not None:
            self.worker.flush_metrics()

    def teardown(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if stage == "fit" and self.worker is not None:
            self.worker.stop()
            self.worker = None

    # -- checkpoints ------------------------------------------------------------------------------

    def save(self, trainer: Trainer, step: int) -> None:
        """Save Lightning's whole checkpoint with the data cursor, from this rank."""
        assert self.lockstep is not None
        assert self.checkpoints is not None
        self.lockstep.flush()
        state = trainer._checkpoint_connector.dump_checkpoint(weights_only=False)
        buffer = io.BytesIO()
        torch.save(state, buffer)
        self.checkpoints.save(
            buffer.getvalue(),
            step=step,
            epoch=trainer.current_epoch,
            cursors=[self.lockstep.cursor(self._carried)],
        )


class _Deferred(IterableDataset[Step]):
    """The loader's dataset before `setup` made the Lockstep (the loader is built earlier)."""

    def __init__(self, fit: StrataFit) -> None:
        self._fit = fit

    def __iter__(self) -> Any:
        if self._fit.lockstep is None:
            raise ConfigError(
                "StrataFit's loader is read before the callback set up: pass "
                "**strata_fit.trainer_options() to the Trainer"
            )
        return iter(self._fit.lockstep)


class StrataCheckpointIO(CheckpointIO):
    """Reads `ckpt_path="strata://latest"` back through Strata. Saving goes through `StrataFit`
    (every rank saves; DDP's `save_checkpoint` would call this on rank 0 only, which never
    commits), so `trainer.save_checkpoint` is refused with what to do instead."""

    def __init__(self, fit: StrataFit) -> None:
        self._fit = fit

    def save_checkpoint(
        self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None
    ) -> None:
        raise ConfigError(
            "trainer.save_checkpoint() runs on rank 0 only under DDP, and a Strata checkpoint "
            "commits when every rank saved: use StrataFit(every_n_steps=...) or call "
            "strata_fit.save(trainer, step) on every rank"
        )

    def load_checkpoint(
        self, path: Any, map_location: Any | None = None, weights_only: bool | None = None
    ) -> dict[str, Any]:
        checkpoints, manifest = self._fit.checkpoints, self._fit.manifest
        if str(path) != LATEST or checkpoints is None:
            raise ConfigError(f"StrataCheckpointIO reads {LATEST!r} only, not {path!r}")
        if manifest is None:
            raise NotFound(
                "the job has no complete checkpoint to resume from; pass "
                "ckpt_path=strata_fit.ckpt_path() (None when there is none)"
            )
        # Every rank holds the same state under DDP: rank 0's shard serves any world size.
        raw = checkpoints.load(step=manifest.step, rank=0)
        # The job's own checkpoint, committed by its own workers: Lightning's loops and
        # hyper-parameters are plain objects beyond tensors.
        loaded: dict[str, Any] = torch.load(
            io.BytesIO(raw), map_location=map_location, weights_only=False
        )
        return loaded

    def remove_checkpoint(self, path: Any) -> None:
        """Retention is Strata's (`keep_count`)."""


class StrataLogger(Logger):
    """Lightning's metrics to `Worker.log_metrics` at the global step (each rank its own)."""

    def __init__(self, worker: Callable[[], Worker | None]) -> None:
        super().__init__()
        self._worker = worker

    @property
    def name(self) -> str:
        return "strata"

    @property
    def version(self) -> str:
        return os.environ.get(Env.JOB, "")

    def log_hyperparams(self, params: dict[str, Any] | Namespace, *args: Any, **kw: Any) -> None:
        """Not recorded."""

    def log_metrics(self, metrics: Mapping[str, float], step: int | None = None) -> None:
        worker = self._worker()
        if worker is None:
            return
        kept = figures(metrics)
        if kept:
            if step is not None:
                worker.set_state("training", step=step)
            worker.log_metrics(kept, step=step)


def _latest_in_storage(path: str | None) -> int | None:
    """The newest complete checkpoint's step of the job ($STRATA_JOB) in storage, read directly:
    before `fit` there is no worker yet, and registering one would change the membership."""
    job = os.environ.get(Env.JOB)
    if not job:
        raise ConfigError(f"{Env.JOB} names the job whose checkpoints to resume from")

    async def newest() -> int | None:
        storage = open_storage(path)
        try:
            keys = await storage.list(job)
            steps = sorted(
                {
                    int(key.split("/")[1].removeprefix("step-"))
                    for key in keys
                    if key.endswith("/MANIFEST.json")
                },
                reverse=True,
            )
            for step in steps:
                try:
                    manifest = Manifest.model_validate_json(
                        await storage.read(manifest_key(job, step))
                    )
                except (StrataError, ValueError):
                    continue
                if manifest.complete:
                    return step
            return None
        finally:
            await storage.close()

    return asyncio.run(newest())
