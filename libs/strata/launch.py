"""The rank a launcher gave this process: the one rule every Strata worker follows.

A worker built without `rank=` (and without `STRATA_RANK`) takes, in this order: the `RANK` of a
launcher that sets `RANK` and `WORLD_SIZE` (torchrun, `accelerate launch`, the chart's Indexed
Job), with `rank-<RANK>` as its worker id so that a process the launcher restarts supersedes its
dead predecessor at once; else the rank of `torch.distributed`'s default group when the process
has initialised one (a launcher that sets no `RANK`, such as Lightning's own); else none, and the
registry gives the lowest free rank. torch is never imported here: only a process that already
imported `torch.distributed` can have a group.
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass

from strata.config import Env
from strata.security import worker_identity

__all__ = ["LaunchedAs", "launched_as"]

RANK_VARIABLES = ("RANK", "WORLD_SIZE")
"""What torch's launchers set in every process they start."""


@dataclass(frozen=True)
class LaunchedAs:
    """A launcher's rank for this process, and the worker id that goes with it (None: the
    registry's or the credential's)."""

    rank: int
    worker_id: str | None


def launched_as() -> LaunchedAs | None:
    """This process's rank as its launcher or torch.distributed gave it, or None (also when
    `STRATA_RANK` is set: the user's choice comes first)."""
    if os.environ.get(Env.RANK):
        return None
    raw = os.environ.get("RANK", "")
    if raw.isdigit() and os.environ.get("WORLD_SIZE"):
        rank = int(raw)
        # A worker credential names the worker itself.
        named = worker_identity(os.environ.get(Env.NATS_USER)) is not None
        return LaunchedAs(rank, None if named else f"rank-{rank}")
    group_rank = _process_group_rank()
    return None if group_rank is None else LaunchedAs(group_rank, None)


def _process_group_rank() -> int | None:
    distributed = sys.modules.get("torch.distributed")
    if distributed is None:
        return None
    try:
        if not (distributed.is_available() and distributed.is_initialized()):
            return None
        rank = distributed.get_rank()
    except (RuntimeError, ValueError):
        return None
    return rank if isinstance(rank, int) and rank >= 0 else None
