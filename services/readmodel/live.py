"""A job's live recovery, folded from the barrier service's `live.*` events: the live group's
world size over time, and a marker for each shrink, growth, heal and discarded step, each with the
step it happened at and a line that says what happened (the dashboard draws them).

A discarded step is reported by every survivor of the group it failed in: the reports make one
marker. A quorum's step is the one its group resumed from: the discarded step less one when a
step was discarded in the quorum before it, else the step its first heal brought a member to
(unknown, null, until one comes: a group whose members all stood at the same step heals nobody).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final

from strata.events import Event, LiveHealed, LiveQuorumFormed, LiveStepDiscarded
from strata.services.readmodel.views import (
    LiveMarkerKind,
    LiveMarkerView,
    LiveView,
    WorldPointView,
)

KEPT: Final = 500
"""Quorums and markers kept per job (the newest); `quorums` counts them all."""

REASON_CHARS: Final = 160
"""Of a discard's reason (a collective's error), what its marker's line quotes."""

QuorumKey = tuple[int, int]


@dataclass
class Marker:
    kind: LiveMarkerKind
    at: int
    quorum: QuorumKey
    step: int | None
    workers: list[str]
    label: str

    def view(self) -> LiveMarkerView:
        return {
            "kind": self.kind,
            "at": self.at,
            "membership_epoch": self.quorum[0],
            "step": self.step,
            "workers": list(self.workers),
            "label": self.label,
        }


@dataclass
class Point:
    at: int
    quorum: QuorumKey
    world_size: int
    step: int | None

    def view(self) -> WorldPointView:
        return {
            "at": self.at,
            "membership_epoch": self.quorum[0],
            "generation": self.quorum[1],
            "world_size": self.world_size,
            "step": self.step,
        }


@dataclass
class LiveLog:
    """Quorums and markers of one job, in the order their events were stored."""

    quorums: int = 0
    heals: int = 0
    discarded_steps: int = 0
    world: list[Point] = field(default_factory=list)
    markers: list[Marker] = field(default_factory=list)
    _discards: dict[tuple[QuorumKey, int], Marker] = field(default_factory=dict)
    """(quorum, step) -> its discard marker: each survivor's report joins it."""
    _last_discard: dict[QuorumKey, int] = field(default_factory=dict)
    """Quorum -> the step discarded in it (its group ended there)."""
    _previous: QuorumKey | None = None

    def fold(self, event: Event) -> bool:
        """Fold a `live.*` event; whether it was one."""
        if isinstance(event, LiveQuorumFormed):
            self._formed(event)
        elif isinstance(event, LiveHealed):
            self._healed(event)
        elif isinstance(event, LiveStepDiscarded):
            self._discarded(event)
        else:
            return False
        return True

    def _formed(self, event: LiveQuorumFormed) -> None:
        key = (event.membership_epoch, event.generation)
        discarded = self._last_discard.get(self._previous) if self._previous else None
        step = discarded - 1 if discarded is not None else None
        self._previous = key
        self.quorums += 1
        previous_size = self.world[-1].world_size if self.world else None
        self.world.append(Point(event.ts, key, event.world_size, step))
        at = f" at step {step}" if step is not None else ""
        change = (
            f"world {previous_size} → {event.world_size}"
            if previous_size is not None
            else f"world {event.world_size}"
        )
        if event.left:
            self._mark(
                Marker(
                    "shrink",
                    event.ts,
                    key,
                    step,
                    list(event.left),
                    f"{', '.join(event.left)} left the group{at} ({change}, membership epoch "
                    f"{event.membership_epoch})",
                )
            )
        if event.joined:
            self._mark(
                Marker(
                    "grow",
                    event.ts,
                    key,
                    step,
                    list(event.joined),
                    f"{', '.join(event.joined)} joined the group{at} ({change}, membership "
                    f"epoch {event.membership_epoch})",
                )
            )
        del self.world[:-KEPT]

    def _healed(self, event: LiveHealed) -> None:
        key = (event.membership_epoch, event.generation)
        self.heals += 1
        for marker in self.markers:
            if marker.quorum == key and marker.step is None:
                marker.step = event.to_step
                marker.label = marker.label.replace(
                    " the group (", f" the group at step {event.to_step} ("
                )
        for point in self.world:
            if point.quorum == key and point.step is None:
                point.step = event.to_step
        self._mark(
            Marker(
                "heal",
                event.ts,
                key,
                event.to_step,
                [event.worker_id],
                f"{event.worker_id} healed from {event.source_worker}: step {event.from_step} → "
                f"{event.to_step}",
            )
        )

    def _discarded(self, event: LiveStepDiscarded) -> None:
        key = (event.membership_epoch, event.generation)
        self._last_discard[key] = event.step
        found = self._discards.get((key, event.step))
        if found is not None:
            if event.worker_id not in found.workers:
                found.workers.append(event.worker_id)
                found.label = _discard_label(event.step, found.workers, event.reason)
            return
        self.discarded_steps += 1
        marker = Marker(
            "discard",
            event.ts,
            key,
            event.step,
            [event.worker_id],
            _discard_label(event.step, [event.worker_id], event.reason),
        )
        self._discards[(key, event.step)] = marker
        self._mark(marker)

    def _mark(self, marker: Marker) -> None:
        self.markers.append(marker)
        if len(self.markers) > KEPT:
            gone = self.markers[:-KEPT]
            del self.markers[:-KEPT]
            for old in gone:
                if old.kind == "discard":
                    self._discards.pop((old.quorum, old.step or 0), None)
        if len(self._last_discard) > KEPT:
            for old_key in sorted(self._last_discard)[:-KEPT]:
                del self._last_discard[old_key]

    def view(self) -> LiveView:
        return {
            "quorums": self.quorums,
            "heals": self.heals,
            "discarded_steps": self.discarded_steps,
            "world_size": self.world[-1].world_size if self.world else None,
            "world": [point.view() for point in self.world],
            "markers": [marker.view() for marker in self.markers],
        }


def _discard_label(step: int, workers: list[str], reason: str) -> str:
    why = f": {reason[:REASON_CHARS]}" if reason else ""
    return f"step {step} discarded by {', '.join(workers)}{why}"
