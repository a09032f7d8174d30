"""Leases: a worker's registration as a fencing token, checked the same way by every domain.

A registration (`worker.registered`) grants a lease: the registering instance and the membership
epoch of that registration. It ends with the worker's `worker.failed` or `worker.left`, or with a
newer registration of the same id. A process paused past its heartbeat timeout (GC, swap, SIGSTOP,
a cut network) comes back holding an ended lease; whatever it asks with it is refused
(`StaleLease`), so a zombie can neither read shards that are another worker's now nor count as
done what it read under the old lease. Pure: folded from events, no clock, no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from strata.errors import LeaseRequired, StaleLease, StrataError
from strata.events import Event, WorkerFailed, WorkerLeft, WorkerRegistered
from strata.events.requests import Lease

__all__ = ["ENDED_KEPT", "Leases", "lease_error"]

ENDED_KEPT = 1_000
"""Ended leases remembered per job (for the refusal's reason), oldest forgotten first."""


@dataclass
class Leases:
    """The current lease of each live worker of one job: worker id -> (instance, epoch)."""

    current: dict[str, tuple[str, int]] = field(default_factory=dict)
    ended: dict[str, str] = field(default_factory=dict)
    """Worker id -> how its last lease ended ("failed", "left"), while it holds none; for the
    message a zombie gets. Dropped when the id registers again."""

    def copy(self) -> Leases:
        return Leases(dict(self.current), dict(self.ended))

    def fold(self, event: Event) -> None:
        if isinstance(event, WorkerRegistered):
            self.current[event.worker_id] = (event.instance, event.membership_epoch)
            self.ended.pop(event.worker_id, None)
        elif (
            isinstance(event, WorkerFailed | WorkerLeft)
            and self.current.pop(event.worker_id, None) is not None
        ):
            self.ended[event.worker_id] = "failed" if isinstance(event, WorkerFailed) else "left"
            while len(self.ended) > ENDED_KEPT:
                del self.ended[next(iter(self.ended))]

    def check(
        self, job: str, lease: Lease | None, worker_id: str | None = None
    ) -> StrataError | None:
        """Why a request carrying `lease` (for `worker_id`, when it must be the lease's holder)
        may not change state, if it may not."""
        return lease_error(self, job, lease, worker_id)


def lease_error(
    leases: Leases, job: str, lease: Lease | None, worker_id: str | None = None
) -> StrataError | None:
    if lease is None:
        return LeaseRequired(
            f"this request of job {job!r} carries no worker lease: the worker's strata SDK is "
            "older than the services, which refuse unfenced changes to sharding state; upgrade "
            "strata on the workers to the services' version"
        )
    if worker_id is not None and lease.worker_id != worker_id:
        return StaleLease(
            f"the request is about worker {worker_id!r} of job {job!r} but carries the lease of "
            f"{lease.worker_id!r}: a worker reports only its own progress"
        )
    current = leases.current.get(lease.worker_id)
    if current == (lease.instance, lease.epoch):
        return None
    held = (
        f"worker {lease.worker_id!r} of job {job!r}, instance {lease.instance[:12]}, "
        f"lease epoch {lease.epoch}"
    )
    if current is None:
        how = leases.ended.get(lease.worker_id)
        why = (
            f"that registration was {how}"
            + (
                " (no heartbeat within the heartbeat timeout: a pause or a cut network)"
                if how == "failed"
                else ""
            )
            if how is not None
            else "no live registration of that worker is known"
        )
    else:
        why = (
            f"the worker registered again since (instance {current[0][:12]}, lease epoch "
            f"{current[1]})"
        )
    return StaleLease(
        f"{held}: {why}. Its shards may be another worker's now; nothing of this request was "
        "recorded, and samples read under this lease and not reported are not counted. Stop "
        "reading: the SDK registers again as a new instance and starts over from the plan"
    )
