"""Strata: the control plane of distributed training jobs.

Workers use this package to register, heartbeat, get data shards, meet at barriers and write
checkpoints; the services under `strata.services` coordinate them over NATS JetStream.

The names below are imported on first use, not with the package: torch imports
`strata.torch.rendezvous` in every torchrun agent (an entry point), and that must not cost the
import of the SDK, nats and pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from strata import _imports
from strata import clock as _clock  # noqa: F401  (installs the test clock seam when asked)
from strata.errors import (
    BackgroundTaskFailed,
    BarrierBroken,
    BarrierTimeout,
    BusError,
    Busy,
    ChecksumMismatch,
    CodecError,
    ConfigError,
    ConflictError,
    Forbidden,
    InvalidRequest,
    LeaseExpired,
    MissingShard,
    NotFound,
    PublishTimeout,
    QuotaExceeded,
    RateLimited,
    RpcError,
    RpcTimeout,
    ServiceUnavailable,
    StaleLease,
    StorageError,
    StrataError,
    ValidationError,
    WorkerSuperseded,
)

# Before anything imports structlog or nats-py: keeps rich and aiohttp out of their imports.
_imports.install()

if TYPE_CHECKING:
    from strata import aio
    from strata.aio import CheckpointOptions, DatasetOptions, WorkerNotStarted, WorkerOptions
    from strata.checkpoint import CheckpointManager
    from strata.datasets import DatasetRegistry
    from strata.worker import Worker, default_worker

__version__ = "0.1.0"

_LAZY = {
    "aio": "strata.aio",
    "WorkerNotStarted": "strata.aio",
    "WorkerOptions": "strata.aio",
    "CheckpointOptions": "strata.aio",
    "DatasetOptions": "strata.aio",
    "CheckpointManager": "strata.checkpoint",
    "DatasetRegistry": "strata.datasets",
    "Worker": "strata.worker",
    "default_worker": "strata.worker",
}

__all__ = [
    "BackgroundTaskFailed",
    "BarrierBroken",
    "BarrierTimeout",
    "BusError",
    "Busy",
    "CheckpointManager",
    "CheckpointOptions",
    "ChecksumMismatch",
    "CodecError",
    "ConfigError",
    "ConflictError",
    "DatasetOptions",
    "DatasetRegistry",
    "Forbidden",
    "InvalidRequest",
    "LeaseExpired",
    "MissingShard",
    "NotFound",
    "PublishTimeout",
    "QuotaExceeded",
    "RateLimited",
    "RpcError",
    "RpcTimeout",
    "ServiceUnavailable",
    "StaleLease",
    "StorageError",
    "StrataError",
    "ValidationError",
    "Worker",
    "WorkerNotStarted",
    "WorkerOptions",
    "WorkerSuperseded",
    "__version__",
    "aio",
    "default_worker",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'strata' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if name == "aio" else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
