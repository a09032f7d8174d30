"""One rank of the demo job: one small PyTorch model trained with DDP over gloo, synthetic data.

Strata gives the rank and the world; the ranks form a gloo process group through a
`torch.distributed.FileStore` created anew for every (re)start of the job (named after the
generation of the `world` barrier, so a restart never meets a store of an earlier group), or, with
`--pg-master HOST:PORT` (pods without a shared volume), through a `TCPStore` that rank 0 hosts,
every (re)start under a key prefix of its own; and wrap the model in DistributedDataParallel:
gradients are averaged over the ranks, so every rank holds the same parameters, and the reported
loss is the mean over every rank's samples.

Training goes in rounds: the ranks train a few steps in lockstep on their shards (a rank out of
batches trains on an empty one), meet at a barrier, and every rank checkpoints its state and data
cursor under the same step (the round number). When a worker dies, the survivors' collectives or
barriers fail; each of them, and the replacement, drops the process group, reloads the latest
complete checkpoint, resets the data progress to its cursors, waits until the whole world is
back, forms a new group and goes on. `seen` counts how often each sample went into the model and
is checkpointed with it, so the end of the job checks every sample was trained exactly once per
epoch. Progress lines go to stdout as JSON for the demo driver.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import faulthandler
import hashlib
import json
import math
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils.data import DataLoader, TensorDataset

import strata
from strata.events import DataCursor, ShardOffset
from strata.events.requests import Manifest
from strata.torch import ShardSampler

DATASET = "synthetic"


def emit(kind: str, **fields: Any) -> None:
    print(json.dumps({"event": kind, "t": time.time(), **fields}), flush=True)


MAX_RESTARTS = 20


def synthetic_data(samples: int, seed: int) -> TensorDataset:
    """The same labelled points in every worker, with their index: a noisy linear boundary in
    16 dimensions."""
    generator = torch.Generator().manual_seed(seed)
    inputs = torch.randn(samples, 16, generator=generator)
    boundary = torch.randn(16, generator=generator)
    noise = 0.1 * torch.randn(samples, generator=generator)
    labels = ((inputs @ boundary + noise) > 0).long()
    return TensorDataset(torch.arange(samples), inputs, labels)


def parameters_digest(model: nn.Module) -> str:
    """A short digest of the model's parameters: equal on every rank when DDP kept them equal."""
    digest = hashlib.sha256()
    for parameter in model.parameters():
        digest.update(parameter.detach().contiguous().numpy().tobytes())
    return digest.hexdigest()[:16]


