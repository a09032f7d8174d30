"""Live recovery as the barrier service records it: a quorum at each release of a live group's
meeting barrier (`live-<epoch>`), and the heals and discarded steps its members report, checked
against that quorum. Pure domain, composed as the service composes it, with a clock the test
holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from strata.errors import Forbidden, NotFound, StrataError
from strata.events import (
    Event,
    LiveHealed,
    LiveQuorumFormed,
    LiveStepDiscarded,
    WorkerFailed,
    WorkerRegistered,
)
from strata.events.requests import (
    ArriveRequest,
    LiveReportRequest,
    live_barrier,
    live_barrier_epoch,
)
from strata.services.barrier import domain
from strata.services.barrier.domain import BarrierState

from tests.tiers import examples

JOB = "job-live"
NOW = 1_700_000_000 * 10**9


@dataclass
class Driver:
    """Registrations, departures and arrivals folded as the service folds them; `log` is what
    the stream would hold."""

    now: int = NOW
    state: BarrierState = field(default_factory=BarrierState)
    log: list[Event] = field(default_factory=list)
    ranks: dict[str, int] = field(default_factory=dict)
    epoch: int = 0

    def fold(self, events: list[Event]) -> None:
        for event in events:
            domain.evolve(self.state, event)
            self.log.append(event)

    def register(self, worker: str) -> None:
        self.epoch += 1
        rank = self.ranks.setdefault(worker, len(self.ranks))
        self.fold(
            [
                WorkerRegistered(
                    job=JOB,
                    source="registry",
                    ts=self.now,
                    worker_id=worker,
                    instance=f"proc-{worker}",
                    rank=rank,
                    world_size=len(self.ranks),
                    membership_epoch=self.epoch,
                    heartbeat_interval=1.0,
                    heartbeat_timeout=5.0,
                )
            ]
        )

    def gone(self, worker: str) -> None:
        self.epoch += 1
        failed = WorkerFailed(
            job=JOB,
            source="registry",
            ts=self.now,
            worker_id=worker,
            rank=self.ranks[worker],
            reason="its connection closed",
            last_heartbeat_ts=self.now,
            membership_epoch=self.epoch,
        )
        self.fold([failed])
        self.fold(domain.member_gone(self.state, JOB, worker, "failed", self.now))

    def arrive(self, worker: str, name: str, arrival: int, expected: int) -> StrataError | None:
        request = ArriveRequest(
            job=JOB, name=name, worker_id=worker, arrival=arrival, expected_count=expected
        )
        self.fold(domain.conclude(self.state, JOB, name, self.now))
        decision = domain.arrive(self.state, request, self.now)
        if decision.error is not None:
            return decision.error
        self.fold(decision.events)
        self.fold(domain.conclude(self.state, JOB, name, self.now))
        return None


def quorums(driver: Driver) -> list[LiveQuorumFormed]:
    return [e for e in driver.log if isinstance(e, LiveQuorumFormed)]


def meet(driver: Driver, workers: list[str], epoch: int, arrival: int) -> None:
    for worker in workers:
        refused = driver.arrive(worker, live_barrier(epoch), arrival, len(workers))
        assert refused is None, refused


def report(driver: Driver, worker: str, epoch: int, generation: int, **fields: Any) -> Any:
    request = LiveReportRequest(
        job=fields.pop("job", JOB),
        worker_id=worker,
        membership_epoch=epoch,
        generation=generation,
        **fields,
    )
    decision = domain.report_live(driver.state, request, driver.now)
    if decision.error is not None:
        return decision.error
    driver.fold(decision.events)
    return decision.events


def test_live_barrier_names_round_trip_and_other_names_are_not_live() -> None:
    assert live_barrier_epoch(live_barrier(17)) == 17
    for name in ("live", "live-", "live-x1", "epoch-end", "alive-3", "live-1-2"):
        assert live_barrier_epoch(name) is None


def test_each_release_of_a_live_barrier_records_a_quorum_with_who_left_and_joined() -> None:
    driver = Driver()
    for worker in ("w0", "w1", "w2"):
        driver.register(worker)
    meet(driver, ["w2", "w0", "w1"], 3, 0)
    first = quorums(driver)
    assert len(first) == 1
    assert first[0].members == ["w0", "w1", "w2"]  # group-rank (registry rank) order
    assert (first[0].world_size, first[0].previous_epoch, first[0].left) == (3, None, [])

    driver.gone("w1")  # membership epoch 4
    meet(driver, ["w0", "w2"], 4, 1)
    driver.register("w3")  # epoch 5: a replacement
    meet(driver, ["w0", "w2", "w3"], 5, 2)
    shrink, grow = quorums(driver)[1:]
    assert (shrink.membership_epoch, shrink.world_size) == (4, 2)
    assert (shrink.left, shrink.joined, shrink.previous_epoch) == (["w1"], [], 3)
    assert (grow.world_size, grow.left, grow.joined, grow.previous_epoch) == (3, [], ["w3"], 4)


def test_other_barriers_record_no_quorum() -> None:
    driver = Driver()
    for worker in ("w0", "w1"):
        driver.register(worker)
    for worker in ("w0", "w1"):
        assert driver.arrive(worker, "epoch-end", 0, 2) is None
    assert any(e.type == "barrier.released" for e in driver.log)
    assert quorums(driver) == []


def test_a_quorum_decided_again_is_not_recorded_twice() -> None:
    driver = Driver()
    for worker in ("w0", "w1"):
        driver.register(worker)
    meet(driver, ["w0", "w1"], 2, 0)
    gen = driver.state.job(JOB).named(live_barrier(2)).generations[0]
    again = domain._quorum(driver.state, JOB, gen, domain._reading(driver.state, driver.now, None))
    assert again == []


def test_members_report_heals_and_discarded_steps_of_their_own_quorum() -> None:
    driver = Driver()
    for worker in ("w0", "w1", "w2"):
        driver.register(worker)
    meet(driver, ["w0", "w1", "w2"], 3, 0)
    discarded = report(driver, "w0", 3, 0, action="discarded", step=41, reason="peer lost")
    assert isinstance(discarded[0], LiveStepDiscarded)
    assert (discarded[0].worker_id, discarded[0].step, discarded[0].source) == ("w0", 41, "barrier")
    healed = report(driver, "w2", 3, 0, action="healed", step=40, from_step=0, source_worker="w0")
    assert isinstance(healed[0], LiveHealed)
    assert (healed[0].source_worker, healed[0].from_step, healed[0].to_step) == ("w0", 0, 40)
    # A retried report is the same event (JetStream drops the copy by its id).
    again = report(driver, "w2", 3, 0, action="healed", step=40, from_step=0, source_worker="w0")
    assert again[0].id == healed[0].id


@pytest.mark.parametrize(
    ("worker", "epoch", "fields", "error"),
    [
        ("w3", 3, {"action": "discarded", "step": 1}, Forbidden),  # live, not in the quorum
        ("ghost", 3, {"action": "discarded", "step": 1}, NotFound),  # not registered at all
        ("w0", 9, {"action": "discarded", "step": 1}, NotFound),  # no such quorum
        ("w0", 3, {"action": "discarded", "step": 1, "job": "other-job"}, NotFound),
        ("w1", 3, {"action": "healed", "step": 5, "source_worker": "w3"}, Forbidden),
        ("w1", 3, {"action": "healed", "step": 5, "source_worker": "w1"}, Forbidden),
        ("w1", 3, {"action": "healed", "step": 5}, Forbidden),
    ],
)
def test_a_report_on_a_quorum_the_worker_is_not_part_of_is_refused(
    worker: str, epoch: int, fields: dict[str, Any], error: type[StrataError]
) -> None:
    driver = Driver()
    for member in ("w0", "w1", "w2"):
        driver.register(member)
    meet(driver, ["w0", "w1", "w2"], 3, 0)
    driver.register("w3")
    before = len(driver.log)
    refused = report(driver, worker, epoch, 0, **fields)
    assert isinstance(refused, error), refused
    assert refused.message
    assert len(driver.log) == before  # nothing recorded


@settings(max_examples=examples(60))
@given(
    st.lists(
        st.sets(st.sampled_from(["w0", "w1", "w2", "w3", "w4"]), min_size=1), min_size=1, max_size=6
    ),
    st.sampled_from(["w0", "w1", "w2", "w3", "w4"]),
)
def test_each_quorum_compares_with_the_one_before_and_only_its_members_report(
    groups: list[set[str]], reporter: str
) -> None:
    """Whatever groups meet one after another, each quorum is exactly who arrived, in registry
    rank order, `left` and `joined` are the differences with the quorum before, and a report on
    it is recorded exactly when its reporter is a member."""
    driver = Driver()
    for worker in ("w0", "w1", "w2", "w3", "w4"):
        driver.register(worker)
    previous: list[str] | None = None
    for arrival, group in enumerate(groups):
        driver.epoch += 1  # each meeting at a newer membership epoch, as LiveGroup does
        meet(driver, sorted(group), driver.epoch, arrival)
        formed = quorums(driver)[-1]
        assert formed.membership_epoch == driver.epoch
        assert formed.members == sorted(group, key=lambda w: driver.ranks[w])
        assert formed.world_size == len(group)
        assert formed.left == [w for w in previous or [] if w not in group]
        assert formed.joined == (
            [] if previous is None else [w for w in formed.members if w not in previous]
        )
        outcome = report(driver, reporter, driver.epoch, 0, action="discarded", step=arrival + 1)
        if reporter in group:
            assert isinstance(outcome, list)
            assert isinstance(outcome[0], LiveStepDiscarded)
        else:
            assert isinstance(outcome, Forbidden)
        previous = formed.members
