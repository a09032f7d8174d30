"""A recorded sharding history that exercises every way a plan changes, and its plans' digests.

`shard.plan_changed` records the members an epoch is planned over, and every fold runs the
planner (`strata.sharding`) on them, so the planner's output is part of the event format: a
planner that deals or moves one shard differently rebuilds different plans from a stored
history (docs/sharding.md, "Why plan events carry members"). `sharding/plans.jsonl` is such a
history (an export file: joins, failures, a departure, progress, a second epoch, a restore
that leaves shards with no reader), made by the sharding domain's own decisions, and
`sharding/plan-digests.json` the digest of each plan after each plan event, as the planner that
recorded it made them. `tests/unit/sharding/test_plan_replay.py` folds the history and fails
on any difference.

`python -m tests.golden.plans` records both files again: only for a deliberate change of the
planner that is known not to matter for stored histories, never to make that test pass.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from strata.events import Event, ShardPlanChanged, WorkerFailed, WorkerLeft, WorkerRegistered
from strata.events.requests import (
    GetShardsRequest,
    RegisterDatasetRequest,
    ReportProgressRequest,
    RestoreProgressRequest,
)
from strata.history import Record
from strata.services.domain import Decision
from strata.services.sharding import domain
from strata.services.sharding.domain import ShardingState
from strata.sharding import Plan

HERE = Path(__file__).resolve().parent
HISTORY = HERE / "sharding" / "plans.jsonl"
DIGESTS = HERE / "sharding" / "plan-digests.json"
"""Beside the dashboard histories, not among them: `*.jsonl` in this folder each rebuild to the
dashboard document of the `.json` beside them (tests/unit/test_replay.py)."""
JOB = "plans-job"
T0 = 1_795_000_000_000_000_000
SECOND = 1_000_000_000


def plan_digest(plan: Plan) -> str:
    """Everything a plan decides: members, version, each shard's reader and reading position."""
    digest = hashlib.sha256()
    digest.update(json.dumps([plan.members, plan.version]).encode())
    digest.update(plan.owner.astype(np.int32).tobytes())
    digest.update(plan.position.astype(np.int32).tobytes())
    return digest.hexdigest()


def digests(events: Iterable[Event]) -> list[dict[str, object]]:
    """Fold `events` with the sharding domain; after each plan event, the digest of its plan."""
    state = ShardingState()
    found: list[dict[str, object]] = []
    for event in events:
        domain.evolve(state, event)
        if isinstance(event, ShardPlanChanged):
            epoch_plan = state.job(event.job).plans.get((event.dataset_id, event.epoch))
            found.append(
                {
                    "event": event.id,
                    "dataset": event.dataset_id,
                    "epoch": event.epoch,
                    "version": event.plan_version,
                    "plan": None if epoch_plan is None else plan_digest(epoch_plan.plan),
                }
            )
    return found


