"""The gateway's metric history fold: bounded per worker however long training runs, buckets of
every rank aligned so the job's mean and total are per bucket, and time travel by stored time."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from strata.events import MetricSampled
from strata.services.gateway.metrics_history import MAX_POINTS, MetricHistory

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
