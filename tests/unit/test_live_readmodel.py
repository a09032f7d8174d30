"""The read model's live recovery (`services/readmodel/live.py`): world size over time and the
markers of shrinks, growths, heals and discarded steps, as `/api/dashboard` renders them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from strata.cli.main import main as cli
from strata.events import Event, LiveHealed, LiveQuorumFormed, LiveStepDiscarded
from strata.history import Record
from strata.services.readmodel import JobState, render_dashboard

JOB = "job-live"
T0 = 1_700_000_000 * 10**9


def quorum(
    epoch: int, members: list[str], left: list[str], joined: list[str], previous: int | None = -1
) -> Event:
    return LiveQuorumFormed(
        job=JOB,
        source="barrier",
        ts=T0 + epoch * 10**9,
        membership_epoch=epoch,
        generation=0,
        members=members,
        world_size=len(members),
        left=left,
        joined=joined,
        previous_epoch=epoch - 1 if previous == -1 else previous,
    )


def discarded(epoch: int, worker: str, step: int) -> Event:
    return LiveStepDiscarded(
        job=JOB,
        source="barrier",
        ts=T0 + epoch * 10**9 + 1,
        membership_epoch=epoch,
        generation=0,
        worker_id=worker,
        step=step,
        reason="Connection closed by peer",
    )


def healed(epoch: int, worker: str, source: str, before: int, after: int) -> Event:
    return LiveHealed(
        job=JOB,
        source="barrier",
        ts=T0 + epoch * 10**9 + 2,
        membership_epoch=epoch,
        generation=0,
        worker_id=worker,
        source_worker=source,
        from_step=before,
        to_step=after,
    )


HISTORY = [
    quorum(3, ["w0", "w1", "w2"], [], [], previous=None),
    discarded(3, "w0", 41),
    discarded(3, "w2", 41),
    quorum(4, ["w0", "w2"], ["w1"], []),
    quorum(5, ["w0", "w2", "w3"], [], ["w3"]),
    healed(5, "w3", "w0", 0, 77),
]


def folded(events: list[Event]) -> JobState:
    state = JobState(JOB)
    for seq, event in enumerate(events, 1):
        state.apply_event(seq, event)  # type: ignore[arg-type]
    return state


def test_world_size_over_time_and_a_marker_per_change() -> None:
    live = render_dashboard(folded(HISTORY))["live"]
    assert [p["world_size"] for p in live["world"]] == [3, 2, 3]
    assert [p["step"] for p in live["world"]] == [None, 40, 77]
    assert (live["quorums"], live["heals"], live["discarded_steps"], live["world_size"]) == (
        3,
        1,
        1,
        3,
    )
    kinds = [(m["kind"], m["step"], m["workers"]) for m in live["markers"]]
    assert kinds == [
        ("discard", 41, ["w0", "w2"]),  # one marker for the step, whoever reported it
        ("shrink", 40, ["w1"]),  # the group resumed after the last committed step
        ("grow", 77, ["w3"]),  # its step from the heal that followed
        ("heal", 77, ["w3"]),
    ]
    labels = [m["label"] for m in live["markers"]]
    assert labels[1] == "w1 left the group at step 40 (world 3 → 2, membership epoch 4)"
    assert labels[3] == "w3 healed from w0: step 0 → 77"
    assert "step 41 discarded by w0, w2" in labels[0]


def test_a_job_without_a_live_group_has_an_empty_live_view() -> None:
    live = render_dashboard(JobState(JOB))["live"]
    assert live == {
        "quorums": 0,
        "heals": 0,
        "discarded_steps": 0,
        "world_size": None,
        "world": [],
        "markers": [],
    }


def test_a_live_event_from_a_worker_is_not_folded() -> None:
    forged = LiveHealed(
        job=JOB,
        source="w3",
        membership_epoch=5,
        generation=0,
        worker_id="w3",
        source_worker="w0",
        from_step=0,
        to_step=9,
    )
    state = folded([*HISTORY[:1], forged])
    assert state.rejected == 1
    assert render_dashboard(state)["live"]["heals"] == 0


def test_strata_replay_explains_each_change_of_a_live_group(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    export = tmp_path / "live.jsonl"
    export.write_text(
        "".join(
            Record(seq, event.ts, event).to_json() + "\n"  # type: ignore[arg-type]
            for seq, event in enumerate(HISTORY, 1)
        )
    )
    assert cli(["replay", "--file", str(export), "--type", "live."]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == len(HISTORY)
    assert "live group of membership 3 formed: 3 (w0, w1, w2)" in lines[0]
    assert "w0 discarded step 41" in lines[1]
    assert "trains it again after step 40" in lines[1]
    assert "formed: 2 (w0, w2), was 3 at membership 3: w1 left" in lines[3]
    assert "formed: 3 (w0, w2, w3), was 2 at membership 4: w3 joined" in lines[4]
    assert "w3 healed from w0 in the live group of membership 5: step 0 -> 77" in lines[5]
    # The rebuilt state places each change at its step.
    assert cli(["replay", "--file", str(export), "--state"]) == 0
    live = json.loads(capsys.readouterr().out)["live"]
    assert [(m["kind"], m["step"]) for m in live["markers"]] == [
        ("discard", 41),
        ("shrink", 40),
        ("grow", 77),
        ("heal", 77),
    ]
