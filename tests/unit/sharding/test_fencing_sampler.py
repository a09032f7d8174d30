"""`ShardSampler` under fencing, against the sharding domain in memory (`LocalShards`).

A sampler reads under one lease. It draws no index once that lease may have expired, checks
before every index (so before every batch, not only between shards), and after its worker
registered again it forgets what it read under the old lease and starts over from the plan.
"""

from __future__ import annotations

from collections import Counter

import pytest
from strata.errors import LeaseExpired, StaleLease
from strata.torch import ShardSampler

from tests.unit.sharding.test_sampler import DS, LocalShards, done_by

SHARD = 10


def counted_samples(shards: LocalShards) -> Counter[int]:
    """Every sample the service counts as consumed: done shards, and offsets of the others."""
    epoch_plan = shards.state.jobs["job-1"].plans[(DS, 0)]
    spec = shards.state.jobs["job-1"].datasets[DS]
    counted: Counter[int] = Counter()
    for shard in range(spec.num_shards):
        start, end = spec.shard_range(shard)[1:]
        upto = end if epoch_plan.plan.done[shard] else start + epoch_plan.offsets.get(shard, 0)
        counted.update(range(start, upto))
    return counted


def test_an_expired_lease_stops_the_drawing_mid_shard() -> None:
    shards = LocalShards(100, SHARD, ["a"], shuffle=False)
    view = shards.view("a")
    sampler = ShardSampler(view, DS, manual_ack=True, lease_wait=0.2)
    iterator = iter(sampler)
    drawn = [next(iterator) for _ in range(4)]
    assert drawn == [0, 1, 2, 3]

    view.lease_expired = True  # no heartbeat confirmed within the timeout
    with pytest.raises(LeaseExpired, match="no new registration came"):
        next(iterator)
    assert view.calls["assignment"] == 1  # not even asked: nothing drawn


def test_a_lease_in_doubt_is_settled_by_the_service_and_reading_goes_on() -> None:
    """A heartbeat confirmed after a gap: the lease may have ended. Here the registry did not
    fail the worker, so the service accepts the lease and the sampler reads on where it was."""
    shards = LocalShards(100, SHARD, ["a"], shuffle=False)
    view = shards.view("a")
    sampler = ShardSampler(view, DS, manual_ack=True)
    iterator = iter(sampler)
    first = [next(iterator) for _ in range(4)]
    view.lease_expired = view.lease_in_doubt = True

    rest = list(iterator)

    # The first fetch, the one that settled the doubt, and the last look for more at the end.
    assert view.calls["assignment"] == 3
    assert first + rest == list(range(100))


def test_a_zombie_reads_nothing_more_of_its_old_shard_and_its_late_report_is_refused() -> None:
    """Worker a pauses mid-shard past its timeout: the registry fails it, its shards go to b,
    and it registers again as a new instance. Its sampler ends the pass without drawing another
    index of the old shard, its report of what it read is refused, and the next pass reads
    from the plan. Every sample is counted exactly once."""
    shards = LocalShards(200, SHARD, ["a", "b"])
    a_view, b_view = shards.view("a"), shards.view("b")
    a = ShardSampler(a_view, DS, manual_ack=True)
    b = ShardSampler(b_view, DS, manual_ack=True)
    a_iter = iter(a)
    for _ in range(SHARD + 4):  # a shard and a bit
        next(a_iter)
    a.ack(SHARD)  # the first shard trained and reported; 4 samples in a batch in flight
    assert a.assignment is not None
    first = a.assignment.shards[0].shard_id
    assert done_by(shards, "a") == [first]
    old_lease = a.lease

    shards.fail("a")  # the registry: no heartbeat for a heartbeat timeout
    shards.join("a", instance="a-2")  # woken, it registered again: a new lease

    assert list(a_iter) == []  # the pass ends: no index of the old lease after the pause
    with pytest.raises(StaleLease, match="lease of worker 'a' that has ended"):
        a.ack(4)  # the batch in flight was read under the old lease: not counted
    assert a.flush() is None

    for _ in range(5):  # passes in turn, until neither has anything left
        for sampler in (b, a):
            for _ in sampler:
                sampler.ack(1)
    assert shards.plan_summary().done_shards == 20
    counted = counted_samples(shards)
    assert counted == Counter(range(200))
    assert a.lease is not None
    assert old_lease is not None
    assert (a.lease.instance, old_lease.instance) == ("a-2", "a")
    assert next(r for r in shards.reports if r[0] == "a") == ("a", [first], [])


def test_a_flush_under_an_ended_lease_is_refused_and_forgets_the_shard_in_progress() -> None:
    shards = LocalShards(100, SHARD, ["a", "b"], shuffle=False)
    view = shards.view("a")
    sampler = ShardSampler(view, DS)
    iterator = iter(sampler)
    for _ in range(5):
        next(iterator)
    shards.fail("a")

    with pytest.raises(StaleLease, match="was failed"):
        sampler.flush()
    assert sampler.state_dict()["current"] is None
    assert shards.plan_summary().done_shards == 0
    assert done_by(shards, "a") == []
