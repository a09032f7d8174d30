"""Whether an event may count: the provenance rule every fold applies before it folds one.

JetStream stores whatever a credential was allowed to publish and keeps no record of who published
it; an event's `source` is only what its publisher claims. So an event counts only when the subject
it was stored on is its own (`subject_for`: its job, area and type), which NATS permissions grant
per credential, and when it claims the one publisher that may emit its type: the service that owns
its area (registry: `worker.*`, sharding: `dataset.*` and `shard.*`, barrier: `barrier.*`,
checkpoint: `checkpoint.*`; `request.rejected`: any service), or, for telemetry, the worker its
subject names. Workers publish nothing on the event stream, so with NATS permissions in force a
worker cannot make a service fold anything it did not decide; without them (an unsecured NATS)
the rule still keeps a confused or foreign publisher's events out of every state.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from strata.events.models import Event, MetricSampled, WorkerHeartbeat
from strata.events.routing import subject_for
from strata.events.rpc import RPC_SERVICES

AREA_OWNERS: Final[dict[str, tuple[str, ...]]] = {
    "worker": ("registry",),
    "dataset": ("sharding",),
    "shard": ("sharding",),
    "barrier": ("barrier",),
    "checkpoint": ("checkpoint",),
    "request": RPC_SERVICES,
}
"""The services that may emit the events of each area (the first token of the event type)."""

WRONG_SUBJECT: Final = "wrong_subject"
WRONG_SOURCE: Final = "wrong_source"


class Refusal(NamedTuple):
    """Why an event does not count: a code for the rejection counters, and a message."""

    code: str
    message: str


def telemetry_worker(event: WorkerHeartbeat | MetricSampled) -> str:
    """The worker a heartbeat or sample is of: the one its subject names."""
    if isinstance(event, WorkerHeartbeat):
        return event.worker_id
    return event.worker_id or event.source


def source_refusal(event: Event) -> Refusal | None:
    """Why `event`'s claimed source may not emit it, or None."""
    if isinstance(event, WorkerHeartbeat | MetricSampled):
        worker = telemetry_worker(event)
        if event.source == worker:
            return None
        return Refusal(
            WRONG_SOURCE,
            f"{event.type} of worker {worker!r} (job {event.job!r}) claims source "
            f"{event.source!r}: a worker's telemetry is its own",
        )
    owners = AREA_OWNERS.get(event.type.split(".", 1)[0], ())
    if event.source in owners:
        return None
    who = " or ".join(owners) if owners else "no"
    return Refusal(
        WRONG_SOURCE,
        f"{event.type} of job {event.job!r} claims source {event.source!r}; only the {who} "
        "service records it",
    )


def refusal(subject: str, event: Event) -> Refusal | None:
    """Why `event`, stored on `subject`, does not count, or None when it does."""
    expected = subject_for(event)
    if subject != expected:
        return Refusal(
            WRONG_SUBJECT,
            f"{event.type} of job {event.job!r} was stored on {subject[:300]}, not on its own "
            f"subject {expected}",
        )
    return source_refusal(event)
