"""Where a job's step files lie, and which committed checkpoints retention removes: the newest
`keep_count`, never the latest one nor the newest complete one, are kept.
"""

from __future__ import annotations

from typing import NamedTuple

from strata.events import CheckpointPruned, Event
from strata.events.ids import event_id
from strata.services.checkpoint.state import (
    SOURCE,
    CheckpointState,
    CommittedCheckpoint,
    JobCheckpoints,
)
from strata.storage.base import step_prefix


def to_prune(job: JobCheckpoints) -> list[CommittedCheckpoint]:
    """Committed checkpoints beyond the job's `keep_count` newest, never the latest one nor the
    newest complete one (the checkpoint a restart resumes from)."""
    latest = job.latest(include_incomplete=True)
    if latest is None:
        return []
    resume_from = job.latest()
    kept = None if resume_from is None else resume_from.step
    keep = job.keep_count if job.keep_count is not None else latest.keep_count
    newest_first = sorted(job.committed.values(), key=lambda c: c.step, reverse=True)
    return [c for c in newest_first[max(1, keep) :] if c.step != kept]


def storage_root(job: JobCheckpoints, fallback: str) -> str:
    """The root the service writes and deletes under for `job`: the one its first checkpoint
    recorded (`fallback` only for a job none was folded for, which has nothing to delete)."""
    return job.root_uri if job.root_uri is not None else fallback


class StepFiles(NamedTuple):
    """Where the files of one step lie: a storage root and the step's key prefix under it."""

    root_uri: str
    prefix: str


def step_files(job: JobCheckpoints, step: int, fallback_root: str) -> StepFiles:
    """The files of `step`, under the job's recorded root (`storage_root`)."""
    return StepFiles(storage_root(job, fallback_root), step_prefix(job.job, step))


def orphaned_by(state: CheckpointState, abort: Event) -> StepFiles | None:
    """The files an abort leaves that no checkpoint will reference: its step's, under the job's
    root. Asked before the abort is folded, while the step is open; None when it was not open
    (an abort recorded at a begin, before anyone wrote): then nothing was written for it."""
    job = state.job(abort.job)
    opened = job.open.get(getattr(abort, "step", -1))
    return None if opened is None else step_files(job, opened.step, opened.root_uri)


def pruned(job: str, old: CommittedCheckpoint, now_ns: int) -> Event:
    return CheckpointPruned(
        id=event_id("ckpt-pruned", job, old.step),
        job=job,
        source=SOURCE,
        ts=now_ns,
        step=old.step,
        manifest_uri=old.manifest_uri,
    )
