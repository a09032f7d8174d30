"""Prometheus metrics shared by the bus helpers, the services and the gateway.

They live in one registry per process (prometheus_client's default), labelled by service, so a test
process that runs several services still exposes each figure once. The training-level figures
(checkpoints, barriers, shards moved) are counted by `observe_decided` from the events a service
decided and stored, so only the replica that decided counts them, and rebuilding state after a
restart counts nothing twice; workers by status are read from the registry's state at scrape time.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterable, Iterator, Mapping
from typing import Final, Protocol, get_args

from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from strata.events.models import (
    BarrierReleased,
    CheckpointAborted,
    CheckpointCommitted,
    Event,
    ShardPlanChanged,
    WorkerState,
)

RPC_REQUESTS: Final = Counter(
    "strata_rpc_requests_total",
    "RPC requests handled, by outcome (ok or an error code).",
    ["service", "verb", "outcome"],
)
RPC_LATENCY: Final = Histogram(
    "strata_rpc_handler_seconds",
    "Time from receiving an RPC request to sending its reply.",
    ["service"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
)
MESSAGES_REJECTED: Final = Counter(
    "strata_messages_rejected_total",
    "Messages refused or dropped (malformed, invalid, no reply subject), by reason code.",
    ["consumer", "code"],
)
RPC_REFUSED: Final = Counter(
    "strata_rpc_refused_total",
    "Requests refused by admission control before any work (rate_limited, busy), by the caller's "
    "job's standing (the code) only: job names stay out of the probes.",
    ["service", "code"],
)
RPC_DROPPED: Final = Counter(
    "strata_rpc_dropped_total",
    "Requests dropped unanswered: no reply subject (nobody could read an answer), or more than "
    "the subscription's pending limits (slow_consumer).",
    ["service", "reason"],
)
RPC_QUEUED: Final = Gauge(
    "strata_rpc_queued",
    "Admitted requests waiting for a handler, all jobs together.",
    ["service"],
)
EVENTS_CONSUMED: Final = Counter(
    "strata_events_consumed_total",
    "Events applied from a stream, by consumer.",
    ["consumer"],
)

# -- training -------------------------------------------------------------------------------------

BARRIER_WAIT: Final = Histogram(
    "strata_barrier_wait_seconds",
    "Time a released barrier held its first arrival (first arrival to release), by job.",
    ["job"],
    buckets=(0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 1800.0),
)
CHECKPOINT_COMMIT: Final = Histogram(
    "strata_checkpoint_commit_seconds",
    "Time from a checkpoint's start to its commit (every rank saved, manifest written), by job.",
    ["job"],
    buckets=(0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0),
)
CHECKPOINT_BYTES: Final = Counter(
    "strata_checkpoint_committed_bytes",
    "Bytes of committed checkpoints (every shard of the step), by job.",
    ["job"],
)
CHECKPOINTS_ABORTED: Final = Counter(
    "strata_checkpoints_aborted",
    "Checkpoints aborted (a participant failed, a timeout, a save that failed), by job.",
    ["job"],
)
SHARDS_MOVED: Final = Counter(
    "strata_shards_moved",
    "Shards the sharding service moved to another worker when membership changed, by job.",
    ["job"],
)
WORKER_STATUSES: Final[tuple[str, ...]] = get_args(WorkerState)


def observe_decided(event: Event) -> None:
    """Count what `event`, just stored by the service that decided it, says about training."""
    if isinstance(event, BarrierReleased):
        BARRIER_WAIT.labels(event.job).observe(event.first_arrival_to_release_ms / 1000)
    elif isinstance(event, CheckpointCommitted):
        CHECKPOINT_COMMIT.labels(event.job).observe(event.duration_ms / 1000)
        CHECKPOINT_BYTES.labels(event.job).inc(event.total_bytes)
    elif isinstance(event, CheckpointAborted):
        CHECKPOINTS_ABORTED.labels(event.job).inc()
    elif isinstance(event, ShardPlanChanged) and event.moved_shards:
        SHARDS_MOVED.labels(event.job).inc(event.moved_shards)


class StatusSource(Protocol):
    def worker_statuses(self) -> Mapping[str, Iterable[str]]:
        """Each job's workers' statuses, as this registry holds them now."""
        ...


class _WorkersByStatus(Collector):
    """`strata_workers{job, status}`: read from the registries of this process at scrape time,
    because a worker's status also changes on the heartbeat path, which must not pay for a
    metric update per beat."""

    def __init__(self) -> None:
        self._sources: weakref.WeakSet[StatusSource] = weakref.WeakSet()

    def add(self, source: StatusSource) -> None:
        """Count the workers of `source` (a registry) while it lives."""
        self._sources.add(source)

    def collect(self) -> Iterator[Metric]:
        gauge = GaugeMetricFamily(
            "strata_workers",
            "Workers of each job by status, as the registry sees them.",
            labels=["job", "status"],
        )
        counts: dict[str, dict[str, int]] = {}
        for source in list(self._sources):
            for job, job_statuses in source.worker_statuses().items():
                per_status = counts.setdefault(job, dict.fromkeys(WORKER_STATUSES, 0))
                for status in job_statuses:
                    per_status[status] = per_status.get(status, 0) + 1
        for job, per_status in sorted(counts.items()):
            for status, count in per_status.items():
                gauge.add_metric([job, status], count)
        yield gauge


WORKERS_BY_STATUS: Final = _WorkersByStatus()
REGISTRY.register(WORKERS_BY_STATUS)
