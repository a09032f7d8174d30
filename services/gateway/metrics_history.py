"""Training metrics history: the `metric.sampled` events of every job, folded into bounded,
downsampled series per worker, served at `GET /api/jobs/{job}/metrics` for the dashboard's charts.

The gateway follows the telemetry stream's samples from its first stored message, so a restarted
gateway (or a reloaded page) shows the whole history the stream still holds. Each (job, metric) has
one stride, in steps: a point is the mean of a worker's samples whose step falls in one bucket of
`stride` steps. When any worker's series would exceed `MAX_POINTS`, the stride doubles and
neighbouring buckets merge, for every worker of that metric alike, so the buckets of all ranks line
up and the job's figures (mean and total over ranks) are computed per bucket when asked. Each
bucket remembers when its newest sample was stored: time travel (`until_ns`) shows the buckets
complete by then.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any, Final

import nats.errors
from nats.js.api import DeliverPolicy
from pydantic import BaseModel, ConfigDict, Field
from strata.bus import Bus
from strata.errors import StrataError
from strata.events import MetricSampled, decode_event, subjects
from strata.events.provenance import refusal
from strata.metrics import MESSAGES_REJECTED

if TYPE_CHECKING:
    pass

CONSUMER: Final = "gateway-metrics"
MAX_POINTS: Final = 256
"""Points kept per worker and metric; past it, the stride doubles and neighbours merge."""
MAX_METRICS_PER_JOB: Final = 64
"""Metric names kept per job; samples of further names are counted and dropped."""
MAX_WORKERS_PER_METRIC: Final = 4096


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


class MetricSeries:
    """One metric of one job: a series of buckets per worker, all with the same stride."""

    def __init__(self) -> None:
        self.stride = 1
        self.workers: dict[str, dict[int, _Bucket]] = {}
        self.samples = 0

    def add(self, worker: str, value: float, step: int, stored_ns: int) -> bool:
        """Fold one sample; False when the metric already has too many workers."""
        buckets = self.workers.get(worker)
        if buckets is None:
            if len(self.workers) >= MAX_WORKERS_PER_METRIC:
                return False
            buckets = self.workers[worker] = {}
        key = step // self.stride
        bucket = buckets.get(key)
        if bucket is None:
            buckets[key] = _Bucket(value, step, stored_ns)
            if len(buckets) > MAX_POINTS:
                self._coarsen()
        else:
            bucket.add(value, step, stored_ns)
        self.samples += 1
        return True

    def _coarsen(self) -> None:
        self.stride *= 2
        for worker, buckets in self.workers.items():
            merged: dict[int, _Bucket] = {}
            for key in sorted(buckets):
                bucket = buckets[key]
                into = merged.get(key // 2)
                if into is None:
                    merged[key // 2] = bucket
                else:
                    into.merge(bucket)
            self.workers[worker] = merged

    def view(self, until_ns: int | None, ranks: dict[str, int]) -> dict[str, Any]:
        """The series as plain columns: per worker (rank order), and the job's mean and total
        over the workers that have a point in each bucket."""
        per_worker: list[dict[str, Any]] = []
        by_key: dict[int, list[_Bucket]] = {}
        for worker, buckets in self.workers.items():
            steps: list[int] = []
            values: list[float] = []
            for key in sorted(buckets):
                bucket = buckets[key]
                if until_ns is not None and bucket.stored_ns > until_ns:
                    continue
                steps.append(bucket.step)
                values.append(bucket.mean)
                by_key.setdefault(key, []).append(bucket)
            if steps:
                per_worker.append(
                    {"worker": worker, "rank": ranks.get(worker), "steps": steps, "values": values}
                )
        per_worker.sort(key=lambda w: (w["rank"] is None, w["rank"] or 0, w["worker"]))
        job_steps: list[int] = []
        means: list[float] = []
        totals: list[float] = []
        for key in sorted(by_key):
            ranks_in_bucket = by_key[key]
            total = sum(b.mean for b in ranks_in_bucket)
            job_steps.append(max(b.step for b in ranks_in_bucket))
            totals.append(total)
            means.append(total / len(ranks_in_bucket))
        return {
            "stride": self.stride,
            "job": {"steps": job_steps, "mean": means, "total": totals},
            "workers": per_worker,
        }


class MetricHistory:
    """Every job's metric series, folded from the telemetry stream's samples."""

    def __init__(self) -> None:
        self.jobs: dict[str, dict[str, MetricSeries]] = {}
        self.last_seq = 0
        self.version = 0
        self.dropped = 0

    def fold(self, sample: MetricSampled, stored_ns: int, seq: int = 0) -> bool:
        """One sample that passed the provenance rule (it is its worker's own); False when it
        was dropped: its job already has `MAX_METRICS_PER_JOB` metrics, or its metric
        `MAX_WORKERS_PER_METRIC` workers."""
        self.last_seq = max(self.last_seq, seq)
        metrics = self.jobs.setdefault(sample.job, {})
        series = metrics.get(sample.name)
        if series is None:
            if len(metrics) >= MAX_METRICS_PER_JOB:
                self.dropped += 1
                return False
            series = metrics[sample.name] = MetricSeries()
        worker = sample.worker_id or sample.source
        step = sample.step if sample.step is not None else 0
        if not series.add(worker, sample.value, step, stored_ns):
            self.dropped += 1
            return False
        self.version += 1
        return True

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


async def follow_samples(bus: Bus, history: MetricHistory) -> None:
    """Fold every sample stored on the telemetry stream, from the first one, until cancelled."""
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
            meta = message.metadata
            stored_ns = int(meta.timestamp.timestamp() * 1e9)
            if not history.fold(event, stored_ns, meta.sequence.stream):
                MESSAGES_REJECTED.labels(CONSUMER, "over_limit").inc()
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
    steps: list[int]
    values: list[float] = Field(description="Mean of the worker's samples in each bucket")


class MetricView(_Shape):
    stride: int = Field(description="Steps per bucket (doubles as the history grows)")
    job: JobSeries
    workers: list[WorkerSeries]


class MetricsHistoryView(_Shape):
    job: str
    until_ns: int | None = Field(description="Only buckets whose newest sample was stored by then")
    metrics: dict[str, MetricView]
