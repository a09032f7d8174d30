"""A Strata sampler iterated through a framework's wrapper that drains or re-shards it fails at
the first index, before any progress is reported; iterated through a plain DataLoader (or a
wrapper over one process, which splits nothing) it reads as before.

The wrappers are the frameworks' own classes (Lightning's `DistributedSamplerWrapper`,
Accelerate's `BatchSamplerShard` and `skip_first_batches`), driven as the frameworks drive them.
"""

from __future__ import annotations

import pytest
from strata.torch import ShardSampler
from strata.torch.wrapping import WrappedDataError, wrapper_of
from torch.utils.data import BatchSampler, DataLoader

from tests.unit.sharding.local_shards import DS, LocalShards

lightning_distributed = pytest.importorskip("lightning.fabric.utilities.distributed")
accelerate_loader = pytest.importorskip("accelerate.data_loader")


def fresh() -> tuple[LocalShards, ShardSampler]:
    shards = LocalShards(40, 10, ["a"])
    return shards, ShardSampler(shards.view("a"), DS)


def test_lightnings_distributed_sampler_wrapper_fails_before_any_report() -> None:
    shards, sampler = fresh()
    wrapped = lightning_distributed.DistributedSamplerWrapper(
        sampler, num_replicas=2, rank=0, shuffle=False
    )
    loader = DataLoader(range(40), batch_size=4, sampler=wrapped)
    with pytest.raises(WrappedDataError) as refused:
        next(iter(loader))
    assert "use_distributed_sampler=False" in refused.value.message
    assert refused.value.code == "wrapped_data"
    assert shards.reports == []
    assert shards.plan_summary().done_shards == 0
    # The plain loader reads the whole epoch afterwards: nothing was lost.
    assert sorted(i for b in DataLoader(range(40), batch_size=4, sampler=sampler) for i in b) == (
        list(range(40))
    )


@pytest.mark.parametrize("split_batches", [False, True])
def test_accelerates_batch_sampler_shard_fails_before_any_report(split_batches: bool) -> None:
    shards, sampler = fresh()
    sharded = accelerate_loader.BatchSamplerShard(
        BatchSampler(sampler, batch_size=4, drop_last=False),
        num_processes=2,
        process_index=0,
        split_batches=split_batches,
    )
    with pytest.raises(WrappedDataError) as refused:
        next(iter(DataLoader(range(40), batch_sampler=sharded)))
    assert "accelerator.prepare" in refused.value.message
    assert shards.reports == []


def test_accelerates_skip_first_batches_fails_before_any_report() -> None:
    shards, sampler = fresh()
    loader = DataLoader(range(40), batch_size=4, sampler=sampler)
    skipping = accelerate_loader.skip_first_batches(loader, num_batches=2)
    with pytest.raises(WrappedDataError) as refused:
        next(iter(skipping))
    assert "after a resume" in refused.value.message
    assert shards.reports == []


def test_a_wrapper_over_one_process_splits_nothing_and_reads_every_sample() -> None:
    shards, sampler = fresh()
    sharded = accelerate_loader.BatchSamplerShard(
        BatchSampler(sampler, batch_size=4, drop_last=False), num_processes=1, process_index=0
    )
    seen = [i for batch in DataLoader(range(40), batch_sampler=sharded) for i in batch]
    assert sorted(seen) == list(range(40))
    assert shards.plan_summary().done_shards == 4


def test_a_plain_loader_and_plain_objects_are_not_wrappers() -> None:
    shards, sampler = fresh()
    assert wrapper_of(sampler) is None
    assert wrapper_of(DataLoader(range(3))) is None
    assert wrapper_of(object()) is None
    seen = [int(i) for batch in DataLoader(range(40), batch_size=8, sampler=sampler) for i in batch]
    assert sorted(seen) == list(range(40))
    assert shards.plan_summary().done_shards == 4
