"""Training figures of a worker (`log_metrics`): checked at once, buffered, and published in
batches as `metric.sampled` events on the telemetry stream."""

from __future__ import annotations

from strata._metrics import check_metrics
from strata.aio._core import WorkerNotStarted
from strata.aio._membership import _Membership


class _TrainingMetrics(_Membership):
    async def log_metrics(self, metrics: dict[str, float], *, step: int | None = None) -> None:
        """Record training figures, e.g. `{"loss": 0.31, "samples_per_s": 812}`, at `step` (by
        default the step last given to `set_state`). Never waits on the network: samples are
        buffered and published as `metric.sampled` events about once a second (sooner when many
        wait) and when the worker stops. Names are 1 to 64 of `a-z0-9_` starting with a letter,
        values finite numbers, at most 64 per call; anything else raises
        `strata.ValidationError` naming the metric."""
        self._add_metrics(metrics, step)

    def _add_metrics(self, metrics: object, step: object) -> None:
        pairs, checked_step = check_metrics(metrics, step)
        self._check_tasks()
        if not self._started:
            raise WorkerNotStarted(
                f"worker {self._worker_id!r} is not started: call start() before log_metrics() "
                "(or use the worker as a context manager)"
            )
        self._metrics.add(pairs, self._progress[1] if checked_step is None else checked_step)

    @property
    def metrics_published(self) -> int:
        """Samples of `log_metrics` published so far."""
        return self._metrics.published

    async def flush_metrics(self) -> int:
        """Publish the samples `log_metrics` buffered now rather than at the next tick; returns
        how many were sent."""
        self._check_tasks()
        self._registered("flush_metrics()")
        return await self._metrics.flush()
