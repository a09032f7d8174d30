"""What one replay may spend, checked record by record: records, planned shards, time, memory.

A replay reads a history someone else wrote (a JetStream stream or an export file), and a small
record can ask the fold for a lot (a re-plan of a million-shard dataset). `ReplayBudget.charge`
is called before each record is folded; the first bound passed raises `TooLarge` or
`DeadlineExceeded`, a one-line error that names the bound and how to ask for less.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Iterable, Iterator

from strata.errors import DeadlineExceeded, TooLarge
from strata.events.models import DatasetRegistered, ShardPlanChanged
from strata.history.reading import ReplayLimits
from strata.history.records import Record


def peak_memory_bytes() -> int:
    """This process's peak resident memory (ru_maxrss: KiB on Linux, bytes on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)


class ReplayBudget:
    """The bounds of one replay of job `what` (`narrow` ends each error: how to ask for less).

    `clock` and `memory` are passed in so a test can drive them; by default the monotonic clock
    and the process's peak memory.
    """

    def __init__(
        self,
        limits: ReplayLimits,
        what: str,
        narrow: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        memory: Callable[[], int] = peak_memory_bytes,
    ) -> None:
        self.limits = limits
        self.what = what
        self.narrow = narrow
        self._clock = clock
        self._memory = memory
        self._deadline = clock() + limits.timeout_s
        self._memory_at_start = memory() if limits.max_memory_bytes is not None else 0
        self._shards: dict[str, int] = {}
        self.records = 0
        self.planned_shards = 0

    def charge(self, record: Record) -> None:
        """Count `record` against the bounds, before it is folded."""
        limits = self.limits
        if self._clock() >= self._deadline:
            raise DeadlineExceeded(
                f"replaying {self.what} took more than {limits.timeout_s:g}s ({self.records:,} "
                f"records folded by then); {self.narrow}",
                folded=self.records,
            )
        if self.records == limits.max_records:
            raise TooLarge(
                f"replaying {self.what} folds more than {limits.max_records:,} events and "
                f"heartbeats, the most one replay may fold; {self.narrow}",
                limit=limits.max_records,
            )
        if limits.max_memory_bytes is not None:
            grown = self._memory() - self._memory_at_start
            if grown > limits.max_memory_bytes:
                raise TooLarge(
                    f"replaying {self.what} grew this process by {grown / 2**20:,.0f} MiB, more "
                    f"than the {limits.max_memory_bytes / 2**20:,.0f} MiB one replay may use "
                    f"({self.records:,} records folded); {self.narrow}",
                    limit=limits.max_memory_bytes,
                )
        event = record.event
        if isinstance(event, DatasetRegistered):
            self._shards[event.dataset_id] = event.num_shards
            self._plan(event.num_shards)
        elif isinstance(event, ShardPlanChanged):
            self._plan(self._shards.get(event.dataset_id, 0))
        self.records += 1

    def _plan(self, shards: int) -> None:
        self.planned_shards += shards
        if self.planned_shards > self.limits.max_planned_shards:
            raise TooLarge(
                f"replaying {self.what} plans more than {self.limits.max_planned_shards:,} "
                f"shards in all (dataset registrations and re-plans, {self.records:,} records "
                f"in), the most one replay may plan; {self.narrow}",
                limit=self.limits.max_planned_shards,
            )

    def bounded(self, records: Iterable[Record]) -> Iterator[Record]:
        """`records`, each charged before it is handed on."""
        for record in records:
            self.charge(record)
            yield record
