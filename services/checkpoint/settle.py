"""Settling a step as one decision the adapter executes (`StoragePlan`): the commit of a
complete step (`settle_commit`), and the aborts the service decides on its own (a participant
gone, a deadline passed) with the files they orphan (`recording`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import NamedTuple

from strata.events import CheckpointAborted, Event
from strata.events.requests import Manifest
from strata.services.checkpoint.fold import evolve
from strata.services.checkpoint.manifest import aborted, committed, manifest, storage_problem
from strata.services.checkpoint.retention import (
    StepFiles,
    orphaned_by,
    pruned,
    step_files,
    storage_root,
    to_prune,
)
from strata.services.checkpoint.state import CheckpointState
from strata.storage.base import manifest_key


def member_gone(
    state: CheckpointState, job_id: str, worker_id: str, why: str, now_ns: int
) -> list[Event]:
    """Abort every open checkpoint the departed worker had not acked yet."""
    job = state.jobs.get(job_id)
    if job is None:
        return []
    events: list[Event] = []
    for opened in job.open.values():
        rank = opened.participants.get(worker_id)
        if rank is not None and rank not in opened.acks:
            reason = f"participant {worker_id!r} (rank {rank}) {why} before saving its shard"
            events.append(aborted(job_id, opened, reason, now_ns))
    return events


def timeouts(state: CheckpointState, now_ns: int, wall_ns: int | None = None) -> list[Event]:
    """The aborts of steps past their deadline: `now_ns` on the deadlines' clock (monotonic in
    the service), `wall_ns` to stamp the events (`now_ns` when not given)."""
    stamp = now_ns if wall_ns is None else wall_ns
    expired = []
    for job in state.jobs.values():
        for opened in job.open.values():
            if now_ns >= opened.deadline_ns:
                limit = opened.timeout_s or (opened.deadline_ns - opened.started_ns) / 1e9
                reason = f"not every participant saved within {limit:g}s"
                expired.append(aborted(job.job, opened, reason, stamp))
    return expired


# -- settling a step: one plan, executed by the adapter --------------------------------------------


class ManifestWrite(NamedTuple):
    """The commit marker to write: `manifest` under `key` of the storage root `root_uri`."""

    root_uri: str
    key: str
    manifest: Manifest


@dataclass(frozen=True)
class StoragePlan:
    """Everything settling a step takes, decided at once; the adapter executes it in this order:

    1. write the manifest (`write`), the commit marker, before anything is recorded: a crash
       after it only writes it again;
    2. record `record` (a commit, or aborts) and wait until it is folded in;
    3. remove `delete` (an aborted step's files, pruned steps' files): a failure is logged, never
       fatal, since nothing references those files any more;
    4. record `record_after` (the prunes): files first, then the record, so a crash in between
       leaves a step that is pruned again.
    """

    write: ManifestWrite | None = None
    record: tuple[Event, ...] = ()
    delete: tuple[StepFiles, ...] = ()
    record_after: tuple[Event, ...] = ()


class CommitCheck(NamedTuple):
    """What storage must answer before a complete step commits: the size of each acked shard."""

    job: str
    step: int
    root_uri: str
    """The job's storage root (`storage_root`), where the shards and the manifest lie."""
    keys: dict[int, str]
    """Rank -> the key its shard was acked under."""


def commit_check(state: CheckpointState, job_id: str, step: int) -> CommitCheck | None:
    """The shards to look up in storage before `step` can commit; None when the step is not open
    or not every rank of its world has acked (nothing to commit yet, or settled already)."""
    job = state.jobs.get(job_id)
    opened = job.open.get(step) if job is not None else None
    if job is None or opened is None or not opened.complete():
        return None
    keys = {rank: saved.key for rank, saved in sorted(opened.acks.items())}
    return CommitCheck(job_id, step, storage_root(job, opened.root_uri), keys)


def settle_commit(
    state: CheckpointState,
    check: CommitCheck,
    sizes: Mapping[int, int | None],
    stored_root_uri: str,
    now_ns: int,
) -> StoragePlan:
    """The whole commit of a complete step, once storage has answered `check` (`sizes`: rank ->
    the size under its acked key, None for no object).

    Every acked shard whole in storage: write the manifest, record `checkpoint.committed`, then
    remove the files of the committed checkpoints retention no longer keeps (`to_prune`, as the
    job stands once the commit is folded) and record their `checkpoint.pruned`. A shard missing
    or cut short: record the step's abort and remove its files. `stored_root_uri` is the root as
    the storage backend names it (`StorageBackend.root_uri`: a local path becomes a `file://`
    URI), under which the manifest's URI is written. A step no longer open or complete (settled
    meanwhile) needs nothing.
    """
    job = state.jobs.get(check.job)
    opened = job.open.get(check.step) if job is not None else None
    if job is None or opened is None or not opened.complete():
        return StoragePlan()
    problem = storage_problem(opened, sizes)
    if problem is not None:
        return recording(state, [aborted(check.job, opened, problem, now_ns)])
    key = manifest_key(check.job, check.step)
    written = manifest(opened, check.job, now_ns)
    done = committed(check.job, opened, f"{stored_root_uri.rstrip('/')}/{key}", now_ns)
    after = CheckpointState({check.job: job.fork()}, clock=state.clock)
    evolve(after, done)
    old = to_prune(after.job(check.job))
    return StoragePlan(
        write=ManifestWrite(check.root_uri, key, written),
        record=(done,),
        delete=tuple(step_files(after.job(check.job), c.step, check.root_uri) for c in old),
        record_after=tuple(pruned(check.job, c, now_ns) for c in old),
    )


def recording(state: CheckpointState, events: Sequence[Event]) -> StoragePlan:
    """Record `events` (a batch's decisions, aborts of the service's own), then remove the files
    of the steps they abort, found while those steps are still open (`orphaned_by`)."""
    orphans = {
        files: None
        for event in events
        if isinstance(event, CheckpointAborted) and (files := orphaned_by(state, event)) is not None
    }
    return StoragePlan(record=tuple(events), delete=tuple(orphans))
