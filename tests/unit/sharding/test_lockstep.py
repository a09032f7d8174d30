"""`Lockstep` in one process against the sharding domain in memory: a loop that fetches one step
ahead (as Lightning does) trains every sample of the epoch exactly once, the epoch ends when the
service says so (not when this rank runs dry while another's shards are still open), and a step
handed out but not acknowledged is never handed out again within the pass."""

from __future__ import annotations

import threading
from collections import Counter

import torch
from strata.torch import Lockstep, Step
from torch.utils.data import DataLoader, TensorDataset

from tests.unit.sharding.local_shards import DS, LocalShards

SAMPLES = 95


def dataset() -> TensorDataset:
    return TensorDataset(torch.arange(SAMPLES), torch.randn(SAMPLES, 3))


def train_fetching_ahead(lockstep: Lockstep, trained: Counter[int]) -> int:
    """Draw step k+1 before training step k, as Lightning's fetcher does; returns the steps."""
    steps = 0
    pending: Step | None = None
    for step in DataLoader(lockstep, batch_size=None):
        if pending is not None:
            trained.update(pending.batch[0].tolist())
            lockstep.trained(pending)
        pending = step
        steps += 1
    if pending is not None:
        trained.update(pending.batch[0].tolist())
        lockstep.trained(pending)
    lockstep.flush()
    return steps


def test_a_loop_that_fetches_ahead_trains_every_sample_once() -> None:
    shards = LocalShards(SAMPLES, 10, ["a"])
    lockstep = Lockstep(shards.view("a"), DS, dataset(), batch_size=8)
    trained: Counter[int] = Counter()
    steps = train_fetching_ahead(lockstep, trained)
    assert trained == Counter(range(SAMPLES))
    assert steps == -(-SAMPLES // 8)  # batches run across shard boundaries
    assert shards.plan_summary().done_shards == shards.plan_summary().total_shards


def test_the_epoch_waits_for_a_failed_workers_shards_then_ends() -> None:
    shards = LocalShards(SAMPLES, 10, ["a", "b"])
    lockstep = Lockstep(shards.view("a"), DS, dataset(), batch_size=8)
    own = len(lockstep.sampler)
    assert 0 < own < SAMPLES
    # b never reads; it fails while a trains, and its shards move to a.
    failed = threading.Event()
    trained: Counter[int] = Counter()
    steps: list[Step] = []

    def fail_b_when_a_runs_dry() -> None:
        failed.wait()
        shards.fail("b")

    failer = threading.Thread(target=fail_b_when_a_runs_dry)
    failer.start()
    for step in lockstep:
        steps.append(step)
        trained.update(step.batch[0].tolist())
        lockstep.trained(step)
        if sum(trained.values()) >= own:
            failed.set()
    failer.join(timeout=60)
    assert trained == Counter(range(SAMPLES))
    assert all(step.samples == step.global_samples for step in steps)
    assert shards.plan_summary().done_shards == shards.plan_summary().total_shards


def test_an_empty_step_has_the_shape_of_a_batch_and_scales_by_one() -> None:
    shards = LocalShards(SAMPLES, 10, ["a"])
    lockstep = Lockstep(shards.view("a"), DS, dataset(), batch_size=8)
    empty = lockstep._empty_batch()
    assert [tuple(t.shape) for t in empty] == [(0,), (0, 3)]
    assert Step(empty, 0, 0).scale == 1.0
    assert Step(empty, 0, 16).scale == 1 / 16
