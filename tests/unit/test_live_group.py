"""The pure parts of `strata.torch.live`: which rank serves the state when a group forms, and
which members form it, in which order."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st
from strata.events.requests import MemberInfo
from strata.torch.live import group_members, state_source

steps = st.lists(st.integers(min_value=0, max_value=10_000), min_size=1, max_size=64)


@given(steps)
def test_the_source_is_the_lowest_rank_furthest_ahead(committed: list[int]) -> None:
    source = state_source(committed)
    if min(committed) == max(committed) > 0:
        assert source is None  # everyone is level: nothing to send
        return
    assert source is not None
    assert committed[source] == max(committed)
    assert all(c < committed[source] for c in committed[:source])


@given(st.integers(min_value=1, max_value=64))
def test_a_first_group_starts_from_rank_zeros_weights(size: int) -> None:
    assert state_source([0] * size) == 0


def test_a_joiner_heals_from_a_survivor_and_a_survivor_behind_by_one_catches_up() -> None:
    assert state_source([40, 0, 40]) == 0
    assert state_source([0, 40, 40]) == 1
    assert state_source([39, 40]) == 1
    assert state_source([]) is None


def member(worker_id: str, rank: int, status: str = "training") -> MemberInfo:
    return MemberInfo(
        worker_id=worker_id,
        instance=f"{worker_id}-i",
        rank=rank,
        status=status,  # type: ignore[arg-type]
        hostname="h",
        gpus=0,
        step=0,
        epoch=0,
        last_heartbeat_ts=None,
    )


def test_members_form_the_group_in_registry_rank_order_without_the_gone() -> None:
    members = [
        member("w2", 2),
        member("w0", 0),
        member("w1", 1, "failed"),
        member("w3", 3, "left"),
        member("w4", 1),
    ]
    assert group_members(members) == ["w0", "w4", "w2"]


@given(st.permutations(list(range(8))))
def test_every_member_computes_the_same_group_from_any_order(order: list[int]) -> None:
    members = [member(f"w{i}", i) for i in order]
    assert group_members(members) == [f"w{i}" for i in range(8)]


def test_a_floor_moves_a_shards_start_past_what_a_dead_rank_trained() -> None:
    from strata.events.requests import ShardAssignment
    from strata.torch.sampler import reading_queue

    assignment = ShardAssignment.model_validate(
        {
            "job": "j",
            "dataset_id": "d",
            "worker_id": "w0",
            "epoch": 0,
            "plan_version": 3,
            "world_size": 2,
            "shards": [
                {"shard_id": 4, "start": 200, "end": 250, "offset": 10, "done": False},
                {"shard_id": 9, "start": 450, "end": 500, "offset": 0, "done": False},
            ],
        }
    )
    queue = reading_queue(assignment, set(), None, {4: 30, 9: 50, 11: 7})
    assert [(q.shard_id, q.offset, q.left) for q in queue] == [(4, 30, 20), (9, 50, 0)]
    # A floor below the recorded offset changes nothing.
    assert reading_queue(assignment, set(), None, {4: 5})[0].offset == 10