def default_store_dir(checkpoints: str) -> Path:
    """Where the process groups' FileStores go unless `--pg-store` says: beside local
    checkpoints (a volume every rank shares), else the temp dir (one machine)."""
    if "://" in checkpoints and not checkpoints.startswith("file://"):
        return Path(tempfile.gettempdir()) / "strata-process-groups"
    local = checkpoints.removeprefix("file://")
    return Path(local).resolve().parent / "process-groups"


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
        self.seen = torch.zeros(args.samples)
        self.record = Recorder(args.record)
        self.recorded_acks = 0
        self.carried: frozenset[int] = frozenset()
        self.store_dir = (
            Path(args.pg_store) if args.pg_store else default_store_dir(args.checkpoints)
        )
        self.store_dir.mkdir(parents=True, exist_ok=True)
        self.tcp_server: Any = None
        """Rank 0's TCPStore with `--pg-master`, made at its first join."""
        self.model: nn.Module | None = None
        emit("started", rank=self.worker.rank, worker=self.worker.id)

    def run(self) -> None:
        restarts = 0
        while True:
            try:
                self.train()
                break
            except (strata.BarrierBroken, strata.BarrierTimeout, RuntimeError) as exc:
                # RuntimeError: a collective or the store of the process group failed (gloo's
                # errors are RuntimeErrors), which a dead peer causes as a broken barrier does.
                restarts += 1
                if restarts > MAX_RESTARTS:
                    raise
                emit("restart", rank=self.worker.rank, reason=str(exc)[:300], restarts=restarts)
                self.leave_group()
                self.checkpoints.wait()
                self.record_acks()
                # The restarted job saves its rounds under the same step numbers again: a new
                # manager's saves are new attempts of the steps the failure aborted.
                self.checkpoints, self.recorded_acks = self.checkpoint_manager(), 0
        self.checkpoints.wait()
        self.record_acks()
        assert self.model is not None
        emit(
            "done",
            rank=self.worker.rank,
            loss=self.loss,
            worker=self.worker.id,
            parameters=parameters_digest(self.model),
            exactly_once=bool((self.seen == self.args.epochs).all()),
        )
        self.leave_group()
        self.worker.stop()

    def checkpoint_manager(self) -> strata.CheckpointManager:
        return strata.CheckpointManager(
            self.worker, self.args.checkpoints, keep_count=self.args.keep_count
        )

    def join_group(self, generation: int) -> None:
        """The gloo process group of this (re)start of the job: Strata's rank and world, and a
        store of this start's own (the `world` barrier's generation names it)."""
        rank = self.worker.rank
        assert rank is not None
        dist.init_process_group(
            "gloo",
            store=self.group_store(rank, generation),
            rank=rank,
            world_size=self.args.world_size,
            timeout=datetime.timedelta(seconds=self.args.barrier_timeout),
        )

    def group_store(self, rank: int, generation: int) -> dist.Store:  # type: ignore[name-defined]
        """A FileStore in the shared directory, or, with `--pg-master`, rank 0's TCPStore with
        this start's prefix. Rank 0 hosts one server for the life of its process; the other
        ranks connect anew each start, since a replaced rank 0 hosts a new one at the address."""
        name = f"{self.args.job}-{generation}"
        if self.args.pg_master is None:
            return dist.FileStore(  # type: ignore[attr-defined]
                str(self.store_dir / f"{name}.store"), self.args.world_size
            )
        host, port = self.args.pg_master
        timeout = datetime.timedelta(seconds=self.args.barrier_timeout)
        if rank == 0:
            if self.tcp_server is None:
                # The server listens on every interface; the pod's peers reach it at `host`.
                self.tcp_server = dist.TCPStore(  # type: ignore[attr-defined]
                    host, port, is_master=True, timeout=timeout, wait_for_workers=False
                )
            store = self.tcp_server
        else:
            store = dist.TCPStore(  # type: ignore[attr-defined]
                host, port, is_master=False, timeout=timeout
            )
        return dist.PrefixStore(name, store)  # type: ignore[attr-defined]

    def leave_group(self) -> None:
        if dist.is_initialized():
            with contextlib.suppress(RuntimeError):  # a group whose peers died may complain
                dist.destroy_process_group()

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
        """(round, epoch, epoch finished) of the latest complete checkpoint, loaded; or a start.

        Only complete checkpoints are committed (a shard of every rank of their world), and the
        job never saves in a world short of a worker, so the latest has a shard for every rank.
        Under DDP every rank saved the same model; each loads its own rank's shard (its cursor).
        """
        manifest = self.checkpoints.latest()
        self.carried = frozenset()
        self.seen = torch.zeros(self.args.samples)
        if manifest is None:
            # The job starts over, and so does its data: what was read before a failure is in
            # no model state.
            self.registry.restore_progress(DATASET, 0, 0)
            return 0, 0, False
        state = self.checkpoints.load_state(step=manifest.step, rank=self.worker.rank)
        model.load_state_dict(state["model"])
        optimiser.load_state_dict(state["optimiser"])
        self.loss = float(state["loss"])
        self.seen = state["seen"]
        epoch, completed, partial = restore_point(manifest)
        self.registry.restore_progress(DATASET, epoch, manifest.step, completed, partial)
        assert self.worker.rank is not None
        self.carried = own_completed(manifest, self.worker.rank)
        self.record("resumed", step=manifest.step, epoch=epoch, rank=self.worker.rank)
        emit("resumed", rank=self.worker.rank, round=state["round"], epoch=epoch)
        return int(state["round"]), epoch, bool(state["epoch_done"])

    def train(self) -> None:
        args = self.args
        module, optimiser = build_model(args.seed)
        round_id, resumed_epoch, epoch_done = self.resume(module, optimiser)
        # Everyone, the replacement included, is back before anyone reads again. The generation
        # of this barrier counts the (re)starts of the job, the same for every worker.
        generation = self.barrier("world", expected=args.world_size)
        self.join_group(generation)
        # DDP starts every rank from rank 0's parameters and averages the gradients from then on.
        model = DistributedDataParallel(module)
        self.model = module
        first_epoch = resumed_epoch + 1 if epoch_done else resumed_epoch
        for epoch in range(first_epoch, args.epochs):
            carried = self.carried if epoch == resumed_epoch else frozenset()
            sampler = ShardSampler(self.registry, DATASET, epoch, manual_ack=True, seed=args.seed)
            batches = iter(DataLoader(self.data, batch_size=args.batch_size, sampler=sampler))
            self.worker.set_state("training", step=round_id, epoch=epoch)
            while True:
                trained = self.train_round(model, optimiser, sampler, batches)
                round_id, epoch_done = self.end_round(
                    module, optimiser, sampler, carried, round_id, epoch, trained
                )
                if epoch_done:
                    break

    def train_round(
        self,
        model: nn.Module,
        optimiser: torch.optim.Optimizer,
        sampler: ShardSampler,
        batches: Any,
    ) -> int:
        """Up to `--round-batches` steps, every rank in lockstep; how many were taken.

        After a re-plan ranks hold different numbers of batches, and DDP needs every rank in
        every all-reduce: a rank with none left trains on an empty batch (no gradient), and the
        loss is scaled so that each step averages over the samples of all ranks.
        """
        world = self.args.world_size
        empty = self.data[:0]
        steps = 0
        while steps < self.args.round_batches:
            batch = next(batches, None)
            count = torch.tensor(0 if batch is None else len(batch[0]))
            dist.all_reduce(count)
            if count.item() == 0:
                break
            index, inputs, labels = batch if batch is not None else empty
            loss_sum = nn.functional.cross_entropy(model(inputs), labels, reduction="sum")
            optimiser.zero_grad()
            (loss_sum * world / count).backward()
            optimiser.step()
            total = loss_sum.detach().clone()
            trained = torch.zeros(self.args.samples).index_add_(0, index, torch.ones(len(index)))
            dist.all_reduce(total)
            dist.all_reduce(trained)
            self.seen += trained
            self.loss = float(total) / int(count)  # the mean over every rank's samples
            if batch is not None:
                sampler.ack(len(index))
            steps += 1
        return steps

    def end_round(
        self,
        module: nn.Module,
        optimiser: torch.optim.Optimizer,
        sampler: ShardSampler,
        carried: frozenset[int],
        round_id: int,
        epoch: int,
        trained: int,
    ) -> tuple[int, bool]:
        """Meet, decide whether the epoch is done, checkpoint; the new round and that decision."""
        worker = self.worker
        sampler.flush()
        self.barrier("round")
        round_id += 1
        plan = self.registry.plan(DATASET, epoch)
        epoch_done = plan.done_shards == plan.total_shards
        # Nobody reads on before everyone has seen the same plan.
        self.barrier("decided")
        refused = self.save_round(module, optimiser, sampler, carried, round_id, epoch, epoch_done)
        # Every rank restarts or none does. A rank that restarted alone would leave the others
        # in the next round's first all-reduce, waiting for it until the group's timeout: a
        # rank that leaves a gloo group does not close its connections. A dead rank fails this
        # all-reduce at once (its connections are closed), and the job restarts as it should.
        verdict = torch.tensor(0 if refused is None else 1)
        dist.all_reduce(verdict, op=dist.ReduceOp.MAX)
        if verdict.item():
            raise strata.BarrierBroken(
                refused or "another rank could not checkpoint this round: restarting with it"
            )
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
        return round_id, epoch_done

    def save_round(
        self,
        module: nn.Module,
        optimiser: torch.optim.Optimizer,
        sampler: ShardSampler,
        carried: frozenset[int],
        round_id: int,
        epoch: int,
        epoch_done: bool,
    ) -> str | None:
        """Checkpoint this round as step `round_id`; None once saving started, else why this
        rank must restart instead."""
        if self.worker.members().world_size < self.args.world_size:
            # A worker failed before this round's barriers opened, so they went on without it:
            # restart rather than checkpoint a world that is short of it.
            return (
                f"the job has fewer than {self.args.world_size} workers: restarting from the "
                "latest complete checkpoint"
            )
        self.worker.set_state("checkpointing", step=round_id, epoch=epoch)
        step = round_id  # a round saved again after a restart is the step's next attempt
        try:
            self.checkpoints.save_state(
                {
                    "model": module.state_dict(),
                    "optimiser": optimiser.state_dict(),
                    "epoch_done": epoch_done,
                    "loss": self.loss,
                    "round": round_id,
                    "seen": self.seen,
                },
                step=step,
                epoch=epoch,
                cursors=[cursor_of(sampler, carried)],
            )
        except strata.ConflictError as exc:
            # A worker failed since the check above: its rank of the world has no live worker,
            # so the step was aborted as it opened.
            return f"the checkpoint of step {step} was refused, restarting: {exc.message}"
        return None


def host_port(text: str) -> tuple[str, int]:
    """`HOST:PORT` of `--pg-master`."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    if host.startswith("[") and host.endswith("]"):  # an IPv6 address, as in a URL
        host = host[1:-1]
    return host, int(port)


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
        "--pg-store",
        metavar="DIR",
        help="directory every rank shares for the process groups' FileStores (default: "
        "'process-groups' beside local checkpoints, else the temp dir)",
    )
    parser.add_argument(
        "--pg-master",
        metavar="HOST:PORT",
        type=host_port,
        help="form the process groups through a TCPStore that rank 0 serves on PORT (on every "
        "interface) and the other ranks reach at HOST:PORT, instead of FileStores in --pg-store",
    )
    parser.add_argument(
        "--record",
        metavar="DIR",
        help="append JSON lines about barrier waits, acknowledged events and resumes to "
        "DIR/worker-<pid>.jsonl",
    )
    args = parser.parse_args(argv)
    # `kill -USR1 <pid>` writes every thread's stack to stderr: where a worker that stopped
    # making progress is waiting.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    Trainer(args).run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
