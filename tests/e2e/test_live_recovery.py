"""docs/pytorch.md's live-recovery example as a real job: three processes train, one is SIGKILLed
mid-epoch, the other two go on in the same processes, a replacement joins and heals from a live
peer. Every process that finishes must report every sample trained exactly once per epoch, the
same weights as the others, and (for the survivors) the PID it was started with.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.bus.server import NatsServer
from strata.events import (
    CheckpointAborted,
    CheckpointCommitted,
    CheckpointStarted,
    LiveHealed,
    LiveQuorumFormed,
    LiveStepDiscarded,
)

from tests.livejob import (
    EPOCHS,
    TRAINING,
    Plans,
    Rank,
    example,
    finish,
    hold_for,
    outputs,
    release,
    wait_with,
)
from tests.support import job_events, new_job, running_services

pytestmark = pytest.mark.timeout(600)


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with running_services(own_nats_server.url, tmp_path / "logs"):
        yield own_nats_server.url


def test_a_killed_rank_costs_a_step_and_a_replacement_heals_from_a_peer(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("live")
    script = example(tmp_path)
    plans = Plans(stack, job)
    ranks = [Rank(script, stack, job, f"w{i}") for i in range(3)]
    try:
        # Mid-epoch: a fifth of the first epoch's shards done, most still to read.
        wait_with(ranks, lambda: plans.done(0) >= 0.2, 240, "a fifth of epoch 0 trained")
        ranks[1].kill()
        wait_with(
            ranks, lambda: plans.done(0) >= 0.5 or plans.done(1) > 0, 120, "the survivors going on"
        )
        hold_for(script, 3)
        replacement = Rank(script, stack, job, "w3")
        ranks.append(replacement)
        survivors = [ranks[0], ranks[2], replacement]
        results = finish(survivors, 300)
        events = plans.runner.run(job_events(plans.bus, job))
    finally:
        for rank in ranks:
            rank.kill()
        plans.close()
    text = outputs(ranks)
    by_worker = {m[1]: m for m in results}
    for match in results:
        assert int(match[3]) == EPOCHS
        assert match[4] == "True", f"{match[1]} did not train every sample once:\n{text}"
    assert len({m[7] for m in results}) == 1, f"the ranks ended with other weights:\n{text}"
    assert len({m[5] for m in results}) == 1, text
    # The survivors are the processes first started, never restarted. One of them may have
    # healed: gloo can complete a step's all-reduce on one survivor and fail it on the other
    # when the peer dies inside it; the one behind then takes that step from the other when the
    # group re-forms (`LiveGroup.train_epoch`), which the ledger and the weights above check.
    for rank in (ranks[0], ranks[2]):
        assert int(by_worker[rank.worker_id][2]) == rank.proc.pid
    # The replacement took the state from a live peer (there is no checkpoint to read).
    assert by_worker["w3"][6] == "True", text
    assert "joined at step 0," not in replacement.output(), text
    # The barrier service recorded each change: the shrink, the discarded step (reported by the
    # survivors), the replacement's arrival and its heal from a live peer.
    quorums = [e for e in events if isinstance(e, LiveQuorumFormed)]
    shrink = next(q for q in quorums if q.left == ["w1"])
    assert sorted(shrink.members) == ["w0", "w2"], quorums
    grown = next(q for q in quorums if q.joined == ["w3"])
    assert sorted(grown.members) == ["w0", "w2", "w3"], quorums
    # A kill inside a step discards it; one that lands between epochs, while the group decides
    # whether the epoch is done, finds no step in flight and costs none.
    discards = [e for e in events if isinstance(e, LiveStepDiscarded)]
    survivors_text = ranks[0].output() + ranks[2].output()
    assert discards or "event=live_group_failed" in survivors_text, text
    assert {d.worker_id for d in discards} <= {"w0", "w2"}
    heal = next(e for e in events if isinstance(e, LiveHealed) and e.worker_id == "w3")
    assert heal.source_worker in ("w0", "w2")
    assert heal.membership_epoch >= grown.membership_epoch
    assert heal.from_step == 0
    assert heal.to_step > 0


def test_two_failures_in_a_row_leave_one_rank_that_goes_on_and_heals_a_replacement(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("live")
    script = example(tmp_path)
    plans = Plans(stack, job)
    ranks = [Rank(script, stack, job, f"w{i}") for i in range(3)]
    try:
        wait_with(ranks, lambda: plans.done(0) >= 0.15, 240, "a part of epoch 0 trained")
        ranks[1].kill()
        wait_with(ranks, lambda: plans.done(0) >= 0.35, 120, "two survivors going on")
        ranks[2].kill()
        hold_for(script, 2)
        replacement = Rank(script, stack, job, "w3")
        ranks.append(replacement)
        results = finish([ranks[0], replacement], 300)
    finally:
        for rank in ranks:
            rank.kill()
        plans.close()
    text = outputs(ranks)
    by_worker = {m[1]: m for m in results}
    for match in results:
        assert match[4] == "True", f"{match[1]} did not train every sample once:\n{text}"
    assert by_worker["w0"][7] == by_worker["w3"][7], f"other weights:\n{text}"
    assert int(by_worker["w0"][2]) == ranks[0].proc.pid
    assert by_worker["w3"][6] == "True", text


DIE_IN_HEAL = """
if os.environ.get("DIE_IN_HEAL") == "joiner":
    # SIGKILLed once the state of the group that takes it in has arrived, before loading it.
    import signal

    live._load_state = lambda data: os.kill(os.getpid(), signal.SIGKILL)
