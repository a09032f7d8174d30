"""One worker of the demo job: a small PyTorch model trained on its shards of a synthetic dataset.

Training goes in rounds: each worker trains a few batches, reports its progress, meets the others
at a barrier, then every rank checkpoints its state under the same step (the round number). When a
worker dies, the survivors' barrier breaks; each of them, and the replacement, reloads the latest
committed checkpoint, resets the data progress to that checkpoint's cursors (to nothing without
one), waits until the whole world is back, and goes on. Progress lines go to stdout as JSON for the
demo driver.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import strata
from strata.events import DataCursor, ShardOffset
from strata.events.requests import Manifest
from strata.torch import ShardSampler

DATASET = "synthetic"


def emit(kind: str, **fields: Any) -> None:
    print(json.dumps({"event": kind, "t": time.time(), **fields}), flush=True)


def synthetic_data(samples: int, seed: int) -> TensorDataset:
    """The same labelled points in every worker: a noisy linear boundary in 16 dimensions."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 16, generator=generator)
    boundary = torch.randn(16, generator=generator)
    noise = 0.1 * torch.randn(samples, generator=generator)
    labels = ((inputs @ boundary + noise) > 0).long()
    return TensorDataset(inputs, labels)


def build_model(seed: int) -> tuple[nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 2))
    return model, torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)


def cursor_of(sampler: ShardSampler, carried: frozenset[int] = frozenset()) -> DataCursor:
    """This rank's cursor of the epoch. `carried`: the shards this rank had completed by the
    checkpoint the job restarted from; a fresh sampler knows only its own reads, and without them
    a second restart in the same epoch would lose those shards' progress and read them again."""
    state = sampler.state_dict()
    current = state["current"]
    partial = [ShardOffset(shard_id=current[0], offset=current[1])] if current else []
    completed = sorted(carried.union(state["completed"]))
    return DataCursor(
        dataset_id=DATASET, epoch=state["epoch"], completed=completed, partial=partial
    )


def own_completed(manifest: Manifest, rank: int) -> frozenset[int]:
    """The shards `rank`'s cursor of the checkpoint's epoch says it completed."""
    return frozenset(
        shard_id
        for shard in manifest.shards
        if shard.rank == rank
        for cursor in shard.cursors
        if cursor.dataset_id == DATASET and cursor.epoch == manifest.epoch
        for shard_id in cursor.completed
    )


class Recorder:
    """With `--record DIR`: JSON lines about barrier waits, acknowledged checkpoint events and
    resumes, one file per process, for tests that check what the job did from the outside."""

    def __init__(self, directory: str | None) -> None:
        self._file: IO[str] | None = None
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
            path = Path(directory) / f"worker-{os.getpid()}.jsonl"
            self._file = path.open("a", encoding="utf-8", buffering=1)

    def __call__(self, kind: str, **fields: Any) -> None:
        if self._file is not None:
            self._file.write(json.dumps({"kind": kind, "t": time.time(), **fields}) + "\n")


def restore_point(manifest: Manifest) -> tuple[int, list[int], dict[int, int]]:
    """The epoch the checkpoint was taken in, and the union of every rank's cursor of it."""
    completed: set[int] = set()
    partial: dict[int, int] = {}
    for shard in manifest.shards:
        for cursor in shard.cursors:
            if cursor.dataset_id == DATASET and cursor.epoch == manifest.epoch:
                completed.update(cursor.completed)
                for item in cursor.partial:
                    partial[item.shard_id] = max(partial.get(item.shard_id, 0), item.offset)
    return (
        manifest.epoch,
        sorted(completed),
        {s: o for s, o in partial.items() if s not in completed},
    )


