"""Training metrics history: the `metric.sampled` events of every job, folded into bounded,
downsampled series per worker, served at `GET /api/jobs/{job}/metrics` for the dashboard's charts.

The gateway follows the telemetry stream's samples from its first stored message, so a restarted
gateway (or a reloaded page) shows the whole history the stream still holds. Only registered
workers' samples are kept. Each worker's series of a metric has its own stride, in steps: a point
is the mean of the worker's samples whose step falls in one bucket of `stride` steps; when the
series would exceed `MAX_POINTS`, its stride doubles and neighbouring buckets merge. One rank
logging at odd steps (a step of 2**53) coarsens its own series only. The job's figures (mean and
total over ranks) are computed when asked, in buckets of the stride most workers have. Each bucket
remembers when its newest sample was stored: time travel (`until_ns`) shows the buckets complete
by then. All jobs' series together are held to a byte budget (`STRATA_GATEWAY_METRICS_MB`): past
it, a sample that would open a bucket or a series is dropped and counted (`over_budget`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any, Final, Literal

import nats.errors
from nats.js.api import DeliverPolicy
from pydantic import BaseModel, ConfigDict, Field
from strata.bus import Bus
from strata.config import GATEWAY_METRICS_MB
from strata.errors import StrataError
from strata.events import MetricSampled, decode_event, subjects
from strata.events.provenance import refusal
from strata.metrics import MESSAGES_REJECTED

CONSUMER: Final = "gateway-metrics"
MAX_POINTS: Final = 256
"""Points kept per worker and metric; past it, the worker's stride doubles and neighbours merge."""
MAX_METRICS_PER_JOB: Final = 64
"""Metric names kept per job; samples of further names are counted and dropped."""
MAX_WORKERS_PER_METRIC: Final = 4096
BUCKET_BYTES: Final = 200
"""What one bucket takes in memory (the object, its dict entry, its numbers), measured
(`tests/unit/test_metric_history.py`), for the budget."""
SERIES_BYTES: Final = 800
"""What one worker's series of one metric takes besides its buckets."""

Outcome = Literal["kept", "too_many_metrics", "too_many_workers", "over_budget", "not_registered"]


class _Bucket:
    """Samples of one worker in one bucket of steps: their sum and count, newest step and time."""

    __slots__ = ("count", "step", "stored_ns", "total")

    def __init__(self, value: float, step: int, stored_ns: int) -> None:
        self.total = value
        self.count = 1
        self.step = step
        self.stored_ns = stored_ns

    def add(self, value: float, step: int, stored_ns: int) -> None:
        self.total += value
        self.count += 1
        self.step = max(self.step, step)
        self.stored_ns = max(self.stored_ns, stored_ns)

    def merge(self, other: _Bucket) -> None:
        self.total += other.total
        self.count += other.count
        self.step = max(self.step, other.step)
        self.stored_ns = max(self.stored_ns, other.stored_ns)

    @property
    def mean(self) -> float:
        return self.total / self.count


