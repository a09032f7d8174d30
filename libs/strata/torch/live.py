"""`LiveGroup`: data-parallel training that survives a failed rank without restarting the others.

Each step every rank starts a small gloo all-reduce before its forward pass, the commit vote:
the number of samples each rank trains, the newest membership epoch each rank has heard of (the
registry's world notices) and where its shards stand once the step commits. Its gradients are
all-reduced in buckets, each started as soon as the backward pass has made it
(`GradientBuckets`). A step whose collectives all complete is committed (the optimizer steps,
the samples are acknowledged, and reported to the sharding service while the next step trains);
a step whose collective fails (a peer died) is discarded, and its samples are
trained again. After a failure the survivors wait for the registry to record it (a new membership
epoch), meet at a Strata barrier named after that epoch, and build a new gloo group over a store
prefix of their own in the job's rendezvous bucket, in the same processes. A newer epoch heard of
in a vote (a replacement registered) makes every rank re-form the group after that step, so a
joiner enters at a step boundary. Whenever a group forms, the ranks compare their committed steps
and the one furthest ahead broadcasts its weights, optimizer state and position to the others: a
replacement heals from a live peer and never reads a checkpoint, and a survivor whose last vote
failed while the others' passed takes the step it missed. A peer that stands still instead of
dying (paused, or cut off from NATS) leaves a collective neither completed nor failed: while one
waits, each rank looks whether the registry failed a member of its group, and drops the group
if so; the rank that comes back commits nothing under the registration it lost, registers
again, and heals back in as a joiner does.

The pure parts (who serves the state, which members form the group) are functions here.
"""

from __future__ import annotations

import asyncio
import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Final

import structlog
import torch
import torch.distributed as dist
from torch.utils.data._utils.collate import default_collate

from strata.errors import (
    BarrierBroken,
    BarrierTimeout,
    BusError,
    ConfigError,
    DeadlineExceeded,
    StaleLease,
    StrataError,
)
from strata.events.models import MAX_SHARDS
from strata.events.requests import (
    Lease,
    LiveAction,
    LiveReportRequest,
    LiveReportResult,
    MemberInfo,
    SuspectResult,
    live_barrier,
)
from strata.torch.sampler import ShardSampler, ShardSource
from strata.worker import Worker

__all__ = [
    "EpochResult",
    "GradientBuckets",
    "LiveGroup",
    "VoteLayout",
    "assign_buckets",
    "group_members",
    "shared_shards",
    "state_source",
]

POLL_S: Final = 0.05
IDLE_S: Final = 0.1
"""How long a rank waits between empty steps while a failed worker's shards have not moved yet."""
BARRIER_S: Final = 10.0
REPORT_S: Final = 5.0
"""How long a rank waits for the barrier service to record a heal or a discarded step."""
PROGRESS_S: Final = 1.0
"""At most how often a rank reports its committed steps' progress to the sharding service while
it trains (0: after every committed step). The group reports everything before it re-forms and
at the end of an epoch. Each report is an event every service reads: reported after every step,
two ranks kept the services busy enough to slow a replacement's start by half on 2 cores. The
votes record where every shard stands, so exactly once does not depend on the reports; a shard
the service moves while its reader has not reported it is caught by `shared_shards`."""
CHECK_S: Final = 0.25
"""While a collective has not completed, how often a rank looks whether the registry failed a
member of its group (a paused or cut-off peer: the collective would wait for its timeout)."""
CHECK: Final = timedelta(seconds=CHECK_S)
STATE_FORMAT: Final = 1
SLOTS: Final = 4
"""Shards one rank's batch may touch in a step: each step's vote carries, for every rank, where
each of them stands once the step commits."""
FIRST_BUCKET_BYTES: Final = 1 << 20
BUCKET_BYTES: Final = 25 << 20
"""Gradient bucket sizes, as `DistributedDataParallel`'s: a small first bucket (the last layers,
whose gradients are ready first) starts the all-reduce early, larger ones amortise its cost."""

log = structlog.get_logger("strata.live")


# -- pure parts -----------------------------------------------------------------------------------


def group_members(members: Sequence[MemberInfo]) -> list[str]:
    """The worker ids of a group, in group-rank order: live members by registry rank."""
    live = [m for m in members if m.status not in ("failed", "left")]
    return [m.worker_id for m in sorted(live, key=lambda m: (m.rank, m.worker_id))]


def state_source(steps: Sequence[int]) -> int | None:
    """The group rank that sends its state to the others, or None when none needs it.

    The rank with the most committed steps (the lowest such rank) is the source; nobody needs
    state when every rank has committed as many steps and that is more than none (at the first
    formation every rank sends rank 0's initial weights, so that all start the same).
    """
    if not steps:
        return None
    most = max(steps)
    if most > 0 and min(steps) == most:
        return None
    return steps.index(most)


