"""Plans computed off the event loop: the sharding service plans a large dataset in its planner
thread before the plan event is folded, and the fold takes that plan only when its inputs are
exactly the fold's, so the state is the same as a fold that computed it itself."""

from __future__ import annotations

import threading

import numpy as np
from strata.events import DatasetRegistered, Event, ShardPlanChanged, WorkerRegistered
from strata.events.requests import GetShardsRequest
from strata.services.sharding import domain
from strata.services.sharding.domain import ShardingState
from strata.services.sharding.service import PLAN_OFF_LOOP_SHARDS, Sharding
from strata.sharding.plan import (
    PREPARED,
    DatasetSpec,
    Plan,
    PreparedPlans,
    frozen,
    initial_plan,
    replan,
)

JOB = "job-big"
DATASET = "big"
NOW = 1_000_000_000_000
SPEC = DatasetSpec("ds", total_samples=1_000, shard_size=10, shuffle=True, seed=3)


def same(a: Plan, b: Plan) -> bool:
    return (
        a.members == b.members
        and a.version == b.version
        and np.array_equal(a.owner, b.owner)
        and np.array_equal(a.position, b.position)
        and np.array_equal(a.done, b.done)
    )


def test_a_prepared_first_plan_is_taken_only_by_a_call_with_its_inputs() -> None:
    prepared = PreparedPlans()
    plan = initial_plan(SPEC, 0, ["w0", "w1"])
    prepared.put_initial(SPEC, 0, ["w1", "w0"], plan)  # members in any order, as the plan sorts
    assert prepared.take_initial(SPEC, 1, ["w0", "w1"]) is None
    assert prepared.take_initial(SPEC, 0, ["w0", "w1", "w2"]) is None
    assert prepared.take_initial(SPEC, 0, ["w0", "w1"]) is plan
    assert prepared.take_initial(SPEC, 0, ["w0", "w1"]) is None  # taken once
    assert prepared.taken == 1


def test_a_prepared_replan_is_refused_once_the_plan_it_was_made_from_has_changed() -> None:
    prepared = PreparedPlans()
    plan = initial_plan(SPEC, 0, ["w0", "w1"])
    prepared.put_replan(plan, ["w0", "w1", "w2"], replan(plan, ["w0", "w1", "w2"]), frozen(plan))
    plan.mark_done([int(plan.shards_of("w0")[0])])  # progress folded since
    assert prepared.take_replan(plan, ["w0", "w1", "w2"]) is None

    other = initial_plan(SPEC, 0, ["w0", "w1"])
    prepared.put_replan(plan, ["w0", "w1", "w2"], replan(plan, ["w0", "w1", "w2"]), frozen(plan))
    assert prepared.take_replan(other, ["w0", "w1", "w2"]) is None  # another plan object
    assert prepared.taken == 0

    expected = replan(plan, ["w0", "w2"])
    prepared.put_replan(plan, ["w2", "w0"], replan(plan, ["w0", "w2"]), frozen(plan))
    taken = prepared.take_replan(plan, ["w0", "w2"])
    assert taken is not None
    assert same(taken[0], expected[0])
    assert taken[1] == expected[1]


def test_prepared_plans_are_bounded() -> None:
    prepared = PreparedPlans(keep=2)
    plans = [initial_plan(SPEC, epoch, ["w0"]) for epoch in range(3)]
    for epoch, plan in enumerate(plans):
        prepared.put_initial(SPEC, epoch, ["w0"], plan)
    assert prepared.take_initial(SPEC, 0, ["w0"]) is None  # the oldest was let go
    assert prepared.take_initial(SPEC, 2, ["w0"]) is plans[2]


def registered(worker: str, epoch: int) -> WorkerRegistered:
    return WorkerRegistered(
        job=JOB,
        source="registry",
        worker_id=worker,
        instance=f"p-{worker}",
        rank=epoch - 1,
        world_size=epoch,
        membership_epoch=epoch,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )


def plan_events(state: ShardingState) -> list[Event]:
    request = GetShardsRequest(
        job=JOB,
        dataset_id=DATASET,
        worker_id="w0",
        epoch=0,
        lease=domain.current_lease(state, JOB, "w0"),
    )
    decision = domain.get_shards(state, request, NOW)
    assert decision.error is None, decision.error
    return decision.events


async def fold(service: Sharding, event: Event) -> None:
    """What the service's feed does with a stored event."""
    await service.prepare_fold(event)
    service.state = service.evolve(service.state, event)


async def test_the_service_folds_a_large_plan_computed_in_its_planner_thread() -> None:
    service, inline = Sharding(), ShardingState()
    planners: list[str] = []
    service._planner.submit(lambda: planners.append(threading.current_thread().name)).result()
    dataset = DatasetRegistered(
        job=JOB,
        source="sharding",
        dataset_id=DATASET,
        total_samples=PLAN_OFF_LOOP_SHARDS * 2,
        shard_size=1,
        shuffle=True,
        seed=7,
    )
    for event in (registered("w0", 1), registered("w1", 2), dataset):
        await fold(service, event)
        domain.evolve(inline, event)

    taken = PREPARED.taken
    (first,) = plan_events(service.state)
    assert isinstance(first, ShardPlanChanged)
    await fold(service, first)
    domain.evolve(inline, first)
    assert PREPARED.taken == taken + 1  # the fold took the thread's plan
    key = (DATASET, 0)
    assert same(service.state.jobs[JOB].plans[key].plan, inline.jobs[JOB].plans[key].plan)

    # A membership change: the re-plan is made in the thread too, and is the one made inline.
    joined = registered("w2", 3)
    await fold(service, joined)
    domain.evolve(inline, joined)
    await service._prepare_membership_replans(JOB)
    (changed,) = domain.replan_after_membership_change(service.state, JOB, NOW)
    assert PREPARED.taken == taken + 2  # the decision counted the moved shards from it
    assert changed == domain.replan_after_membership_change(inline, JOB, NOW)[0]
    await fold(service, changed)
    domain.evolve(inline, changed)
    assert PREPARED.taken == taken + 3
    assert same(service.state.jobs[JOB].plans[key].plan, inline.jobs[JOB].plans[key].plan)
    assert planners == ["strata-planner_0"]
