"""A job's lost ranks and restarts, folded from its registry events: what the dashboard's overview
and training charts mark.

A rank is lost when its process is failed (it missed its heartbeats, or a new process of the same
worker id superseded it). A restart is a new process taking the rank or the worker id of one that
was lost or left. Replacements registering within `GROUP_WINDOW_NS` of a restart's first one
join it (a launcher restarting the whole group), unless they take a rank it already restarted or
replace one of its own processes: a group of 8 ranks restarted once counts once. Each restart
knows the step its lost processes had reached and the first step a replacement reported after it:
the steps between the two were trained twice, and the charts shade them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Literal

from strata.services.readmodel.views import LossView, RestartView

GROUP_WINDOW_NS: Final = 60 * 10**9
"""How long after a restart's first replacement another one still joins it."""
KEPT: Final = 100
"""Losses and restarts listed per job (the newest); the counts cover them all."""

GoneStatus = Literal["failed", "left"]


@dataclass(frozen=True)
class Loss:
    """A process that stopped holding its rank: failed, or left."""

    rank: int
    worker: str
    instance: str
    status: GoneStatus
    at: int
    """ns; the time of the event that recorded it."""
    step: int
    """The step it had reached (its latest beat, else its latest state change)."""

    def view(self) -> LossView:
        return {
            "rank": self.rank,
            "worker": self.worker,
            "status": self.status,
            "at": self.at,
            "step": self.step,
        }


@dataclass
class Restart:
    """The replacements of processes gone before the first of them registered."""

    at: int
    """ns; when the first replacement registered."""
    replaced: list[Loss] = field(default_factory=list)
    replacements: dict[tuple[str, str], int] = field(default_factory=dict)
    """(worker id, instance) of each replacement -> its rank."""
    resumed_step: int | None = None

    def view(self) -> RestartView:
        return {
            "at": self.at,
            "ranks": sorted(self.replacements.values()),
            "replaced": [loss.view() for loss in self.replaced],
            "step_reached": max((loss.step for loss in self.replaced), default=0),
            "resumed_step": self.resumed_step,
        }


@dataclass
class RestartLog:
    """Losses and restarts of one job, in the order their events were stored."""

    losses: list[Loss] = field(default_factory=list)
    """Every failure (kept to `KEPT`; `lost` counts them all)."""
    lost: int = 0
    restarts: list[Restart] = field(default_factory=list)
    """The newest `KEPT` restarts; `restarted` counts them all."""
    restarted: int = 0
    vacated: dict[int, Loss] = field(default_factory=dict)
    """Rank -> the loss of its last holder, until a new process takes it."""
    vacated_ids: dict[str, Loss] = field(default_factory=dict)
    """Worker id -> its loss, until a new process registers with that id."""

    def gone(self, loss: Loss) -> None:
        """A live process failed or left."""
        self.vacated[loss.rank] = loss
        self.vacated_ids[loss.worker] = loss
        if loss.status == "failed":
            self.lost += 1
            self.losses.append(loss)
            del self.losses[:-KEPT]

    def registered(self, worker: str, instance: str, rank: int, at: int) -> None:
        """A process registered: a restart when it takes a lost or vacated rank or worker id."""
        # The process a new one replaces: the one that had its id, and the one that had its rank
        # (the same one, unless the id comes back on another rank).
        replaced = [
            loss
            for loss in (self.vacated_ids.get(worker), self.vacated.get(rank))
            if loss is not None
        ]
        if not replaced:
            return
        if len(replaced) == 2 and replaced[0] is replaced[1]:
            replaced.pop()
        for loss in replaced:
            self.vacated.pop(loss.rank, None)
            self.vacated_ids.pop(loss.worker, None)
        latest = self.restarts[-1] if self.restarts else None
        if (
            latest is None
            or rank in latest.replacements.values()
            or any((loss.worker, loss.instance) in latest.replacements for loss in replaced)
            or at - latest.at > GROUP_WINDOW_NS
        ):
            latest = Restart(at=at)
            self.restarts.append(latest)
            self.restarted += 1
            del self.restarts[:-KEPT]
        latest.replaced.extend(replaced)
        latest.replacements[(worker, instance)] = rank

    def progressed(self, worker: str, instance: str, step: int) -> None:
        """A process reported `step`: the first step above 0 a replacement reports is where its
        restart resumed (a process reports step 0 until it has loaded its checkpoint)."""
        if step <= 0 or not self.restarts:
            return
        latest = self.restarts[-1]
        if latest.resumed_step is None and (worker, instance) in latest.replacements:
            latest.resumed_step = step