def assign_buckets(
    params: Sequence[tuple[int, str]],
    *,
    first: int = FIRST_BUCKET_BYTES,
    cap: int = BUCKET_BYTES,
) -> list[list[int]]:
    """Gradient buckets: the indices of `params` ((bytes, dtype) of each, in the model's order)
    in the order a backward pass makes their gradients (the model's last parameters first),
    one dtype to a bucket, a bucket closed once it holds `first` bytes (the first bucket) or
    `cap` bytes (the others)."""
    buckets: list[list[int]] = []
    current: list[int] = []
    held = 0
    dtype: str | None = None
    for index in reversed(range(len(params))):
        size, kind = params[index]
        if current and kind != dtype:
            buckets.append(current)
            current, held = [], 0
        current.append(index)
        held += size
        dtype = kind
        if held >= (cap if buckets else first):
            buckets.append(current)
            current, held = [], 0
    if current:
        buckets.append(current)
    return buckets


@dataclass(frozen=True)
class VoteLayout:
    """Where things are in a step's vote, one int64 vector all-reduced with SUM: the samples
    every rank trained in the step, then one slot per rank for the newest membership epoch it
    heard of, then `SLOTS` (shard id + 1, position once the step commits) pairs per rank, then
    how many times the step trained each audited sample. Each rank fills only its own slots,
    so the sum is every rank's values side by side."""

    size: int
    audit: int

    @property
    def epochs(self) -> slice:
        return slice(1, 1 + self.size)

    @property
    def _positions_start(self) -> int:
        return 1 + self.size

    @property
    def positions(self) -> slice:
        return slice(self._positions_start, self._positions_start + self.size * SLOTS * 2)

    @property
    def ledger(self) -> slice:
        return slice(self.length - self.audit, self.length)

    @property
    def length(self) -> int:
        return self._positions_start + self.size * SLOTS * 2 + self.audit

    def positions_of(self, rank: int) -> slice:
        start = self._positions_start + rank * SLOTS * 2
        return slice(start, start + SLOTS * 2)


def shared_shards(vote: torch.Tensor, layout: VoteLayout) -> list[int]:
    """The shards that more than one rank's batch read in the step `vote` records.

    A shard has one reader at a time, so this is empty but for one race: the sharding service
    moved a shard (to a joiner, say) and its old reader had not heard yet when the new one
    started it, from where the group's votes said it stood. Both then read the same samples
    in the same step; every rank sees the same vote, so every rank discards that step."""
    read = vote[layout.positions].view(layout.size, SLOTS, 2)[:, :, 0]  # shard + 1, or 0
    ranks = torch.arange(layout.size, dtype=torch.int64).unsqueeze(1).expand_as(read)
    used = read > 0
    # (rank, shard) once each (a rank may read a shard in two runs of one batch), then shards
    # named by more than one rank.
    pairs = torch.unique(ranks[used] * (MAX_SHARDS + 1) + read[used])
    shards, counts = torch.unique(pairs % (MAX_SHARDS + 1), return_counts=True)
    return [int(shard) - 1 for shard in shards[counts > 1].tolist()]


@dataclass(frozen=True)
class EpochResult:
    """What `LiveGroup.train_epoch` did: steps committed and discarded, samples trained by
    this rank, and the group changes it went through."""

    epoch: int
    committed: int
    discarded: int
    samples: int
    reformed: int


# -- gradients ------------------------------------------------------------------------------------


class MemberFailed(RuntimeError):
    """The registry recorded a member of the group failed while this rank waited on a collective
    with it: the group is dropped as if the collective had failed (a `RuntimeError`, as gloo's)."""


def park(group: Any, works: list[Any]) -> None:
    """Keep an abandoned group alive on a thread of its own until its collectives `works` end,
    and empty `works`. Dropping a gloo group waits for its collectives under way (up to its
    timeout), so the training thread must not hold the last reference; and while they are
    under way a peer that comes back (a paused one resumed) may complete them, into buffers no
    longer used. Once they end, the group's connections close, and that peer's next
    collective on it fails at once."""
    held = [group, *works]
    works.clear()

    def drain() -> None:
        for work in held[1:]:
            with contextlib.suppress(Exception):
                work.wait()
        held.clear()

    threading.Thread(target=drain, name="strata-live-abandoned", daemon=True).start()


def watch(works: Sequence[Any], gone: Callable[[], list[str]]) -> list[str]:
    """Wait until every one of `works` has ended, successfully or not, calling `gone` every
    `CHECK_S` while one has not; return at once what `gone` returned when it was not empty (the
    members that left the group), else []. A wait with a timeout ends the wait, not the
    collective, and costs a step no more than a plain wait (`bench/live_wait.py`)."""
    for work in works:
        while True:
            try:
                work.wait(CHECK)
                break
            except (RuntimeError, dist.DistError):
                if work.is_completed():
                    break  # it failed: the caller's wait raises that
            left = gone()
            if left:
                return left
    return []


Launch = Callable[[torch.Tensor], Any]
"""Starts an all-reduce (SUM) of a tensor in the current group; returns its work (None when
the group is this rank alone)."""


