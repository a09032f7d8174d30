"""Strata: the control plane of distributed training jobs.

Workers use this package to register, heartbeat, get data shards, meet at barriers and write
checkpoints; the services under `strata.services` coordinate them over NATS JetStream.
"""

from strata import aio
from strata.aio import WorkerNotStarted
from strata.checkpoint import CheckpointManager
from strata.datasets import DatasetRegistry
from strata.errors import (
    BarrierBroken,
    BarrierTimeout,
    BusError,
    ChecksumMismatch,
    CodecError,
    ConfigError,
    ConflictError,
    Forbidden,
    InvalidRequest,
    MissingShard,
    NotFound,
    PublishTimeout,
    RpcError,
    RpcTimeout,
    ServiceUnavailable,
    StorageError,
    StrataError,
    ValidationError,
    WorkerSuperseded,
)
from strata.worker import Worker, default_worker

__version__ = "0.1.0"

__all__ = [
    "BarrierBroken",
    "BarrierTimeout",
    "BusError",
    "CheckpointManager",
    "ChecksumMismatch",
    "CodecError",
    "ConfigError",
    "ConflictError",
    "DatasetRegistry",
    "Forbidden",
    "InvalidRequest",
    "MissingShard",
    "NotFound",
    "PublishTimeout",
    "RpcError",
    "RpcTimeout",
    "ServiceUnavailable",
    "StorageError",
    "StrataError",
    "ValidationError",
    "Worker",
    "WorkerNotStarted",
    "WorkerSuperseded",
    "__version__",
    "aio",
    "default_worker",
]