elif os.environ.get("DIE_IN_HEAL") == "survivor":
    # SIGKILLed on entering the state sync of its third group: the one taking in a replacement
    # (the first formed at the start, the second after a peer died).
    import signal

    _sync_state = live._sync_state

    def _dying_sync() -> int:
        if live.reformed == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return _sync_state()

    live._sync_state = _dying_sync
"""


def dying_example(directory: Path) -> Path:
    """The example, with a process that is told to (DIE_IN_HEAL) SIGKILLing itself in a heal."""
    script = example(directory)
    text = script.read_text(encoding="utf-8")
    assert text.count("\nlive.join()\n") == 1, "the example's join changed: update this test"
    script.write_text(text.replace("\nlive.join()\n", DIE_IN_HEAL + "live.join()\n"), "utf-8")
    return script


def test_a_joiner_killed_in_its_heal_leaves_the_survivors_going_and_a_second_one_heals(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("live")
    script = dying_example(tmp_path)
    plans = Plans(stack, job)
    ranks = [Rank(script, stack, job, f"w{i}") for i in range(3)]
    try:
        wait_with(ranks, lambda: plans.done(0) >= 0.15, 240, "a part of epoch 0 trained")
        ranks[1].kill()
        wait_with(
            ranks, lambda: plans.done(0) >= 0.3 or plans.done(1) > 0, 120, "survivors going on"
        )
        hold_for(script, 3)
        doomed = Rank(script, stack, job, "w3", die_in_heal="joiner")
        ranks.append(doomed)
        doomed.proc.wait(240)
        replacement = Rank(script, stack, job, "w4")
        ranks.append(replacement)
        results = finish([ranks[0], ranks[2], replacement], 300)
    finally:
        for rank in ranks:
            rank.kill()
        plans.close()
    text = outputs(ranks)
    # It died inside the heal: the state received, never loaded, `join` never returned.
    assert doomed.proc.returncode == -signal.SIGKILL, text
    assert "joined at step" not in doomed.output(), text
    by_worker = {m[1]: m for m in results}
    for match in results:
        assert match[4] == "True", f"{match[1]} did not train every sample once:\n{text}"
    assert len({m[7] for m in results}) == 1, f"the ranks ended with other weights:\n{text}"
    for rank in (ranks[0], ranks[2]):
        assert int(by_worker[rank.worker_id][2]) == rank.proc.pid
    assert by_worker["w4"][6] == "True", text


def test_a_survivor_killed_while_the_group_heals_a_replacement_leaves_the_others_going(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("live")
    script = dying_example(tmp_path)
    plans = Plans(stack, job)
    ranks = [Rank(script, stack, job, "w0"), Rank(script, stack, job, "w1")]
    ranks.append(Rank(script, stack, job, "w2", die_in_heal="survivor"))
    try:
        wait_with(ranks, lambda: plans.done(0) >= 0.15, 240, "a part of epoch 0 trained")
        ranks[1].kill()
        wait_with(
            ranks, lambda: plans.done(0) >= 0.3 or plans.done(1) > 0, 120, "survivors going on"
        )
        hold_for(script, 3)
        replacement = Rank(script, stack, job, "w3")
        ranks.append(replacement)
        ranks[2].proc.wait(240)
        # w2 is gone and w3 in: the group of two goes on.
        wait_with(ranks, lambda: "joined at step" in replacement.output(), 240, "w3 joined")
        release(script)
        results = finish([ranks[0], replacement], 300)
    finally:
        for rank in ranks:
            rank.kill()
        plans.close()
    text = outputs(ranks)
    # w2 died on entering the sync of the group that took in w3.
    assert ranks[2].proc.returncode == -signal.SIGKILL, text
    assert not ranks[2].result(), text
    by_worker = {m[1]: m for m in results}
    for match in results:
        assert match[4] == "True", f"{match[1]} did not train every sample once:\n{text}"
    assert by_worker["w0"][7] == by_worker["w3"][7], f"other weights:\n{text}"
    assert int(by_worker["w0"][2]) == ranks[0].proc.pid
    assert by_worker["w3"][6] == "True", text


SAVING = """
CHECKPOINTS = strata.CheckpointManager(worker, path=CHECKPOINT_DIR, keep_count=1000)


