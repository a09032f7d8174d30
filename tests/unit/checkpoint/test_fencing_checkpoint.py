"""Fencing in the checkpoint domain: a begin or an ack under an ended lease is refused.

The same rule as the sharding service's (`strata.services.leases`): the lease is the worker's
registration (instance, membership epoch of the registration), ended by its failure, its leave or
a newer registration. Requests that carry no lease (older SDKs) keep the instance check alone.
"""

from __future__ import annotations

from strata.errors import StaleLease
from strata.events.requests import AckShardRequest, Lease
from strata.services.checkpoint import domain

from tests.unit.checkpoint.cases import (
    JOB,
    SECOND,
    failed,
    fold,
    registered,
    request,
    with_workers,
)


def lease(rank: int, epoch: int, instance: str | None = None) -> Lease:
    return Lease(worker_id=f"w{rank}", instance=instance or f"proc-w{rank}", epoch=epoch)


def ack_request(step: int, rank: int, held: Lease) -> AckShardRequest:
    return AckShardRequest(
        job=JOB,
        worker_id=f"w{rank}",
        step=step,
        epoch=0,
        rank=rank,
        bytes=100 + rank,
        checksum="xxh128:" + "ab" * 16,
        instance=held.instance,
        lease=held,
    )


def test_a_begin_under_the_current_lease_opens_and_under_an_ended_one_is_refused() -> None:
    state = with_workers(2)
    current = request(10, "w0").model_copy(update={"lease": lease(0, 1)})
    assert domain.begin(state, current, 10 * SECOND).error is None

    fold(state, [failed(0, 3), registered(0, 4, instance="proc-w0")])  # same instance, new lease
    stale = request(11, "w0").model_copy(update={"lease": lease(0, 1)})
    decision = domain.begin(state, stale, 11 * SECOND)
    assert isinstance(decision.error, StaleLease)
    assert decision.events == []
    renewed = request(11, "w0").model_copy(update={"lease": lease(0, 4)})
    assert domain.begin(state, renewed, 11 * SECOND).error is None


def test_an_ack_under_an_ended_lease_is_refused() -> None:
    state = with_workers(2)
    for rank in (0, 1):
        decision = domain.begin(
            state,
            request(10, f"w{rank}").model_copy(update={"lease": lease(rank, rank + 1)}),
            10 * SECOND,
        )
        assert decision.error is None
        fold(state, decision.events)
    fold(state, [registered(1, 3, instance="proc-w1")])  # w1 registered again: a new lease

    refused = domain.ack(state, ack_request(10, 1, lease(1, 2)), 11 * SECOND)
    assert isinstance(refused.error, StaleLease)
    assert refused.events == []
    accepted = domain.ack(state, ack_request(10, 0, lease(0, 1)), 11 * SECOND)
    assert accepted.error is None
    assert [e.type for e in accepted.events] == ["checkpoint.shard_saved"]
