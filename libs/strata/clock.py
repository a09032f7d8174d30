"""The two clocks a process reads: monotonic for durations and deadlines, wall time for stamps.

A deadline runs on `time.monotonic` inside a process, so a wall-clock step (NTP) never ends one
early or late. Wall time only stamps events (`ts`), and it is what carries a deadline across a
restart: the stored deadline's wall time, turned back into a remaining duration that is clamped
to [0, timeout] (`TimeBase.deadline`), so a step backwards cannot extend it.

`wall_ns()` is the wall clock every service stamps events with. A test steps one process's wall
clock by writing an offset in seconds to the file named by `STRATA_TEST_CLOCK_OFFSET_FILE` in
that process's environment; nothing else sets it, and without it `wall_ns()` is `time.time_ns()`.
"""

from __future__ import annotations

import os
import time
from typing import Final, NamedTuple

from strata.config import Env

OFFSET_FILE_ENV: Final = Env.TEST_CLOCK_OFFSET_FILE
"""The file holding a test's offset (seconds, a float) added to this process's wall clock."""
OFFSET_REREAD_S: Final = 0.05
"""How often the offset file is read again: a step takes effect within this."""

_offset_file = os.environ.get(OFFSET_FILE_ENV) or None
_offset_ns = 0
_offset_read_at = -1.0


def _offset() -> int:
    global _offset_ns, _offset_read_at
    now = time.monotonic()
    if now - _offset_read_at >= OFFSET_REREAD_S:
        _offset_read_at = now
        try:
            with open(_offset_file or "", encoding="utf-8") as file:
                _offset_ns = int(float(file.read().strip() or 0) * 1e9)
        except (OSError, ValueError):
            _offset_ns = 0
    return _offset_ns


def wall_ns() -> int:
    """Wall-clock nanoseconds, the unit of every event's `ts` (stepped only in tests)."""
    if _offset_file is None:
        return time.time_ns()
    return time.time_ns() + _offset()


def wall() -> float:
    """`wall_ns()` in seconds."""
    return wall_ns() / 1e9


def monotonic_ns() -> int:
    """This process's monotonic clock: durations and deadlines. Meaningless in another process."""
    return time.monotonic_ns()


class TimeBase(NamedTuple):
    """One moment read on both clocks, so that a wall-clock stamp from an event can be placed
    on the monotonic clock. Pure: the adapter reads the clocks and passes this in."""

    mono_ns: int
    wall_ns: int

    def deadline(self, deadline_wall_ns: int, timeout_ns: int) -> int:
        """The monotonic deadline of a duration whose end an event stamped as `deadline_wall_ns`:
        the time left by the wall clock, clamped to [0, timeout_ns]. For a deadline decided at
        this moment that is exactly `timeout_ns`; after a restart, the time the previous process
        left. A wall clock stepped back cannot extend it; one stepped forward while no process
        ran shortens it (to nothing, at worst: the deadline is then due at once)."""
        left = min(max(deadline_wall_ns - self.wall_ns, 0), timeout_ns)
        return self.mono_ns + left

    def mono(self, stamp_wall_ns: int) -> int:
        """A wall-clock stamp placed on the monotonic clock (a past event: before `mono_ns`)."""
        return self.mono_ns + min(stamp_wall_ns - self.wall_ns, 0)


def now() -> TimeBase:
    """Both clocks, read now."""
    return TimeBase(monotonic_ns(), wall_ns())