class GradientBuckets:
    """A model's gradients as flat buffers, one per bucket (`assign_buckets`; one dtype and
    device to a bucket), each parameter's `.grad` a view into its bucket, so autograd accumulates
    into them in place. Between `start` and `finish`, a bucket's all-reduce starts as soon as the
    backward pass has produced all of its gradients, while the rest of the pass runs; buckets
    start in their order, which is the same on every rank whatever order the gradients come
    in. The hooks stay on the parameters and do nothing outside a step."""

    def __init__(
        self,
        params: Sequence[torch.nn.Parameter],
        *,
        first: int = FIRST_BUCKET_BYTES,
        cap: int = BUCKET_BYTES,
    ) -> None:
        self._params = list(params)
        sizes = [(p.numel() * p.element_size(), f"{p.dtype}/{p.device}") for p in params]
        order = assign_buckets(sizes, first=first, cap=cap)
        self._members = [[params[i] for i in bucket] for bucket in order]
        self._buffers: list[torch.Tensor] = []
        self._where: dict[int, tuple[int, torch.Tensor]] = {}
        """id of a parameter -> its bucket and its view there."""
        self._allocate()
        self._launch: Launch | None = None
        self._left: list[int] = []
        self._next = 0
        self._works: list[Any] = []
        self._error: BaseException | None = None
        for p in params:
            p.register_post_accumulate_grad_hook(self._ready)  # type: ignore[no-untyped-call]

    def _allocate(self) -> None:
        self._buffers = [
            torch.zeros(
                sum(p.numel() for p in members), dtype=members[0].dtype, device=members[0].device
            )
            for members in self._members
        ]
        for number, members in enumerate(self._members):
            offset = 0
            for p in members:
                view = self._buffers[number][offset : offset + p.numel()].view_as(p)
                self._where[id(p)] = (number, view)
                offset += p.numel()

    def __len__(self) -> int:
        return len(self._buffers)

    def start(self, launch: Launch) -> None:
        """Zero the gradients (each parameter's `.grad` its view again, should something have
        replaced it) and arm the hooks that start the buckets' all-reduces with `launch`."""
        for buffer in self._buffers:
            buffer.zero_()
        for p in self._params:
            view = self._where[id(p)][1]
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view
        self._left = [len(members) for members in self._members]
        self._next = 0
        self._works = []
        self._error = None
        self._launch = launch

    def _ready(self, p: torch.Tensor) -> None:
        if self._launch is None:
            return  # a backward pass outside a step
        number, view = self._where[id(p)]
        grad = p.grad
        if grad is not None and grad.data_ptr() != view.data_ptr():
            view.copy_(grad)  # the gradient was replaced rather than accumulated into
            p.grad = view
        self._left[number] -= 1
        while self._next < len(self._buffers) and self._left[self._next] <= 0:
            self._start_next()

    def send(self, tensor: torch.Tensor) -> None:
        """Start an all-reduce of `tensor` too (the step's vote), waited for by `finish`."""
        self._start(tensor)

    def _start_next(self) -> None:
        buffer = self._buffers[self._next]
        self._next += 1
        self._start(buffer)

    def _start(self, tensor: torch.Tensor) -> None:
        if self._launch is None or self._error is not None:
            return
        try:
            work = self._launch(tensor)
        except (RuntimeError, dist.DistError) as exc:
            self._error = exc  # raised by `finish`: a hook cannot stop the backward pass cleanly
            return
        if work is not None:
            self._works.append(work)

    def finish(self, settle: Callable[[list[Any]], None] | None = None) -> None:
        """Start the buckets not started yet (gradients the pass did not reach, or no pass at
        all), wait for every all-reduce, and raise the first that failed.

        `settle(works)`, when given, returns once every work has ended, or raises having taken
        them away (the group was abandoned with its all-reduces under way): the buckets are
        then new buffers, since the abandoned all-reduces may still write into the old ones."""
        while self._next < len(self._buffers):
            self._start_next()
        self._launch = None
        error, self._error = self._error, None
        works, self._works = self._works, []
        if settle is not None and works:
            try:
                settle(works)
            except MemberFailed:
                self._allocate()
                raise
        while works:
            # Each work holds the group's connections open: none may outlive this call (not
            # even in a traceback), or a peer waiting on this rank in a collective of a group
            # that failed would wait for its timeout instead of failing when the group drops.
            work = works.pop(0)
            try:
                work.wait()
            except (RuntimeError, dist.DistError) as exc:
                error = error or exc
            del work
        if error is not None:
            raise error

    def abandon(self) -> None:
        """Disarm the hooks (the step ended before `finish`); the group is dropped after this."""
        self._launch = None
        self._works = []

    def divide(self, total: int) -> None:
        for buffer in self._buffers:
            buffer.div_(total)


# -- the group ------------------------------------------------------------------------------------


