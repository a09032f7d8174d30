"""What iterates a Strata data source: refuse the wrappers that would drain or re-shard it.

Strata's sampler and lockstep dataset already give each rank its own samples and report what was
read. A framework that wraps them in a sampler of its own (Lightning's `DistributedSamplerWrapper`
under the default `use_distributed_sampler=True`, a `DistributedSampler` made by hand) drains the
whole epoch into a list, so the service records every shard done before anything trained; one that
splits the batches again across ranks (Accelerate's `prepare(loader)`) trains part of each rank's
samples and reports all of them. Both lose data silently. `check_consumer` looks at the frames
that asked for the first index (a few frames, once per pass: no cost per sample) and raises
`WrappedDataError`, saying what to change, before any index is handed out and so before any
progress is reported.

The wrappers are recognised by class name (their module and qualified name, on the class or a
base), so neither framework is imported here.
"""

from __future__ import annotations

import sys
from types import FrameType
from typing import Final

from strata.errors import ConfigError

__all__ = ["WrappedDataError", "check_consumer", "wrapper_of"]

FRAMES: Final = 16
"""How far up the first `next()` is looked at: a DataLoader iterator, a batch sampler and a
framework's wrapper are a handful of frames."""

_LIGHTNING_FIX: Final = (
    "pass Trainer(use_distributed_sampler=False) (strata.lightning.StrataFit's "
    "trainer_options() does): Strata already gives each rank its own shards"
)
_ACCELERATE_FIX: Final = (
    "leave the DataLoader out of accelerator.prepare(...) and prepare the model and optimiser "
    "only (strata.accelerate.StrataRun reads the data itself): Strata already gives each rank "
    "its own shards"
)
_SAMPLER_FIX: Final = (
    "give the DataLoader the Strata sampler itself (DataLoader(data, sampler=sampler)); Strata "
    "already gives each rank its own shards"
)

# (module prefix, class name, what it does to the data, what to change)
_WRAPPERS: Final = (
    (
        "lightning",
        "_DatasetSamplerWrapper",
        "Lightning's DistributedSamplerWrapper (use_distributed_sampler=True) drains the whole "
        "epoch into a list and splits it again across ranks",
        _LIGHTNING_FIX,
    ),
    (
        "pytorch_lightning",
        "_DatasetSamplerWrapper",
        "Lightning's DistributedSamplerWrapper (use_distributed_sampler=True) drains the whole "
        "epoch into a list and splits it again across ranks",
        _LIGHTNING_FIX,
    ),
    (
        "accelerate",
        "BatchSamplerShard",
        "accelerator.prepare(loader) splits each rank's batches again across the processes",
        _ACCELERATE_FIX,
    ),
    (
        "accelerate",
        "IterableDatasetShard",
        "accelerator.prepare(loader) splits each rank's batches again across the processes",
        _ACCELERATE_FIX,
    ),
    (
        "accelerate",
        "DataLoaderDispatcher",
        "accelerator.prepare(loader) with dispatch_batches reads on one rank and splits its "
        "batches across the processes",
        _ACCELERATE_FIX,
    ),
    (
        "accelerate",
        "SkipBatchSampler",
        "accelerator.skip_first_batches() drains the skipped batches, which Strata would count "
        "as read; Strata's cursor already resumes after them",
        "iterate the loader from the start after a resume",
    ),
    (
        "torch.utils.data.distributed",
        "DistributedSampler",
        "a DistributedSampler over the Strata sampler splits its indices again across ranks",
        _SAMPLER_FIX,
    ),
)


class WrappedDataError(ConfigError):
    """A Strata sampler or dataset is iterated through a wrapper that would lose data."""

    code = "wrapped_data"


def _names(cls: type) -> list[tuple[str, str]]:
    return [(getattr(k, "__module__", "") or "", k.__name__) for k in cls.__mro__]


def _shards_across_processes(obj: object) -> bool:
    """A re-sharding wrapper over one process splits nothing."""
    processes = getattr(obj, "num_processes", None)
    if isinstance(processes, int):
        return processes > 1
    replicas = getattr(obj, "num_replicas", None)
    if isinstance(replicas, int):
        return replicas > 1
    return True


def wrapper_of(obj: object) -> tuple[str, str] | None:
    """(what `obj` does to the data, what to change) if it is a wrapper that loses data."""
    names = _names(type(obj))
    for module, name, what, fix in _WRAPPERS:
        for own_module, own_name in names:
            if own_name == name and (own_module == module or own_module.startswith(module + ".")):
                return (what, fix) if _shards_across_processes(obj) else None
    return None


def check_consumer(source: str, frame: FrameType | None = None) -> None:
    """Raise `WrappedDataError` if the code that asked `source` (e.g. "ShardSampler") for its
    first index runs inside a wrapper that drains or re-shards it.

    Call it first thing in the generator's body: `frame` defaults to the generator's caller."""
    current: FrameType | None = frame if frame is not None else sys._getframe(2)
    for _ in range(FRAMES):
        if current is None:
            return
        owner = current.f_locals.get("self")
        if owner is not None:
            found = wrapper_of(owner)
            if found is not None:
                what, fix = found
                raise WrappedDataError(
                    f"{source} is iterated through {type(owner).__name__}: {what}, so samples "
                    f"would be reported read that never trained. Nothing was reported. To fix: "
                    f"{fix}"
                )
        current = current.f_back
