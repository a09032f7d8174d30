"""`LiveGroup` (docs/pytorch.md, live recovery) against the faults beyond a kill: a rank paused
past the heartbeat timeout and resumed, a rank whose NATS connection is black-holed and then
healed, and a rank whose wall clock steps.

Each runs the docs example as three real processes against real services (heartbeats every
1 s, a 3 s timeout). What must hold: the survivors go on without the rank that stood still,
in the same processes; the rank that comes back was fenced (its lease ended), commits nothing
with the group it was cut off from, and heals back in from a live peer as a joiner does; every
process ends with every sample trained exactly once per epoch and the same weights. A stepped
wall clock fails nobody.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from strata.bus.server import NatsServer
from strata.clock import OFFSET_FILE_ENV, step_wall_clock
from strata.events import LiveHealed, LiveQuorumFormed, WorkerFailed
from strata.events.models import AnyEvent

from tests.faults.conftest import INTERVAL, TIMEOUT
from tests.faults.netproxy import Proxy
from tests.livejob import EPOCHS, Plans, Rank, example, finish, outputs, wait_with
from tests.support import job_events, new_job, running_services

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(900)]

VICTIM = "w1"
START_S = 240.0
"""How long three fresh Pythons importing torch may take to train a fifth of an epoch."""
SHRINK_S = 120.0
"""How long after the fault the survivors may take to form their group of two."""
COLLECTIVE_TIMEOUT_S = 60.0
"""The example's `LiveGroup` timeout: the survivors must not have waited for it."""
FINISH_S = 420.0


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with running_services(
        own_nats_server.url,
        tmp_path / "logs",
        heartbeat_interval=INTERVAL,
        heartbeat_timeout=TIMEOUT,
    ):
        yield own_nats_server.url


def events_of(plans: Plans) -> list[AnyEvent]:
    return plans.runner.run(job_events(plans.bus, plans.job))


def shrunk(plans: Plans) -> LiveQuorumFormed | None:
    """The survivors' quorum without the victim, once the barrier service recorded it."""
    for event in events_of(plans):
        if isinstance(event, LiveQuorumFormed) and event.left == [VICTIM]:
            return event
    return None


def check_healed_back(ranks: list[Rank], plans: Plans) -> None:
    """Every rank finishes in its first process with every sample once and the same weights;
    the survivors shrank to two, the victim came back as a joiner and healed from a peer.
    """
    results = finish(ranks, FINISH_S)
    events = events_of(plans)
    text = outputs(ranks)
    for match in results:
        assert int(match[3]) == EPOCHS
        assert match[4] == "True", f"{match[1]} did not train every sample once:\n{text}"
    assert len({m[7] for m in results}) == 1, f"the ranks ended with other weights:\n{text}"
    assert len({m[5] for m in results}) == 1, text
    by_worker = {m[1]: m for m in results}
    for rank in ranks:
        assert int(by_worker[rank.worker_id][2]) == rank.proc.pid, "a process was restarted"
    quorums = [e for e in events if isinstance(e, LiveQuorumFormed)]
    shrink = next(q for q in quorums if q.left == [VICTIM])
    assert sorted(shrink.members) == ["w0", "w2"], quorums
    back = next(q for q in quorums if q.joined == [VICTIM])
    assert back.membership_epoch > shrink.membership_epoch, quorums
    assert sorted(back.members) == ["w0", "w1", "w2"], quorums
    failures = [e for e in events if isinstance(e, WorkerFailed)]
    assert [f.worker_id for f in failures] == [VICTIM], failures
    heal = next(
        e
        for e in events
        if isinstance(e, LiveHealed)
        and e.worker_id == VICTIM
        and e.membership_epoch >= back.membership_epoch
    )
    assert heal.source_worker in ("w0", "w2")
    assert heal.to_step > heal.from_step
    assert by_worker[VICTIM][6] == "True", text
    # The step it stood still in was not committed there: its collectives failed, or completed
    # against the survivors' abandoned group and the step was fenced off. Stood still between
    # epochs, it had no step in flight: its group failed.
    victim = next(r for r in ranks if r.worker_id == VICTIM).output()
    assert any(
        f"event={event}" in victim
        for event in ("live_step_fenced", "live_step_discarded", "live_group_failed")
    ), victim