class _WorkerSeries:
    """One worker's buckets of one metric, with its own stride."""

    __slots__ = ("buckets", "stride")

    def __init__(self) -> None:
        self.stride = 1
        self.buckets: dict[int, _Bucket] = {}

    def coarsen(self) -> int:
        """Double the stride, merging neighbours; how many buckets fewer there are."""
        before = len(self.buckets)
        self.stride *= 2
        merged: dict[int, _Bucket] = {}
        for key in sorted(self.buckets):
            bucket = self.buckets[key]
            into = merged.get(key // 2)
            if into is None:
                merged[key // 2] = bucket
            else:
                into.merge(bucket)
        self.buckets = merged
        return before - len(merged)


class MetricSeries:
    """One metric of one job: a series of buckets per worker, each with its own stride."""

    def __init__(self) -> None:
        self.workers: dict[str, _WorkerSeries] = {}
        self.samples = 0

    @property
    def stride(self) -> int:
        """The stride most workers have (the median): the job's figures are in its buckets."""
        strides = sorted(series.stride for series in self.workers.values())
        return strides[len(strides) // 2] if strides else 1

    def add(
        self, worker: str, value: float, step: int, stored_ns: int, room: bool = True
    ) -> tuple[Outcome, int, int]:
        """Fold one sample: (outcome, buckets added (or removed), series added). Without
        `room` (the budget is spent), a sample that would open a bucket or a series is dropped."""
        series = self.workers.get(worker)
        opened = 0
        if series is None:
            if len(self.workers) >= MAX_WORKERS_PER_METRIC:
                return "too_many_workers", 0, 0
            if not room:
                return "over_budget", 0, 0
            series = self.workers[worker] = _WorkerSeries()
            opened = 1
        key = step // series.stride
        bucket = series.buckets.get(key)
        if bucket is not None:
            bucket.add(value, step, stored_ns)
            self.samples += 1
            return "kept", 0, opened
        if not room and not opened:
            return "over_budget", 0, 0
        series.buckets[key] = _Bucket(value, step, stored_ns)
        added = 1
        while len(series.buckets) > MAX_POINTS:
            added -= series.coarsen()
        self.samples += 1
        return "kept", added, opened

    def view(self, until_ns: int | None, ranks: dict[str, int]) -> dict[str, Any]:
        """The series as plain columns: per worker (rank order), and the job's mean and total
        over the workers that have a point in each bucket of the common stride."""
        stride = self.stride
        per_worker: list[dict[str, Any]] = []
        # Common bucket -> worker -> (sum of the worker's means, how many, newest step).
        by_key: dict[int, dict[str, list[float]]] = {}
        for worker, series in self.workers.items():
            steps: list[int] = []
            values: list[float] = []
            for key in sorted(series.buckets):
                bucket = series.buckets[key]
                if until_ns is not None and bucket.stored_ns > until_ns:
                    continue
                steps.append(bucket.step)
                values.append(bucket.mean)
                common = by_key.setdefault(bucket.step // stride, {})
                entry = common.get(worker)
                if entry is None:
                    common[worker] = [bucket.total, float(bucket.count), float(bucket.step)]
                else:
                    entry[0] += bucket.total
                    entry[1] += bucket.count
                    entry[2] = max(entry[2], float(bucket.step))
            if steps:
                per_worker.append(
                    {
                        "worker": worker,
                        "rank": ranks.get(worker),
                        "stride": series.stride,
                        "steps": steps,
                        "values": values,
                    }
                )
        per_worker.sort(key=lambda w: (w["rank"] is None, w["rank"] or 0, w["worker"]))
        job_steps: list[int] = []
        means: list[float] = []
        totals: list[float] = []
        for key in sorted(by_key):
            entries = by_key[key].values()
            total = sum(e[0] / e[1] for e in entries)
            job_steps.append(int(max(e[2] for e in entries)))
            totals.append(total)
            means.append(total / len(entries))
        return {
            "stride": stride,
            "job": {"steps": job_steps, "mean": means, "total": totals},
            "workers": per_worker,
        }


class MetricHistory:
    """Every job's metric series, folded from the telemetry stream's samples, within a byte
    budget for all jobs together."""

    def __init__(self, budget_bytes: int = GATEWAY_METRICS_MB * 1024 * 1024) -> None:
        self.jobs: dict[str, dict[str, MetricSeries]] = {}
        self.last_seq = 0
        self.version = 0
        self.dropped = 0
        self.budget_bytes = budget_bytes
        self.buckets = 0
        self.series = 0
        self.unregistered = 0
        """Samples of workers that had not registered, left out."""

    @property
    def bytes(self) -> int:
        """What the series take, as the budget counts it."""
        return self.buckets * BUCKET_BYTES + self.series * SERIES_BYTES

    def fold(self, sample: MetricSampled, stored_ns: int, seq: int = 0) -> Outcome:
        """One sample that passed the provenance rule (it is its worker's own) from a registered
        worker; anything but "kept" when it was dropped: its job already has
        `MAX_METRICS_PER_JOB` metrics, its metric `MAX_WORKERS_PER_METRIC` workers, or the
        budget is spent."""
        self.last_seq = max(self.last_seq, seq)
        room = self.bytes + BUCKET_BYTES + SERIES_BYTES <= self.budget_bytes
        metrics = self.jobs.get(sample.job)
        series = None if metrics is None else metrics.get(sample.name)
        if series is None:
            if metrics is not None and len(metrics) >= MAX_METRICS_PER_JOB:
                self.dropped += 1
                return "too_many_metrics"
            if not room:
                self.dropped += 1
                return "over_budget"
            metrics = self.jobs.setdefault(sample.job, {})
            series = metrics[sample.name] = MetricSeries()
        worker = sample.worker_id or sample.source
        step = sample.step if sample.step is not None else 0
        outcome, buckets, opened = series.add(worker, sample.value, step, stored_ns, room)
        if outcome != "kept":
            self.dropped += 1
            if not series.workers and metrics is not None:
                del metrics[sample.name]
                if not metrics:
                    del self.jobs[sample.job]
            return outcome
        self.buckets += buckets
        self.series += opened
        self.version += 1
        return "kept"

    def view(
        self,
        job: str,
        *,
        until_ns: int | None = None,
        names: set[str] | None = None,
        ranks: dict[str, int] | None = None,
    ) -> dict[str, Any] | None:
        """The job's metrics up to `until_ns` (stored time), or None for a job with none."""
        metrics = self.jobs.get(job)
        if metrics is None:
            return None
        return {
            "job": job,
            "until_ns": until_ns,
            "metrics": {
                name: series.view(until_ns, ranks or {})
                for name, series in sorted(metrics.items())
                if names is None or name in names
            },
        }


async def follow_samples(
    bus: Bus,
    history: MetricHistory,
    registered: Callable[[str, str], bool] = lambda job, worker: True,
    on_sample: Callable[[MetricSampled], None] | None = None,
) -> None:
    """Fold every sample stored on the telemetry stream, from the first one, until cancelled:
    those of workers `registered(job, worker)` says have registered, each also given to
    `on_sample` (kept in the history or not: its step is the worker's progress all the same)."""
    sub = await bus.js.subscribe(
        subjects.all_metrics(),
        stream=subjects.TELEMETRY_STREAM,
        ordered_consumer=True,
        deliver_policy=DeliverPolicy.ALL,
        idle_heartbeat=2.0,
        pending_msgs_limit=1_000_000,
    )
    try:
        async for message in sub.messages:
            try:
                event = decode_event(message.data)
            except StrataError as exc:
                MESSAGES_REJECTED.labels(CONSUMER, exc.code).inc()
                continue
            if not isinstance(event, MetricSampled):
                MESSAGES_REJECTED.labels(CONSUMER, "not_a_sample").inc()
                continue
            refused = refusal(message.subject, event)
            if refused is not None:
                MESSAGES_REJECTED.labels(CONSUMER, refused.code).inc()
                continue
            if not registered(event.job, event.worker_id or event.source):
                history.unregistered += 1
                MESSAGES_REJECTED.labels(CONSUMER, "not_registered").inc()
                continue
            if on_sample is not None:
                on_sample(event)
            meta = message.metadata
            stored_ns = int(meta.timestamp.timestamp() * 1e9)
            outcome = history.fold(event, stored_ns, meta.sequence.stream)
            if outcome != "kept":
                MESSAGES_REJECTED.labels(CONSUMER, outcome).inc()
    finally:
        with contextlib.suppress(nats.errors.Error):
            await sub.unsubscribe()


# -- HTTP ------------------------------------------------------------------------------------------


class _Shape(BaseModel):
    model_config = ConfigDict(extra="forbid")


class JobSeries(_Shape):
    steps: list[int] = Field(description="The newest step of each bucket")
    mean: list[float] = Field(description="Mean over the workers with a point in the bucket")
    total: list[float] = Field(description="Sum over them (throughputs add up)")


class WorkerSeries(_Shape):
    worker: str
    rank: int | None = Field(description="Its rank in the job (None: not registered)")
    stride: int = Field(description="Steps per bucket of this worker's series")
    steps: list[int]
    values: list[float] = Field(description="Mean of the worker's samples in each bucket")


class MetricView(_Shape):
    stride: int = Field(
        description="Steps per bucket of the job's figures: the stride most workers have"
    )
    job: JobSeries
    workers: list[WorkerSeries]


class MetricsHistoryView(_Shape):
    job: str
    until_ns: int | None = Field(description="Only buckets whose newest sample was stored by then")
    metrics: dict[str, MetricView]
