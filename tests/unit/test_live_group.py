"""The pure parts of `strata.torch.live`: which rank serves the state when a group forms, and
which members form it, in which order."""

from __future__ import annotations

from collections import Counter
from typing import Any

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from strata.events.requests import MemberInfo
from strata.torch.live import (
    SLOTS,
    GradientBuckets,
    VoteLayout,
    assign_buckets,
    group_members,
    shared_shards,
    state_source,
)

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


# -- gradient buckets and the vote ----------------------------------------------------------------

param_specs = st.lists(
    st.tuples(st.integers(min_value=1, max_value=5_000), st.sampled_from(["f32", "bf16"])),
    min_size=1,
    max_size=40,
)


@given(param_specs, st.integers(min_value=1, max_value=4_000), st.integers(1, 20_000))
def test_buckets_hold_every_parameter_once_in_backward_order(
    params: list[tuple[int, str]], first: int, cap: int
) -> None:
    buckets = assign_buckets(params, first=first, cap=cap)
    assert [i for bucket in buckets for i in bucket] == list(reversed(range(len(params))))
    for number, bucket in enumerate(buckets):
        assert bucket, "an empty bucket"
        assert len({params[i][1] for i in bucket}) == 1, "a bucket mixes dtypes"
        limit = first if number == 0 else cap
        # Closed as soon as it held its limit: without its last parameter it held less.
        assert sum(params[i][0] for i in bucket[:-1]) < limit
        if number + 1 < len(buckets):
            next_dtype = params[buckets[number + 1][0]][1]
            held = sum(params[i][0] for i in bucket)
            assert held >= limit or next_dtype != params[bucket[0]][1]


def test_a_small_first_bucket_starts_the_all_reduce_early() -> None:
    # An MLP's (weight, bias) pairs: the last layer's few bytes, then the big middle layer.
    sizes = [(32 * 2048 * 4, "f32"), (2048 * 4, "f32"), (2048 * 2048 * 4, "f32")]
    sizes += [(2048 * 4, "f32"), (2 * 2048 * 4, "f32"), (2 * 4, "f32")]
    assert assign_buckets(sizes) == [[5, 4, 3, 2], [1, 0]]


@given(st.integers(min_value=1, max_value=16), st.integers(min_value=0, max_value=100))
def test_the_votes_parts_tile_it(size: int, audit: int) -> None:
    layout = VoteLayout(size, audit)
    spans = [slice(0, 1), layout.epochs, layout.positions, layout.ledger]
    assert [s.start for s in spans[1:]] == [s.stop for s in spans[:-1]]
    assert layout.ledger.stop == layout.length
    assert layout.positions_of(0).start == layout.positions.start
    assert layout.positions_of(size - 1).stop == layout.positions.stop


def _vote_of(batches: list[list[tuple[int, int]]], layout: VoteLayout) -> torch.Tensor:
    """The summed vote of ranks whose batches end at (shard, position) each, as each rank
    fills only its own slots."""
    vote = torch.zeros(layout.length, dtype=torch.int64)
    for rank, positions in enumerate(batches):
        base = layout.positions_of(rank).start
        for i, (shard, offset) in enumerate(positions):
            vote[base + 2 * i] += shard + 1
            vote[base + 2 * i + 1] += offset
    return vote


def test_a_shard_two_ranks_read_in_one_step_is_found() -> None:
    layout = VoteLayout(3, 0)
    # Rank 0 finished shard 0 and started 49; the plan gave 49 to rank 2, which started it
    # from the same position (the group's floor) before rank 0 heard.
    vote = _vote_of([[(0, 50), (49, 8)], [(7, 16)], [(49, 8)]], layout)
    assert shared_shards(vote, layout) == [49]
    assert shared_shards(_vote_of([[(0, 50), (49, 8)], [(7, 16)], []], layout), layout) == []


@given(
    st.lists(
        # Not unique: a rank may read a shard in two runs of one batch.
        st.lists(st.integers(min_value=0, max_value=20), max_size=SLOTS),
        min_size=1,
        max_size=8,
    )
)
def test_shared_shards_are_those_in_two_ranks_batches(batches: list[list[int]]) -> None:
    layout = VoteLayout(len(batches), 0)
    vote = _vote_of([[(shard, 3) for shard in batch] for batch in batches], layout)
    readers = Counter(shard for batch in batches for shard in set(batch))
    assert shared_shards(vote, layout) == sorted(s for s, n in readers.items() if n > 1)


def _rank(
    pg: Any, model: torch.nn.Module, x: torch.Tensor, buckets: GradientBuckets
) -> list[torch.Tensor]:
    def launch(tensor: torch.Tensor) -> Any:
        return pg.allreduce([tensor])

    for _ in range(2):  # twice: the second step starts from zeroed gradients
        buckets.start(launch)
        model(x).sum().backward()
        buckets.finish()
    return [p.grad.clone() for p in model.parameters() if p.grad is not None]


