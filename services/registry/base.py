"""What every part of the registry process shares: the state it folds, its policy, its place
among the heartbeat partitions and its two clocks.

The registry is one `Projection` built from one class per concern, each in its own module:
`notices` (re-registration and world notices to workers), `heartbeats` (the heartbeat intake),
`partitions` (what heartbeat partitions tell the leader), `detector` (failure detection: the
proof of hearing, the verdicts, their conditional write) and `service` (the wiring and the
requests). They are one object, so the heartbeat path stays a plain method call with no
indirection; each module reads only what this base and the modules below it define.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from strata.clock import monotonic_ns, wall, wall_ns
from strata.config import Settings
from strata.events.models import Event
from strata.services.projection import Projection
from strata.services.registry.domain import Policy, RegistryState


class RegistryBase(Projection[RegistryState]):
    name = "registry"

    def __init__(
        self, clock: Callable[[], float] = wall, liveness_ns: Callable[[], int] = monotonic_ns
    ) -> None:
        super().__init__(clock)
        # Silence is measured on a clock only moving forward; the wall clock stamps events.
        self._liveness_ns = liveness_ns
        self.policy = Policy()
        self.heartbeats = 0
        self.applied = 0
        self.partition, self.partitions = 0, 1
        # The heartbeat path reads the clock once per heartbeat: the wall clock in ns directly
        # when it is the wall clock (no float round trip), else the injected one.
        self._beat_clock_ns: Callable[[], int] = wall_ns if clock is wall else self.now_ns
        self._settings: Settings | None = None
        self._outbox: asyncio.Queue[Event] = asyncio.Queue(maxsize=100_000)

    def initial_state(self) -> RegistryState:
        return RegistryState()

    @property
    def leader(self) -> bool:
        """Partition 0: the registry process that decides membership."""
        return self.partition == 0


def _fields(event: Event, *names: str) -> dict[str, Any]:
    return {name: getattr(event, name) for name in names}
