"""A job's lost ranks and restarts, folded from its registry events: what the dashboard's overview
and training charts mark.

A rank is lost when its process is failed (it missed its heartbeats, or a new process of the same
worker id superseded it). A restart is a new process taking the rank or the worker id of one that
was lost or left. Replacements registering within `GROUP_WINDOW_NS` of a restart's first one
join it (a launcher restarting the whole group), unless they take a rank it already restarted or
replace one of its own processes: a group of 8 ranks restarted once counts once. Each restart
knows the step its lost processes had reached and the first step its replacements reported: the
steps between the two were trained twice, and the charts shade them.

Both steps come from what each process reported (heartbeats, state changes, logged metrics),
kept per process as the first step above 0 and the highest: heartbeats travel on a stream of
their own, heard before or after the events they follow, and a process's steps only grow, so
these two are the same whatever the order (`tests/unit/test_replay.py`). A restart resumed at the
first step of its replacements; a process that registered again is a replacement of its newest
restart only.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Final, Literal

from strata.services.readmodel.views import LossView, RestartView

GROUP_WINDOW_NS: Final = 60 * 10**9
"""How long after a restart's first replacement another one still joins it."""
KEPT: Final = 100
"""Losses and restarts listed per job (the newest); the counts cover them all."""
PROCESSES_KEPT: Final = 8192
"""Processes whose steps are kept (the most recently heard of): beats of workers not registered
yet count too, so this bounds what unknown senders can make the log keep."""

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
    """The step it had reached when it was recorded (its latest beat, state change or logged
    metric); its view takes the highest step the process reported at all (`Steps`)."""

    def view(self, steps: Steps) -> LossView:
        return {
            "rank": self.rank,
            "worker": self.worker,
            "status": self.status,
            "at": self.at,
            "step": max(self.step, steps.highest(self.worker, self.instance)),
        }


class Steps:
    """Per process (worker id, instance): the first step above 0 it reported and the highest,
    whatever the order its reports were heard in; the `PROCESSES_KEPT` heard of last."""

    def __init__(self) -> None:
        self._kept: OrderedDict[tuple[str, str], tuple[int | None, int]] = OrderedDict()

    def add(self, worker: str, instance: str, step: int) -> None:
        key = (worker, instance)
        first, highest = self._kept.get(key, (None, 0))
        if step > 0 and (first is None or step < first):
            first = step
        self._kept[key] = (first, max(highest, step))
        self._kept.move_to_end(key)
        if len(self._kept) > PROCESSES_KEPT:
            self._kept.popitem(last=False)

    def first(self, worker: str, instance: str) -> int | None:
        return self._kept.get((worker, instance), (None, 0))[0]

    def highest(self, worker: str, instance: str) -> int:
        return self._kept.get((worker, instance), (None, 0))[1]


@dataclass
class Restart:
    """The replacements of processes gone before the first of them registered."""

    at: int
    """ns; when the first replacement registered."""
    replaced: list[Loss] = field(default_factory=list)
    replacements: dict[tuple[str, str], int] = field(default_factory=dict)
    """(worker id, instance) of each replacement -> its rank."""
    superseded: set[tuple[str, str]] = field(default_factory=set)
    """Replacements that registered again since, in a newer restart: theirs now."""

    def view(self, steps: Steps) -> RestartView:
        replaced = [loss.view(steps) for loss in self.replaced]
        firsts = [
            steps.first(worker, instance)
            for worker, instance in self.replacements
            if (worker, instance) not in self.superseded
        ]
        resumed = [first for first in firsts if first is not None]
        return {
            "at": self.at,
            "ranks": sorted(self.replacements.values()),
            "replaced": replaced,
            "step_reached": max((loss["step"] for loss in replaced), default=0),
            "resumed_step": min(resumed, default=None),
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
    steps: Steps = field(default_factory=Steps)

    def loss_views(self) -> list[LossView]:
        return [loss.view(self.steps) for loss in self.losses]

    def restart_views(self) -> list[RestartView]:
        return [restart.view(self.steps) for restart in self.restarts]

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
        key = (worker, instance)
        for older in self.restarts[:-1]:
            if key in older.replacements:
                older.superseded.add(key)
        latest.superseded.discard(key)
        latest.replaced.extend(replaced)
        latest.replacements[key] = rank

    def progressed(self, worker: str, instance: str, step: int) -> None:
        """A process reported `step` (a heartbeat, perhaps of a process not registered yet, a
        state change, a logged metric): where its restart resumed and the step it reached
        are taken from these (`Steps`). A process reports step 0 until it has loaded its
        checkpoint."""
        self.steps.add(worker, instance, step)
