"""The checkpoint service's pure domain: worlds, intents, acks, commit, abort, retention.

Properties: a step commits exactly when every rank of its declared world has acked (a world with
a rank no live worker holds never commits), and retention never removes the newest complete
checkpoint.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given
from hypothesis import strategies as st
from strata.errors import ConflictError, NotFound, WorkerSuperseded
from strata.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointPruned,
    CheckpointShardSaved,
    CheckpointShardStarted,
    CheckpointStarted,
    Event,
    Participant,
)
from strata.events.requests import AckShardRequest, ShardFailedRequest
from strata.services.checkpoint import domain
from strata.services.checkpoint.domain import CheckpointState
from strata.storage.base import shard_key

from tests.unit.checkpoint.cases import (
    JOB,
    ROOT,
    SECOND,
    failed,
    fold,
    registered,
    request,
    with_workers,
)


def begin(
    state: CheckpointState,
    step: int,
    worker: str = "w0",
    keep: int = 2,
    world: tuple[int, int] | None = None,
) -> None:
    decision = domain.begin(state, request(step, worker, world=world, keep=keep), step * SECOND)
    assert decision.error is None
    fold(state, decision.events)


def ack(step: int, rank: int, worker: str | None = None, epoch: int = 0) -> CheckpointShardSaved:
    worker = worker or f"w{rank}"
    key = f"{JOB}/step-{step:012d}/rank-{rank:05d}.bin"
    return CheckpointShardSaved(
        job=JOB,
        source="checkpoint",
        step=step,
        epoch=epoch,
        rank=rank,
        worker_id=worker,
        uri=f"{ROOT}/{key}",
        key=key,
        bytes=100 + rank,
        checksum="xxh128:" + "ab" * 16,
    )


def commit(state: CheckpointState, step: int) -> None:
    opened = state.job(JOB).open[step]
    assert opened.complete()
    fold(state, [domain.committed(JOB, opened, f"{ROOT}/{JOB}/step/MANIFEST.json", step * SECOND)])


def test_participants_are_frozen_when_the_step_opens() -> None:
    state = with_workers(3)
    begin(state, 10)
    opened = state.job(JOB).open[10]
    assert opened.participants == {"w0": 0, "w1": 1, "w2": 2}
    assert (opened.world_size, opened.membership_epoch) == (3, 3)
    fold(state, [registered(3, 4)])
    assert state.job(JOB).open[10].participants == {"w0": 0, "w1": 1, "w2": 2}
    # A later begin of a participant records its intent; its retry records nothing more.
    later = domain.begin(state, request(10, "w2"), 11 * SECOND)
    assert later.error is None
    assert [(type(e), getattr(e, "rank", None)) for e in later.events] == [
        (CheckpointShardStarted, 2)
    ]
    fold(state, later.events)
    assert opened.intents[2].worker_id == "w2"
    retry = domain.begin(state, request(10, "w2"), 12 * SECOND)
    assert (retry.events, retry.error) == ([], None)


def test_the_first_begin_opens_the_step_for_its_world_and_declares_its_rank() -> None:
    state = with_workers(3)
    decision = domain.begin(state, request(4, "w1", world=(3, 3)), SECOND)
    assert decision.error is None
    started, intent = decision.events
    assert isinstance(started, CheckpointStarted)
    assert (started.world_size, started.membership_epoch) == (3, 3)
    assert [p.rank for p in started.participants] == [0, 1, 2]
    assert isinstance(intent, CheckpointShardStarted)
    assert (intent.rank, intent.worker_id, intent.instance) == (1, "w1", "proc-w1")
    fold(state, decision.events)
    assert domain.info(state, JOB, 4).world_size == 3


def test_a_world_with_a_rank_no_live_worker_holds_aborts_at_once() -> None:
    state = with_workers(4)
    fold(state, [failed(1, 5)])  # live ranks 0, 2, 3: a world of 3 lacks rank 1
    decision = domain.begin(state, request(8, "w0", world=(3, 5)), 8 * SECOND)
    assert isinstance(decision.error, ConflictError)
    assert "rank 1 of the world of 3 has no live worker" in decision.error.message
    started, abort = decision.events
    assert isinstance(started, CheckpointStarted)
    assert isinstance(abort, CheckpointAborted)
    assert abort.reason == "rank 1 of the world of 3 has no live worker"
    assert abort.missing_ranks == [0, 1, 2]
    fold(state, decision.events)
    assert domain.info(state, JOB, 8).status == "aborted"
    again = domain.begin(state, request(8, "w2", world=(3, 5)), 9 * SECOND)
    assert isinstance(again.error, ConflictError)
    assert "aborted" in again.error.message
    assert again.events == []


def test_a_view_that_missed_joins_counts_them_but_one_that_missed_failures_keeps_its_world() -> (
    None
):
    joined = with_workers(4)  # the first worker still believes it is alone
    decision = domain.begin(joined, request(1, "w0", world=(1, 1)), SECOND)
    assert decision.error is None
    started = decision.events[0]
    assert isinstance(started, CheckpointStarted)
    assert (started.world_size, started.membership_epoch) == (4, 4)

    lost = with_workers(3)
    fold(lost, [failed(2, 4)])  # w0 has not heard of it yet: its world is still 3
    decision = domain.begin(lost, request(1, "w0", world=(3, 3)), SECOND)
    assert isinstance(decision.error, ConflictError)
    assert "rank 2 of the world of 3 has no live worker" in decision.error.message

    # Having heard of it, the world is the two that are left, both live: a world of its own.
    decision = domain.begin(lost, request(2, "w0", world=(2, 4)), SECOND)
    assert decision.error is None
    started = decision.events[0]
    assert isinstance(started, CheckpointStarted)
    assert started.world_size == 2


def test_a_later_begin_declaring_another_world_is_refused_naming_both() -> None:
    state = with_workers(3)
    begin(state, 6, world=(3, 3))
    fold(state, [registered(3, 4)])
    joiner = domain.begin(state, request(6, "w3", world=(4, 4)), 7 * SECOND)
    assert isinstance(joiner.error, ConflictError)
    assert "world of 3" in joiner.error.message
    assert "world of 4" in joiner.error.message
    assert joiner.events == []  # not a participant: the step goes on without it
    # A participant that has not heard of the join yet counts the same world, only late.
    late = domain.begin(state, request(6, "w2", world=(2, 2)), 7 * SECOND)
    assert late.error is None
    fold(state, late.events)
    # A participant that will not save into the world of 3 ends the step at once.
    other = domain.begin(state, request(6, "w1", world=(4, 4)), 8 * SECOND)
    assert isinstance(other.error, ConflictError)
    assert "world of 3" in other.error.message
    assert "world of 4" in other.error.message
    assert len(other.events) == 1
    assert isinstance(other.events[0], CheckpointAborted)


def test_a_begin_for_another_epoch_or_root_is_refused() -> None:
    state = with_workers(2)
    begin(state, 3)
    wrong_epoch = domain.begin(state, request(3, "w1", epoch=1), 4 * SECOND)
    assert isinstance(wrong_epoch.error, ConflictError)
    assert "epoch" in wrong_epoch.error.message
    elsewhere = request(3, "w1").model_copy(update={"root_uri": "/tmp/elsewhere"})
    wrong_root = domain.begin(state, elsewhere, 4 * SECOND)
    assert isinstance(wrong_root.error, ConflictError)
    assert "/tmp/elsewhere" in wrong_root.error.message


def test_a_rank_has_one_writer_and_one_save_per_step() -> None:
    state = with_workers(2)
    begin(state, 5)
    second_save = domain.begin(state, request(5, "w0", save_id="another-save"), 6 * SECOND)
    assert isinstance(second_save.error, ConflictError)
    assert "step 5 was already saved by rank 0; save under a later step" in str(second_save.error)
    assert second_save.events == []
    # The process that began rank 0 acks; a restart under the same worker id supersedes it.
    fold(state, [ack(5, 0), failed(0, 3), registered(0, 4, instance="i0-restarted")])
    old_process = domain.begin(state, request(6, "w0"), 6 * SECOND)
    assert isinstance(old_process.error, WorkerSuperseded)
    assert "i0-restarted" in old_process.error.message
    assert old_process.events == []
    restarted = domain.begin(state, request(5, "w0", instance="i0-restarted"), 6 * SECOND)
    assert isinstance(restarted.error, ConflictError)
    assert "rank 0 of step 5 was already declared by another process" in str(restarted.error)
    assert restarted.events == []
    # A rank acked without a recorded intent (an older client) is not written again either.
    state = with_workers(2)
    begin(state, 5)
    fold(state, [ack(5, 1)])
    again = domain.begin(state, request(5, "w1"), 6 * SECOND)
    assert isinstance(again.error, ConflictError)


def test_a_committed_or_pruned_step_is_refused_never_reopened() -> None:
    state = with_workers(1)
    for step in (1, 2):
        begin(state, step)
        fold(state, [ack(step, 0)])
        commit(state, step)
    fold(state, [CheckpointPruned(job=JOB, source="checkpoint", step=1, manifest_uri="m")])
    for step in (1, 2):
        decision = domain.begin(state, request(step, save_id="fresh"), 9 * SECOND)
        assert isinstance(decision.error, ConflictError)
        assert "already committed" in decision.error.message
        assert decision.events == []


def test_an_ack_with_another_checksum_never_replaces_the_first() -> None:
    state = with_workers(2)
    begin(state, 4)
    first = ack(4, 0)
    fold(state, [first])
    opened = state.job(JOB).open[4]
    assert domain.ack_problem(opened, first) is None  # the same ack again counts once
    other = first.model_copy(update={"checksum": "xxh128:" + "cd" * 16})
    problem = domain.ack_problem(opened, other)
    assert problem is not None
    assert "never replaces" in problem
    fold(state, [other])
    assert opened.acks[0].checksum == first.checksum


def test_storage_must_hold_every_acked_shard_at_its_acked_size() -> None:
    state = with_workers(2)
    begin(state, 2)
    fold(state, [ack(2, 0), ack(2, 1)])
    opened = state.job(JOB).open[2]
    assert domain.storage_problem(opened, {0: 100, 1: 101}) is None
    missing = domain.storage_problem(opened, {0: 100, 1: None})
    assert missing is not None
    assert "rank 1" in missing
    assert "missing" in missing
    short = domain.storage_problem(opened, {0: 7, 1: 101})
    assert short is not None
    assert "holds 7 bytes in storage, 100 were acked" in short


def test_commit_needs_every_participant_and_acks_count_once() -> None:
    state = with_workers(3)
    begin(state, 5)
    fold(state, [ack(5, 0), ack(5, 0), ack(5, 1)])
    opened = state.job(JOB).open[5]
    assert not opened.complete()
    assert opened.missing_ranks() == [2]
    fold(state, [ack(5, 2)])
    assert opened.complete()
    manifest = domain.manifest(opened, JOB, 6 * SECOND)
    assert [s.rank for s in manifest.shards] == [0, 1, 2]
    assert manifest.total_bytes == 100 + 101 + 102
    commit(state, 5)
    assert state.job(JOB).latest() is not None
    assert domain.info(state, JOB, 5).status == "committed"


def test_foreign_or_mismatched_acks_do_not_count() -> None:
    state = with_workers(2)
    begin(state, 7)
    opened = state.job(JOB).open[7]
    stranger = ack(7, 1, worker="nobody")
    wrong_rank = ack(7, 0, worker="w1")
    wrong_epoch = ack(7, 1, epoch=3)
    assert domain.ack_problem(opened, stranger) is not None
    assert domain.ack_problem(opened, wrong_rank) is not None
    assert domain.ack_problem(opened, wrong_epoch) is not None
    fold(state, [stranger, wrong_rank, wrong_epoch])
    assert opened.acks == {}


def test_failure_before_acking_aborts_and_after_acking_does_not() -> None:
    state = with_workers(3)
    begin(state, 3)
    fold(state, [ack(3, 0)])
    assert domain.member_gone(state, JOB, "w0", "failed", 4 * SECOND) == []
    events = domain.member_gone(state, JOB, "w1", "failed", 4 * SECOND)
    assert len(events) == 1
    assert isinstance(events[0], CheckpointAborted)
    assert events[0].missing_ranks == [1, 2]
    assert "w1" in events[0].reason
    fold(state, events)
    assert 3 not in state.job(JOB).open
    retry = domain.begin(state, request(3, "w0"), 5 * SECOND)
    assert isinstance(retry.error, ConflictError)


def test_timeout_aborts_at_the_deadline_not_before() -> None:
    state = with_workers(2)
    begin(state, 1)
    deadline = state.job(JOB).open[1].deadline_ns
    assert domain.timeouts(state, deadline - 1) == []
    assert len(domain.timeouts(state, deadline)) == 1


def test_retention_keeps_the_newest_and_never_the_open_ones() -> None:
    state = with_workers(1)
    for step in (1, 2, 3, 4):
        begin(state, step, keep=2)
        fold(state, [ack(step, 0)])
        commit(state, step)
    begin(state, 5, keep=2)
    pruned = [c.step for c in domain.to_prune(state.job(JOB))]
    assert pruned == [2, 1]
    assert 5 in state.job(JOB).open


def test_a_worker_that_is_not_live_cannot_open_a_step() -> None:
    state = with_workers(1)
    fold(state, [failed(0, 2)])
    decision = domain.begin(state, request(1, "w0"), SECOND)
    assert isinstance(decision.error, NotFound)


@given(st.lists(st.tuples(st.integers(0, 3), st.booleans()), max_size=30))
def test_evolve_is_idempotent_and_commits_only_complete_steps(acks: list[tuple[int, bool]]) -> None:
    state = with_workers(4)
    begin(state, 9)
    events: list[Event] = [ack(9, rank) for rank, _ in acks]
    fold(state, events)
    fold(state, events)
    opened = state.job(JOB).open[9]
    assert set(opened.acks) == {rank for rank, _ in acks}
    assert opened.complete() == (set(opened.acks) == {0, 1, 2, 3})
    started = [e for e in events if isinstance(e, CheckpointStarted | CheckpointCommitted)]
    assert started == []


def test_an_ack_pointing_outside_its_slot_is_refused() -> None:
    state = with_workers(1)
    begin(state, 2)
    opened = state.job(JOB).open[2]
    honest = ack(2, 0)
    for key, uri in (
        ("../../etc/passwd", f"{ROOT}/../../etc/passwd"),
        (honest.key, "/elsewhere/" + honest.key),
        (
            f"{JOB}/step-000000000002/rank-00001.bin",
            f"{ROOT}/{JOB}/step-000000000002/rank-00001.bin",
        ),
    ):
        forged = honest.model_copy(update={"key": key, "uri": uri})
        problem = domain.ack_problem(opened, forged)
        assert problem is not None
        assert "must be stored as" in problem
    assert domain.ack_problem(opened, honest) is None


@given(
    st.integers(1, 6),
    st.sets(st.integers(0, 7)),
    st.lists(st.integers(0, 7), max_size=12),
)
def test_a_step_commits_exactly_when_every_rank_of_its_world_acked(
    world: int, live_ranks: set[int], acked: list[int]
) -> None:
    state = CheckpointState()
    fold(state, [registered(rank, epoch) for epoch, rank in enumerate(sorted(live_ranks), 1)])
    opener = next((f"w{rank}" for rank in sorted(live_ranks)), None)
    if opener is None:
        return
    epoch = state.job(JOB).membership_epoch
    decision = domain.begin(state, request(1, opener, world=(world, epoch)), SECOND)
    fold(state, decision.events)
    fold(state, [ack(1, rank) for rank in acked])
    job = state.job(JOB)
    if not set(range(world)) <= live_ranks:
        # A rank of the world that no live worker holds: never open, never committed.
        assert isinstance(decision.error, ConflictError)
        assert 1 not in job.open
        return
    opened = job.open[1]
    assert opened.complete() == (set(range(world)) <= set(acked))
    if opened.complete():
        commit(state, 1)
        done = job.latest()
        assert done is not None
        assert done.manifest.complete
        assert [s.rank for s in done.manifest.shards] == list(range(world))


def legacy_commit(state: CheckpointState, step: int, ranks: list[int], keep: int) -> None:
    """A step as recorded before worlds were: its participants are its world."""
    participants = [Participant(worker_id=f"w{rank}", rank=rank) for rank in ranks]
    fold(
        state,
        [
            CheckpointStarted(
                job=JOB,
                source="checkpoint",
                ts=step * SECOND,
                step=step,
                epoch=0,
                root_uri=ROOT,
                participants=participants,
                keep_count=keep,
                timeout_s=60.0,
            ),
            *(ack(step, rank) for rank in ranks),
        ],
    )
    commit(state, step)


@given(
    st.lists(st.booleans(), min_size=1, max_size=12),
    st.integers(1, 4),
)
def test_retention_never_removes_the_newest_complete_checkpoint(
    completeness: list[bool], keep: int
) -> None:
    state = with_workers(4)
    for step, complete in enumerate(completeness, start=1):
        # Incomplete ones can only come from before worlds were recorded: ranks 0, 1 and 3.
        legacy_commit(state, step, [0, 1, 2] if complete else [0, 1, 3], keep)
    job = state.job(JOB)
    pruned = {c.step for c in domain.to_prune(job)}
    newest_complete = job.latest()
    newest = max(job.committed)
    assert newest not in pruned
    if newest_complete is not None:
        assert newest_complete.step not in pruned
        assert newest_complete.manifest.complete
    kept = sorted(set(job.committed) - pruned, reverse=True)
    assert kept[:keep] == sorted(job.committed, reverse=True)[:keep]
    assert len(kept) <= keep + 1


def test_the_latest_is_the_newest_complete_unless_asked_for_any() -> None:
    state = with_workers(4)
    legacy_commit(state, 1, [0, 1, 2], keep=5)
    legacy_commit(state, 2, [0, 1, 3], keep=5)  # lacks rank 2 of its world of 3
    job = state.job(JOB)
    assert job.committed[2].manifest.missing_ranks() == [2]
    latest = job.latest()
    assert latest is not None
    assert latest.step == 1
    anything = job.latest(include_incomplete=True)
    assert anything is not None
    assert anything.step == 2


def attempt_ack(step: int, rank: int, attempt: int) -> CheckpointShardSaved:
    key = shard_key(JOB, step, rank, attempt)
    return ack(step, rank).model_copy(update={"key": key, "uri": f"{ROOT}/{key}"})


def test_an_aborted_step_is_opened_again_by_a_new_save_as_its_next_attempt() -> None:
    """A job restarting from the checkpoint before reaches the same step numbers again."""
    state = with_workers(3)
    first = domain.begin(state, request(3, "w0"), 3 * SECOND)
    fold(state, first.events)
    fold(state, [attempt_ack(3, 0, 0)])
    fold(state, domain.member_gone(state, JOB, "w1", "failed", 4 * SECOND))
    fold(state, [failed(1, 4), registered(1, 5, instance="proc-w1-restarted")])

    restarted = request(3, "w1", save_id="after-restart", instance="proc-w1-restarted")
    again = domain.begin(state, restarted, 6 * SECOND)

    assert again.error is None, again.error
    started = again.events[0]
    assert isinstance(started, CheckpointStarted)
    assert started.attempt == 1
    assert started.id != first.events[0].id, "the stream would drop it as a duplicate"
    fold(state, again.events)
    assert domain.info(state, JOB, 3).attempt == 1
    opened = state.job(JOB).open[3]
    # The aborted attempt's ack is fenced off by its key; this attempt's count.
    assert domain.ack_problem(opened, attempt_ack(3, 0, 0)) is not None
    for rank in range(3):
        assert domain.ack_problem(opened, attempt_ack(3, rank, 1)) is None
        fold(state, [attempt_ack(3, rank, 1)])
    commit(state, 3)
    assert state.job(JOB).latest() is not None
    retried = domain.begin(state, request(3, "w0"), 7 * SECOND)
    assert isinstance(retried.error, ConflictError), "a committed step is never reopened"


def test_a_retry_of_a_save_that_belonged_to_the_aborted_attempt_stays_refused() -> None:
    state = with_workers(2)
    fold(state, domain.begin(state, request(3, "w0"), 3 * SECOND).events)
    fold(state, domain.member_gone(state, JOB, "w1", "failed", 4 * SECOND))
    retry = domain.begin(state, request(3, "w0"), 5 * SECOND)  # the same save id
    assert isinstance(retry.error, ConflictError)
    assert "aborted" in retry.error.message
    assert retry.events == []


# -- acks recorded by the service, and the job's fixed storage ------------------------------------


def ack_request(
    step: int, rank: int, worker: str | None = None, *, instance: str | None = None, **changes: Any
) -> AckShardRequest:
    worker = worker or f"w{rank}"
    fields: dict[str, Any] = {
        "job": JOB,
        "worker_id": worker,
        "step": step,
        "epoch": 0,
        "rank": rank,
        "bytes": 100 + rank,
        "checksum": "xxh128:" + "ab" * 16,
        "instance": instance or f"proc-{worker}",
    }
    return AckShardRequest(**(fields | changes))


def test_the_service_records_an_ack_under_the_key_it_derives_itself() -> None:
    state = with_workers(2)
    begin(state, 7)
    decision = domain.ack(state, ack_request(7, 0), 8 * SECOND)
    assert decision.error is None
    (saved,) = decision.events
    assert isinstance(saved, CheckpointShardSaved)
    key = shard_key(JOB, 7, 0)
    assert (saved.source, saved.key, saved.uri) == ("checkpoint", key, f"{ROOT}/{key}")
    assert decision.result is not None
    assert (decision.result.event_id, decision.result.key) == (saved.id, key)
    fold(state, decision.events)
    assert state.job(JOB).open[7].acks[0] == saved
    # A retry is answered the same and records nothing more.
    again = domain.ack(state, ack_request(7, 0), 9 * SECOND)
    assert (again.events, again.error, again.result) == ([], None, decision.result)


def test_an_ack_for_another_rank_undeclared_or_from_another_process_is_refused() -> None:
    state = with_workers(3)
    begin(state, 7)  # w0 opens the step and declares rank 0
    cases = [
        (ack_request(7, 1, "w0"), ConflictError, "has rank 0 in step 7, not 1"),
        (ack_request(7, 1), ConflictError, "rank 1 of step 7 was never declared"),
        (ack_request(7, 0, instance="proc-other"), WorkerSuperseded, "declared by another"),
        (ack_request(7, 0, epoch=3), ConflictError, "is of epoch 0, not 3"),
        (ack_request(8, 0), NotFound, "no open checkpoint of step 8"),
    ]
    for request_, kind, says in cases:
        decision = domain.ack(state, request_, 8 * SECOND)
        assert isinstance(decision.error, kind), request_
        assert says in decision.error.message
        assert decision.events == []
    fold(state, [*domain.ack(state, ack_request(7, 0), 8 * SECOND).events])
    other = domain.ack(state, ack_request(7, 0, checksum="xxh128:" + "cd" * 16), 9 * SECOND)
    assert isinstance(other.error, ConflictError)
    assert "never replaces" in other.error.message


def test_a_retried_ack_after_the_commit_gets_its_answer_and_a_stranger_does_not() -> None:
    state = with_workers(1)
    begin(state, 2)
    first = domain.ack(state, ack_request(2, 0), 3 * SECOND)
    fold(state, first.events)
    commit(state, 2)
    retried = domain.ack(state, ack_request(2, 0), 4 * SECOND)
    assert retried.error is None
    assert retried.events == []
    assert retried.result is not None
    assert (retried.result.status, retried.result.event_id) == ("committed", first.events[0].id)
    changed = domain.ack(state, ack_request(2, 0, bytes=1), 4 * SECOND)
    assert isinstance(changed.error, ConflictError)
    assert "already committed" in changed.error.message


def test_an_ack_of_an_aborted_step_is_refused_with_why_it_was_aborted() -> None:
    state = with_workers(2)
    begin(state, 3)
    fold(state, domain.member_gone(state, JOB, "w1", "failed", 4 * SECOND))
    decision = domain.ack(state, ack_request(3, 0), 5 * SECOND)
    assert isinstance(decision.error, ConflictError)
    assert "aborted" in decision.error.message
    assert "failed" in decision.error.message


def test_a_jobs_root_and_keep_count_are_fixed_by_its_first_checkpoint() -> None:
    state = with_workers(1)
    begin(state, 1, keep=3)
    job = state.job(JOB)
    assert (job.root_uri, job.keep_count) == (ROOT, 3)
    for changed in ({"root_uri": "/tmp/victim"}, {"keep_count": 1}):
        asked = request(2, keep=3).model_copy(update=changed)
        decision = domain.begin(state, asked, 2 * SECOND)
        assert isinstance(decision.error, ConflictError)
        message = decision.error.message
        assert f"keeps its checkpoints in {ROOT} with keep_count=3" in message
        assert f"asks for {asked.root_uri} with keep_count={asked.keep_count}" in message
        assert decision.events == []
    # Aborted or committed, the first checkpoint's choice stays the job's.
    fold(state, domain.member_gone(state, JOB, "w0", "failed", 3 * SECOND))
    fold(state, [registered(0, 3, instance="again")])
    elsewhere = request(4, keep=3, instance="again").model_copy(update={"root_uri": "/x"})
    assert isinstance(domain.begin(state, elsewhere, 4 * SECOND).error, ConflictError)
    assert domain.begin(state, request(4, keep=3, instance="again"), 4 * SECOND).error is None


def test_retention_counts_with_the_jobs_keep_count_and_deletes_under_its_root() -> None:
    state = with_workers(1)
    for step in (1, 2, 3):
        begin(state, step, keep=2)
        fold(state, [ack(step, 0)])
        commit(state, step)
    job = state.job(JOB)
    assert [c.step for c in domain.to_prune(job)] == [1]
    assert domain.storage_root(job, "/ignored") == ROOT
    assert domain.storage_root(CheckpointState().job("new"), "/fallback") == "/fallback"


def failure(
    step: int, rank: int, worker: str | None = None, instance: str | None = None
) -> ShardFailedRequest:
    worker = worker or f"w{rank}"
    return ShardFailedRequest(
        job=JOB,
        worker_id=worker,
        step=step,
        epoch=0,
        rank=rank,
        reason="[Errno 28] No space left on device",
        instance=instance or f"proc-{worker}",
    )


def test_a_failed_write_reported_by_its_declared_writer_aborts_the_step_at_once() -> None:
    state = with_workers(2)
    begin(state, 5, "w0")
    begin(state, 5, "w1")
    # Only the rank's declared writer, from the declaring process, can end the step.
    refused = domain.fail(state, failure(5, 1, worker="w0"), 6 * SECOND)
    assert isinstance(refused.error, ConflictError)
    superseded = domain.fail(state, failure(5, 1, instance="proc-old"), 6 * SECOND)
    assert isinstance(superseded.error, WorkerSuperseded)
    [abort] = domain.fail(state, failure(5, 1), 6 * SECOND).events
    assert isinstance(abort, CheckpointAborted)
    assert "rank 1 could not write its shard: [Errno 28] No space left" in abort.reason
    fold(state, [abort])
    assert domain.info(state, JOB, 5).status == "aborted"
    assert domain.fail(state, failure(5, 1), 7 * SECOND).events == []  # a retry: settled


def test_a_failure_report_after_the_rank_acked_or_the_step_committed_changes_nothing() -> None:
    state = with_workers(2)
    begin(state, 5, "w0")
    begin(state, 5, "w1")
    fold(state, [ack(5, 0)])
    assert domain.fail(state, failure(5, 0), 6 * SECOND) == domain.Decision()
    fold(state, [ack(5, 1)])
    commit(state, 5)
    assert domain.fail(state, failure(5, 1), 7 * SECOND) == domain.Decision()
    assert domain.info(state, JOB, 5).status == "committed"
