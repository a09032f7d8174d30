"""PyTorch helpers: `ShardSampler` reads this worker's shards of an epoch through a DataLoader;
`strata.torch.dcp` stores torch.distributed.checkpoint (DCP) checkpoints through Strata's commit.

This package imports torch, so `import strata` never does; import `strata.torch` where the training
code already uses torch.
"""

from strata.extras import require

require("torch", what="strata.torch")

from strata.torch.sampler import ShardSampler, ShardSource, within_shard_order  # noqa: E402

__all__ = ["ShardSampler", "ShardSource", "within_shard_order"]


def __getattr__(name: str) -> object:
    # `strata.torch.dcp` imports torch.distributed.checkpoint: only for those who use it.
    if name == "dcp":
        import importlib

        return importlib.import_module("strata.torch.dcp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