class LiveGroup:
    """A data-parallel group over the job's live workers that re-forms itself in place.

    `LiveGroup(worker, model, optimizer)` ties `model` (replicated on every rank) and its
    optimizer to the job's membership. `train_epoch(registry, dataset, data, loss_fn,
    batch_size=..., epoch=...)` trains this rank's shards of the epoch: `loss_fn(batch)` returns
    the loss summed over the batch, and each committed step averages the gradients over every
    sample the contributing ranks trained in it. The epoch ends on every rank at the same step,
    once the sharding service has every shard done.

    `wait_for=N`: the first group forms when N workers are registered (later groups, and a
    joiner's first while the others train, are whoever is live). The worker's state is
    `training` (with the step) while the group trains and `recovering` while it re-forms.
    `audit_samples=N` keeps `ledger`, how many times each of N samples went into a
    committed step, healed along with the weights (a check for small datasets: it adds N
    numbers to every step's all-reduce). `timeout` bounds each collective and a re-forming;
    a collective with a member the registry fails meanwhile (paused, or cut off from NATS) ends
    sooner, when the failure is recorded.
    """

    def __init__(
        self,
        worker: Worker,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        wait_for: int = 1,
        timeout: float = 60.0,
        audit_samples: int = 0,
    ) -> None:
        self._worker = worker
        self._model = model
        self._optimizer = optimizer
        self._wait_for = wait_for
        self._timeout = timeout
        self._params = [p for p in model.parameters() if p.requires_grad]
        self._buckets: GradientBuckets | None = None
        self._reporter: ThreadPoolExecutor | None = None
        self._report_in_flight: Future[None] | None = None
        """The progress report of the last committed step, sent while the next step trains."""
        self._unreported = False
        self._reported_at = -PROGRESS_S
        """When (monotonic) the last progress report was sent."""
        self.ledger = torch.zeros(audit_samples, dtype=torch.float32)
        self.step = 0
        """Steps committed by the group since the job began (healed from peers)."""
        self.epoch = 0
        """The data epoch the group is in (healed from peers: a joiner learns it here)."""
        self.healed = False
        """Whether this rank ever received the state from a peer after training had begun."""
        self.reformed = 0
        self._floors: dict[int, int] = {}
        """Shard -> samples trained in committed steps, as every rank's vote said (this epoch):
        what a rank that died before reporting its last step had trained."""
        self._pg: Any = None
        self._peers: list[str] = []
        """The worker ids of the current group, in group-rank order."""
        self._group_epoch: int | None = None
        self._generation = 0
        """The generation of the meeting barrier that formed the current group."""
        self._group_lease: Lease | None = None
        """This worker's registration when the current (or last) group formed: a rank that
        registered again since was failed meanwhile, and was fenced out of that group."""
        self._epoch_checked = 0
        """The newest membership epoch whose members `_members_failed` looked at."""
        self._rank = 0
        self._size = 1
        self._store: Any = None
        self._bucket: Any = None
        self._log = log.bind(worker=worker.id)

    # -- properties -------------------------------------------------------------------------------

    @property
    def rank(self) -> int:
        """This worker's rank in the current group."""
        return self._rank

    @property
    def world_size(self) -> int:
        """The size of the current group."""
        return self._size

    @property
    def membership_epoch(self) -> int | None:
        """The membership epoch the current group was formed at (None before the first)."""
        return self._group_epoch

    # -- the group --------------------------------------------------------------------------------

    def join(self) -> None:
        """Form (or join) the group now, taking the state from a peer that is ahead."""
        if self._pg is None:
            self._form()

    def _kv(self) -> Any:
        if self._store is None:
            from strata.config import load_settings
            from strata.torch.store import KVStore, RendezvousBucket, _bucket

            worker = self._worker
            kv = worker.runner.run(_bucket(worker.bus.nc, load_settings(), worker.job, 30.0))
            self._bucket = RendezvousBucket(worker.bus.nc, kv, worker.job)
            self._store = KVStore(
                self._bucket, worker.runner, worker.job, timeout=timedelta(seconds=self._timeout)
            )
        return self._store

    def _form(self) -> int:
        """Meet the live members at the barrier of the newest epoch, build the group, sync
        state; how many committed steps this rank was behind the group."""
        started = time.monotonic()
        deadline = started + self._timeout
        worker = self._worker
        previous = self._group_epoch
        self._pg = None
        if self.reformed:
            worker.set_state("recovering", step=self.step, epoch=self.epoch)
        pg: Any = None
        while True:
            if time.monotonic() >= deadline:
                raise DeadlineExceeded(
                    f"worker {worker.id!r} could not form a training group within "
                    f"{self._timeout:g}s (last group at membership epoch {previous}): are the "
                    "other workers and the registry up? raise LiveGroup(timeout=...) if they "
                    "are slow to start"
                )
            result = worker.members(retry_for=max(1.0, deadline - time.monotonic()))
            epoch = result.membership_epoch
            ids = group_members(result.members)
            if (previous is not None and epoch <= previous) or worker.id not in ids:
                time.sleep(POLL_S)  # the registry has not recorded the change yet
                continue
            going = any(m.status in ("training", "recovering") for m in result.members)
            if not self.reformed and not going and len(ids) < self._wait_for:
                time.sleep(POLL_S)
                continue
            try:
                generation = worker.barrier(
                    live_barrier(epoch),
                    timeout=min(BARRIER_S, max(0.5, deadline - time.monotonic())),
                    expected=len(ids),
                )
            except (BarrierBroken, BarrierTimeout) as exc:
                self._log.info("live_barrier_retry", membership_epoch=epoch, error=str(exc))
                continue
            rank, size = ids.index(worker.id), len(ids)
            store = dist.PrefixStore(f"live/{epoch}/{generation}", self._kv())  # type: ignore[attr-defined]
            try:
                pg = dist.ProcessGroupGloo(store, rank, size, timedelta(seconds=self._timeout))
                self._pg, self._rank, self._size = pg, rank, size
                self._peers = ids
                self._group_epoch, self._generation = epoch, generation
                behind = self._sync_state()
            except (RuntimeError, dist.DistError) as exc:
                # A member died while the group formed: wait for the registry to record it.
                # The group is dropped here, not when the next one is built: its connections
                # close, so a peer still waiting in one of its collectives fails now instead of
                # at the collective's timeout.
                self._pg = pg = None
                self._log.warning("live_group_retry", membership_epoch=epoch, error=str(exc))
                self._report_suspects(ids)
                previous = epoch
                continue
            break
        self._group_lease = worker.lease
        self.reformed += 1
        worker.set_state("training", step=self.step, epoch=self.epoch)
        self._log.info(
            "live_group_formed",
            membership_epoch=self._group_epoch,
            rank=self._rank,
            world_size=self._size,
            step=self.step,
            seconds=round(time.monotonic() - started, 3),
        )
        return behind

    def _sync_state(self) -> int:
        """Bring every rank to the state of the one furthest ahead; how many steps this rank
        was behind it."""
        mine = torch.zeros(self._size, dtype=torch.int64)
        mine[self._rank] = self.step
        self._allreduce(mine, dist.ReduceOp.SUM)
        steps = [int(s) for s in mine.tolist()]
        source = state_source(steps)
        if source is None:
            return 0
        behind = steps[source] - self.step
        payload = self._state_bytes() if self._rank == source else b""
        length = torch.tensor([len(payload)], dtype=torch.int64)
        self._broadcast(length, source)
        buffer = (
            torch.frombuffer(bytearray(payload), dtype=torch.uint8)
            if self._rank == source
            else torch.empty(int(length.item()), dtype=torch.uint8)
        )
        self._broadcast(buffer, source)
        if self._rank != source:
            before = self.step
            self._load_state(buffer.numpy().tobytes())
            if behind:
                self.healed = True
                self._log.info("live_healed", step=self.step, behind=behind, source_rank=source)
                self._report(
                    "healed", self.step, from_step=before, source_worker=self._peers[source]
                )
        return behind

    def _state_bytes(self) -> bytes:
        out = io.BytesIO()
        torch.save(
            {
                "format": STATE_FORMAT,
                "model": self._model.state_dict(),
                "optimizer": self._optimizer.state_dict(),
                "step": self.step,
                "epoch": self.epoch,
                "ledger": self.ledger,
                "floors": self._floors,
            },
            out,
        )
        return out.getvalue()

    def _load_state(self, data: bytes) -> None:
        # weights_only: tensors and plain containers, nothing that runs code.
        state = torch.load(io.BytesIO(data), weights_only=True)
        if state.get("format") != STATE_FORMAT:
            raise StrataError(f"a peer sent training state of format {state.get('format')!r}")
        self._model.load_state_dict(state["model"])
        self._optimizer.load_state_dict(state["optimizer"])
        self.step = int(state["step"])
        self.epoch = int(state["epoch"])
        self.ledger = state["ledger"]
        self._floors = {int(k): int(v) for k, v in state["floors"].items()}

    def _allreduce(self, tensor: torch.Tensor, op: Any) -> None:
        self._complete([self._start_allreduce(tensor, op)])

    def _complete(self, works: list[Any]) -> None:
        """Wait for `works` (None for a group of one), raise the first that failed."""
        works = [work for work in works if work is not None]
        self._settle(works)
        for work in works:
            work.wait()

    def _settle(self, works: list[Any]) -> None:
        """Return once every one of `works` has ended, successfully or not (`watch`); if the
        registry failed a member of the group meanwhile (a peer paused, or cut off from NATS,
        past the heartbeat timeout: the collective would wait for the group's `timeout`), park
        the group with `works` (taking them) and raise `MemberFailed`, as a collective that
        failed would."""
        gone = watch(works, self._members_failed)
        if gone:
            park(self._pg, works)
            raise MemberFailed(
                f"the registry recorded {', '.join(gone)} failed while this rank waited on a "
                f"collective of the group formed at membership epoch {self._group_epoch}"
            )

    def _members_failed(self) -> list[str]:
        """The members of the current group the registry no longer counts live: asked only
        when a membership epoch newer than the group's (and than the last one asked) was heard
        of, so a collective that simply takes long costs nothing."""
        heard = self._worker.membership_epoch
        if heard <= max(self._group_epoch or 0, self._epoch_checked):
            return []
        try:
            result = self._worker.members(retry_for=REPORT_S)
        except StrataError as exc:
            self._log.info("live_members_not_read", error=str(exc))
            return []
        self._epoch_checked = result.membership_epoch
        live = set(group_members(result.members))
        return [peer for peer in self._peers if peer not in live]

    def _fenced(self) -> str | None:
        """Why this rank must not commit the step whose collectives just completed, or None.
        A rank that stood still (paused, or cut off from NATS) past the heartbeat timeout may
        have been failed meanwhile and its peers gone on without it; a resumed peer can still
        complete the collectives the others abandoned (`park`). So: a registration other than
        the one the group formed with, or a lease that may have ended and that the registry
        does not confirm, fences the step off."""
        worker = self._worker
        lease = worker.lease
        if lease != self._group_lease:
            return "this worker registered again since its group formed (it was failed)"
        if not worker.lease_expired:
            return None
        try:
            result = worker.members(retry_for=REPORT_S)
        except StrataError as exc:
            return f"its lease may have ended and the registry could not be asked: {exc}"
        if any(
            member.worker_id == worker.id
            and member.instance == lease.instance
            and member.status not in ("failed", "left")
            for member in result.members
        ):
            return None
        return "the registry failed this worker while it stood still"

    def _start_allreduce(self, tensor: torch.Tensor, op: Any = dist.ReduceOp.SUM) -> Any:
        """Start an all-reduce of `tensor` in the group; its work (None alone)."""
        if self._size == 1:
            return None
        options = dist.AllreduceOptions()
        options.reduceOp = op
        return self._pg.allreduce([tensor], options)

    def _broadcast(self, tensor: torch.Tensor, root: int) -> None:
        if self._size == 1:
            return
        options = dist.BroadcastOptions()
        options.rootRank = root
        options.rootTensor = 0
        self._complete([self._pg.broadcast([tensor], options)])

    def _fail(self, exc: BaseException, *, training: bool = True) -> None:
        """The group's collective failed: drop the group, report its other members as suspects
        and (for a step that was training a batch, `training`) the step as discarded."""
        self._log.warning(
            "live_step_discarded" if training else "live_group_failed",
            step=self.step,
            membership_epoch=self._group_epoch,
            error=f"{type(exc).__name__}: {exc}",
            consequence="the step is trained again by the group the survivors form"
            if training
            else "no step was in flight (the group was deciding whether the epoch is done): "
            "the survivors form a new group and go on from this step",
        )
        self._pg = None
        self._report_suspects(self._peers)
        if training:
            self._report("discarded", self.step + 1, reason=f"{type(exc).__name__}: {exc}"[:1000])

    def _report(self, action: LiveAction, step: int, **details: Any) -> None:
        """Have the barrier service record what this rank did in its group (a heal, a discarded
        step) as an event, checked against the quorum it recorded. Training does not depend on
        it: a report that cannot be delivered is logged and the group goes on."""
        worker = self._worker
        if self._group_epoch is None:
            return
        request = LiveReportRequest(
            job=worker.job,
            worker_id=worker.id,
            membership_epoch=self._group_epoch,
            generation=self._generation,
            action=action,
            step=step,
            lease=worker.lease,
            **details,
        )
        try:
            worker.runner.run(
                worker.bus.rpc.call(
                    "barrier",
                    "live",
                    request,
                    result=LiveReportResult,
                    timeout=REPORT_S,
                    idempotent=True,
                )
            )
        except StrataError as exc:
            self._log.info("live_report_not_recorded", action=action, step=step, error=str(exc))

    def _report_suspects(self, peers: Sequence[str]) -> None:
        """Report the group's other members to the registry as suspects, all at once: a dead
        one (its connection gone) is recorded failed now, so the new membership epoch the
        survivors wait for comes without waiting for the heartbeat timeout. A live or paused
        peer changes nothing (`Worker.report_suspect`)."""
        others = [peer for peer in peers if peer != self._worker.id]
        if not others:
            return
        aio = self._worker.aio

        async def report_all() -> list[SuspectResult | BaseException]:
            return await asyncio.gather(
                *(aio.report_suspect(peer) for peer in others), return_exceptions=True
            )

        for peer, outcome in zip(others, self._worker.runner.run(report_all()), strict=True):
            if isinstance(outcome, SuspectResult):
                if outcome.verdict == "failed":
                    self._log.warning("live_peer_failed", suspect=peer)
                else:
                    # Alive, not live any more, or unanswered (paused, or its connection not
                    # seen closed yet): the heartbeat timeout decides.
                    self._log.info("live_peer_not_failed", suspect=peer, verdict=outcome.verdict)
            elif isinstance(outcome, Exception):
                # Not reported (the registry busy or away): the heartbeat timeout still applies.
                self._log.info("live_suspect_not_reported", suspect=peer, error=str(outcome))
            else:
                raise outcome

    # -- training ---------------------------------------------------------------------------------

    def train_epoch(
        self,
        registry: ShardSource,
        dataset_id: str,
        data: Sequence[Any],
        loss_fn: Callable[[Any], torch.Tensor],
        *,
        batch_size: int,
        epoch: int,
        collate_fn: Callable[[list[Any]], Any] = default_collate,
        shuffle_within_shard: bool = False,
        seed: int = 0,
        on_commit: Callable[[int], None] | None = None,
    ) -> EpochResult:
        """Train this rank's shards of `epoch` until the job has trained every sample of it.

        `on_commit(step)` is called after each committed step (to log metrics, for instance).

        Returns at once (with nothing trained) for an epoch the group has already finished,
        which is how a replacement that healed into a later epoch skips the ones before it.
        """

        def new_sampler() -> ShardSampler:
            return ShardSampler(
                registry,
                dataset_id,
                epoch,
                manual_ack=True,
                report_every=0,
                shuffle_within_shard=shuffle_within_shard,
                seed=seed,
            )

        sampler = new_sampler()
        indices: Iterator[int] | None = None
        pending: list[int] | None = None
        committed = discarded = samples = 0
        reformed = self.reformed
        while True:
            if self._pg is None:
                self._report_now(sampler)
                lease = self._group_lease
                behind = self._form()
                if lease is not None and lease != self._group_lease:
                    # This worker was failed and registered again: what it read under the
                    # ended lease is read again by whoever holds those shards now, from where
                    # the group's votes say they stand (healed with the state just received).
                    sampler = new_sampler()
                    indices = pending = None
                elif behind == 1 and pending is not None:
                    # This rank's vote failed where the others' passed: the step it was in,
                    # its batch included, is committed; the state just received holds it.
                    self._record(sampler, len(pending))
                    samples += len(pending)
                    pending = None
            if self.epoch > epoch:
                break
            if pending is None:
                pending = []
                for shard, offset in self._floors.items():
                    sampler.skip_to(shard, offset)
                if indices is None:
                    indices = iter(sampler)
                for index in indices:
                    pending.append(index)
                    if len(pending) == batch_size:
                        break
                else:
                    indices = None
            if self._buckets is None:
                self._buckets = GradientBuckets(self._params)
            buckets = self._buckets
            layout = VoteLayout(self._size, self.ledger.numel())
            vote = self._vote(sampler, pending, layout)
            # The vote travels while the batch trains; each bucket of gradients as soon as the
            # backward pass has made it.
            buckets.start(self._start_allreduce)
            buckets.send(vote)
            self._report_meanwhile(sampler)
            try:
                if pending:
                    loss = loss_fn(collate_fn([data[i] for i in pending]))
                    loss.backward()  # type: ignore[no-untyped-call]
            except BaseException:
                buckets.abandon()
                self._pg = None  # this rank's collectives are out of step with its peers'
                self._reported()
                raise
            try:
                buckets.finish(self._settle)
            except (RuntimeError, dist.DistError) as exc:
                self._reported()
                self._fail(exc)
                discarded += 1
                continue  # `pending` is trained again, in the next group
            self._reported()
            fenced = self._fenced()
            if fenced is not None:
                self._log.warning(
                    "live_step_fenced",
                    step=self.step,
                    membership_epoch=self._group_epoch,
                    reason=fenced,
                    consequence="the step is discarded here; this worker joins the group "
                    "again and heals from a peer, as a replacement does",
                )
                self._pg = None
                discarded += 1
                continue
            shared = shared_shards(vote, layout)
            if shared:
                if self._discard_shared(sampler, shared):
                    indices = pending = None  # a new pass fetches this worker's shards again
                discarded += 1
                continue
            total = int(vote[0].item())
            if total:
                buckets.divide(total)
                self._optimizer.step()
                if self.ledger.numel():
                    self.ledger += vote[layout.ledger].to(self.ledger.dtype)
                self._note_positions(vote[layout.positions])
                self.step += 1
                committed += 1
                samples += len(pending)
                self._acknowledge(sampler, len(pending))
                # Rides on the next heartbeat: the dashboard's step, and a joiner's sign that
                # the group is already training (it need not wait for `wait_for` workers).
                self._worker.set_state("training", step=self.step, epoch=epoch)
                if on_commit is not None:
                    on_commit(self.step)
            else:
                sampler.flush()
                done = torch.tensor([int(self._epoch_done(registry, dataset_id, epoch))])
                try:
                    self._allreduce(done, dist.ReduceOp.MIN)
                except (RuntimeError, dist.DistError) as exc:
                    self._fail(exc, training=False)
                    pending = None
                    continue
                if done.item():
                    self.epoch = epoch + 1
                    self._floors = {}
                    break
                time.sleep(IDLE_S)
            pending = None
            if int(vote[layout.epochs].max().item()) > (self._group_epoch or 0):
                self._pg = None  # someone heard of a newer membership: re-form at this boundary
        return EpochResult(epoch, committed, discarded, samples, self.reformed - reformed)

    def _discard_shared(self, sampler: ShardSampler, shared: list[int]) -> bool:
        """Discard the step whose vote shows `shared` read by two ranks (`shared_shards`);
        True when this rank's batch read one of them: it draws its batch afresh from the plan,
        which names one reader for each shard. The others train the same batch again."""
        mine = any(shard in shared for shard, _ in sampler.pending_positions())
        reason = (
            f"shards {shared[:8]} were read by two ranks in the step (the plan moved them and "
            "one rank had not heard yet)"
        )
        self._log.warning(
            "live_step_discarded",
            step=self.step,
            membership_epoch=self._group_epoch,
            error=reason,
            consequence="no rank commits the step; "
            + (
                "this rank fetches its shards again"
                if mine
                else "this rank trains the same batch again"
            ),
        )
        self._report("discarded", self.step + 1, reason=reason)
        return mine

    def _acknowledge(self, sampler: ShardSampler, count: int) -> None:
        """Acknowledge a committed step's samples; they are reported to the sharding service
        while the next step trains (`_report_meanwhile`), or before the group re-forms."""
        try:
            sampler.ack(count)
        except StaleLease as exc:
            self._progress_refused(exc)
        self._unreported = True

    def _report_meanwhile(self, sampler: ShardSampler) -> None:
        """Send the progress of the steps committed since the last report, at most every
        `PROGRESS_S`, on a thread of its own while this step trains (the sampler is not touched
        again until `_reported`): a round trip to the sharding service adds nothing to a step.
        A rank that dies before its report lands loses nothing: the votes of its committed
        steps recorded where its shards stand."""
        if not self._unreported or time.monotonic() - self._reported_at < PROGRESS_S:
            return
        self._unreported = False
        if self._reporter is None:
            self._reporter = ThreadPoolExecutor(1, thread_name_prefix="strata-live-report")
        self._report_in_flight = self._reporter.submit(self._flush, sampler)

    def _reported(self) -> None:
        """Wait for the report `_report_meanwhile` sent; raise what it raised."""
        report, self._report_in_flight = self._report_in_flight, None
        if report is not None:
            report.result()

    def _report_now(self, sampler: ShardSampler) -> None:
        """Report what is acknowledged and not reported yet (before the group re-forms)."""
        self._reported()
        if self._unreported:
            self._unreported = False
            self._flush(sampler)

    def _flush(self, sampler: ShardSampler) -> None:
        self._reported_at = time.monotonic()
        try:
            sampler.flush()
        except StaleLease as exc:
            self._progress_refused(exc)
        except BusError as exc:
            # NATS or the sharding service out of reach (this process stood still, or its
            # connection is cut): the sampler keeps what it did not report, sent again with
            # the next step's report; the votes recorded where the shards stand meanwhile.
            self._log.warning("live_progress_not_reported", step=self.step, error=str(exc))
            self._unreported = True

    def _progress_refused(self, exc: StaleLease) -> None:
        # The registry took this worker for failed meanwhile (a stall): the report is refused
        # and its shards may move, but the votes recorded where they stand, so whoever reads
        # them next starts after what the step trained.
        self._log.warning(
            "live_progress_refused",
            step=self.step,
            error=exc.message,
            consequence="the shards' positions travel in the group's votes instead",
        )

    def _record(self, sampler: ShardSampler, count: int) -> None:
        """Acknowledge a committed step's samples and report them to the sharding service."""
        self._acknowledge(sampler, count)
        self._report_now(sampler)

    def _vote(self, sampler: ShardSampler, pending: list[int], layout: VoteLayout) -> torch.Tensor:
        """This rank's part of the step's vote (`VoteLayout`)."""
        vote = torch.zeros(layout.length, dtype=torch.int64)
        vote[0] = len(pending)
        vote[layout.epochs.start + self._rank] = self._worker.membership_epoch
        positions = sampler.pending_positions()
        if len(positions) > SLOTS:
            raise ConfigError(
                f"a batch of this rank spans {len(positions)} shards, more than the {SLOTS} a "
                "step's vote records: use larger shards or smaller batches"
            )
        base = layout.positions_of(self._rank).start
        for i, (shard, offset) in enumerate(positions):
            vote[base + 2 * i] = shard + 1
            vote[base + 2 * i + 1] = offset
        if layout.audit and pending:
            vote[layout.ledger.start + torch.tensor(pending)] = 1
        return vote

    def _note_positions(self, positions: torch.Tensor) -> None:
        pairs = positions.view(-1, 2).tolist()
        for shard_plus_one, offset in pairs:
            if shard_plus_one:
                shard = int(shard_plus_one) - 1
                self._floors[shard] = max(self._floors.get(shard, 0), int(offset))

    @staticmethod
    def _epoch_done(registry: ShardSource, dataset_id: str, epoch: int) -> bool:
        summary = registry.plan(dataset_id, epoch)
        return summary.done_shards >= summary.total_shards

    def close(self) -> None:
        """Drop the group (the worker is the caller's to stop)."""
        self._pg = None
        self._report_in_flight = None
        if self._reporter is not None:
            self._reporter.shutdown(wait=True)
            self._reporter = None