def save_every_10(step: int) -> None:
    if step % 10 == 0:
        try:
            CHECKPOINTS.save(f"{worker.id} {step}".encode(), step=step, epoch=live.epoch)
        except strata.StrataError as exc:  # a save refused (its step aborted): reported
            print(f"{worker.id}: save of step {step} refused: {exc}", flush=True)


"""
WAITING = """
try:
    CHECKPOINTS.wait()
except strata.StrataError as exc:
    print(f"{worker.id}: a save did not commit: {exc}", flush=True)
worker.stop()
"""


def saving_example(directory: Path) -> Path:
    """The example, each member of the group saving a checkpoint every 10 committed steps."""
    script = example(directory)
    text = script.read_text(encoding="utf-8")
    call = TRAINING[:-1] + ", on_commit=hold)"
    assert text.count(call) == 1, "the example's training call changed: update this test"
    assert text.count("\nworker.stop()\n") == 1, "the example's end changed: update this test"
    saving = f"CHECKPOINT_DIR = {str(directory / 'checkpoints')!r}" + SAVING
    text = text.replace("\nlive.join()\n", "\n" + saving + "live.join()\n")
    text = text.replace(call, TRAINING[:-1] + ", on_commit=save_every_10)")
    text = text.replace("\nworker.stop()\n", WAITING)
    script.write_text(text, encoding="utf-8")
    return script


def test_a_checkpoint_saved_after_a_shrink_is_the_survivors_world_and_commits(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("live")
    script = saving_example(tmp_path)
    plans = Plans(stack, job)
    ranks = [Rank(script, stack, job, f"w{i}") for i in range(3)]
    try:
        wait_with(ranks, lambda: plans.done(0) >= 0.2, 240, "a fifth of epoch 0 trained")
        ranks[1].kill()  # whatever registry rank it held, the survivors' ranks have a hole
        results = finish([ranks[0], ranks[2]], 400)
        events = plans.runner.run(job_events(plans.bus, job))
    finally:
        for rank in ranks:
            rank.kill()
        plans.close()
    text = outputs(ranks)
    assert all(m[4] == "True" for m in results), text
    shrink = next(
        e for e in events if isinstance(e, LiveQuorumFormed) and e.left == [ranks[1].worker_id]
    )
    assert sorted(shrink.members) == ["w0", "w2"], shrink
    survivors = {(worker, rank) for rank, worker in enumerate(shrink.members)}
    after = [
        e
        for e in events
        if isinstance(e, CheckpointStarted) and e.membership_epoch >= shrink.membership_epoch
    ]
    assert after, f"no checkpoint opened after the shrink:\n{text}"
    for started in after:
        # The step's world is the quorum that trained it, ranked as in the group.
        assert started.world_size == 2, started
        assert {(p.worker_id, p.rank) for p in started.participants} == survivors, started
    committed = {e.step for e in events if isinstance(e, CheckpointCommitted)}
    saved = {e.step for e in after} & committed
    assert len(saved) >= len(after) - 1, f"{sorted(e.step for e in after)} {committed}:\n{text}"
    holes = [
        e for e in events if isinstance(e, CheckpointAborted) and "has no live worker" in e.reason
    ]
    assert not holes, holes
