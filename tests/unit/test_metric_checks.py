"""`log_metrics`'s argument checks: every bad sample is refused before anything is buffered, with
a `ValidationError` that names the metric and says what to pass."""

from __future__ import annotations

import math

import numpy as np
import pytest
from strata._metrics import MAX_METRICS_PER_CALL, check_metrics
from strata.errors import ValidationError


def test_numbers_of_any_kind_are_taken_as_floats() -> None:
    pairs, step = check_metrics({"loss": 0.31, "samples_per_s": 812, "lr": np.float32(0.5)}, 7)
    assert pairs == [("loss", 0.31), ("samples_per_s", 812.0), ("lr", 0.5)]
    assert step == 7
    assert all(type(value) is float for _, value in pairs)


@pytest.mark.parametrize(
    ("metrics", "step", "field", "hint"),
    [
        ({"loss": math.nan}, 1, "metrics.loss", "finite"),
        ({"loss": math.inf}, 1, "metrics.loss", "finite"),
        ({"loss": "0.3"}, 1, "metrics.loss", "real number"),
        ({"loss": True}, 1, "metrics.loss", "real number"),
        ({"Loss": 1.0}, 1, "metrics.Loss", "lower-case"),
        ({"val/loss": 1.0}, 1, "metrics.val/loss", "lower-case"),
        ({}, 1, "metrics", "at least one"),
        ([("loss", 1.0)], 1, "metrics", "dict of name -> number"),
        ({f"m{i}": 1.0 for i in range(MAX_METRICS_PER_CALL + 1)}, 1, "metrics", "at most 64"),
        ({"loss": 1.0}, -1, "step", "between"),
        ({"loss": 1.0}, 1.5, "step", "integer"),
    ],
)
def test_bad_samples_are_refused_with_what_to_pass(
    metrics: object, step: object, field: str, hint: str
) -> None:
    with pytest.raises(ValidationError, match=hint) as refused:
        check_metrics(metrics, step)
    assert refused.value.field == field
    assert refused.value.code == "invalid_field"


def test_a_name_seen_before_still_gets_its_value_checked() -> None:
    check_metrics({"accuracy": 0.5}, 1)
    with pytest.raises(ValidationError, match="finite"):
        check_metrics({"accuracy": math.inf}, 2)
