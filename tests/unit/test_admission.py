"""The pure pieces of admission control and bounded work: token buckets driven by an injected
clock, the fair queue between jobs, the refusals' messages, the sharding quotas and the pages of
a `get_shards` answer."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st
from strata.admission import (
    OPERATOR,
    Admission,
    AdmissionLimits,
    Budgets,
    FairQueue,
    TokenBucket,
)
from strata.errors import Busy, QuotaExceeded, RateLimited, error_from_code
from strata.events import WorkerRegistered
from strata.events.requests import SHARDS_PER_REPLY, GetShardsRequest, RegisterDatasetRequest
from strata.services.sharding import domain
from strata.services.sharding.domain import ShardingLimits, ShardingState

# -- token bucket ----------------------------------------------------------------------------------


def test_a_bucket_lets_a_burst_through_then_refuses_until_it_refills() -> None:
    bucket = TokenBucket(rate=10.0, burst=5, now=100.0)
    assert [bucket.take(100.0) for _ in range(6)] == [True] * 5 + [False]
    # 0.25 s at 10/s is 2.5 tokens: two requests, not three.
    assert [bucket.take(100.25) for _ in range(3)] == [True, True, False]
    # A long pause refills to the burst, never beyond it.
    assert sum(bucket.take(1_000.0) for _ in range(20)) == 5


def test_a_clock_that_goes_back_adds_no_tokens() -> None:
    bucket = TokenBucket(rate=1.0, burst=1, now=50.0)
    assert bucket.take(50.0)
    assert not bucket.take(10.0)
    assert not bucket.take(50.5)
    assert bucket.take(51.0)


@given(
    rate=st.floats(min_value=0.5, max_value=1_000.0),
    burst=st.integers(min_value=1, max_value=100),
    steps=st.lists(st.floats(min_value=0.0, max_value=2.0), max_size=60),
)
def test_a_bucket_never_admits_more_than_its_burst_plus_what_the_elapsed_time_allows(
    rate: float, burst: int, steps: list[float]
) -> None:
    now = 0.0
    bucket = TokenBucket(rate, burst, now)
    admitted = 0
    for step in steps:
        now += step
        admitted += sum(bucket.take(now) for _ in range(3))
    assert admitted <= burst + rate * now + 1e-6


def test_budgets_forget_full_buckets_first_and_stay_bounded() -> None:
    budgets: Budgets[str] = Budgets(rate=2.0, burst=2, max_keys=3)
    assert budgets.take("idle-1", 0.0)
    assert budgets.take("idle-2", 0.0)
    assert budgets.take("busy", 0.45)
    assert budgets.take("busy", 0.45)
    # At 0.5 s the idle ones are full again and may be forgotten; the spent one is kept.
    assert budgets.take("new", 0.5)
    assert len(budgets) <= 3
    assert not budgets.take("busy", 0.5)  # still spent: forgetting it would reset its budget


def test_budgets_hold_at_most_max_keys_even_when_every_one_is_in_use() -> None:
    budgets: Budgets[int] = Budgets(rate=0.001, burst=1, max_keys=100)
    sizes = []
    for key in range(10_000):
        budgets.take(key, 0.0)
        sizes.append(len(budgets))
    assert max(sizes) <= 100
    # Room is made a quarter at a time: one scan per 25 new keys, not one per key.
    assert sum(1 for before, after in itertools.pairwise(sizes) if after < before) <= 400


# -- fair queue ------------------------------------------------------------------------------------


def test_the_fair_queue_serves_jobs_round_robin_whatever_their_backlog() -> None:
    queue: FairQueue[str, int] = FairQueue(per_key=100_000, total=1_000_000)
    for i in range(10_000):
        assert queue.push("noisy", i)
    assert queue.push("quiet", 0)
    assert queue.push("quiet", 1)
    served = [queue.pop() for _ in range(5)]
    assert served == [("noisy", 0), ("quiet", 0), ("noisy", 1), ("quiet", 1), ("noisy", 2)]
    assert len(queue) == 10_000 - 3


def test_the_fair_queue_keeps_each_jobs_order_and_skips_jobs_not_eligible() -> None:
    queue: FairQueue[str, int] = FairQueue(per_key=10, total=100)
    for i in range(3):
        queue.push("a", i)
        queue.push("b", i)
    only_b = [queue.pop(lambda key: key == "b") for _ in range(3)]
    assert only_b == [("b", 0), ("b", 1), ("b", 2)]
    assert queue.pop(lambda key: key == "b") is None
    assert [queue.pop() for _ in range(3)] == [("a", 0), ("a", 1), ("a", 2)]
    assert queue.pop() is None
    assert len(queue) == 0


def test_the_fair_queue_refuses_past_a_jobs_bound_and_past_the_total() -> None:
    queue: FairQueue[str, int] = FairQueue(per_key=2, total=3)
    assert queue.push("a", 0)
    assert queue.push("a", 1)
    assert not queue.push("a", 2)  # a's own bound
    assert queue.push("b", 0)
    assert not queue.push("c", 0)  # every job's bound together
    assert queue.queued("a") == 2
    assert queue.queued("c") == 0


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.booleans()), max_size=200))
def test_the_fair_queue_loses_and_reorders_nothing_within_a_job(
    script: list[tuple[str, bool]],
) -> None:
    queue: FairQueue[str, int] = FairQueue(per_key=1_000, total=10_000)
    pushed: dict[str, list[int]] = {}
    popped: dict[str, list[int]] = {}
    for n, (key, pop) in enumerate(script):
        if pop:
            got = queue.pop()
            if got is not None:
                popped.setdefault(got[0], []).append(got[1])
        else:
            queue.push(key, n)
            pushed.setdefault(key, []).append(n)
    while (got := queue.pop()) is not None:
        popped.setdefault(got[0], []).append(got[1])
    assert popped == pushed


@given(st.lists(st.tuples(st.sampled_from("abcd"), st.integers(0, 3)), max_size=300))
def test_a_waiting_job_is_served_before_any_other_job_is_served_twice(
    script: list[tuple[str, int]],
) -> None:
    """However long one job's backlog, a job with a request waiting gets the next turn but at
    most one of each other job waiting: the queues are drained fairly."""
    queue: FairQueue[str, int] = FairQueue(per_key=1_000, total=10_000)
    passed: dict[str, int] = {}
    """For each job waiting: the pops of other jobs since it was last served or began to wait."""
    for n, (key, pops) in enumerate(script):
        if queue.queued(key) == 0:
            passed[key] = 0
        assert queue.push(key, n)
        for _ in range(pops):
            got = queue.pop()
            assert got is not None
            served = got[0]
            for waiting in list(passed):
                if waiting == served:
                    passed[waiting] = 0
                elif queue.queued(waiting):
                    passed[waiting] += 1
                    assert passed[waiting] <= len("abcd") - 1, (waiting, passed)
            if not queue.queued(served):
                del passed[served]
            if not queue:
                break


# -- refusals --------------------------------------------------------------------------------------


def test_a_noisy_worker_spends_its_own_budget_and_its_jobs_budget_is_separate() -> None:
    limits = AdmissionLimits(job_rate=100.0, job_burst=10, worker_rate=1.0, worker_burst=3)
    admission = Admission("registry", limits)
    assert [admission.admit("a", "w0", 0.0) for _ in range(3)] == [None] * 3
    refused = admission.admit("a", "w0", 0.0)
    assert refused is not None
    assert refused.code == "rate_limited"
    assert "STRATA_RPC_WORKER_RATE" in refused.message
    assert "coordinator.admission.workerRate" in refused.message  # the chart's name for it
    assert "'w0'" in refused.message
    # Another worker of the job, and another job, still get in.
    assert admission.admit("a", "w1", 0.0) is None
    assert admission.admit("b", "w0", 0.0) is None
    # After a second, the worker's budget has one token again.
    assert admission.admit("a", "w0", 1.0) is None


def test_a_job_spread_over_many_workers_meets_its_jobs_budget() -> None:
    limits = AdmissionLimits(job_rate=1.0, job_burst=5, worker_rate=100.0, worker_burst=100)
    admission = Admission("barrier", limits)
    results = [admission.admit("a", f"w{i}", 0.0) for i in range(8)]
    assert results[:5] == [None] * 5
    refused = results[5]
    assert refused is not None
    assert refused.code == "rate_limited"
    assert "STRATA_RPC_JOB_RATE" in refused.message
    assert "coordinator.admission.jobRate" in refused.message
    assert "job 'a'" in refused.message
    assert admission.admit("b", "w0", 0.0) is None


def test_operators_have_no_budget_and_only_the_total_bounds_their_queue() -> None:
    admission = Admission("registry", AdmissionLimits(job_rate=1.0, job_burst=1))
    assert all(admission.admit(None, None, 0.0) is None for _ in range(10_000))
    queue: FairQueue[str, int] = FairQueue(per_key=2, total=5)
    assert all(queue.push(OPERATOR, i, bounded=False) for i in range(5))
    assert not queue.push(OPERATOR, 5, bounded=False)


def test_busy_names_the_bound_that_was_reached() -> None:
    admission = Admission("sharding", AdmissionLimits(job_pending=4, max_pending=10))
    assert "STRATA_RPC_JOB_PENDING" in admission.busy("a", 4, 6).message
    assert "STRATA_RPC_MAX_PENDING" in admission.busy("a", 1, 10).message


def test_refusal_codes_come_back_as_their_classes() -> None:
    assert isinstance(error_from_code("rate_limited", "x"), RateLimited)
    assert isinstance(error_from_code("rate_limited", "x"), Busy)
    assert isinstance(error_from_code("busy", "x"), Busy)
    assert isinstance(error_from_code("quota_exceeded", "x"), QuotaExceeded)


def test_the_default_limits_let_a_1000_worker_job_start_in_one_burst() -> None:
    admission = Admission("registry", AdmissionLimits())
    # Every worker registers and reads the members at once: two requests each.
    refused = [admission.admit("big", f"w{i}", 0.0) for i in range(1_000) for _ in range(2)]
    assert refused == [None] * 2_000


# -- sharding quotas and pages ---------------------------------------------------------------------

JOB = "job-a"
NOW = 1_000_000_000_000


def registered(state: ShardingState, worker: str, rank: int) -> None:
    domain.evolve(
        state,
        WorkerRegistered(
            job=JOB,
            source="registry",
            worker_id=worker,
            instance=f"p-{worker}",
            rank=rank,
            world_size=rank + 1,
            membership_epoch=rank + 1,
            heartbeat_interval=1.0,
            heartbeat_timeout=5.0,
        ),
    )


def register(
    state: ShardingState, dataset: str, shards: int, limits: ShardingLimits
) -> list[object]:
    request = RegisterDatasetRequest(
        job=JOB, dataset_id=dataset, total_samples=shards, shard_size=1, shuffle=True, seed=3
    )
    decision = domain.register_dataset(state, request, NOW, limits)
    if decision.error is not None:
        raise decision.error
    for event in decision.events:
        domain.evolve(state, event)
    return list(decision.events)


def test_a_job_reaching_its_dataset_quota_gets_quota_exceeded_naming_the_setting() -> None:
    limits = ShardingLimits(max_datasets=2, max_shards=1_000)
    state = ShardingState()
    register(state, "d0", 10, limits)
    register(state, "d1", 10, limits)
    assert register(state, "d1", 10, limits) == []  # the same one again is no new dataset
    with pytest.raises(QuotaExceeded, match="STRATA_MAX_DATASETS_PER_JOB"):
        register(state, "d2", 10, limits)


def test_a_dataset_with_more_shards_than_the_quota_is_refused() -> None:
    limits = ShardingLimits(max_datasets=10, max_shards=1_000)
    state = ShardingState()
    register(state, "fits", 1_000, limits)
    with pytest.raises(QuotaExceeded, match="STRATA_MAX_SHARDS_PER_DATASET"):
        register(state, "huge", 1_001, limits)


def test_get_shards_pages_at_the_reply_bound_and_the_pages_make_the_whole_list() -> None:
    state = ShardingState()
    registered(state, "w0", 0)
    total = 2 * SHARDS_PER_REPLY + 7
    register(state, "big", total, ShardingLimits())
    first_request = GetShardsRequest(
        job=JOB,
        dataset_id="big",
        worker_id="w0",
        epoch=0,
        lease=domain.current_lease(state, JOB, "w0"),
    )
    for event in domain.get_shards(state, first_request, NOW).events:
        domain.evolve(state, event)
    pages = []
    offset: int | None = 0
    while offset is not None:
        request = first_request.model_copy(update={"offset": offset})
        page = domain.assignment(state, request)
        assert len(page.shards) <= SHARDS_PER_REPLY
        assert page.total_shards == total
        assert page.offset == offset
        pages.append(page)
        offset = page.next_offset
    assert [len(p.shards) for p in pages] == [SHARDS_PER_REPLY, SHARDS_PER_REPLY, 7]
    every = [span.shard_id for page in pages for span in page.shards]
    plan = state.jobs[JOB].plans[("big", 0)].plan
    assert every == plan.shards_of("w0")
    assert all(span.end - span.start == 1 for page in pages for span in page.shards)
    # A smaller page on request, and the boundary: an offset at the end is an empty last page.
    small = domain.assignment(state, first_request.model_copy(update={"limit": 3}))
    assert [s.shard_id for s in small.shards] == every[:3]
    assert small.next_offset == 3
    end = domain.assignment(state, first_request.model_copy(update={"offset": total}))
    assert end.shards == []
    assert end.next_offset is None


@given(
    rate=st.floats(0.5, 1000),
    burst=st.integers(1, 10),
    extra=st.integers(1, 20),
    start=st.floats(0, 1e6),
)
def test_a_worker_refusal_holds_exactly_until_its_budget_has_a_token(
    rate: float, burst: int, extra: int, start: float
) -> None:
    """What `RpcServer` refuses from a subject's bytes alone, without asking again: every request
    of the worker until `held_for` has passed is refused, and the first after it is taken."""
    admission = Admission("svc", AdmissionLimits(worker_rate=rate, worker_burst=burst))
    refusal = None
    for _ in range(burst + extra):
        refusal = admission.admit("j", "w", start)
    assert refusal is not None
    assert refusal.code == "rate_limited"
    held = admission.held_for(refusal, "j", "w", start)
    assert 0 < held <= 1 / rate + 1e-9
    assert admission.admit("j", "w", start + held * 0.999) is refusal
    assert admission.admit("j", "w", start + held * 1.001 + 1e-9) is None
    # Only the worker's own budget holds: another refusal, or an operator, holds nothing.
    busy = admission.busy("j", 1, 1)
    assert admission.held_for(busy, "j", "w", start) == 0.0
    assert admission.held_for(refusal, "j", None, start) == 0.0
