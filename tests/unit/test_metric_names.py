"""Framework metric names and values as `log_metrics` takes them: names made to fit, values that
are not one finite number left out, never an error from inside a framework's logging call."""

from __future__ import annotations

import math
import re

import torch
from strata._metric_names import MAX_FIGURES, figures, metric_name
from strata.events.models import METRIC_NAME_PATTERN


def test_names_are_made_to_fit_or_left_out() -> None:
    assert metric_name("train_loss") == "train_loss"
    assert metric_name("val/loss") == "val_loss"
    assert metric_name("Train Loss (epoch)") == "train_loss_epoch"
    assert metric_name("1st") is None
    assert metric_name("///") is None
    assert len(metric_name("a" * 100) or "") == 64
    for raw in ("val/loss", "Train Loss (epoch)", "a" * 100):
        assert re.match(METRIC_NAME_PATTERN, metric_name(raw) or "")


def test_values_that_are_not_one_finite_number_are_left_out() -> None:
    kept = figures(
        {
            "loss": torch.tensor(0.5),
            "epoch": 1,
            "nan": math.nan,
            "inf": math.inf,
            "text": "hello",
            "vector": torch.ones(3),
            "9bad": 1.0,
        }
    )
    assert kept == {"loss": 0.5, "epoch": 1.0}


def test_at_most_the_figures_one_call_takes() -> None:
    kept = figures({f"m{i}": float(i) for i in range(200)})
    assert len(kept) == MAX_FIGURES
    assert all(re.match(METRIC_NAME_PATTERN, name) for name in kept)
