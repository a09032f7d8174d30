"""PyTorch helpers: `ShardSampler` reads this worker's shards of an epoch through a DataLoader;
`Lockstep` steps every rank's batches together under DDP, whatever the framework around it;
`strata.torch.dcp` stores torch.distributed.checkpoint (DCP) checkpoints through Strata's commit;
`LiveGroup` (`strata.torch.live`) trains data parallel through rank failures without a restart;
`strata.torch.rendezvous` is torchrun's `--rdzv-backend=strata`.

This package imports torch, so `import strata` never does; import `strata.torch` where the training
code already uses torch. Its names are imported on first use: torch imports
`strata.torch.rendezvous` in every torchrun agent, which must not pay for the sampler's imports.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from strata.extras import require

require("torch", what="strata.torch")

if TYPE_CHECKING:
    from strata.torch.live import LiveGroup
    from strata.torch.lockstep import Lockstep, Step
    from strata.torch.sampler import ShardSampler, ShardSource, within_shard_order

__all__ = ["LiveGroup", "Lockstep", "ShardSampler", "ShardSource", "Step", "within_shard_order"]

_SAMPLER = frozenset(["ShardSampler", "ShardSource", "within_shard_order"])
_LOCKSTEP = frozenset(["Lockstep", "Step"])


def __getattr__(name: str) -> object:
    if name in _SAMPLER:
        value = getattr(importlib.import_module("strata.torch.sampler"), name)
        globals()[name] = value
        return value
    if name in _LOCKSTEP:
        value = getattr(importlib.import_module("strata.torch.lockstep"), name)
        globals()[name] = value
        return value
    if name == "LiveGroup":
        value = importlib.import_module("strata.torch.live").LiveGroup
        globals()[name] = value
        return value
    # `strata.torch.dcp` imports torch.distributed.checkpoint: only for those who use it.
    if name == "dcp":
        return importlib.import_module("strata.torch.dcp")
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