def test_bucketed_all_reduce_sums_the_gradients_of_every_rank() -> None:
    """Two ranks (threads of this process, a real gloo group over a real store), each with its
    own batch: every parameter's gradient after `finish` is the sum of both ranks' gradients."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.HashStore()  # type: ignore[attr-defined]
    torch.manual_seed(0)
    models = [
        torch.nn.Sequential(torch.nn.Linear(6, 300), torch.nn.ReLU(), torch.nn.Linear(300, 3))
        for _ in range(2)
    ]
    models[1].load_state_dict(models[0].state_dict())
    batches = [torch.randn(5, 6), torch.randn(7, 6)]
    expected = []
    for p0, p1 in zip(models[0].parameters(), models[1].parameters(), strict=True):
        expected.append(
            torch.autograd.grad(models[0](batches[0]).sum(), p0)[0]
            + torch.autograd.grad(models[1](batches[1]).sum(), p1)[0]
        )
    results: dict[int, list[torch.Tensor]] = {}

    def run(rank: int) -> None:
        pg = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=30))
        # A small first bucket, so that there are several.
        params = list(models[rank].parameters())
        buckets = GradientBuckets(params, first=1_000, cap=4_000)
        results[rank] = _rank(pg, models[rank], batches[rank], buckets)

    threads = [threading.Thread(target=run, args=(rank,)) for rank in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(results) == [0, 1], "a rank did not finish"
    for rank in (0, 1):
        assert len(results[rank]) == len(expected)
        for got, want in zip(results[rank], expected, strict=True):
            torch.testing.assert_close(got, want)


def test_an_abandoned_step_is_parked_and_completes_into_buffers_no_longer_used() -> None:
    """Rank 1 stands still (a paused process) while rank 0's step waits on it; rank 0 abandons
    the step (`MemberFailed`), parking its group with the all-reduces under way. Rank 1, resumed,
    still completes them against the parked group (which is why a resumed rank must not commit
    on that alone), and they write into rank 0's old buffers, not the ones it trains with now;
    once they end, the parked group is let go."""
    import threading
    from datetime import timedelta

    import torch.distributed as dist
    from strata.torch.live import MemberFailed, park

    from tests.support import wait_until

    store = dist.HashStore()  # type: ignore[attr-defined]
    torch.manual_seed(0)
    models = [torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 2)) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    x = torch.randn(3, 4)
    groups: dict[int, Any] = {}
    formed = threading.Barrier(2)

    def form(rank: int) -> None:
        groups[rank] = dist.ProcessGroupGloo(store, rank, 2, timedelta(seconds=60))
        formed.wait(30)

    formers = [threading.Thread(target=form, args=(rank,)) for rank in range(2)]
    for thread in formers:
        thread.start()
    for thread in formers:
        thread.join(60)
    assert sorted(groups) == [0, 1], "the group did not form"

    def launch(rank: int) -> Any:
        return lambda tensor: groups[rank].allreduce([tensor])

    params0 = list(models[0].parameters())
    buckets0 = GradientBuckets(params0)
    buckets0.start(launch(0))
    models[0](x).sum().backward()
    old = [p.grad for p in params0]
    assert all(g is not None for g in old)
    own = [g.clone() for g in old if g is not None]
    pending: list[Any] = []

    def abandon(works: list[Any]) -> None:
        assert not any(work.is_completed() for work in works), "rank 1 took part already"
        pending.extend(works)
        park(groups[0], works)
        raise MemberFailed("rank 1 was failed")

    with pytest.raises(MemberFailed):
        buckets0.finish(abandon)
    parked = [t for t in threading.enumerate() if t.name == "strata-live-abandoned"]
    assert parked, "no thread holds the abandoned group"
    del groups[0]
    buckets0.start(lambda tensor: None)  # the next step, alone: its buffers are new ones
    fresh = [p.grad for p in params0]
    for before, now in zip(old, fresh, strict=True):
        assert before is not None
        assert now is not None
        assert before.data_ptr() != now.data_ptr()

    # Rank 1 resumes: its step's all-reduces meet rank 0's parked ones and complete.
    buckets1 = GradientBuckets(list(models[1].parameters()))
    buckets1.start(launch(1))
    models[1](x).sum().backward()
    buckets1.finish()
    # Rank 0's side of them may end a moment after rank 1's: the parked thread waits for it.
    wait_until(
        lambda: not any(thread.is_alive() for thread in parked), 60, "the parked group let go"
    )
    assert all(work.is_completed() for work in pending)
    for before, now, mine in zip(old, fresh, own, strict=True):
        assert before is not None
        assert now is not None
        torch.testing.assert_close(before, 2 * mine)  # the sum landed in the old buffers
        assert not now.any()  # the buffers rank 0 trains with now are untouched
