"""Properties of the shard planner: exact cover, balance, determinism, minimal movement, resume."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from strata.errors import ValidationError
from strata.sharding import DatasetSpec, Plan, initial_plan, replan, shard_order

from tests.tiers import examples

specs = st.builds(
    DatasetSpec,
    dataset_id=st.just("ds"),
    total_samples=st.integers(1, 5_000),
    shard_size=st.integers(1, 50),
    shuffle=st.booleans(),
    seed=st.integers(0, 2**63 - 1),
)
member_sets = st.sets(st.from_regex(r"w[0-9]{1,3}", fullmatch=True), min_size=1, max_size=40)


def owners(plan: Plan) -> dict[int, str]:
    return {s: w for w in plan.members for s in plan.shards_of(w)}


def open_loads(plan: Plan) -> list[int]:
    return [sum(1 for s in plan.shards_of(w) if not plan.done[s]) for w in plan.members]


@given(spec=specs, members=member_sets, epoch=st.integers(0, 1000))
def test_initial_plan_covers_every_shard_exactly_once_and_is_balanced(
    spec: DatasetSpec, members: set[str], epoch: int
) -> None:
    plan = initial_plan(spec, epoch, sorted(members))
    assigned = [s for w in plan.members for s in plan.shards_of(w)]
    assert sorted(assigned) == list(range(spec.num_shards))
    loads = list(plan.loads().values())
    assert max(loads) - min(loads) <= 1
    if spec.num_shards >= 20 * len(members):
        assert max(loads) / (spec.num_shards / len(members)) <= 1.05
    samples = sorted(i for w in plan.members for r in plan.ranges_of(w) for i in range(*r[1:]))
    assert samples == list(range(spec.total_samples))


@given(spec=specs, members=member_sets, epoch=st.integers(0, 1000))
def test_plans_are_deterministic_and_independent_of_member_order(
    spec: DatasetSpec, members: set[str], epoch: int
) -> None:
    forward = initial_plan(spec, epoch, sorted(members))
    backward = initial_plan(spec, epoch, sorted(members, reverse=True))
    assert forward.assignment() == backward.assignment()


def test_shard_order_is_pinned_for_a_seed() -> None:
    spec = DatasetSpec("ds", 100, 10, True, 42)
    # Pinned: a change of generator or seeding would silently reshuffle every resumed job.
    assert shard_order(spec, 3).tolist() == [4, 3, 7, 2, 5, 1, 9, 8, 0, 6]
    assert shard_order(spec, 0).tolist() != shard_order(spec, 1).tolist()
    natural = DatasetSpec("ds", 100, 10, False, 42)
    assert shard_order(natural, 7).tolist() == list(range(10))


@given(spec=specs, members=member_sets, epoch=st.integers(0, 50), data=st.data())
def test_a_leave_moves_exactly_the_leavers_unfinished_shards(
    spec: DatasetSpec, members: set[str], epoch: int, data: st.DataObject
) -> None:
    assume(len(members) >= 2)
    plan = initial_plan(spec, epoch, sorted(members))
    done = data.draw(st.sets(st.integers(0, spec.num_shards - 1), max_size=spec.num_shards))
    plan.mark_done(done)
    leaver = data.draw(st.sampled_from(sorted(members)))
    before = owners(plan)
    after_plan, moved = replan(plan, sorted(members - {leaver}))
    after = owners(after_plan)
    leavers_open = [s for s in plan.shards_of(leaver) if not plan.done[s]]
    assert moved == len(leavers_open)
    for shard, worker in before.items():
        if worker != leaver:
            assert after[shard] == worker
    for shard in leavers_open:
        assert after[shard] != leaver
    assert set(before) - set(after) == {s for s in plan.shards_of(leaver) if plan.done[s]}
    loads = open_loads(after_plan)
    assert max(loads) - min(loads) <= max(1, max(open_loads(plan)) - min(open_loads(plan)))


@given(spec=specs, members=member_sets, epoch=st.integers(0, 50))
def test_a_join_moves_close_to_the_optimal_share(
    spec: DatasetSpec, members: set[str], epoch: int
) -> None:
    plan = initial_plan(spec, epoch, sorted(members))
    joined, moved = replan(plan, [*members, "joiner"])
    n = len(members) + 1
    givable = sum(max(0, load - 1) for load in plan.loads().values())
    assert moved == min(spec.num_shards // n, givable)
    assert len(joined.shards_of("joiner")) == moved
    moved_from_others = {
        s for w in members for s in plan.shards_of(w) if s not in joined.shards_of(w)
    }
    assert moved_from_others == set(joined.shards_of("joiner"))
    loads = list(joined.loads().values())
    if givable >= spec.num_shards // n:
        assert max(loads) - min(loads) <= 1
    for worker in members:
        if plan.shards_of(worker):
            assert joined.shards_of(worker)[0] == plan.shards_of(worker)[0]


@given(
    spec=specs,
    members=member_sets,
    epoch=st.integers(0, 50),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 100), st.floats(0, 1)), max_size=6),
)
@settings(max_examples=examples(150))
def test_every_sample_is_consumed_exactly_once_across_failures_and_joins(
    spec: DatasetSpec,
    members: set[str],
    epoch: int,
    steps: list[tuple[bool, int, float]],
) -> None:
    """Workers read their shards in order; members fail (losing unreported work) or join."""
    plan = initial_plan(spec, epoch, sorted(members))
    consumed: list[int] = []
    live = set(members)
    for fail, pick, fraction in steps:
        # Each live worker finishes a prefix of its unfinished shards and reports it.
        for worker in sorted(live):
            pending = [s for s in plan.shards_of(worker) if not plan.done[s]]
            finished = pending[: int(len(pending) * fraction)]
            plan.mark_done(finished)
            consumed.extend(finished)
        if fail and len(live) > 1:
            live.discard(sorted(live)[pick % len(live)])
        else:
            live.add(f"j{pick}")
        plan, _ = replan(plan, sorted(live))
    for worker in sorted(live):
        pending = [s for s in plan.shards_of(worker) if not plan.done[s]]
        plan.mark_done(pending)
        consumed.extend(pending)
    assert sorted(consumed) == list(range(spec.num_shards))


def first_unfinished(plan: Plan) -> dict[str, int]:
    """The shard each member reads now: its first unfinished one in reading order."""
    firsts = {}
    for worker in plan.members:
        pending = [s for s in plan.shards_of(worker) if not plan.done[s]]
        if pending:
            firsts[worker] = pending[0]
    return firsts


@given(
    spec=specs,
    members=member_sets,
    epoch=st.integers(0, 50),
    steps=st.lists(st.tuples(st.booleans(), st.integers(0, 100), st.floats(0, 1)), max_size=8),
)
@settings(max_examples=examples(200))
def test_the_shard_a_worker_is_reading_stays_its_own_and_first(
    spec: DatasetSpec,
    members: set[str],
    epoch: int,
    steps: list[tuple[bool, int, float]],
) -> None:
    """Members read (and report) their shards in order while others fail or join: the shard a
    survivor is reading is never taken, and no shard it is given is read before it."""
    plan = initial_plan(spec, epoch, sorted(members))
    live = set(members)
    for fail, pick, fraction in steps:
        for worker in sorted(live):
            pending = [s for s in plan.shards_of(worker) if not plan.done[s]]
            plan.mark_done(pending[: int(len(pending) * fraction)])
        if fail and len(live) > 1:
            live.discard(sorted(live)[pick % len(live)])
        else:
            live.add(f"j{pick}")
        reading = first_unfinished(plan)
        plan, _ = replan(plan, sorted(live))
        after = first_unfinished(plan)
        for worker, shard in reading.items():
            if worker in live:
                assert after[worker] == shard, (worker, shard, after.get(worker))


def test_a_shard_in_progress_stays_with_its_reader_after_a_failure_and_joins() -> None:
    """Shards inherited from a failed worker come after the one the survivor is reading; by epoch
    order they came first, so a joiner took the survivor's shard in progress (its last by epoch
    order) and read its first samples again."""
    spec = DatasetSpec("ds", 44, 7, True, 0)
    plan = initial_plan(spec, 0, ["w0", "w1"])
    assert plan.shards_of("w1") == [4, 6, 0]
    plan.mark_done([4])  # w1 is now reading shard 6, not yet reported
    plan, _ = replan(plan, ["w1"])  # w0 fails: w1 inherits 2, 3, 1 and 5
    assert plan.shards_of("w1")[:2] == [4, 6]
    plan, _ = replan(plan, ["w1", "w2"])
    plan, _ = replan(plan, ["w1", "w2", "w3"])
    assert 6 in plan.shards_of("w1")
    assert first_unfinished(plan)["w1"] == 6
    assert sorted(s for w in plan.members for s in plan.shards_of(w)) == list(range(7))


def test_large_plan_meets_the_balance_bound() -> None:
    spec = DatasetSpec("big", 1_000_000, 10, True, 7)
    plan = initial_plan(spec, 0, [f"w{i}" for i in range(1000)])
    loads = np.array(list(plan.loads().values()))
    assert loads.max() / loads.mean() == 1.0
    _, moved = replan(
        initial_plan(spec, 0, [f"w{i}" for i in range(100)]),
        [
            *(f"w{i}" for i in range(100)),
            "w-new",
        ],
    )
    assert moved / spec.num_shards <= 0.0100


def test_bad_inputs_are_refused() -> None:
    spec = DatasetSpec("ds", 100, 10, False, 0)
    with pytest.raises(ValidationError, match="at least one live worker"):
        initial_plan(spec, 0, [])
    with pytest.raises(ValidationError, match="does not exist"):
        spec.shard_range(10)
    with pytest.raises(ValidationError, match="outside"):
        initial_plan(spec, 0, ["a"]).mark_done([11])
