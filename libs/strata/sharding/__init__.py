"""Pure sharding algorithms: shard ranges, seeded shard orders, balanced elastic plans. No I/O."""

from strata.sharding.plan import (
    DatasetSpec,
    Plan,
    ShardRange,
    initial_plan,
    replan,
    shard_order,
)

__all__ = ["DatasetSpec", "Plan", "ShardRange", "initial_plan", "replan", "shard_order"]
