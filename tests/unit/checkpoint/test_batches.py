"""The checkpoint domain's group commit: a batch decides exactly as its requests one at a time.

`decide_all` decides each begin and ack against a fork holding the previous ones' events; the
state it is given must come out unchanged (the service's state changes only by folding what the
stream stored), each answer must be the one deciding alone would give (a begin's: the step as its
own events leave it), and folding the batch's events must give the state of one at a time.
"""

from __future__ import annotations

import copy
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from strata.events.requests import AckShardRequest, BeginCheckpointRequest, CheckpointInfo
from strata.services.checkpoint import domain
from strata.services.checkpoint.domain import BatchDecision, CheckpointState, Command
from strata.services.checkpoint.service import Checkpoints
from strata.services.domain import Decision

from tests.tiers import examples
from tests.unit.checkpoint.cases import JOB, SECOND, failed, fold, registered

NOW = 50 * SECOND
WORKERS = 4
ROOTS = ("/tmp/ckpt", "/tmp/elsewhere")

_worker = st.integers(0, WORKERS - 1)
_step = st.integers(1, 3)
_world = st.one_of(st.none(), st.tuples(st.integers(2, 5), st.integers(0, 6)))

_begin = st.builds(
    lambda step, worker, world, save, root, keep, epoch: BeginCheckpointRequest(
        job=JOB,
        worker_id=f"w{worker}",
        step=step,
        epoch=epoch,
        root_uri=root,
        keep_count=keep,
        world_size=None if world is None else world[0],
        membership_epoch=0 if world is None else world[1],
        instance=f"proc-w{worker}",
        save_id=f"save-{save}",
    ),
    _step,
    _worker,
    _world,
    st.integers(0, 1),
    st.sampled_from(ROOTS[:1] * 3 + ROOTS[1:]),
    st.sampled_from([2, 2, 2, 1]),
    st.sampled_from([0, 0, 0, 1]),
)
_ack = st.builds(
    lambda step, rank, worker, size: AckShardRequest(
        job=JOB,
        worker_id=f"w{worker}",
        step=step,
        epoch=0,
        rank=rank,
        bytes=size,
        checksum="xxh128:" + "ab" * 16,
        instance=f"proc-w{worker}",
    ),
    _step,
    _worker,
    _worker,
    st.sampled_from([100, 200]),
)
_own_ack = st.tuples(
    st.just("own"), st.integers(0, 7), st.integers(0, 7), st.sampled_from([100, 200])
)
"""An ack by a rank declared in an open step, with its own process (random acks are mostly
refused)."""
_service = st.sampled_from(["settle", "fail", "join", "time out"])
"""What the service and the registry do between requests: commit complete steps, fail or
register a worker, abort the steps past their deadline."""
_history = st.lists(st.one_of(_begin, _ack, _own_ack, _own_ack, _service), max_size=24)
_batch = st.lists(st.one_of(_begin, _begin, _own_ack, _own_ack, _ack), max_size=14)


def resolve(state: CheckpointState, step: Any) -> Command:
    if not isinstance(step, tuple):
        return step
    _, which_step, which_rank, size = step
    job = state.job(JOB)
    declared = [
        (s, r, i) for s, o in sorted(job.open.items()) for r, i in sorted(o.intents.items())
    ]
    if not declared:
        return BeginCheckpointRequest(
            job=JOB, worker_id="w0", step=1 + which_step % 3, epoch=0, root_uri=ROOTS[0]
        )
    opened_step, rank, intent = declared[(which_step * 8 + which_rank) % len(declared)]
    return AckShardRequest(
        job=JOB,
        worker_id=intent.worker_id,
        step=opened_step,
        epoch=job.open[opened_step].epoch,
        rank=rank,
        bytes=size,
        checksum="xxh128:" + "ab" * 16,
        instance=intent.instance,
    )


def decide_one(state: CheckpointState, command: Command, now_ns: int) -> BatchDecision:
    """A request decided alone, as the service did before batches, then folded."""
    if isinstance(command, AckShardRequest):
        acked = domain.ack(state, command, now_ns)
        fold(state, acked.events)
        return acked
    begun = domain.begin(state, command, now_ns)
    fold(state, begun.events)
    if begun.error is not None:
        return Decision(begun.events, begun.error)
    return Decision(begun.events, result=domain.info(state, JOB, command.step))