def left_behind_and_healed_back(
    ranks: list[Rank], plans: Plans, fault: Callable[[], None], recover: Callable[[], None]
) -> float:
    """Mid-epoch, `fault` makes the victim stand still; the survivors must form their group of
    two well within the collective's timeout and train on; then `recover` ends the fault and
    the victim must heal back in (`check_healed_back`). Returns the seconds from the fault to
    the survivors' group."""
    wait_with(ranks, lambda: plans.done(0) >= 0.2, START_S, "a fifth of epoch 0 trained")
    fault()
    fault_at = time.monotonic()
    wait_with(ranks, lambda: shrunk(plans) is not None, SHRINK_S, "the survivors' group of two")
    shrink_s = time.monotonic() - fault_at
    # Detection is the registry's heartbeat timeout (TIMEOUT) and a look every 0.25 s, not the
    # collective's timeout; a loaded machine may take many seconds more.
    assert shrink_s < COLLECTIVE_TIMEOUT_S * 2 / 3, f"the survivors waited {shrink_s:.0f}s"
    going = plans.progress()
    wait_with(ranks, lambda: plans.progress() >= going + 0.1, SHRINK_S, "the survivors going on")
    recover()
    check_healed_back(ranks, plans)
    return shrink_s


def test_a_rank_paused_past_its_timeout_is_left_behind_then_heals_back_in(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("live-paused")
    script = example(tmp_path)
    plans = Plans(stack, job)
    ranks = [Rank(script, stack, job, f"w{i}") for i in range(3)]
    victim = ranks[1]
    try:
        shrink_s = left_behind_and_healed_back(ranks, plans, victim.pause, victim.resume)
    finally:
        for rank in ranks:
            rank.resume()
            rank.kill()
        plans.close()
    print(f"paused rank: survivors' group of two {shrink_s:.1f}s after the pause")


def test_a_rank_cut_off_from_nats_past_its_timeout_is_left_behind_then_heals_back_in(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("live-cut")
    script = example(tmp_path)
    plans = Plans(stack, job)
    upstream = int(stack.rsplit(":", 1)[1])
    with Proxy(upstream) as proxy:
        ranks = [
            Rank(script, proxy.url if f"w{i}" == VICTIM else stack, job, f"w{i}") for i in range(3)
        ]
        try:
            # Its NATS connection carries nothing either way, and stays open (a black hole);
            # the group's own connections between the ranks still work.
            shrink_s = left_behind_and_healed_back(ranks, plans, proxy.cut, proxy.heal)
        finally:
            for rank in ranks:
                rank.kill()
            plans.close()
    print(f"cut-off rank: survivors' group of two {shrink_s:.1f}s after the cut")


def test_a_rank_whose_wall_clock_steps_fails_nobody(stack: str, tmp_path: Path) -> None:
    job = new_job("live-clock")
    script = example(tmp_path)
    plans = Plans(stack, job)
    offset = tmp_path / "w1-clock"
    step_wall_clock(offset, 0.0)
    ranks = [
        Rank(script, stack, job, f"w{i}", env={OFFSET_FILE_ENV: str(offset)} if i == 1 else None)
        for i in range(3)
    ]
    try:
        wait_with(ranks, lambda: plans.done(0) >= 0.2, START_S, "a fifth of epoch 0 trained")
        for seconds in (+60.0, -60.0):
            # NTP steps w1's wall clock a minute ahead, later a minute behind the true time.
            step_wall_clock(offset, seconds)
            target = plans.progress() + 0.3
            wait_with(ranks, lambda t=target: plans.progress() >= t, SHRINK_S, "the group going on")
        results = finish(ranks, FINISH_S)
        events = events_of(plans)
    finally:
        for rank in ranks:
            rank.kill()
        plans.close()
    text = outputs(ranks)
    for match in results:
        assert match[4] == "True", f"{match[1]} did not train every sample once:\n{text}"
    assert len({m[7] for m in results}) == 1, f"the ranks ended with other weights:\n{text}"
    assert not [e for e in events if isinstance(e, WorkerFailed)], text
    quorums = [e for e in events if isinstance(e, LiveQuorumFormed)]
    assert len(quorums) == 1, quorums
    assert sorted(quorums[0].members) == ["w0", "w1", "w2"], quorums
    assert "live_step_fenced" not in text, text