class Trainer:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.worker = strata.Worker(job=args.job, nats_url=args.nats_url)
        self.worker.start()
        self.registry = strata.DatasetRegistry(self.worker)
        self.registry.register_dataset(
            DATASET, args.samples, args.shard_size, shuffle=True, seed=args.seed
        )
        self.checkpoints = self.checkpoint_manager()
        self.data = synthetic_data(args.samples, args.seed)
        self.loss = math.nan
        self.record = Recorder(args.record)
        self.recorded_acks = 0
        self.carried: frozenset[int] = frozenset()
        emit("started", rank=self.worker.rank, worker=self.worker.id)

    def run(self) -> None:
        restarts = 0
        while True:
            try:
                self.train()
                break
            except (strata.BarrierBroken, strata.BarrierTimeout) as exc:
                restarts += 1
                emit("restart", rank=self.worker.rank, reason=str(exc), restarts=restarts)
                self.checkpoints.wait()
                self.record_acks()
                # The restarted job saves its rounds under the same step numbers again: a new
                # manager's saves are new attempts of the steps the failure aborted.
                self.checkpoints, self.recorded_acks = self.checkpoint_manager(), 0
        self.checkpoints.wait()
        self.record_acks()
        emit("done", rank=self.worker.rank, loss=self.loss, worker=self.worker.id)
        self.worker.stop()

    def checkpoint_manager(self) -> strata.CheckpointManager:
        return strata.CheckpointManager(
            self.worker, self.args.checkpoints, keep_count=self.args.keep_count
        )

    def record_acks(self) -> None:
        """Record the checkpoint acks the service answered since the last call (with the id of
        the `checkpoint.shard_saved` event it recorded for each)."""
        saved = self.checkpoints.aio.saved[self.recorded_acks :]
        for answer in saved:
            self.record("acked", id=answer.event_id, step=answer.step, rank=answer.rank)
        self.recorded_acks += len(saved)

    def barrier(self, name: str, *, expected: int | None = None) -> int:
        timeout = self.args.barrier_timeout
        started = time.monotonic()
        outcome = "released"
        try:
            return self.worker.barrier(name, timeout=timeout, expected=expected)
        except strata.BarrierBroken:
            outcome = "broken"
            raise
        except strata.BarrierTimeout:
            outcome = "timeout"
            raise
        finally:
            self.record(
                "barrier",
                name=name,
                seconds=time.monotonic() - started,
                timeout=timeout,
                outcome=outcome,
                rank=self.worker.rank,
            )

    def resume(self, model: nn.Module, optimiser: torch.optim.Optimizer) -> tuple[int, int, bool]:
        """(round, epoch, epoch finished) of the latest committed checkpoint, loaded; or a start.

        Only complete checkpoints are committed (a shard of every rank of their world), and the
        job never saves in a world short of a worker, so the latest has a shard for every rank.
        """
        manifest = self.checkpoints.latest()
        self.carried = frozenset()
        if manifest is None:
            # The job starts over, and so does its data: what was read before a failure is in
            # no model state.
            self.registry.restore_progress(DATASET, 0, 0)
            return 0, 0, False
        state = self.checkpoints.load_state(step=manifest.step, rank=self.worker.rank)
        model.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        self.loss = float(state["loss"])
        epoch, completed, partial = restore_point(manifest)
        self.registry.restore_progress(DATASET, epoch, manifest.step, completed, partial)
        assert self.worker.rank is not None
        self.carried = own_completed(manifest, self.worker.rank)
        self.record("resumed", step=manifest.step, epoch=epoch, rank=self.worker.rank)
        emit("resumed", rank=self.worker.rank, round=state["round"], epoch=epoch)
        return int(state["round"]), epoch, bool(state["epoch_done"])

    def train(self) -> None:
        args, worker = self.args, self.worker
        model, optimiser = build_model(args.seed)
        round_id, resumed_epoch, epoch_done = self.resume(model, optimiser)
        # Everyone, the replacement included, is back before anyone reads again. The generation
        # of this barrier counts the (re)starts of the job, the same for every worker.
        self.barrier("world", expected=args.world_size)
        first_epoch = resumed_epoch + 1 if epoch_done else resumed_epoch
        for epoch in range(first_epoch, args.epochs):
            carried = self.carried if epoch == resumed_epoch else frozenset()
            sampler = ShardSampler(self.registry, DATASET, epoch, manual_ack=True, seed=args.seed)
            batches = iter(DataLoader(self.data, batch_size=args.batch_size, sampler=sampler))
            worker.set_state("training", step=round_id, epoch=epoch)
            while True:
                trained = 0
                for inputs, labels in batches:
                    optimiser.zero_grad()
                    loss = nn.functional.cross_entropy(model(inputs), labels)
                    loss.backward()  # type: ignore[no-untyped-call]
                    optimiser.step()
                    sampler.ack(len(labels))
                    self.loss = float(loss)
                    trained += 1
                    if trained >= args.round_batches:
                        break
                sampler.flush()
                self.barrier("round")
                round_id += 1
                plan = self.registry.plan(DATASET, epoch)
                epoch_done = plan.done_shards == plan.total_shards
                # Nobody reads on before everyone has seen the same plan.
                self.barrier("decided")
                if worker.members().world_size < args.world_size:
                    # A worker failed before this round's barriers opened, so they went on
                    # without it: restart rather than checkpoint a world that is short of it.
                    raise strata.BarrierBroken(
                        f"the job has fewer than {args.world_size} workers: restarting from the "
                        "latest complete checkpoint"
                    )
                worker.set_state("checkpointing", step=round_id, epoch=epoch)
                step = round_id  # a round saved again after a restart is the step's next attempt
                try:
                    self.checkpoints.save_state(
                        {
                            "model": model.state_dict(),
                            "optimiser": optimiser.state_dict(),
                            "epoch_done": epoch_done,
                            "loss": self.loss,
                            "round": round_id,
                        },
                        step=step,
                        epoch=epoch,
                        cursors=[cursor_of(sampler, carried)],
                    )
                except strata.ConflictError as exc:
                    # A worker failed since the check above: its rank of the world has no live
                    # worker, so the step was aborted as it opened. Restart, as above.
                    raise strata.BarrierBroken(
                        f"the checkpoint of step {step} was refused, restarting: {exc.message}"
                    ) from exc
                self.record_acks()
                worker.set_state("training", step=round_id, epoch=epoch)
                emit(
                    "round",
                    rank=worker.rank,
                    round=round_id,
                    epoch=epoch,
                    loss=self.loss,
                    batches=trained,
                    done_shards=plan.done_shards,
                    total_shards=plan.total_shards,
                )
                if epoch_done:
                    break


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="A worker of `strata demo`.")
    parser.add_argument("--job", required=True)
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--checkpoints", required=True)
    parser.add_argument("--world-size", type=int, required=True)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--samples", type=int, default=6144)
    parser.add_argument("--shard-size", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--round-batches", type=int, default=8)
    parser.add_argument("--barrier-timeout", type=float, default=120.0)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument(
        "--keep-count", type=int, default=3, help="committed checkpoints kept (older are pruned)"
    )
    parser.add_argument(
        "--record",
        metavar="DIR",
        help="append JSON lines about barrier waits, acknowledged events and resumes to "
        "DIR/worker-<pid>.jsonl",
    )
    Trainer(parser.parse_args(argv)).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