def run_history(state: CheckpointState, history: list[Any]) -> None:
    epoch, gone = WORKERS, 0
    for at, step in enumerate(history):
        now = (at + 1) * SECOND
        if step == "settle":
            job = state.job(JOB)
            for opened in [o for o in job.open.values() if o.complete()]:
                manifest_uri = f"{opened.root_uri}/{JOB}/MANIFEST-{opened.step}.json"
                fold(state, [domain.committed(JOB, opened, manifest_uri, now)])
            for old in domain.to_prune(job):
                fold(state, [domain.pruned(JOB, old, now)])
        elif step == "fail":
            live = sorted(state.job(JOB).live.items())
            if live:
                epoch += 1
                worker, rank = live[gone % len(live)]
                gone += 1
                fold(state, [failed(rank, epoch)])
                fold(state, domain.member_gone(state, JOB, worker, "failed", now))
        elif step == "join":
            holders = set(state.job(JOB).live.values())
            free = [rank for rank in range(WORKERS) if rank not in holders]
            if free:
                epoch += 1
                fold(state, [registered(free[0], epoch)])
        elif step == "time out":
            fold(state, domain.timeouts(state, now + 400 * SECOND))
        else:
            decide_one(state, resolve(state, step), now)


def outcome(decision: BatchDecision) -> tuple[object, ...]:
    error = decision.error
    return (decision.events, error and (type(error), str(error)), decision.result)


@settings(max_examples=examples(300), deadline=None)
@given(history=_history, steps=_batch)
def test_a_batch_decides_as_the_same_requests_one_at_a_time_and_leaves_the_state_alone(
    history: list[Any], steps: list[Any]
) -> None:
    state = CheckpointState()
    fold(state, [registered(rank, rank + 1) for rank in range(WORKERS)])
    run_history(state, history)
    batch = [resolve(state, step) for step in steps]
    untouched = copy.deepcopy(state)
    one_at_a_time = copy.deepcopy(state)

    decisions = domain.decide_all(state, batch, NOW)

    expected = [decide_one(one_at_a_time, command, NOW) for command in batch]
    assert [outcome(d) for d in decisions] == [outcome(d) for d in expected]
    assert state == untouched
    for decision in decisions:
        fold(state, decision.events)
    assert state == one_at_a_time


def test_every_rank_acking_at_once_completes_the_step_in_one_batch() -> None:
    state = CheckpointState()
    fold(state, [registered(rank, rank + 1) for rank in range(WORKERS)])
    begins: list[Command] = [
        BeginCheckpointRequest(
            job=JOB, worker_id=f"w{r}", step=5, epoch=0, root_uri=ROOTS[0], instance=f"proc-w{r}"
        )
        for r in range(WORKERS)
    ]
    begun = domain.decide_all(state, begins, NOW)
    assert [d.error for d in begun] == [None] * WORKERS
    fold(state, [event for d in begun for event in d.events])
    acks: list[Command] = [
        AckShardRequest(
            job=JOB,
            worker_id=f"w{r}",
            step=5,
            epoch=0,
            rank=r,
            bytes=10,
            checksum="xxh128:" + "cd" * 16,
            instance=f"proc-w{r}",
        )
        for r in range(WORKERS)
    ]

    acked = domain.decide_all(state, acks, NOW)

    assert [len(d.events) for d in acked] == [1] * WORKERS
    assert not state.job(JOB).open[5].acks
    fold(state, [event for d in acked for event in d.events])
    assert state.job(JOB).open[5].complete()


def test_a_begins_answer_is_the_infos_plain_data_with_the_roster_converted_once() -> None:
    service = Checkpoints()
    state = CheckpointState()
    fold(state, [registered(rank, rank + 1) for rank in range(WORKERS)])
    begins: list[Command] = [
        BeginCheckpointRequest(
            job=JOB, worker_id=f"w{r}", step=5, epoch=0, root_uri=ROOTS[0], instance=f"proc-w{r}"
        )
        for r in range(WORKERS)
    ]
    infos = [d.result for d in domain.decide_all(state, begins, NOW)]
    assert all(isinstance(info, CheckpointInfo) for info in infos)

    answers = [service.info_data(info) for info in infos if isinstance(info, CheckpointInfo)]

    assert answers == [info.model_dump(mode="python") for info in infos if info is not None]
    assert all(a["participants"] is answers[0]["participants"] for a in answers)
    assert [p["rank"] for p in answers[0]["participants"]] == list(range(WORKERS))
