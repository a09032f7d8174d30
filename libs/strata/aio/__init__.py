"""The asyncio worker SDK: join a job, heartbeat in the background, and follow its membership.

`Worker` is what asyncio training code uses directly; the synchronous `strata.Worker` runs one on a
background event loop. Later SDK parts (datasets, checkpoints, barriers) reuse its `bus`.

The worker is built in layers, one module per concern: its identity, settings and registration
(`_core`), what a heartbeat reports about the process (`_sampling`), its heartbeats
(`_heartbeats`), its membership and re-registration (`_membership`), its training metrics
(`_training`), and its life and barriers (`worker`). This module is the public face: import
from `strata.aio`, not from those.
"""

from __future__ import annotations

from strata.aio._core import (
    CLOSE_TIMEOUT_S,
    LEAVE_RETRY_S,
    MEMBERS_RETRY_S,
    REGISTER_RETRY_S,
    REGISTRY,
    RPC_TIMEOUT_S,
    SAVES_TIMEOUT_S,
    OnRejoin,
    WorkerNotStarted,
)
from strata.aio._membership import decode_world_notice
from strata.aio.worker import Worker

__all__ = [
    "CLOSE_TIMEOUT_S",
    "LEAVE_RETRY_S",
    "MEMBERS_RETRY_S",
    "REGISTER_RETRY_S",
    "REGISTRY",
    "RPC_TIMEOUT_S",
    "SAVES_TIMEOUT_S",
    "CheckpointManager",
    "DatasetRegistry",
    "OnRejoin",
    "Worker",
    "WorkerNotStarted",
    "decode_world_notice",
]

# The other asyncio SDK parts, under their public names (they import this package for types only).
from strata.checkpoint import AsyncCheckpointManager as CheckpointManager
from strata.datasets import AsyncDatasetRegistry as DatasetRegistry
