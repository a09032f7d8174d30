"""Metric names from training frameworks (`val/loss`, `Train Loss`) as Strata accepts them."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

from strata._metrics import MAX_METRICS_PER_CALL

_NAME_BAD = re.compile(r"[^a-z0-9_]+")
MAX_FIGURES = MAX_METRICS_PER_CALL


def metric_name(name: str) -> str | None:
    """`name` as a Strata metric name (`val/loss` -> `val_loss`); None if none fits."""
    cleaned = _NAME_BAD.sub("_", name.lower()).strip("_")[:64]
    return cleaned if cleaned[:1].isalpha() else None


def figures(values: Mapping[str, Any]) -> dict[str, float]:
    """The finite numbers of `values` under names Strata accepts (at most 64); the rest left
    out (a framework logs strings and tensors of several values too)."""
    kept: dict[str, float] = {}
    for key, value in values.items():
        name = metric_name(key)
        try:
            number = float(value)
        except (TypeError, ValueError, RuntimeError):
            continue
        if name is not None and math.isfinite(number) and len(kept) < MAX_FIGURES:
            kept[name] = number
    return kept
