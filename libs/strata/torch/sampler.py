"""`ShardSampler`: a `torch.utils.data.Sampler` over this worker's unread samples of an epoch.

It reads the worker's shards in the plan's order, reports each shard as done once it is consumed,
follows plan changes (shards of a failed worker arrive, shards go to a joiner), and keeps a cursor
(`state_dict`) that resumes exactly where the training loop stopped. The pure parts (within-shard
order, reading queue, cursor checks) are functions of `strata.torch.reading`, tested without a
service.
"""

from __future__ import annotations

import contextlib
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass
from typing import Any, Final, Protocol

import structlog
from torch.utils.data import Sampler

from strata._checks import check_int
from strata.datasets import merge_cursors
from strata.errors import (
    ConflictError,
    LeaseExpired,
    StaleLease,
    ValidationError,
    WorkerSuperseded,
)
from strata.events.models import MAX_EPOCH, MAX_SHARDS, MAX_TOTAL_SAMPLES, DataCursor, ShardOffset
from strata.events.requests import Lease, PlanSummary, ProgressResult, ShardAssignment
from strata.torch.reading import (
    CURSOR_VERSION,
    Queued,
    check_cursor,
    reading_queue,
    within_shard_order,
)
from strata.torch.wrapping import check_consumer

__all__ = [
    "CURSOR_VERSION",
    "Queued",
    "ShardSampler",
    "ShardSource",
    "check_cursor",
    "reading_queue",
    "within_shard_order",
]

REPORT_ATTEMPTS: Final = 3
"""A report that keeps conflicting after this many re-fetches means the plan is changing faster
than the sampler can follow; it is an error rather than a silent loss."""
POLL_S: Final = 0.05
MAX_POLL_S: Final = 1.0
REFETCH_S: Final = 2.0
LEASE_WAIT_S: Final = 120.0
"""How long the sampler waits for its worker's lease to hold again (a confirmed heartbeat the
sharding service accepts) or for a new registration, before it raises `LeaseExpired`: long
enough for a registry restart and a re-registration."""

log = structlog.get_logger("strata.sampler")


class ShardSource(Protocol):
    """What the sampler needs of a registry; `strata.DatasetRegistry` is one."""

    @property
    def worker_id(self) -> str: ...

    @property
    def lease(self) -> Lease: ...

    @property
    def lease_expired(self) -> bool: ...

    @property
    def lease_in_doubt(self) -> bool: ...

    @property
    def superseded(self) -> bool: ...

    def assignment(
        self,
        dataset_id: str,
        worker_id: str | None = None,
        epoch: int = 0,
        *,
        lease: Lease | None = None,
    ) -> ShardAssignment: ...

    def report_progress(
        self,
        dataset_id: str,
        epoch: int,
        completed: Iterable[int] = (),
        partial: Mapping[int, int] | None = None,
        *,
        lease: Lease | None = None,
    ) -> ProgressResult: ...

    def plan(self, dataset_id: str, epoch: int = 0) -> PlanSummary: ...

    def plan_version_seen(self, dataset_id: str, epoch: int) -> int | None: ...


@dataclass(slots=True)
class _Drawn:
    """A run of samples of one shard handed out and not yet acknowledged."""

    shard_id: int
    offset: int
    """Samples of the shard consumed before this run."""
    count: int
    length: int


# -- the sampler ----------------------------------------------------------------------------------


