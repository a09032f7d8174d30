"""Fencing in the sharding domain: a request is decided only under the worker's current lease.

A lease is a registration (instance, membership epoch of the registration); it ends with the
worker's failure, its leave, or a newer registration of the id. A process that paused past its
heartbeat timeout comes back with an ended lease: its reads and reports are refused
(`stale_lease`), and a report naming a shard another worker finished is refused too, never
accepted silently.
"""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strata.errors import ConflictError, LeaseRequired, StaleLease
from strata.events import Event, WorkerLeft
from strata.events.requests import GetShardsRequest, Lease
from strata.services.leases import ENDED_KEPT, Leases
from strata.services.sharding import domain
from strata.services.sharding.domain import ShardingState, restore, snapshot

from tests.tiers import examples
from tests.unit.sharding.cases import (
    DATASET,
    JOB,
    NOW,
    apply,
    failed,
    lease,
    registered,
    report,
    shards_of,
    started_job,
)

"""The membership epoch `started_job` registered each worker at."""


def left(worker: str, epoch: int) -> WorkerLeft:
    return WorkerLeft(job=JOB, source="registry", worker_id=worker, rank=0, membership_epoch=epoch)


def ask(worker: str, held: Lease | None) -> GetShardsRequest:
    return GetShardsRequest(job=JOB, dataset_id=DATASET, worker_id=worker, epoch=0, lease=held)


def fold(state: ShardingState, *events: Event) -> None:
    for event in events:
        domain.evolve(state, event)
    apply_replan(state)


def apply_replan(state: ShardingState) -> None:
    for event in domain.replan_after_membership_change(state, JOB, NOW):
        domain.evolve(state, event)


def test_a_request_without_a_lease_is_refused_with_a_message_to_upgrade() -> None:
    state = started_job()
    for decision in (
        domain.get_shards(state, ask("w0", None), NOW),
        domain.report_progress(state, report("w0", None, [shards_of(state, "w0")[0]]), NOW),
    ):
        assert isinstance(decision.error, LeaseRequired)
        assert decision.error.code == "lease_required"
        assert "upgrade strata on the workers" in decision.error.message
        assert decision.events == []


def test_the_current_lease_is_accepted() -> None:
    state = started_job()
    first = shards_of(state, "w0")[0]
    events = apply(state, domain.report_progress(state, report("w0", lease("w0"), [first]), NOW))
    assert [e.type for e in events] == ["shard.progress"]
    assert domain.get_shards(state, ask("w0", lease("w0")), NOW).error is None


def test_a_failed_workers_late_report_is_refused_and_counts_nothing() -> None:
    """The zombie: paused past its timeout, failed, its shards re-planned; it wakes and reports
    the shard it was reading, under the lease it held."""
    state = started_job()
    reading = shards_of(state, "w0")[0]
    fold(state, failed("w0", 3))
    assert reading in shards_of(state, "w1")

    decision = domain.report_progress(
        state, report("w0", lease("w0"), [reading], {shards_of(state, "w1")[-1]: 5}), NOW
    )

    assert isinstance(decision.error, StaleLease)
    assert decision.error.code == "stale_lease"
    assert "was failed" in decision.error.message
    assert "not counted" in decision.error.message
    assert decision.events == []
    assert domain.get_shards(state, ask("w0", lease("w0")), NOW).error is not None


def test_a_rejoin_is_a_new_lease_and_the_old_one_stays_ended() -> None:
    state = started_job()
    fold(state, failed("w0", 3), registered("w0", "p-w0-again", 4))
    new = lease("w0", "p-w0-again", 4)

    for held in (lease("w0"), Lease(worker_id="w0", instance="p-w0", epoch=4)):
        decision = domain.get_shards(state, ask("w0", held), NOW)
        assert isinstance(decision.error, StaleLease)
        assert "registered again since" in decision.error.message
    assert domain.get_shards(state, ask("w0", new), NOW).error is None
    mine = shards_of(state, "w0")
    assert mine
    assert domain.report_progress(state, report("w0", new, mine[:1]), NOW).error is None


def test_the_same_instance_registered_again_is_a_new_lease_too() -> None:
    """An older SDK re-registers with its old instance: the epoch tells the leases apart."""
    state = started_job()
    fold(state, failed("w0", 3), registered("w0", "p-w0", 4))
    assert isinstance(domain.get_shards(state, ask("w0", lease("w0")), NOW).error, StaleLease)
    assert domain.get_shards(state, ask("w0", lease("w0", epoch=4)), NOW).error is None


def test_a_worker_that_left_holds_no_lease() -> None:
    state = started_job()
    fold(state, left("w1", 3))
    decision = domain.get_shards(state, ask("w1", lease("w1")), NOW)
    assert isinstance(decision.error, StaleLease)
    assert "was left" in decision.error.message


def test_a_lease_speaks_only_for_its_own_worker() -> None:
    state = started_job()
    theirs = shards_of(state, "w1")[0]
    decision = domain.report_progress(state, report("w1", lease("w0"), [theirs]), NOW)
    assert isinstance(decision.error, StaleLease)
    assert decision.events == []


