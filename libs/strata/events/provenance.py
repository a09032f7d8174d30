"""Whether an event may count: the provenance rule every fold applies before it folds one.

JetStream stores whatever a credential was allowed to publish and keeps no record of who published
it; an event's `source` is only what its publisher claims. So an event counts only when the subject
it was stored on is its own (`subject_for`: its job, area and type), which NATS permissions grant
per credential, and when it claims the one publisher that may emit its type: the service that owns
its area (registry: `worker.*`, sharding: `dataset.*` and `shard.*`, barrier: `barrier.*` and
`live.*`, checkpoint: `checkpoint.*`; `request.rejected`: any service), or, for telemetry, the
worker its subject names. Workers publish nothing on the event stream, so with NATS permissions
in force a worker cannot make a service fold anything it did not decide; without them (an
unsecured NATS) the rule still keeps a confused or foreign publisher's events out of every state.
"""

from __future__ import annotations

from typing import Final, NamedTuple

from strata.events import subjects
from strata.events.models import Event, MetricSampled, WorkerHeartbeat
from strata.events.routing import subject_for
from strata.events.rpc import RPC_SERVICES

AREA_OWNERS: Final[dict[str, tuple[str, ...]]] = {
    "worker": ("registry",),
    "dataset": ("sharding",),
    "shard": ("sharding",),
    "barrier": ("barrier",),
    "live": ("barrier",),
    "checkpoint": ("checkpoint",),
    "request": RPC_SERVICES,
}
"""The services that may emit the events of each area (the first token of the event type)."""

WRONG_SUBJECT: Final = "wrong_subject"
WRONG_SOURCE: Final = "wrong_source"
BAD_SUBJECT: Final = "bad_subject"
"""A heartbeat received on a subject that is no heartbeat subject at all."""
SUBJECT_MISMATCH: Final = "subject_mismatch"
"""A heartbeat received on another job's or worker's heartbeat subject."""


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


def heartbeat_belongs(subject: str, job: str, worker_id: str, source: str) -> bool:
    """The provenance rule of heartbeats: one counts only on its own subject (the one of its job
    and worker, which NATS permissions grant to that worker alone) and from its own worker.

    Takes the plain fields so the registry's per-heartbeat fast path, which never builds the
    model, applies the very rule every other reader does (`heartbeat_refusal`).
    """
    return source == worker_id and subject == subjects.heartbeat_subject(job, worker_id)


def heartbeat_refusal(subject: str, heartbeat: WorkerHeartbeat) -> Refusal | None:
    """Why `heartbeat`, received on `subject`, does not count (`heartbeat_belongs`), or None."""
    if heartbeat_belongs(subject, heartbeat.job, heartbeat.worker_id, heartbeat.source):
        return None
    if subject != subjects.heartbeat_subject(heartbeat.job, heartbeat.worker_id):
        try:
            subjects.parse_heartbeat_subject(subject)
        except ValueError as exc:
            return Refusal(BAD_SUBJECT, str(exc)[:400])
        return Refusal(
            SUBJECT_MISMATCH,
            f"heartbeat of worker {heartbeat.worker_id!r} (job {heartbeat.job!r}) was sent on "
            f"{subject[:300]}, not on its own subject "
            f"{subjects.heartbeat_subject(heartbeat.job, heartbeat.worker_id)}",
        )
    return source_refusal(heartbeat)
