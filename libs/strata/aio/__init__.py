"""The asyncio SDK: a worker that joins a job, heartbeats in the background and follows its
membership, and on it datasets and shards, checkpoints and barriers.

These classes own the SDK's behaviour; `strata.Worker`, `strata.DatasetRegistry` and
`strata.CheckpointManager` are their blocking faces, which run these coroutines on a background
event loop (`strata._loop`) and take the same options objects (`WorkerOptions`,
`DatasetOptions`, `CheckpointOptions`). This package never imports those faces.

The worker is built in layers, one module per concern: its identity, settings and registration
(`_core`), what a heartbeat reports about the process (`_sampling`), its heartbeats
(`_heartbeats`), its membership and re-registration (`_membership`), its training metrics
(`_training`), and its life (`worker`); its barrier waits are `_barrier`'s, and datasets and
checkpoints are `_datasets` and `_checkpoint`, on the worker's bus. This module is the public
face: import from `strata.aio`, not from those. The checkpoint names are imported on first use:
a rank that trains without checkpoints (a `LiveGroup` replacement heals from its peers) does not
pay for `strata.storage`.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from strata.aio._core import (
    CLOSE_TIMEOUT_S,
    LEAVE_RETRY_S,
    MEMBERS_RETRY_S,
    REGISTER_RETRY_S,
    REGISTRY,
    RPC_TIMEOUT_S,
    SAVES_TIMEOUT_S,
    OnRejoin,
    WorkerArgs,
    WorkerNotStarted,
    WorkerOptions,
)
from strata.aio._datasets import DatasetArgs, DatasetOptions, DatasetRegistry
from strata.aio._membership import decode_world_notice
from strata.aio.worker import Worker

if TYPE_CHECKING:
    from strata.aio._checkpoint import (
        CheckpointArgs,
        CheckpointManager,
        CheckpointOptions,
        ShardSlot,
    )

_CHECKPOINT = frozenset(["CheckpointArgs", "CheckpointManager", "CheckpointOptions", "ShardSlot"])

__all__ = [
    "CLOSE_TIMEOUT_S",
    "LEAVE_RETRY_S",
    "MEMBERS_RETRY_S",
    "REGISTER_RETRY_S",
    "REGISTRY",
    "RPC_TIMEOUT_S",
    "SAVES_TIMEOUT_S",
    "CheckpointArgs",
    "CheckpointManager",
    "CheckpointOptions",
    "DatasetArgs",
    "DatasetOptions",
    "DatasetRegistry",
    "OnRejoin",
    "ShardSlot",
    "Worker",
    "WorkerArgs",
    "WorkerNotStarted",
    "WorkerOptions",
    "decode_world_notice",
]


def __getattr__(name: str) -> object:
    if name not in _CHECKPOINT:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module("strata.aio._checkpoint"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | _CHECKPOINT)
