"""A stored history rebuilds the plans it was decided with: the planner's output is part of the
event format (`shard.plan_changed` records members, and every fold runs the planner on them).

`tests/golden/sharding/plans.jsonl` was recorded by the sharding domain (`tests.golden.plans`);
`plan-digests.json` beside it holds the digest of each plan after each plan event as recorded.
A planner that deals, moves or orders one shard differently fails here before it can rebuild
other plans from the histories already in users' streams (docs/sharding.md, "Why plan events
carry members").
"""

from __future__ import annotations

import json

from strata.events import ShardPlanChanged, ShardProgressRestored, WorkerFailed, WorkerLeft
from strata.history import read_records

from tests.golden.plans import DIGESTS, HISTORY, digests


def test_the_recorded_history_rebuilds_every_plan_as_recorded() -> None:
    events = [record.event for record in read_records(HISTORY)]
    recorded = json.loads(DIGESTS.read_text())
    rebuilt = digests(events)
    assert len(rebuilt) == len(recorded)
    for now, then in zip(rebuilt, recorded, strict=True):
        assert now == then, f"plan after {then['event']} ({then['dataset']} epoch {then['epoch']})"


def test_the_recorded_history_covers_every_way_a_plan_changes() -> None:
    events = [record.event for record in read_records(HISTORY)]
    plans = [e for e in events if isinstance(e, ShardPlanChanged)]
    reasons = {e.reason for e in plans}
    assert reasons >= {"first request of the epoch", "membership changed", "restored"}
    assert any(isinstance(e, WorkerFailed) for e in events)
    assert any(isinstance(e, WorkerLeft) for e in events)
    assert any(isinstance(e, ShardProgressRestored) for e in events)
    assert {(e.dataset_id, e.epoch) for e in plans} >= {("images", 0), ("images", 1)}
    assert sum(e.moved_shards for e in plans) > 1000  # re-plans that moved work, not no-ops
    assert all(d["plan"] is not None for d in json.loads(DIGESTS.read_text()))
