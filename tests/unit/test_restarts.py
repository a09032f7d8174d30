"""The read model's figures of a job: workers live, lost ranks and restarts, computed once for
every reader (the dashboard's overview and charts, `/api/jobs`), folded from the registry's
events; and a worker's step advanced by the steps of its metrics."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from strata.events import WorkerFailed, WorkerLeft
from strata.services.readmodel import render_dashboard
from strata.services.readmodel.restarts import GROUP_WINDOW_NS, GoneStatus, Loss, RestartLog

from tests.replays import JOB, History
from tests.tiers import examples


def failed(h: History, worker: str, rank: int) -> None:
    h.add(
        WorkerFailed(
            job=JOB,
            source="registry",
            ts=h.now,
            worker_id=worker,
            rank=rank,
            reason="no heartbeat for 5.1s (timeout 5s)",
            last_heartbeat_ts=h.now,
            membership_epoch=h.seq + 1,
        )
    )


def left(h: History, worker: str, rank: int) -> None:
    h.add(
        WorkerLeft(
            job=JOB,
            source="registry",
            ts=h.now,
            worker_id=worker,
            rank=rank,
            membership_epoch=h.seq + 1,
        )
    )


def two_ranks_training() -> History:
    h = History()
    h.register("w0", 0)
    h.register("w1", 1)
    h.beat("w0", step=40)
    h.beat("w1", step=38)
    return h


def test_a_job_without_losses_has_none_and_counts_its_live_workers() -> None:
    document = render_dashboard(two_ranks_training().fold())
    figures = document["figures"]
    assert (figures["workers"], figures["live"], figures["failed"], figures["left"]) == (2, 2, 0, 0)
    assert (figures["max_step"], figures["min_step"]) == (40, 38)
    assert (figures["ranks_lost"], figures["restarts"]) == (0, 0)
    assert figures["last_loss_at"] is None
    assert figures["last_restart_at"] is None
    assert document["losses"] == document["restarts"] == []
    assert [worker["live"] for worker in document["workers"]] == [True, True]


def test_a_failed_rank_is_lost_with_the_step_it_reached_and_its_replacement_is_a_restart() -> None:
    h = two_ranks_training()
    failed(h, "w1", 1)
    lost_at = h.records[-1].event.ts
    state = h.fold()
    document = render_dashboard(state)
    assert document["losses"] == [
        {"rank": 1, "worker": "w1", "status": "failed", "at": lost_at, "step": 38}
    ]
    assert document["figures"]["ranks_lost"] == 1
    assert document["figures"]["last_loss_at"] == lost_at
    assert document["figures"]["restarts"] == 0
    assert (document["figures"]["live"], document["figures"]["failed"]) == (1, 1)
    assert [w["live"] for w in document["workers"]] == [True, False]
    assert state.summary()["running"] is True

    # A new process takes the freed rank: one restart, resumed once it reports a step above 0.
    h.register("w9", 1)
    restarted_at = h.records[-1].event.ts
    h.beat("w9", step=0)
    h.beat("w9", step=30)
    h.beat("w9", step=35)
    document = render_dashboard(h.fold())
    assert document["restarts"] == [
        {
            "at": restarted_at,
            "ranks": [1],
            "replaced": document["losses"],
            "step_reached": 38,
            "resumed_step": 30,
        }
    ]
    assert (document["figures"]["restarts"], document["figures"]["ranks_lost"]) == (1, 1)
    assert document["figures"]["last_restart_at"] == restarted_at
    assert h.fold().summary()["restarts"] == 1


def test_a_process_of_the_same_worker_id_restarting_is_a_restart_of_its_rank() -> None:
    h = two_ranks_training()
    failed(h, "w0", 0)
    h.register("w0", 0, instance="w0-b")
    h.state("w0", "training", step=20)
    document = render_dashboard(h.fold())
    (restart,) = document["restarts"]
    assert (restart["ranks"], restart["step_reached"], restart["resumed_step"]) == ([0], 40, 20)
    assert [w["live"] for w in document["workers"]] == [True, True]


def test_a_group_restarted_at_once_is_one_restart_and_a_later_one_is_another() -> None:
    h = two_ranks_training()
    failed(h, "w1", 1)
    left(h, "w0", 0)
    h.register("a0", 0)
    h.register("a1", 1)
    document = render_dashboard(h.fold())
    assert [r["ranks"] for r in document["restarts"]] == [[0, 1]]
    assert {(loss["worker"], loss["status"]) for loss in document["restarts"][0]["replaced"]} == {
        ("w0", "left"),
        ("w1", "failed"),
    }
    # Only the failure lost a rank; the process that left gave its rank back.
    assert document["figures"]["ranks_lost"] == 1

    # One of the replacements fails: the next replacement is a restart of its own.
    failed(h, "a1", 1)
    h.register("b1", 1)
    document = render_dashboard(h.fold())
    assert [r["ranks"] for r in document["restarts"]] == [[0, 1], [1]]
    assert document["figures"]["restarts"] == 2
    assert document["figures"]["ranks_lost"] == 2


def test_replacements_far_apart_are_separate_restarts() -> None:
    h = two_ranks_training()
    failed(h, "w0", 0)
    h.register("a0", 0)
    h.now += GROUP_WINDOW_NS + 1
    failed(h, "w1", 1)
    h.register("a1", 1)
    assert [r["ranks"] for r in render_dashboard(h.fold())["restarts"]] == [[0], [1]]


def test_a_new_worker_on_a_never_used_rank_is_no_restart() -> None:
    h = two_ranks_training()
    h.register("w2", 2)
    document = render_dashboard(h.fold())
    assert document["restarts"] == []
    assert document["figures"]["restarts"] == 0
    assert document["figures"]["live"] == 3
    assert h.fold().summary()["running"] is True


def test_a_job_whose_workers_all_left_is_not_running() -> None:
    h = two_ranks_training()
    left(h, "w0", 0)
    left(h, "w1", 1)
    state = h.fold()
    assert state.summary()["running"] is False
    figures = render_dashboard(state)["figures"]
    assert (figures["live"], figures["left"], figures["max_step"]) == (0, 2, None)
    assert figures["ranks_lost"] == 0


def test_a_step_logged_with_metrics_advances_the_worker_and_a_new_process_counts_its_own() -> None:
    h = two_ranks_training()
    state = h.fold()
    version = state.version
    assert state.apply_metric_step("w0", 120) is True
    assert state.version > version
    assert state.apply_metric_step("w0", 90) is False  # a late sample never takes it back
    assert state.apply_metric_step("stranger", 500) is False
    steps = {w["id"]: w["step"] for w in render_dashboard(state)["workers"]}
    assert steps == {"w0": 120, "w1": 38}
    assert render_dashboard(state)["figures"]["max_step"] == 120

    # The same worker id registered by a new process: the old process's steps no longer count.
    failed(h, "w0", 0)
    h.register("w0", 0, instance="w0-b")
    for record in h.records[-2:]:
        state.apply(record)
    assert {w["id"]: w["step"] for w in render_dashboard(state)["workers"]}["w0"] == 0
    assert state.apply_metric_step("w0", 100) is True
    (restart,) = render_dashboard(state)["restarts"]
    assert (restart["step_reached"], restart["resumed_step"]) == (120, 100)


def test_a_worker_id_back_on_another_rank_replaces_both_gone_holders() -> None:
    h = two_ranks_training()
    failed(h, "w0", 0)
    failed(h, "w1", 1)
    # w1 comes back first and gets the lowest free rank, 0: it replaces w1 and rank 0's holder.
    h.register("w1", 0, instance="w1-b")
    document = render_dashboard(h.fold())
    (restart,) = document["restarts"]
    assert restart["ranks"] == [0]
    assert {loss["worker"] for loss in restart["replaced"]} == {"w0", "w1"}
    assert restart["step_reached"] == 40
    # Nothing is left to replace: a new worker on rank 1 is no further restart.
    h.register("w7", 1)
    assert render_dashboard(h.fold())["figures"]["restarts"] == 1


@st.composite
def membership_histories(draw: st.DrawFn) -> list[tuple[str, int]]:
    """Operations on a job of up to 4 ranks: ("fail" | "leave", slot) or ("join", id number)."""
    return draw(
        st.lists(
            st.one_of(
                st.tuples(st.sampled_from(["fail", "leave"]), st.integers(0, 3)),
                st.tuples(st.just("join"), st.integers(0, 5)),
            ),
            max_size=40,
        )
    )


@given(membership_histories())
@settings(max_examples=examples(300), deadline=None)
def test_every_loss_is_replaced_at_most_once_and_only_replacements_restart(
    operations: list[tuple[str, int]],
) -> None:
    log = RestartLog()
    live: dict[int, tuple[str, str]] = {}  # rank -> (worker id, instance)
    used_ranks: set[int] = set()
    used_ids: set[str] = set()
    gone_ids: set[str] = set()
    failures = replacements = 0
    for now, (op, arg) in enumerate(operations):
        at = now * 10**9
        if op == "join":
            worker = f"w{arg}"
            if any(holder[0] == worker for holder in live.values()):
                continue  # the same id live elsewhere: a supersede, covered by the examples
            rank = min(set(range(7)) - set(live))  # 6 ids at most: a rank is always free
            is_replacement = rank in used_ranks or worker in gone_ids
            before = sum(len(r.replacements) for r in log.restarts)
            log.registered(worker, f"{worker}-{now}", rank, at)
            added = sum(len(r.replacements) for r in log.restarts) - before
            # Restarts are only for ranks or ids that were held before (and not yet replaced).
            assert added <= int(is_replacement)
            replacements += added
            live[rank] = (worker, f"{worker}-{now}")
            used_ranks.add(rank)
            used_ids.add(worker)
        elif arg in live:
            worker, instance = live.pop(arg)
            status: GoneStatus = "failed" if op == "fail" else "left"
            failures += op == "fail"
            log.gone(Loss(arg, worker, instance, status, at, now))
            gone_ids.add(worker)
    assert log.lost == failures
    assert log.restarted == len(log.restarts)
    assert sum(len(r.replacements) for r in log.restarts) == replacements
    replaced = [(loss.worker, loss.instance) for r in log.restarts for loss in r.replaced]
    assert len(replaced) == len(set(replaced)), "a loss replaced twice"
    for restart in log.restarts:
        ranks = list(restart.replacements.values())
        assert len(ranks) == len(set(ranks)), "a rank twice in one restart"
        assert restart.view(log.steps)["step_reached"] == max(
            loss.step for loss in restart.replaced
        )
