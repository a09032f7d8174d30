"""The checkpoint service's NATS adapter: begin and ack over RPC, commit, abort, retention.

Each saving worker's begin (an RPC, before it writes) opens the step or records its rank's writer;
its ack (an RPC, once the write returned) is checked against the step, and the service records
`checkpoint.shard_saved` itself, with the shard's key derived from the job, step, rank and attempt:
the event log holds only what the service decided, and no request names a file the service then
touches. The service reacts when an ack is folded in. Completing a step checks that storage holds
every acked shard at its acked size, writes the manifest to the job's storage root, then records
`checkpoint.committed` (the manifest is written first, so a crash in between only re-writes it):
the adapter reads the sizes, and the domain decides the rest in one plan (`settle_commit`), which
the adapter executes (`_execute`).
An abort records `checkpoint.aborted`, then removes the step's files under the job's root; the
root and retention of a job are fixed by its first checkpoint. After a restart, open steps that
completed or lost a participant meanwhile are settled before going live. A writer whose shard
could not be stored says so (`fail`) and the step aborts at once. Deadlines run on this process's
monotonic clock; the wall clock only stamps events and carries a deadline across a restart.

Begins and acks are decided in batches (group commit, `strata.services.commit`): when every rank
of a job saves at once, the begins (or the acks) waiting at a moment are decided in order against
a fork of the state, their events stored pipelined, and each caller answered once they are folded
in: a step of a thousand ranks is a few round trips to the stream, not a thousand. What the
service decides on its own (commit, abort, prune) is stored the same way (`publish_all`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
from strata import clock
from strata.bus import Bus, RpcServer
from strata.config import Settings
from strata.errors import NotFound, StrataError
from strata.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointShardSaved,
    WorkerFailed,
    WorkerLeft,
)
from strata.events.models import Event
from strata.events.requests import (
    ACK_SHARD,
    BEGIN_CHECKPOINT,
    CHECKPOINT_STATUS,
    SHARD_FAILED,
    AckShardRequest,
    AckShardResult,
    BeginCheckpointRequest,
    CheckpointAnswer,
    CheckpointInfo,
    CheckpointQuery,
    ShardFailedRequest,
)
from strata.services.checkpoint import domain
from strata.services.checkpoint.domain import BatchDecision, CheckpointState, Command
from strata.services.commit import MAX_BATCH, GroupCommit
from strata.services.projection import Projection
from strata.storage import StorageBackend, open_storage

log = structlog.get_logger("strata.checkpoint")

TIMEOUT_CHECK_S = 0.25
SIZE_CHECKS_IN_FLIGHT = 32
"""Shards checked in storage at once before a commit (HEAD requests, or stats)."""
RPC_CONCURRENCY = 4096
"""Requests in hand at once; each waits for its batch (see `strata.services.commit`)."""
ROSTERS_KEPT = 64
"""Open steps whose participant lists are kept in plain form for their begins' answers."""
RosterKey = tuple[str, int, int, int | None, int | None]
"""An open step's job, step, attempt, membership epoch and world size: its participants."""


class _Recording:
    """What the group commit stores a batch through: `Checkpoints.record`, so that an abort a
    request caused removes its step's files before anyone is answered."""

    def __init__(self, service: Checkpoints) -> None:
        self.lock = service.lock
        self._service = service

    async def publish_all(self, events: Sequence[Event]) -> None:
        await self._service.record(events)


