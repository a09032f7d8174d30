"""The process's clocks: wall time stamps events, the monotonic clock measures durations.

Liveness, deadlines and intervals are measured on `monotonic_ns`, which no NTP step or manual
clock change moves; wall time (`wall`, `wall_ns`) only says when something happened, and it is
what carries a deadline across a restart: the stored deadline's wall time, turned back into a
remaining duration clamped to [0, timeout] (`TimeBase.deadline`), so a step backwards cannot
extend it.

Fault tests step a running process's wall clock through one seam: when
`STRATA_CLOCK_OFFSET_FILE` names a file, its content (seconds, a float) is added to the
process's wall clock, read again whenever the file changes. Then `time.time` and `time.time_ns`
themselves are replaced (importing `strata` installs them), so every reader of the wall clock in
the process sees the step, as with an NTP step; the monotonic clock is left alone. Unset (every
deployment), nothing is replaced and `wall_ns` is `time.time_ns` itself.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import Final, NamedTuple

OFFSET_FILE_ENV: Final = "STRATA_CLOCK_OFFSET_FILE"
"""Names a file holding seconds added to this process's wall clock (fault tests only)."""

monotonic_ns: Final[Callable[[], int]] = time.monotonic_ns


class _SteppedWall:
    """The wall clock plus the offset in a file, re-read when the file's mtime or size changes."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._offset_ns = 0

    def offset_ns(self) -> int:
        try:
            status = os.stat(self.path)
        except OSError:
            self._stamp, self._offset_ns = None, 0
            return 0
        stamp = (status.st_mtime_ns, status.st_size)
        if stamp != self._stamp:
            try:
                with open(self.path, encoding="utf-8") as file:
                    text = file.read().strip()
                self._offset_ns = round(float(text or 0.0) * 1e9)
            except (OSError, ValueError):
                return self._offset_ns  # a file being rewritten: the last offset holds
            self._stamp = stamp
        return self._offset_ns


def _wall_source() -> Callable[[], int]:
    path = os.environ.get(OFFSET_FILE_ENV)
    if not path:
        return time.time_ns
    stepped = _SteppedWall(path)
    real_time_ns = time.time_ns

    def time_ns() -> int:
        return real_time_ns() + stepped.offset_ns()

    def time_s() -> float:
        return time_ns() / 1e9

    time.time_ns, time.time = time_ns, time_s
    return time_ns


wall_ns: Final[Callable[[], int]] = _wall_source()
"""Wall-clock nanoseconds since the epoch: what events are stamped with."""


def wall() -> float:
    """Wall-clock seconds since the epoch."""
    return wall_ns() / 1e9


def step_wall_clock(path: str | os.PathLike[str], seconds: float) -> None:
    """Set the offset a process started with `STRATA_CLOCK_OFFSET_FILE=path` adds to its wall
    clock (written whole, then renamed, so a reader never sees half of it)."""
    target = os.fspath(path)
    partial = f"{target}.partial"
    with open(partial, "w", encoding="utf-8") as file:
        file.write(repr(float(seconds)))
    os.replace(partial, target)


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