class _Recorder:
    def __init__(self) -> None:
        self.state = ShardingState()
        self.events: list[Event] = []
        self.now = T0
        self.membership = 0

    def record(self, events: Iterable[Event]) -> None:
        for event in events:
            domain.evolve(self.state, event)
            self.events.append(event)
        self.now += SECOND

    def decided(self, decision: Decision[None]) -> None:
        assert decision.error is None, decision.error
        self.record(decision.events)

    def membership_changed(self, event: Event) -> None:
        self.record([event])
        self.record(domain.replan_after_membership_change(self.state, JOB, self.now))

    def join(self, rank: int) -> None:
        self.membership += 1
        self.membership_changed(
            WorkerRegistered(
                job=JOB,
                source="registry",
                ts=self.now,
                worker_id=f"w{rank:02d}",
                instance=f"proc-w{rank:02d}-{self.membership}",
                rank=rank,
                world_size=rank + 1,
                membership_epoch=self.membership,
                heartbeat_interval=1.0,
                heartbeat_timeout=5.0,
            )
        )

    def fail(self, rank: int) -> None:
        self.membership += 1
        self.membership_changed(
            WorkerFailed(
                job=JOB,
                source="registry",
                ts=self.now,
                worker_id=f"w{rank:02d}",
                rank=rank,
                reason="no heartbeat within the heartbeat timeout",
                last_heartbeat_ts=self.now - 5 * SECOND,
                membership_epoch=self.membership,
            )
        )

    def leave(self, rank: int) -> None:
        self.membership += 1
        self.membership_changed(
            WorkerLeft(
                job=JOB,
                source="registry",
                ts=self.now,
                worker_id=f"w{rank:02d}",
                rank=rank,
                membership_epoch=self.membership,
            )
        )

    def get_shards(self, dataset: str, epoch: int, worker: str) -> None:
        self.decided(
            domain.get_shards(
                self.state,
                GetShardsRequest(
                    job=JOB,
                    dataset_id=dataset,
                    worker_id=worker,
                    epoch=epoch,
                    lease=domain.current_lease(self.state, JOB, worker),
                ),
                self.now,
            )
        )

    def read(self, dataset: str, epoch: int, shards_each: int) -> None:
        """Every live worker reports its first `shards_each` unfinished shards done."""
        plan = self.state.job(JOB).plans[(dataset, epoch)].plan
        for worker in sorted(self.state.job(JOB).live):
            mine = [s for s in plan.shards_of(worker) if not plan.done[s]][:shards_each]
            if mine:
                self.decided(
                    domain.report_progress(
                        self.state,
                        ReportProgressRequest(
                            job=JOB,
                            dataset_id=dataset,
                            epoch=epoch,
                            worker_id=worker,
                            completed=mine,
                            lease=domain.current_lease(self.state, JOB, worker),
                        ),
                        self.now,
                    )
                )


def record_history() -> list[Event]:
    """The recorded scenario, decided by the sharding domain itself."""
    r = _Recorder()
    for rank in range(10):
        r.join(rank)
    for dataset, samples, shuffle in (("images", 250_000, True), ("captions", 100_300, False)):
        r.decided(
            domain.register_dataset(
                r.state,
                RegisterDatasetRequest(
                    job=JOB,
                    dataset_id=dataset,
                    total_samples=samples,
                    shard_size=100,
                    shuffle=shuffle,
                    seed=7,
                ),
                r.now,
            )
        )
        r.get_shards(dataset, 0, "w00")
    r.read("images", 0, 40)
    r.read("captions", 0, 10)
    r.fail(3)  # its unfinished shards go to the least-loaded survivors
    r.fail(7)
    r.read("images", 0, 30)
    r.join(10)  # joiners take the last unfinished shards of the most-loaded
    r.join(11)
    r.read("images", 0, 20)
    r.leave(0)
    r.get_shards("images", 1, "w01")  # the next epoch, planned over today's members
    r.read("images", 1, 25)
    first_epoch = r.state.job(JOB).plans[("images", 0)].plan
    cursor = [int(s) for s in np.flatnonzero(first_epoch.done)[::2]]
    r.decided(
        domain.restore_progress(
            r.state,
            RestoreProgressRequest(
                job=JOB,
                dataset_id="images",
                epoch=0,
                worker_id="w01",
                checkpoint_step=1200,
                completed=cursor,
                lease=domain.current_lease(r.state, JOB, "w01"),
            ),
            r.now,
        )
    )
    r.fail(5)
    r.join(3)  # a failed worker back, as a new registration
    r.read("images", 0, 15)
    return r.events


def main() -> None:
    events = record_history()
    lines = [Record(seq, T0 + seq, event).to_json() for seq, event in enumerate(events, 1)]
    HISTORY.write_text("\n".join(lines) + "\n")
    DIGESTS.write_text(json.dumps(digests(events), indent=1) + "\n")
    print(f"{len(events)} events, {sum(isinstance(e, ShardPlanChanged) for e in events)} plans")


if __name__ == "__main__":
    main()