def test_a_live_worker_may_read_another_members_shards_under_its_own_lease() -> None:
    state = started_job()
    decision = domain.get_shards(state, ask("w1", lease("w0")), NOW)
    assert decision.error is None
    assert domain.assignment(state, ask("w1", lease("w0"))).worker_id == "w1"


def test_a_report_on_a_shard_another_worker_finished_is_refused_not_ignored() -> None:
    """w0 paused and rejoined as a new instance, with the sampler state of the old one: the
    shard it was reading moved to w1, which finished it. Naming it done again is refused."""
    state = started_job()
    reading = shards_of(state, "w0")[0]
    fold(state, failed("w0", 3))
    assert reading in shards_of(state, "w1")
    apply(state, domain.report_progress(state, report("w1", lease("w1"), [reading]), NOW))
    fold(state, registered("w0", "p-w0-again", 4))

    decision = domain.report_progress(
        state, report("w0", lease("w0", "p-w0-again", 4), [reading]), NOW
    )

    assert isinstance(decision.error, ConflictError)
    assert "already finished by another worker ('w1'" in decision.error.message
    assert decision.events == []


def test_a_retried_report_of_ones_own_done_shard_is_still_a_no_op() -> None:
    state = started_job()
    first = shards_of(state, "w0")[0]
    apply(state, domain.report_progress(state, report("w0", lease("w0"), [first]), NOW))
    again = domain.report_progress(state, report("w0", lease("w0"), [first]), NOW)
    assert again.error is None
    assert again.events == []


def test_leases_survive_a_snapshot() -> None:
    state = started_job()
    fold(state, failed("w0", 3), registered("w0", "p-w0-again", 4), left("w1", 5))
    restored = restore(snapshot(state))
    assert restored.jobs[JOB].leases == state.jobs[JOB].leases
    assert domain.current_lease(restored, JOB, "w0") == lease("w0", "p-w0-again", 4)
    decision = domain.get_shards(restored, ask("w1", lease("w1")), NOW)
    assert isinstance(decision.error, StaleLease)
    assert "was left" in decision.error.message


def test_ended_leases_remembered_are_bounded() -> None:
    leases = Leases()
    for n in range(ENDED_KEPT + 10):
        leases.fold(registered(f"w{n}", "p", n))
        leases.fold(failed(f"w{n}", n + 1))
    assert len(leases.ended) == ENDED_KEPT
    assert "w0" not in leases.ended
    assert leases.current == {}


# -- the rule, as a property ----------------------------------------------------------------------

_step = st.one_of(
    st.tuples(st.just("register"), st.sampled_from(["w0", "w1"]), st.sampled_from(["a", "b"])),
    st.tuples(st.just("fail"), st.sampled_from(["w0", "w1"]), st.just("")),
    st.tuples(st.just("leave"), st.sampled_from(["w0", "w1"]), st.just("")),
)


@settings(max_examples=examples(200), deadline=None)
@given(history=st.lists(_step, max_size=12), pick=st.integers(0, 1000))
def test_a_request_is_decided_only_under_the_latest_registration_still_live(
    history: list[tuple[str, str, str]], pick: int
) -> None:
    """Whatever the history of registrations, failures and leaves, a request carrying any lease
    ever granted is refused unless it is its worker's latest one and nothing ended it since."""
    state = started_job()
    granted = [lease("w0"), lease("w1")]
    latest = {"w0": lease("w0"), "w1": lease("w1")}
    live = {"w0", "w1"}
    epoch = 2
    for kind, worker, instance in history:
        epoch += 1
        if kind == "register":
            event: Event = registered(worker, f"{worker}-{instance}", epoch)
            latest[worker] = lease(worker, f"{worker}-{instance}", epoch)
            granted.append(latest[worker])
            live.add(worker)
        elif worker not in live:
            continue  # the registry records one end per registration
        else:
            event = failed(worker, epoch) if kind == "fail" else left(worker, epoch)
            live.discard(worker)
        fold(state, event)
    held = granted[pick % len(granted)]
    expected_ok = held.worker_id in live and latest[held.worker_id] == held

    decision = domain.get_shards(state, ask(held.worker_id, held), NOW)

    if expected_ok:
        assert not isinstance(decision.error, StaleLease)
    else:
        assert isinstance(decision.error, StaleLease), decision.error
        assert decision.events == []


@pytest.mark.parametrize("held_by", ["w0", "w1"])
def test_a_batch_decides_a_lease_as_the_events_before_it_in_the_batch_leave_it(
    held_by: str,
) -> None:
    """Group commit: a report decided after a re-registration in the same history sees it."""
    state = started_job()
    fold(state, failed(held_by, 3), registered(held_by, "again", 4))
    new = lease(held_by, "again", 4)
    mine = shards_of(state, held_by)
    decisions = domain.decide_all(
        state,
        [report(held_by, lease(held_by), mine[:1]), report(held_by, new, mine[:1])],
        NOW,
    )
    assert isinstance(decisions[0].error, StaleLease)
    assert decisions[1].error is None
    assert [e.type for e in decisions[1].events] == ["shard.progress"]
