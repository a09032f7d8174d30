"""PyTorch helpers: `ShardSampler` reads this worker's shards of an epoch through a DataLoader.

This package imports torch, so `import strata` never does; import `strata.torch` where the training
code already uses torch.
"""

from strata.extras import require

require("torch", what="strata.torch")

from strata.torch.sampler import ShardSampler, ShardSource, within_shard_order  # noqa: E402

__all__ = ["ShardSampler", "ShardSource", "within_shard_order"]