class ShardSampler(Sampler[int]):
    """This worker's unread sample indices of an epoch, shard by shard, in reading order.

    Iterating fetches the worker's assignment and yields the indices of each unfinished shard
    (shuffled within the shard if asked, from (seed, epoch, shard id)); a partly read shard starts
    after its recorded offset. A shard counts as consumed once the iteration has moved past its
    last index, and is then reported done: every `report_every` shards, and at the end of a pass
    (with 0, only then and on `flush()`). Before each shard the sampler checks for a newer plan
    and re-fetches, and when it runs out it fetches again, so unfinished shards moved to this
    worker (from a failed one) are read in the same pass; a shard moved away is dropped. A done
    shard never moves, so a sample of the epoch is consumed exactly once across the job, whatever
    fails, up to the shard a failed worker was reading (its samples since the last report or
    `flush()` are read again by another worker). `wait_for_more()` ends an epoch.

    `DataLoader(num_workers > 0)`: the loader iterates the sampler in the main process only and
    sends the indices to its worker processes, which only call `dataset[i]`; the sampler is never
    copied into them (nor pickled, with `spawn`), so there is one cursor and one stream of
    reports, and each index goes to one loader worker. The loader draws up to
    `prefetch_factor * num_workers` batches ahead of the loop, so by default a shard is reported
    when its last index was handed to the loader. For exactly-once at the training step, pass
    `manual_ack=True` and call `ack(len(batch))` after each step: the loader returns batches in
    the order it drew them, so the first N indices drawn are the N the loop consumed, and only
    those count in reports and in `state_dict()`.

    `state_dict()` is the cursor (epoch, shards consumed, the shard in progress and its offset);
    `load_state_dict()` or `cursor=` resumes from it. `flush()` reports the pending done shards and
    the offset of the shard in progress; call it at a checkpoint. One iteration at a time.
    """

    def __init__(
        self,
        registry: ShardSource,
        dataset_id: str,
        epoch: int = 0,
        *,
        shuffle_within_shard: bool = False,
        seed: int = 0,
        report_every: int = 1,
        cursor: Mapping[str, Any] | None = None,
        manual_ack: bool = False,
        lease_wait: float = LEASE_WAIT_S,
    ) -> None:
        super().__init__()
        if not isinstance(lease_wait, int | float) or not 0 < lease_wait <= 86_400:
            raise ValidationError(
                f"lease_wait must be seconds in (0, 86400], got {lease_wait!r}", field="lease_wait"
            )
        self._lease_wait = float(lease_wait)
        self._registry = registry
        self._dataset_id = _check_str("dataset_id", dataset_id)
        self._epoch = check_int("epoch", epoch, 0, MAX_EPOCH)
        if not isinstance(shuffle_within_shard, bool) or not isinstance(manual_ack, bool):
            raise ValidationError("shuffle_within_shard and manual_ack must be True or False")
        self._shuffle = shuffle_within_shard
        self._seed = check_int("seed", seed, 0, 2**63 - 1)
        self._report_every = check_int("report_every", report_every, 0, MAX_SHARDS)
        self._manual_ack = manual_ack
        self._log = log.bind(dataset=dataset_id)
        self._reset()
        if cursor is not None:
            self.load_state_dict(cursor)

    def _reset(self) -> None:
        self._floors: dict[int, int] = {}
        self._completed: set[int] = set()
        self._unreported: list[int] = []
        self._current: tuple[int, int] | None = None
        self._current_length = 0
        self._assignment: ShardAssignment | None = None
        self._remaining: int | None = None
        self._stale = False
        self._in_flight: deque[_Drawn] = deque()
        self._lost: list[int] = []
        self._lease: Lease | None = None
        """The lease this sampler's progress belongs to; reported under it, never another."""
        self._fenced = False
        """A service refused `_lease` (`StaleLease`): nothing more is read until a new one."""
        self._orphaned = 0
        """Indices handed out under an ended lease and not acknowledged (`manual_ack`): their
        `ack()` is taken and ignored."""

    def __repr__(self) -> str:
        return (
            f"<ShardSampler {self._dataset_id} epoch={self._epoch} "
            f"completed={len(self._completed)} current={self._current}>"
        )

    # -- properties -------------------------------------------------------------------------------

    @property
    def dataset_id(self) -> str:
        """The dataset this sampler reads."""
        return self._dataset_id

    @property
    def epoch(self) -> int:
        """The epoch this sampler reads (change it with `set_epoch`)."""
        return self._epoch

    @property
    def lease(self) -> Lease | None:
        """The lease this sampler reads and reports under (None before its first fetch)."""
        return self._lease

    @property
    def assignment(self) -> ShardAssignment | None:
        """The assignment as last fetched."""
        return self._assignment

    @property
    def completed_shards(self) -> frozenset[int]:
        """Shards this sampler consumed to the end in the epoch."""
        return frozenset(self._completed)

    @property
    def lost_shards(self) -> list[int]:
        """Shards consumed here, to the end or in part, but moved to another worker before
        they were reported: their samples (those read here since the last accepted report) are
        read again there. Non-empty only when a plan changed under a slow report."""
        return list(self._lost)

    @property
    def held_shards(self) -> frozenset[int]:
        """With `manual_ack=True`: shards with indices handed out and not yet acknowledged."""
        return frozenset(run.shard_id for run in self._in_flight)

    def __len__(self) -> int:
        """Samples left to read as of the last fetch (fetching now if there was none)."""
        if self._remaining is None:
            self._fetch(set())
        assert self._remaining is not None
        return self._remaining

    # -- epochs and cursors -----------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Start another epoch; done shards of the previous one not yet reported are reported."""
        epoch = check_int("epoch", epoch, 0, MAX_EPOCH)
        if epoch == self._epoch:
            return
        self._report()
        self._epoch = epoch
        self._reset()

    def state_dict(self) -> dict[str, Any]:
        """The cursor: what this sampler consumed of the epoch (plain data: save it anywhere)."""
        return {
            "version": CURSOR_VERSION,
            "dataset_id": self._dataset_id,
            "epoch": self._epoch,
            "shuffle_within_shard": self._shuffle,
            "seed": self._seed,
            "completed": sorted(self._completed),
            "current": list(self._current) if self._current is not None else None,
        }

    def cursor(self, carried: DataCursor | None = None) -> DataCursor:
        """This sampler's cursor as a checkpoint records it (`CheckpointManager.save(...,
        cursors=[...])`), merged with `carried`: the cursor the job was restored to
        (`DatasetRegistry.restore_from`), which a fresh sampler does not know. Without it, a
        second restore in the same epoch would make the job read the first one's shards again."""
        current = self._current
        partial = [ShardOffset(shard_id=current[0], offset=current[1])] if current else []
        own = DataCursor(
            dataset_id=self._dataset_id,
            epoch=self._epoch,
            completed=sorted(self._completed),
            partial=partial,
        )
        return merge_cursors(self._dataset_id, self._epoch, [own, *([carried] if carried else [])])

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Resume from a cursor: its done shards are reported again (a no-op for those already
        recorded) and its shard in progress continues after its offset, if still this worker's."""
        cursor = check_cursor(
            state,
            dataset_id=self._dataset_id,
            shuffle_within_shard=self._shuffle,
            seed=self._seed,
        )
        self._epoch = cursor.epoch
        self._reset()
        self._completed = set(cursor.completed)
        self._unreported = sorted(cursor.completed)
        self._current = cursor.current

    # -- iteration --------------------------------------------------------------------------------

    def __iter__(self) -> Iterator[int]:
        # Drained or re-sharded by a framework's wrapper, it would report what never trained.
        check_consumer("ShardSampler")
        # What was handed out and never acknowledged was not consumed: it is handed out again.
        self._in_flight.clear()
        epoch = self._epoch
        drawn: set[int] = set()
        handed_out = False
        while True:
            try:
                if self._settle_lease(drawn) and handed_out:
                    # A new lease: this pass ends here, so that no batch mixes indices read
                    # under the ended lease with new ones; the next pass reads from the plan.
                    return
                self._report()
                queue = self._fetch(drawn)
                if not queue:
                    self._report()
                    return
                for item in queue:
                    if self._epoch != epoch:
                        return  # set_epoch() was called: this iteration belongs to the old epoch
                    if not self._may_draw():
                        break
                    order = within_shard_order(
                        item.start,
                        item.end,
                        shuffle=self._shuffle,
                        seed=self._seed,
                        epoch=self._epoch,
                        shard_id=item.shard_id,
                    )
                    length = len(order)
                    # A floor raised since the fetch (`skip_to`: another reader's steps of the
                    # shard, committed meanwhile) moves the start too.
                    start = max(item.offset, min(self._floors.get(item.shard_id, 0), length))
                    interrupted = False
                    for k in range(start, length):
                        # Before every index, so before every batch: a lease that may have
                        # ended, or a newer plan, stops the drawing here, mid-shard.
                        if not self._may_draw():
                            interrupted = True
                            break
                        self._draw(item.shard_id, k, length)
                        handed_out = True
                        yield order[k]
                        if self._epoch != epoch:
                            return
                    if interrupted:
                        self._stale = True
                        break
                    drawn.add(item.shard_id)
                    # Here the loop has asked for the index after the shard's last one.
                    if not self._manual_ack or start >= length:
                        self._complete(item.shard_id)
            except StaleLease as exc:
                self._log.warning(
                    "lease_refused",
                    epoch=self._epoch,
                    error=exc.message,
                    consequence="what this sampler read under the ended lease and did not "
                    "report is not counted; it starts over from the plan under a new one",
                )

    def ack(self, num_samples: int) -> None:
        """With `manual_ack=True`: the loop is done with the next `num_samples` indices handed
        out (in order); shards acknowledged to their end are reported done. Raises
        `strata.StaleLease` when some of them were handed out under a lease that has ended
        (they are not counted), or when the report is refused for that reason."""
        if not self._manual_ack:
            raise ValidationError(
                "ack() is for samplers made with manual_ack=True; this one counts an index as "
                "consumed once the iteration moves past it"
            )
        count = check_int("num_samples", num_samples, 0, MAX_TOTAL_SAMPLES)
        ignored = min(count, self._orphaned)
        self._orphaned -= ignored
        count -= ignored
        if ignored:
            self._acknowledge(count)
            raise StaleLease(
                f"{ignored} of the indices acknowledged were handed out under a lease of worker "
                f"{self._registry.worker_id!r} that has ended: they are not counted (another "
                "worker reads them); discard what was trained on them if you can"
            )
        self._acknowledge(count)

    def _acknowledge(self, count: int) -> None:
        outstanding = sum(run.count for run in self._in_flight)
        if count > outstanding:
            raise ValidationError(
                f"ack({count}) is more than the {outstanding} indices handed out and not yet "
                "acknowledged",
                field="num_samples",
            )
        finished = False
        while count:
            run = self._in_flight[0]
            taken = min(count, run.count)
            run.offset += taken
            run.count -= taken
            count -= taken
            self._current, self._current_length = (run.shard_id, run.offset), run.length
            if run.offset >= run.length:
                self._in_flight.popleft()
                self._complete(run.shard_id, report=False)
                finished = True
        # Reported once every index is taken: a refused report (an ended lease) leaves none of
        # them outstanding, to be handed out and trained again.
        if finished and self._report_every and len(self._unreported) >= self._report_every:
            self._report()

    def flush(self) -> ProgressResult | None:
        """Report the done shards not yet reported and the offset of the shard in progress, so
        that a worker taking over after a failure starts there. Call it at a checkpoint."""
        partial: dict[int, int] = {}
        if self._current is not None:
            shard, offset = self._current
            if offset >= self._current_length > 0:
                self._complete(shard, report=False)
            elif offset > 0:
                partial[shard] = offset
        return self._report(partial)

    def pending_positions(self) -> list[tuple[int, int]]:
        """With `manual_ack=True`: for each shard with indices handed out and not yet
        acknowledged, (shard id, samples of it consumed once they are): where the shard stands
        if the step they are in commits."""
        return [(run.shard_id, run.offset + run.count) for run in self._in_flight]

    def skip_to(self, shard_id: int, offset: int) -> None:
        """The first `offset` samples of shard `shard_id` of this epoch were trained by another
        worker that could not report them (it died after its step committed): should the shard
        come to this sampler, it starts after them (and is done at once if that is all of it)."""
        shard = check_int("shard_id", shard_id, 0, MAX_SHARDS - 1)
        self._floors[shard] = max(
            self._floors.get(shard, 0), check_int("offset", offset, 0, MAX_TOTAL_SAMPLES)
        )

    def wait_for_more(self, timeout: float = 300.0) -> bool:
        """After an iteration ended: wait until this worker has shards to read again (True: iterate
        again) or every shard of the epoch is done, by anyone (False: the epoch is over).

        Shards of a worker that fails late in the epoch reach the survivors only once its
        heartbeat timeout has passed; this is how a loop that finished its own shards waits for
        them. With `manual_ack=True`, acknowledge everything handed out first: what is not
        acknowledged is handed out again. Raises `TimeoutError` if neither happens within
        `timeout` seconds.
        """
        if not 0 < timeout <= 86_400:
            raise ValidationError(f"timeout must be in (0, 86400] s, got {timeout!r}")
        with contextlib.suppress(StaleLease):
            self._report()  # refused: nothing of it counts, and the next fetch starts afresh
        deadline = time.monotonic() + timeout
        delay = POLL_S
        fetched_at = time.monotonic()
        while True:
            summary = self._registry.plan(self._dataset_id, self._epoch)
            if summary.done_shards >= summary.total_shards:
                return False
            known = self._assignment.plan_version if self._assignment is not None else -1
            # The service re-plans only each dataset's latest epoch on its own; asking for
            # shards brings an older epoch's plan up to date, so ask now and then regardless.
            if (
                summary.plan_version > known
                or time.monotonic() - fetched_at >= REFETCH_S
                or self._lease != self._registry.lease
            ):
                fetched_at = time.monotonic()
                try:
                    self._settle_lease(set())
                    if self._fetch(set()):
                        return True
                except StaleLease:
                    pass  # the lease ended: the next round waits for the new one
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"epoch {self._epoch} of {self._dataset_id!r}: {summary.done_shards} of "
                    f"{summary.total_shards} shards done after {timeout:g}s, none of the rest "
                    "for this worker"
                )
            # Backing off: a thousand workers waiting must not flood the service.
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, MAX_POLL_S)

    # -- internals --------------------------------------------------------------------------------

    def _may_draw(self) -> bool:
        """Whether the next index may be handed out: the lease this sampler reads under is the
        worker's current one and holds, no newer plan was heard of, and no report was refused
        since the last fetch (a shard it named, perhaps the one being read, moved away)."""
        registry = self._registry
        if self._fenced or self._stale or registry.lease != self._lease or registry.lease_expired:
            return False
        return not self._newer_plan()

    def _settle_lease(self, drawn: set[int]) -> bool:
        """Before fetching: wait until the worker's lease holds (or is in doubt: the fetch,
        which carries it, settles that), starting over from the plan under a new lease.
        True when the lease was replaced."""
        replaced = False
        registry = self._registry
        deadline = time.monotonic() + self._lease_wait
        delay = POLL_S
        while True:
            current = registry.lease
            if self._lease is None:
                self._lease = current
            elif current != self._lease:
                self._log.warning(
                    "lease_replaced",
                    epoch=self._epoch,
                    dropped_shard=self._current,
                    dropped_unreported=len(self._unreported),
                    consequence="this sampler starts over from the plan under the new lease",
                )
                self._restart_under(current)
                drawn.clear()
                replaced = True
            if not self._fenced and (not registry.lease_expired or registry.lease_in_doubt):
                return replaced
            if registry.superseded:
                raise WorkerSuperseded(
                    f"worker {registry.worker_id!r} was registered by another process: this "
                    "one reads no more data; stop it"
                )
            if time.monotonic() >= deadline:
                raise LeaseExpired(
                    f"the lease of worker {registry.worker_id!r} ended or may have (no heartbeat "
                    f"confirmed within the heartbeat timeout) and no new registration came "
                    f"within {self._lease_wait:g}s: is the registry reachable?"
                )
            time.sleep(min(delay, max(0.0, deadline - time.monotonic())))
            delay = min(delay * 1.5, MAX_POLL_S)

    def _restart_under(self, lease: Lease) -> None:
        """Forget what was read under the ended lease (it is not counted: another worker reads
        it again), keeping the epoch; the next fetch starts from the plan."""
        orphaned = self._orphaned + sum(run.count for run in self._in_flight)
        self._reset()
        self._orphaned = orphaned
        self._lease = lease

    def _newer_plan(self) -> bool:
        seen = self._registry.plan_version_seen(self._dataset_id, self._epoch)
        return (
            seen is not None
            and self._assignment is not None
            and seen > self._assignment.plan_version
        )

    def _fetch(self, drawn: AbstractSet[int]) -> list[Queued]:
        if self._lease is None:
            self._lease = self._registry.lease
        try:
            assignment = self._registry.assignment(
                self._dataset_id, epoch=self._epoch, lease=self._lease
            )
        except StaleLease:
            self._fenced = True
            raise
        self._assignment, self._stale = assignment, False
        if self._current is not None and not self._in_flight:
            span = next((s for s in assignment.shards if s.shard_id == self._current[0]), None)
            if span is None or span.done:
                self._current = None  # moved away or done: nothing of it is left to us
            else:
                self._current_length = span.end - span.start
        # Indices handed out and not yet acknowledged are drawn: a re-fetch mid-shard goes on
        # after the last of them.
        position = self._current
        if self._in_flight:
            last = self._in_flight[-1]
            position = (last.shard_id, last.offset + last.count)
        queue = reading_queue(assignment, self._completed | drawn, position, self._floors)
        self._remaining = sum(item.left for item in queue)
        return queue

    def _draw(self, shard_id: int, index: int, length: int) -> None:
        if not self._manual_ack:
            self._current, self._current_length = (shard_id, index + 1), length
            return
        last = self._in_flight[-1] if self._in_flight else None
        if last is not None and last.shard_id == shard_id:
            last.count += 1
        else:
            self._in_flight.append(_Drawn(shard_id, index, 1, length))

    def _complete(self, shard_id: int, *, report: bool = True) -> None:
        if shard_id in self._completed:
            return
        self._completed.add(shard_id)
        if self._current is not None and self._current[0] == shard_id:
            self._current = None
        self._unreported.append(shard_id)
        if report and self._report_every and len(self._unreported) >= self._report_every:
            self._report()

    def _report(self, partial: Mapping[int, int] | None = None) -> ProgressResult | None:
        completed = list(self._unreported)
        offsets = dict(partial or {})
        result = None
        if self._lease is None and (completed or offsets):
            self._lease = self._registry.lease
        for _ in range(REPORT_ATTEMPTS):
            if not completed and not offsets:
                break
            try:
                result = self._registry.report_progress(
                    self._dataset_id, self._epoch, completed, offsets, lease=self._lease
                )
                break
            except StaleLease:
                # Read under a lease that ended: none of it counts, another worker reads it.
                self._fenced = True
                self._unreported = []
                self._current = None
                raise
            except ConflictError as exc:
                # Some shard is no longer ours: keep what still is, drop the rest, re-plan.
                try:
                    assignment = self._registry.assignment(
                        self._dataset_id, epoch=self._epoch, lease=self._lease
                    )
                except StaleLease:
                    self._fenced = True
                    self._unreported = []
                    self._current = None
                    raise
                self._assignment, self._stale = assignment, True
                ours = {span.shard_id for span in assignment.shards}
                lost = [s for s in completed if s not in ours]
                # A shard read in part and moved away is lost too: its new reader starts at
                # the offset recorded before, and reads again what was read here since.
                lost += [s for s in offsets if s not in ours and s not in lost]
                self._lost.extend(lost)
                self._log.warning(
                    "shards_moved_before_report",
                    epoch=self._epoch,
                    lost=lost[:20],
                    lost_count=len(lost),
                    error=exc.message,
                    consequence="another worker reads these shards again",
                )
                completed = [s for s in completed if s in ours]
                offsets = {s: o for s, o in offsets.items() if s in ours}
        else:
            raise ConflictError(
                f"progress on {self._dataset_id!r} epoch {self._epoch} still conflicts after "
                f"{REPORT_ATTEMPTS} re-fetches of the plan: is it changing all the time?"
            )
        self._unreported = []
        return result


def _check_str(what: str, value: object) -> str:
    if not isinstance(value, str) or not value:
        raise ValidationError(f"{what} must be a non-empty string, got {value!r}", field=what)
    return value
