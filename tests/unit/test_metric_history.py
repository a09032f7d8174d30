"""The gateway's metric history fold: bounded per worker however long training runs, buckets of
every rank aligned so the job's mean and total are per bucket, and time travel by stored time."""

from __future__ import annotations

import tracemalloc

from hypothesis import given
from hypothesis import strategies as st
from strata.events import MetricSampled
from strata.services.gateway.metrics_history import (
    BUCKET_BYTES,
    MAX_POINTS,
    SERIES_BYTES,
    MetricHistory,
)

JOB = "job-1"


def sample(worker: str, name: str, value: float, step: int) -> MetricSampled:
    return MetricSampled(
        job=JOB, source=worker, worker_id=worker, name=name, value=value, step=step
    )


def test_each_rank_and_the_job_mean_and_total_per_step() -> None:
    history = MetricHistory()
    for step in range(10):
        history.fold(sample("w0", "samples_per_s", 100.0 + step, step), stored_ns=step)
        history.fold(sample("w1", "samples_per_s", 300.0 + step, step), stored_ns=step)
    view = history.view(JOB, ranks={"w0": 1, "w1": 0})
    assert view is not None
    series = view["metrics"]["samples_per_s"]
    assert series["stride"] == 1
    assert [w["worker"] for w in series["workers"]] == ["w1", "w0"]  # rank order
    assert series["workers"][1]["values"] == [100.0 + step for step in range(10)]
    assert series["job"]["steps"] == list(range(10))
    assert series["job"]["total"] == [400.0 + 2 * step for step in range(10)]
    assert series["job"]["mean"] == [200.0 + step for step in range(10)]


@given(st.integers(min_value=1, max_value=5000), st.integers(min_value=1, max_value=3))
def test_a_long_run_stays_bounded_and_keeps_the_mean(steps: int, workers: int) -> None:
    history = MetricHistory()
    for step in range(steps):
        for w in range(workers):
            history.fold(sample(f"w{w}", "loss", float(step), step), stored_ns=step)
    view = history.view(JOB)
    assert view is not None
    series = view["metrics"]["loss"]
    for worker in series["workers"]:
        assert len(worker["values"]) <= MAX_POINTS
        assert worker["steps"] == series["job"]["steps"]  # every rank's buckets line up
        assert worker["steps"][-1] == steps - 1
    # A bucket's mean is the mean of the steps in it: the overall mean is kept exactly.
    stride = series["stride"]
    first = series["workers"][0]
    weights = [min(stride, steps - i * stride) for i in range(len(first["values"]))]
    kept = sum(v * n for v, n in zip(first["values"], weights, strict=True)) / steps
    assert abs(kept - (steps - 1) / 2) < 1e-6


def test_time_travel_shows_the_buckets_stored_by_then() -> None:
    history = MetricHistory()
    for step in range(6):
        history.fold(sample("w0", "loss", 1.0 / (step + 1), step), stored_ns=1000 * step)
    view = history.view(JOB, until_ns=2500)
    assert view is not None
    assert view["metrics"]["loss"]["workers"][0]["steps"] == [0, 1, 2]
    assert history.view("other-job") is None
    assert history.view(JOB, names={"nope"}) == {"job": JOB, "until_ns": None, "metrics": {}}


def test_a_rank_logging_at_huge_steps_coarsens_its_own_series_only() -> None:
    history = MetricHistory()
    for step in range(300):
        if step < 200:
            for worker in ("w0", "w2"):
                history.fold(sample(worker, "loss", float(step), step), stored_ns=step)
        history.fold(sample("w1", "loss", 1.0, step * 2**53), stored_ns=step)
    view = history.view(JOB, ranks={"w0": 0, "w1": 1, "w2": 2})
    assert view is not None
    loss = view["metrics"]["loss"]
    first, odd, third = loss["workers"]
    for normal in (first, third):
        assert normal["stride"] == 1
        assert normal["steps"] == list(range(200))
    assert odd["stride"] >= 2**53
    assert len(odd["steps"]) <= MAX_POINTS
    # The job's figures are in the stride most workers have: a point per step still.
    assert loss["stride"] == 1
    assert loss["job"]["steps"][:200] == list(range(200))
    assert loss["job"]["mean"][:200] == [float(step) for step in range(200)]


def test_every_job_together_stays_within_the_byte_budget() -> None:
    budget = 64 * 1024
    history = MetricHistory(budget_bytes=budget)
    outcomes: dict[str, int] = {}
    for i in range(20_000):
        outcome = history.fold(sample(f"w{i % 500}", "loss", 1.0, i), stored_ns=i)
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
    assert history.bytes <= budget
    assert outcomes["over_budget"] > 0
    assert outcomes["kept"] > 0
    # A sample that falls in a bucket already kept is still folded past the budget.
    worker = next(iter(history.jobs[JOB]["loss"].workers))
    key_step = next(iter(history.jobs[JOB]["loss"].workers[worker].buckets))
    assert history.fold(sample(worker, "loss", 3.0, key_step), stored_ns=1) == "kept"


def test_the_budget_counts_at_least_what_the_buckets_take() -> None:
    """`BUCKET_BYTES` and `SERIES_BYTES`, measured: the budget is not an understatement."""
    history = MetricHistory()
    tracemalloc.start()
    try:
        before = tracemalloc.take_snapshot()
        for w in range(50):
            for step in range(MAX_POINTS):
                history.fold(sample(f"w{w}", "loss", 1.0, step), stored_ns=step)
        after = tracemalloc.take_snapshot()
    finally:
        tracemalloc.stop()
    taken = sum(stat.size_diff for stat in after.compare_to(before, "filename"))
    assert history.buckets == 50 * MAX_POINTS
    assert taken <= history.bytes, (taken, history.bytes)
    assert history.bytes == 50 * MAX_POINTS * BUCKET_BYTES + 50 * SERIES_BYTES
