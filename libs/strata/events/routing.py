"""Which subject an event goes to: a pure function of the event, so every publisher agrees."""

from __future__ import annotations

from strata.events import subjects
from strata.events.models import Event, MetricSampled, WorkerHeartbeat


def subject_for(event: Event) -> str:
    """Heartbeats and samples go to the telemetry subjects (a sample under the worker it is of, or
    else its source), everything else to the event stream."""
    if isinstance(event, WorkerHeartbeat):
        return subjects.heartbeat_subject(event.job, event.worker_id)
    if isinstance(event, MetricSampled):
        return subjects.metric_subject(event.job, event.worker_id or event.source, event.name)
    return subjects.event_subject(event.job, event.type)
