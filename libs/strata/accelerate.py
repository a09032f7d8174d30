"""Hugging Face Accelerate with Strata: elastic exactly-once data, checkpoints through Strata's
two-phase commit from every rank, resume from the latest complete one, a tracker for the
dashboard.

    accelerator = Accelerator(cpu=True, log_with=[StrataTracker()])
    strata_run = StrataRun(accelerator, "points", data, shard_size=50, batch_size=16,
                           every_n_steps=10)
    model, optimiser = accelerator.prepare(model, optimiser)     # not the DataLoader
    strata_run.resume(model=model, optimiser=optimiser)
    for epoch in strata_run.epochs(2):
        for step in strata_run.steps():
            ...                                                  # train on step.batch
            strata_run.trained(step, model=model, optimiser=optimiser)

Leave the DataLoader out of `accelerator.prepare`: Strata already gives each rank its own
samples, and Accelerate would split them again (a `ShardSampler` or `Lockstep` refuses it at the
first batch). `StrataRun` is made after the `Accelerator`, which makes the process group, so its
worker takes the process index as its rank (and the id `rank-N`).

Accelerate is an optional extra: `pip install 'strata-ctl[accelerate]'`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

from strata.extras import require

require("accelerate", what="strata.accelerate")

from accelerate import Accelerator  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402
from torch.utils.data._utils.collate import default_collate  # noqa: E402

from strata._metric_names import figures  # noqa: E402
from strata.checkpoint import CheckpointManager  # noqa: E402
from strata.datasets import DatasetRegistry  # noqa: E402
from strata.events import DataCursor  # noqa: E402
from strata.events.requests import Manifest  # noqa: E402
from strata.torch.lockstep import Lockstep, Step  # noqa: E402
from strata.worker import Worker  # noqa: E402

__all__ = ["StrataRun", "StrataTracker"]


class StrataRun:
    """One rank's Strata side of an Accelerate job (see the module)."""

    def __init__(
        self,
        accelerator: Accelerator,
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
        self.accelerator = accelerator
        rank = accelerator.process_index
        self.worker = Worker(worker_id=f"rank-{rank}", rank=rank).start()
        _ranked.append(self.worker)
        self.registry = DatasetRegistry(self.worker)
        self.dataset_id = dataset_id
        self.registry.register_dataset(
            dataset_id,
            total_samples=len(data) if total_samples is None else total_samples,
            shard_size=shard_size,
            shuffle=shuffle,
            seed=seed,
        )
        self.checkpoints = CheckpointManager(self.worker, path, keep_count=keep_count)
        self.lockstep = Lockstep(
            self.registry, dataset_id, data, batch_size=batch_size, collate_fn=collate_fn
        )
        self.every = every_n_steps
        self.step = 0
        """Global steps trained (restored by `resume`)."""
        self.manifest: Manifest | None = None
        """The checkpoint `resume` went on from, if any."""
        self._first_epoch = 0
        self._carried: DataCursor | None = None

    def resume(self, **state: Any) -> dict[str, Any]:
        """Load the latest complete checkpoint into `state`'s objects (anything with
        `load_state_dict`: model, optimiser, scheduler; models unwrapped first) and reset the
        data progress to its cursors, on every rank; returns the plain values saved with it
        (those without `load_state_dict`). From scratch without a checkpoint."""
        self.manifest = self.checkpoints.latest()
        plain: dict[str, Any] = {}
        if self.manifest is not None:
            # Every rank holds the same state under DDP: rank 0's shard serves any world size.
            saved = self.checkpoints.load_state(step=self.manifest.step, rank=0)
            for name, value in saved.items():
                target = state.get(name)
                if name == "_strata_step":
                    continue
                if target is not None and hasattr(target, "load_state_dict"):
                    self._unwrapped(target).load_state_dict(value)
                else:
                    plain[name] = value
            self.step = self.manifest.step
            self._first_epoch = self.manifest.epoch
        self._carried = self.registry.restore_from(self.manifest, self.dataset_id)
        self.accelerator.wait_for_everyone()  # every rank restored before any reads
        return plain

    def epochs(self, count: int) -> Iterator[int]:
        """The epochs left of `count`, from the resumed one."""
        for epoch in range(self._first_epoch, count):
            self.lockstep.set_epoch(epoch)
            yield epoch
            self._carried = None  # it was the restored epoch's

    def steps(self) -> Iterator[Step]:
        """This rank's steps of the epoch, in lockstep with every rank (`strata.torch.Step`)."""
        return iter(self.lockstep)

    def trained(self, step: Step, **state: Any) -> None:
        """The step is trained: its samples count as read, the worker's step advances, and every
        `every_n_steps` steps `state` (as for `resume`) is saved from every rank."""
        self.lockstep.trained(step)
        self.step += 1
        self.worker.set_state("training", step=self.step, epoch=self.lockstep.epoch)
        if self.every and self.step % self.every == 0:
            self.save(**state)

    def save(self, **state: Any) -> None:
        """Save `state` at the current step with the data cursor, from this rank (every rank
        must: the checkpoint commits when every rank of the world saved)."""
        self.lockstep.flush()
        saved = {
            name: self._unwrapped(value).state_dict() if hasattr(value, "state_dict") else value
            for name, value in state.items()
        }
        self.checkpoints.save_state(
            saved,
            step=self.step,
            epoch=self.lockstep.epoch,
            cursors=[self.lockstep.cursor(self._carried)],
        )

    def finish(self) -> None:
        """Wait for the pending saves, publish the last metrics, leave the job."""
        self.checkpoints.wait()
        self.worker.stop()

    def _unwrapped(self, value: Any) -> Any:
        try:
            return self.accelerator.unwrap_model(value)
        except Exception:
            return value


_ranked: list[Worker] = []
"""The workers `StrataRun` made, newest last: the tracker logs through the newest."""


class StrataTracker(GeneralTracker):
    """`accelerator.log(...)` to `Worker.log_metrics` at the step (names made to fit)."""

    name = "strata"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()

    @property
    def tracker(self) -> Any:
        return self

    def store_init_configuration(self, values: dict[str, Any]) -> None:
        """Not recorded."""

    def log(self, values: dict[str, Any], step: int | None = None, **kwargs: Any) -> None:
        worker = _ranked[-1] if _ranked and _ranked[-1].started else None
        kept = figures(values)
        if worker is not None and kept:
            worker.log_metrics(kept, step=step)
