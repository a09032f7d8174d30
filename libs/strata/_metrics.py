"""Training metrics from the worker SDK: `log_metrics` checks its samples and buffers them, and a
background task publishes them as `metric.sampled` events in batches.

A training loop calls `log_metrics` every step, so the call must cost microseconds: it never waits
on the network. Samples are published fire-and-forget on the telemetry stream (like heartbeats)
once a second, or as soon as `FLUSH_AT` are waiting, and once more when the worker stops. The sync
worker calls `add` from the training thread while the flush runs on the worker's event loop, so
the buffer is guarded by a thread lock.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import numbers
import re
import threading
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine, Mapping
from typing import Any, Final, NamedTuple

import structlog

from strata._checks import check_int
from strata.errors import ValidationError
from strata.events import MetricSampled
from strata.events.models import MAX_STEP, METRIC_NAME_PATTERN

FLUSH_INTERVAL_S: Final = 1.0
"""Samples wait at most this long before they are published."""
FLUSH_AT: Final = 512
"""A batch this large is published at once rather than at the next tick."""
MAX_PENDING: Final = 100_000
"""Samples kept while NATS is unreachable; beyond this the oldest are dropped (and counted)."""
MAX_METRICS_PER_CALL: Final = 64

_NAME: Final = re.compile(METRIC_NAME_PATTERN)
_GOOD_NAMES: Final[set[str]] = set()
"""Names already found valid (a training loop logs the same few every step)."""
MAX_GOOD_NAMES: Final = 4096

log = structlog.get_logger("strata.metrics")


class Sample(NamedTuple):
    name: str
    value: float
    step: int | None
    ts: int


def check_metrics(metrics: object, step: object) -> tuple[list[tuple[str, float]], int | None]:
    """The (name, value) pairs and step of one `log_metrics` call; `ValidationError` naming
    what to pass for anything a `metric.sampled` event could not carry."""
    if not isinstance(metrics, Mapping):
        raise ValidationError(
            f"metrics must be a dict of name -> number, e.g. {{'loss': 0.31}}; got "
            f"{type(metrics).__name__}",
            field="metrics",
        )
    if not metrics:
        raise ValidationError(
            "metrics is empty: pass at least one name -> number, e.g. {'loss': 0.31}",
            field="metrics",
        )
    if len(metrics) > MAX_METRICS_PER_CALL:
        raise ValidationError(
            f"{len(metrics)} metrics in one call; pass at most {MAX_METRICS_PER_CALL}",
            field="metrics",
        )
    pairs: list[tuple[str, float]] = []
    for name, value in metrics.items():
        # The common case, checked first and cheaply: a training loop calls this every step.
        if type(value) is float and name in _GOOD_NAMES and math.isfinite(value):
            pairs.append((name, value))
            continue
        if not isinstance(name, str) or not _NAME.match(name):
            raise ValidationError(
                f"metric name {name!r} is not valid: use 1 to 64 lower-case letters, digits or "
                "'_', starting with a letter (e.g. 'loss', 'samples_per_s')",
                field=f"metrics.{name}",
            )
        pairs.append((name, _number(name, value)))
        if len(_GOOD_NAMES) < MAX_GOOD_NAMES:
            _GOOD_NAMES.add(name)
    checked_step = None if step is None else check_int("step", step, 0, MAX_STEP)
    return pairs, checked_step


def _number(name: str, value: object) -> float:
    # Real numbers of any kind (int, float, numpy scalars, 0-d tensors via .item()); not bools.
    item = getattr(value, "item", None)
    if not isinstance(value, numbers.Real) and callable(item):
        with contextlib.suppress(Exception):
            value = item()
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ValidationError(
            f"metric {name!r} must be a real number, got {type(value).__name__} {value!r}; "
            "pass a float (for a tensor, loss.item())",
            field=f"metrics.{name}",
        )
    number = float(value)
    if not math.isfinite(number):
        raise ValidationError(
            f"metric {name!r} is {number}: only finite values can be logged; skip the sample or "
            "log a finite one",
            field=f"metrics.{name}",
        )
    return number


Publish = Callable[[MetricSampled], Awaitable[None]]


class MetricBatcher:
    """Buffers one worker's samples and publishes them in batches from its event loop."""

    def __init__(
        self,
        job: str,
        worker_id: Callable[[], str],
        publish: Publish,
        *,
        flush_interval: float = FLUSH_INTERVAL_S,
        flush_at: int = FLUSH_AT,
        max_pending: int = MAX_PENDING,
    ) -> None:
        self._job = job
        self._worker_id = worker_id
        self._publish = publish
        self._flush_interval = flush_interval
        self._flush_at = flush_at
        self._pending: deque[Sample] = deque(maxlen=max_pending)
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self.batches = 0
        """Batches published so far (each one flush of whatever was waiting)."""
        self.published = 0
        self.dropped = 0
        """Samples lost: dropped while too many waited, or refused by the client."""

    def start(
        self, spawn: Callable[[Coroutine[Any, Any, None], str], asyncio.Task[None]] | None = None
    ) -> None:
        """Start the flush task on the running loop (the worker's), through `spawn` (the
        worker's supervised tasks) when given."""
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        if spawn is not None:
            self._task = spawn(self._run(), "metrics")
        else:
            self._task = self._loop.create_task(self._run(), name="strata-metrics")

    def add(self, pairs: list[tuple[str, float]], step: int | None) -> None:
        """Buffer checked samples; any thread. Wakes the flush early when a batch is full."""
        ts = time.time_ns()
        with self._lock:
            overflow = len(self._pending) + len(pairs) - (self._pending.maxlen or 0)
            if overflow > 0:
                self.dropped += min(overflow, len(self._pending) + len(pairs))
            self._pending.extend(Sample(name, value, step, ts) for name, value in pairs)
            full = len(self._pending) >= self._flush_at
        if full and self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            # asyncio.timeout, not wait_for: on Python 3.11 wait_for swallows a cancellation
            # that comes as the wake-up is set (a full batch at stop), and close() would hang.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._flush_interval):
                    await self._wake.wait()
            self._wake.clear()
            await self.flush()

    async def flush(self) -> int:
        """Publish every waiting sample now (on the worker's loop); returns how many."""
        with self._lock:
            batch = list(self._pending)
            self._pending.clear()
        if not batch:
            return 0
        worker = self._worker_id()
        sent = 0
        try:
            for sample in batch:
                await self._publish(
                    MetricSampled(
                        job=self._job,
                        source=worker,
                        worker_id=worker,
                        name=sample.name,
                        value=sample.value,
                        step=sample.step,
                        ts=sample.ts,
                    )
                )
                sent += 1
        except Exception as exc:
            self.dropped += len(batch) - sent
            log.warning(
                "metrics_not_published",
                error=f"{type(exc).__name__}: {exc}",
                lost=len(batch) - sent,
            )
        self.batches += 1
        self.published += sent
        return sent

    async def close(self) -> None:
        """Stop the flush task and publish what is still waiting."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            # A flush task that died is its supervisor's to report; what waits goes out now.
            await asyncio.wait([task])
        await self.flush()
        self._loop = self._wake = None