class Checkpoints(Projection[CheckpointState]):
    name = "checkpoint"

    def __init__(
        self, wall: Callable[[], float] = clock.wall, *, max_batch: int = MAX_BATCH
    ) -> None:
        """`max_batch=1` decides and stores one request at a time (the benchmark's baseline)."""
        super().__init__(wall)
        self._rpc: RpcServer | None = None
        self._settings: Settings | None = None
        self._storages: dict[str, StorageBackend] = {}
        self._plain_rosters: dict[RosterKey, list[dict[str, Any]]] = {}
        self.commits: GroupCommit[Command, BatchDecision] = GroupCommit(
            _Recording(self), self._decide_all, max_batch=max_batch, prepare=self._catch_up
        )

    def initial_state(self) -> CheckpointState:
        return CheckpointState()

    def evolve(self, state: CheckpointState, event: Event) -> CheckpointState:
        # A started step's wall-clock deadline is placed on this process's monotonic clock.
        state.clock = clock.TimeBase(clock.monotonic_ns(), self.now_ns())
        return domain.evolve(state, event)

    def storage(self, root_uri: str) -> StorageBackend:
        found = self._storages.get(root_uri)
        if found is None:
            found = self._storages[root_uri] = open_storage(root_uri, self._settings)
        return found

    async def go_live(self, bus: Bus, settings: Settings) -> None:
        self._settings = settings
        async with self.lock:
            for job in list(self.state.jobs.values()):
                for opened in list(job.open.values()):
                    gone = [w for w in opened.participants if w not in job.live]
                    if opened.complete():
                        await self._commit(job.job, opened.step)
                    elif gone:
                        await self._abort(
                            domain.member_gone(
                                self.state,
                                job.job,
                                gone[0],
                                "left while the service was down",
                                self.now_ns(),
                            )
                        )
        self.spawn(self.commits.run(), "commits")
        self._rpc = await self.rpc_server(bus, settings, concurrency=RPC_CONCURRENCY)
        self._rpc.serve(BEGIN_CHECKPOINT, self._begin)
        self._rpc.serve(ACK_SHARD, self._ack)
        self._rpc.serve(SHARD_FAILED, self._failed)
        self._rpc.serve(CHECKPOINT_STATUS, self._status)
        await self._rpc.start()
        self.spawn(self._time_out(), "timeouts")

    async def before_stop(self) -> None:
        if self._rpc is not None:
            await self._rpc.stop()
        for storage in self._storages.values():
            await storage.close()

    # -- requests ---------------------------------------------------------------------------------

    def _decide_all(self, commands: list[Command]) -> list[BatchDecision]:
        decisions = domain.decide_all(self.state, commands, self.now_ns())
        for command, decision in zip(commands, decisions, strict=True):
            if isinstance(command, AckShardRequest) and decision.error is not None:
                log.warning(
                    "ack_refused",
                    job=command.job,
                    step=command.step,
                    rank=command.rank,
                    worker=command.worker_id,
                    code=decision.error.code,
                    why=decision.error.message,
                )
        return decisions

    async def _catch_up(self, commands: list[Command]) -> None:
        # The begin of a worker that has just registered must see its registration: everything
        # stored before the batch's requests arrived is folded in first, one look for the batch.
        if any(isinstance(command, BeginCheckpointRequest) for command in commands):
            await self.sync()

    async def _begin(self, request: BeginCheckpointRequest) -> dict[str, Any]:
        fixed = self.state.jobs.get(request.job)
        if fixed is None or fixed.root_uri in (None, request.root_uri):
            self.storage(request.root_uri)  # fails here, clearly, for a root it cannot use

        def answer(decision: BatchDecision) -> dict[str, Any]:
            assert isinstance(decision.result, CheckpointInfo)
            return self.info_data(decision.result)

        return await self.commits.submit(request, answer)

    def info_data(self, info: CheckpointInfo) -> dict[str, Any]:
        """The plain data of a begin's answer (`CheckpointInfo`), with the participant list of an
        open step converted once for all its ranks' answers, not once per answer: when every
        rank of a large world begins at once, that conversion was most of the service's work."""
        data = info.model_dump(mode="python", exclude={"participants"})
        key = (info.job, info.step, info.attempt, info.membership_epoch, info.world_size)
        plain = self._plain_rosters.get(key) if info.status == "open" else None
        if plain is None or len(plain) != len(info.participants):
            plain = [participant.model_dump(mode="python") for participant in info.participants]
            if info.status == "open":
                if len(self._plain_rosters) >= ROSTERS_KEPT:
                    del self._plain_rosters[next(iter(self._plain_rosters))]
                self._plain_rosters[key] = plain
        data["participants"] = plain
        return data

    async def _ack(self, request: AckShardRequest) -> AckShardResult:
        def answer(decision: BatchDecision) -> AckShardResult:
            assert isinstance(decision.result, AckShardResult)
            return domain.ack_result(self.state, request, decision.result)

        return await self.commits.submit(request, answer)

    async def _failed(self, request: ShardFailedRequest) -> dict[str, Any]:
        """A writer could not store its shard: the step aborts (its files are removed) before the
        answer, which is the step as it now stands."""
        log.warning(
            "shard_write_failed",
            job=request.job,
            step=request.step,
            rank=request.rank,
            worker=request.worker_id,
            reason=request.reason,
        )

        def answer(decision: BatchDecision) -> dict[str, Any]:
            assert isinstance(decision.result, CheckpointInfo)
            return self.info_data(decision.result)

        return await self.commits.submit(request, answer)

    async def _status(self, query: CheckpointQuery) -> CheckpointAnswer:
        job = self.state.job(query.job)
        if query.step is None:
            latest = job.latest(include_incomplete=query.include_incomplete)
            if latest is None:
                return CheckpointAnswer(found=False)
            step = latest.step
        else:
            step = query.step
        try:
            checkpoint = domain.info(self.state, query.job, step)
        except NotFound:
            return CheckpointAnswer(found=False)
        done = job.committed.get(step)
        return CheckpointAnswer(
            found=True, checkpoint=checkpoint, manifest=done.manifest if done else None
        )

    # -- reactions --------------------------------------------------------------------------------

    async def on_applied(self, event: Event) -> None:
        if isinstance(event, CheckpointShardSaved):
            await self._on_ack(event)
        elif isinstance(event, WorkerFailed | WorkerLeft):
            why = "failed" if isinstance(event, WorkerFailed) else "left the job"
            async with self.lock:
                now = self.now_ns()
                await self._abort(
                    domain.member_gone(self.state, event.job, event.worker_id, why, now)
                )

    async def _on_ack(self, ack: CheckpointShardSaved) -> None:
        # Only acks this service recorded (see `_ack`) reach here: a step no longer open was
        # settled by its commit or abort already, and has nothing left to do.
        async with self.lock:
            await self._commit(ack.job, ack.step)

    async def _commit(self, job: str, step: int) -> None:
        """Commit `step` if every rank has acked: storage is asked for the acked shards' sizes,
        the domain decides the rest at once (`domain.settle_commit`), and the plan is executed."""
        check = domain.commit_check(self.state, job, step)
        if check is None:
            return
        storage = self.storage(check.root_uri)
        sizes = await self._stored_sizes(storage, check.keys)
        await self._execute(
            domain.settle_commit(self.state, check, sizes, storage.root_uri, self.now_ns())
        )

    @staticmethod
    async def _stored_sizes(
        storage: StorageBackend, keys: Mapping[int, str]
    ) -> dict[int, int | None]:
        """Rank -> the size storage holds under its acked key (None: nothing there)."""
        limit = asyncio.Semaphore(SIZE_CHECKS_IN_FLIGHT)

        async def size(key: str) -> int | None:
            async with limit:
                return await storage.size(key)

        ranks = sorted(keys)
        sizes = await asyncio.gather(*(size(keys[rank]) for rank in ranks))
        return dict(zip(ranks, sizes, strict=True))

    async def _abort(self, events: list[Event]) -> None:
        await self.record(events)

    async def record(self, events: Sequence[Event]) -> None:
        """Store `events` pipelined and wait until they are folded in; then remove the files of
        the steps they abort (`domain.recording`)."""
        await self._execute(domain.recording(self.state, events))

    async def _execute(self, plan: domain.StoragePlan) -> None:
        """Carry out a plan the domain made, in its order (`domain.StoragePlan`)."""
        if plan.write is not None:
            data = plan.write.manifest.model_dump_json(indent=2).encode()
            await self.storage(plan.write.root_uri).write(plan.write.key, data)
        await self.publish_all(plan.record)
        for event in plan.record:
            if isinstance(event, CheckpointCommitted):
                log.info(
                    "checkpoint_committed", job=event.job, step=event.step, bytes=event.total_bytes
                )
            elif isinstance(event, CheckpointAborted):
                log.warning("checkpoint_aborted", job=event.job, reason=event.reason)
        for files in plan.delete:
            await self._cleanup(files)
        await self.publish_all(plan.record_after)

    async def _cleanup(self, files: domain.StepFiles) -> None:
        """Remove the files of an aborted or pruned step (`domain.step_files`); a failure is
        logged, never fatal."""
        try:
            await self.storage(files.root_uri).delete_prefix(files.prefix)
        except (StrataError, OSError) as exc:
            log.warning("cleanup_failed", root=files.root_uri, error=str(exc))

    async def _time_out(self) -> None:
        while True:
            await asyncio.sleep(TIMEOUT_CHECK_S)
            async with self.lock:
                expired = domain.timeouts(self.state, clock.monotonic_ns(), self.now_ns())
                await self._abort(expired)


def create() -> Checkpoints:
    return Checkpoints()
