"""The sharding domain's group commit: a batch decides exactly as its requests one at a time.

`decide_all` decides each request against a fork holding the previous ones' events; the state it
is given must come out unchanged (the service's state changes only by folding what the stream
stored), and folding the batch's events must give the state that deciding one at a time gives.
"""

from __future__ import annotations

from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st
from strata.events import Event, ShardOffset, ShardProgress, WorkerFailed, WorkerRegistered
from strata.events.requests import (
    GetShardsRequest,
    RegisterDatasetRequest,
    ReportProgressRequest,
    RestoreProgressRequest,
)
from strata.services.domain import Decision
from strata.services.sharding import domain
from strata.services.sharding.domain import Command, ShardingState, snapshot

from tests.tiers import examples

JOB = "job-a"
DATASETS = ("ds", "other")
WORKERS = ("w0", "w1", "w2")
SHARDS = 8
NOW = 1_000_000_000_000


def registered(worker: str, epoch: int) -> Event:
    return WorkerRegistered(
        job=JOB,
        source="registry",
        worker_id=worker,
        instance=f"p-{worker}",
        rank=WORKERS.index(worker),
        world_size=1,
        membership_epoch=epoch,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )


def failed(worker: str, epoch: int) -> Event:
    return WorkerFailed(
        job=JOB,
        source="registry",
        worker_id=worker,
        rank=WORKERS.index(worker),
        reason="killed",
        last_heartbeat_ts=0,
        membership_epoch=epoch,
    )


_dataset = st.sampled_from(DATASETS)
_worker = st.sampled_from(WORKERS)
_epoch = st.integers(0, 3)
_shards = st.lists(st.integers(0, SHARDS - 1), max_size=3)
_partial = st.lists(
    st.builds(ShardOffset, shard_id=st.integers(0, SHARDS - 1), offset=st.integers(1, 9)),
    max_size=2,
)

_command: st.SearchStrategy[Command] = st.one_of(
    st.builds(
        RegisterDatasetRequest,
        job=st.just(JOB),
        dataset_id=_dataset,
        total_samples=st.sampled_from([SHARDS * 10, SHARDS * 10 + 5]),
        shard_size=st.just(10),
        shuffle=st.booleans(),
        seed=st.just(1),
    ),
    st.builds(
        GetShardsRequest, job=st.just(JOB), dataset_id=_dataset, worker_id=_worker, epoch=_epoch
    ),
    st.builds(
        ReportProgressRequest,
        job=st.just(JOB),
        dataset_id=_dataset,
        epoch=_epoch,
        worker_id=_worker,
        completed=_shards,
        partial=_partial,
    ),
    st.builds(
        RestoreProgressRequest,
        job=st.just(JOB),
        dataset_id=_dataset,
        epoch=_epoch,
        worker_id=_worker,
        checkpoint_step=st.integers(0, 3),
        completed=_shards,
        partial=_partial,
    ),
)
_own_report = st.tuples(
    st.just("own"), _dataset, st.integers(0, 5), st.integers(0, 5), st.integers(1, SHARDS)
)
"""A report of the first shards a member of a planned epoch holds (random reports mostly name
other workers' shards, or epochs with no plan, and are refused)."""
_membership = st.tuples(st.sampled_from(["join", "fail"]), _worker)
_history = st.lists(st.one_of(_command, _own_report, _membership), max_size=16)
_batch = st.lists(st.one_of(_command, _own_report, _own_report), max_size=12)


def resolve(state: ShardingState, step: Command | tuple[Any, ...]) -> Command:
    """The request of a history or batch step: an own report is made against `state`."""
    if not isinstance(step, tuple):
        return step
    _, dataset_id, which_epoch, which_member, count = step
    job = state.jobs.get(JOB)
    epochs = sorted(e for d, e in job.plans if d == dataset_id) if job else []
    if job is None or not epochs:
        return GetShardsRequest(
            job=JOB,
            dataset_id=dataset_id,
            worker_id="w0",
            epoch=0,
            lease=domain.current_lease(state, JOB, "w0"),
        )
    epoch = epochs[which_epoch % len(epochs)]
    plan = job.plans[(dataset_id, epoch)].plan
    worker = plan.members[which_member % len(plan.members)]
    return ReportProgressRequest(
        job=JOB,
        dataset_id=dataset_id,
        epoch=epoch,
        worker_id=worker,
        completed=plan.shards_of(worker)[:count],
        lease=domain.current_lease(state, JOB, worker),
    )


def run_history(state: ShardingState, history: list[Any]) -> None:
    """Requests decided one at a time and workers joining or failing, folded as they come."""
    epoch = 0
    for step in history:
        if isinstance(step, tuple) and step[0] != "own":
            epoch += 1
            kind, worker = step
            event = registered(worker, epoch) if kind == "join" else failed(worker, epoch)
            domain.evolve(state, event)
            for replanned in domain.replan_after_membership_change(state, JOB, NOW):
                domain.evolve(state, replanned)
        else:
            decide_one(state, resolve(state, step))


def decide_one(state: ShardingState, command: Command) -> Decision[None]:
    decision = domain.decide(state, command, NOW)
    for event in decision.events:
        domain.evolve(state, event)
    return decision


def outcome(decision: Decision[None]) -> tuple[object, ...]:
    # A progress report's id is random (the report is idempotent by its content, not its id).
    events = [
        e.model_copy(update={"id": "-"}) if isinstance(e, ShardProgress) else e
        for e in decision.events
    ]
    error = decision.error
    return (events, error and (type(error), str(error)), decision.result)


@settings(max_examples=examples(250), deadline=None)
@given(history=_history, steps=_batch)
def test_a_batch_decides_as_the_same_requests_one_at_a_time_and_leaves_the_state_alone(
    history: list[Any], steps: list[Any]
) -> None:
    state, one_at_a_time = ShardingState(), ShardingState()
    for copy in (state, one_at_a_time):
        domain.evolve(copy, registered("w0", 0))
        run_history(copy, history)
    untouched = snapshot(state)
    batch = [resolve(state, step) for step in steps]

    decisions = domain.decide_all(state, batch, NOW)

    expected = [decide_one(one_at_a_time, command) for command in batch]
    assert [outcome(d) for d in decisions] == [outcome(d) for d in expected]
    assert snapshot(state) == untouched
    for decision in decisions:
        for event in decision.events:
            domain.evolve(state, event)
    assert snapshot(state) == snapshot(one_at_a_time)


def test_an_epoch_asked_for_by_every_worker_at_once_is_planned_once() -> None:
    state = ShardingState()
    for epoch, worker in enumerate(WORKERS, start=1):
        domain.evolve(state, registered(worker, epoch))
    register = RegisterDatasetRequest(job=JOB, dataset_id="ds", total_samples=80, shard_size=10)
    asks: list[Command] = [
        GetShardsRequest(
            job=JOB,
            dataset_id="ds",
            worker_id=w,
            epoch=0,
            lease=domain.current_lease(state, JOB, w),
        )
        for w in WORKERS
    ]

    decisions = domain.decide_all(state, [register, *asks], NOW)

    events = [event.type for d in decisions for event in d.events]
    assert events == ["dataset.registered", "shard.plan_changed"]
    assert all(d.error is None for d in decisions)
    assert state.jobs[JOB].datasets == {}
