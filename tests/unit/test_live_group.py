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
