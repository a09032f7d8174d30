"""The contract every service domain shares (registry, sharding, barrier, checkpoint).

A domain is pure: `evolve(state, event)` folds an event into its state, and its command functions
take the state, the request and the time (`now_ns`: wall-clock nanoseconds, the unit of every
event's `ts`) and return a `Decision`. Nothing here does I/O; the adapters publish the events and
answer with the result or the error.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Final, Generic, TypeVar

from strata.errors import StrataError
from strata.events.models import Event

R = TypeVar("R")


@dataclass(frozen=True)
class Decision(Generic[R]):
    """What a command records, what its caller is answered, and the error it gets.

    `events` and `error` may both be set: a command can record an outcome (an abort) and still
    be refused. `result` is the answer when the domain computes it (None when the adapter reads
    its answer off the state once the events are folded).
    """

    events: list[Event] = field(default_factory=list)
    error: StrataError | None = None
    result: R | None = None


NS_PER_S: Final = 1_000_000_000
"""Nanoseconds per second: durations configured in seconds meet `now_ns` through this."""
