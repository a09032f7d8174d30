"""Snapshots of jobs' folded states, so a time travel folds only from the nearest one.

Rebuilding a job at a past point from its first event costs a read of its whole history up to
there. The gateway folds every event anyway, so while it does it keeps a serialized copy of a
job's state every so many events (`SnapshotStore.folded`); a time travel restores the newest
snapshot at or before the point asked for (`nearest`) and folds only the events after it.

A snapshot holds what a replay without heartbeats holds: the events' part of the state. The live
state's heartbeats are the latest of each worker, not those of the past point, so they are left
out, and a restored state is exactly the one a fold of the same events from the start gives.

Snapshots are pickled: the gateway reads back only the bytes it wrote itself, in the same
process, and pickling copies the domains' states whole, whatever their shape (a 1,000-worker job
is about 1 MB and 20 ms). Three rules bound what they cost:

- spacing: a job is snapshotted at most once per `every` of its events (2,048 at first);
- time: a snapshot waits until at least `cost_factor` (3) times the last one's duration has
  passed since it, so snapshots take at most a quarter of the gateway's time while it catches up
  with a long stream (and nearly none once it follows the live one);
- memory: all snapshots together stay within `budget_bytes` (`STRATA_REPLAY_SNAPSHOT_MB`, 256
  MiB by default). Past it, the job holding the most gives up every other snapshot and doubles
  its spacing, so an old job keeps snapshots over its whole history, further apart.
"""

from __future__ import annotations

import bisect
import pickle
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Final

import structlog
from strata.services.readmodel.state import JobState, collector_paused

log = structlog.get_logger("strata.readmodel")

SNAPSHOT_EVERY_EVENTS: Final = 2048
SNAPSHOT_COST_FACTOR: Final = 3.0
SNAPSHOT_BUDGET_BYTES: Final = 256 * 1024 * 1024

_LEFT_OUT: Final = frozenset(
    {"beats", "unclaimed", "metric_steps", "_evolvers", "_routes", "_recent_rows"}
)
"""What a snapshot does not keep: the telemetry (heartbeats, steps of metrics: not those of the
past point), and what
`thaw` makes again (the domains' wiring, the cache of rendered rows)."""


def freeze(state: JobState) -> bytes:
    """The events' part of `state`, serialized: what `thaw` restores."""
    kept: dict[str, Any] = {k: v for k, v in vars(state).items() if k not in _LEFT_OUT}
    kept["heartbeats"] = 0
    kept["beats_ignored"] = 0
    kept["version"] = state.events
    return pickle.dumps(kept, protocol=pickle.HIGHEST_PROTOCOL)


def thaw(blob: bytes) -> JobState:
    """A new state from `freeze`'s bytes, independent of the one it was taken from."""
    state = JobState.__new__(JobState)
    with collector_paused():  # a restore makes some 100,000 objects at once, cycles none
        vars(state).update(pickle.loads(blob))  # only bytes this process wrote
    state.beats = {}
    state.unclaimed = OrderedDict()
    state.metric_steps = {}
    state._recent_rows = {}
    state._connect_domains()
    return state


@dataclass
class _JobSnapshots:
    """One job's snapshots, oldest first."""

    every: int
    seqs: list[int] = field(default_factory=list)
    stored_ns: list[int] = field(default_factory=list)
    blobs: list[bytes] = field(default_factory=list)
    since: int = 0
    """Events folded since the last snapshot."""
    held: int = 0
    """Bytes of `blobs`."""
    failed: bool = False
    """Its state could not be pickled: no more snapshots of this job (time travel reads all)."""

    def thin(self) -> int:
        """Give up every other snapshot, the newest kept; the bytes freed."""
        keep = range(len(self.blobs) - 1, -1, -2)
        kept = sorted(keep)
        freed = self.held - sum(len(self.blobs[i]) for i in kept)
        self.seqs = [self.seqs[i] for i in kept]
        self.stored_ns = [self.stored_ns[i] for i in kept]
        self.blobs = [self.blobs[i] for i in kept]
        self.held -= freed
        self.every *= 2
        return freed

    def drop_all(self) -> int:
        freed, self.held = self.held, 0
        self.seqs, self.stored_ns, self.blobs = [], [], []
        self.every *= 2
        return freed


class SnapshotStore:
    """Snapshots of every job the gateway folds, within a memory budget."""

    def __init__(
        self,
        budget_bytes: int = SNAPSHOT_BUDGET_BYTES,
        every: int = SNAPSHOT_EVERY_EVENTS,
        cost_factor: float = SNAPSHOT_COST_FACTOR,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.budget_bytes = budget_bytes
        self.every = every
        self.cost_factor = cost_factor
        self._clock = clock
        self._jobs: dict[str, _JobSnapshots] = {}
        self.held = 0
        """Bytes of all snapshots."""
        self._next_allowed = 0.0
        self.taken = 0

    def folded(self, state: JobState, stored_ns: int) -> None:
        """Note that `state` has just folded an event stored at `stored_ns`; snapshot it when
        one is due. Cheap when none is: a count and a comparison."""
        snapshots = self._jobs.get(state.job)
        if snapshots is None:
            snapshots = self._jobs[state.job] = _JobSnapshots(self.every)
        snapshots.since += 1
        if snapshots.since < snapshots.every or snapshots.failed:
            return
        started = self._clock()
        if started < self._next_allowed:
            return
        try:
            blob = freeze(state)
        except Exception as exc:  # a domain state that cannot be pickled must not stop the fold
            snapshots.failed = True
            log.error("snapshot_failed", job=state.job, error=f"{type(exc).__name__}: {exc}")
            return
        finished = self._clock()
        self._next_allowed = finished + self.cost_factor * (finished - started)
        snapshots.since = 0
        snapshots.seqs.append(state.seq)
        snapshots.stored_ns.append(stored_ns)
        snapshots.blobs.append(blob)
        snapshots.held += len(blob)
        self.held += len(blob)
        self.taken += 1
        self._keep_within_budget()

    def _keep_within_budget(self) -> None:
        while self.held > self.budget_bytes:
            largest = max(self._jobs.values(), key=lambda job: job.held)
            if len(largest.blobs) > 1:
                self.held -= largest.thin()
            else:
                self.held -= largest.drop_all()

    def count(self, job: str) -> int:
        snapshots = self._jobs.get(job)
        return 0 if snapshots is None else len(snapshots.blobs)

    def nearest(self, job: str, *, seq: int | None = None, at_ns: int | None = None) -> JobState:
        """A new state of `job` restored from its newest snapshot at or before events-stream
        sequence `seq` (or stored time `at_ns`): an empty state when there is none. Fold the
        job's events after its `seq` up to the point to have the state there."""
        snapshots = self._jobs.get(job)
        if snapshots is None or (seq is None and at_ns is None):
            return JobState(job)
        if seq is not None:
            index = bisect.bisect_right(snapshots.seqs, seq) - 1
        else:
            index = bisect.bisect_right(snapshots.stored_ns, at_ns or 0) - 1
        if index < 0:
            return JobState(job)
        return thaw(snapshots.blobs[index])
