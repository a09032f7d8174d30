"""The sharding state's snapshot (`snapshot`, `restore`): plans depend on their history, so
their owner and reading-order arrays are stored, not recomputed.
"""

from __future__ import annotations

from typing import Any

import numpy as np
from strata.services.leases import Leases
from strata.services.sharding.state import EpochPlan, ShardingState
from strata.sharding import DatasetSpec, Plan

# -- snapshots ------------------------------------------------------------------------------------

SNAPSHOT_VERSION = 5
"""2: restore counts and retired plan versions. 3: only the plans of each dataset's newest epochs
(`domain.EPOCHS_KEPT`), with the versions of those dropped. 4: each plan's reading order, which a
re-plan changes (moved shards go last), so it no longer follows from (seed, epoch). 5: each live
worker's lease, and how the last lease of each other one ended. An older
snapshot is ignored: the stream is replayed instead, which rebuilds all of it as evolve does."""


def snapshot(state: ShardingState) -> dict[str, Any]:
    """Plans are history-dependent, so their owner and reading-order arrays are stored, not
    recomputed."""
    jobs = []
    for job in state.jobs.values():
        jobs.append(
            {
                "job": job.job,
                "membership_epoch": job.membership_epoch,
                "live": sorted(job.live),
                "leases": [[w, i, e] for w, (i, e) in sorted(job.leases.current.items())],
                "ended": [[w, how] for w, how in sorted(job.leases.ended.items())],
                "restored": [[ds, e, step] for ds, (e, step) in job.restored.items()],
                "restores": [[ds, count] for ds, count in job.restores.items()],
                "retired": [[ds, e, version] for (ds, e), version in job.retired.items()],
                "datasets": [
                    [s.dataset_id, s.total_samples, s.shard_size, s.shuffle, s.seed]
                    for s in job.datasets.values()
                ],
                "plans": [
                    {
                        "dataset_id": ds,
                        "epoch": epoch,
                        "members": ep.plan.members,
                        "version": ep.plan.version,
                        "owner": ep.plan.owner.astype(np.int32).tobytes(),
                        "position": ep.plan.position.astype(np.int32).tobytes(),
                        "done": np.packbits(ep.plan.done).tobytes(),
                        "offsets": [[s, o] for s, o in ep.offsets.items()],
                        "restored": sorted(ep.restored),
                    }
                    for (ds, epoch), ep in job.plans.items()
                ],
            }
        )
    return {"v": SNAPSHOT_VERSION, "jobs": jobs}


def restore(data: dict[str, Any]) -> ShardingState:
    if data.get("v") != SNAPSHOT_VERSION:
        raise ValueError(f"unknown sharding snapshot version {data.get('v')!r}")
    state = ShardingState()
    for raw in data["jobs"]:
        job = state.job(raw["job"])
        job.membership_epoch = raw["membership_epoch"]
        job.live = set(raw["live"])
        job.leases = Leases(
            {w: (i, int(e)) for w, i, e in raw["leases"]}, {w: how for w, how in raw["ended"]}
        )
        job.restored = {ds: (e, step) for ds, e, step in raw.get("restored", [])}
        job.restores = {ds: int(count) for ds, count in raw.get("restores", [])}
        job.retired = {(ds, e): int(version) for ds, e, version in raw.get("retired", [])}
        for ds, total, size, shuffle, seed in raw["datasets"]:
            job.datasets[ds] = DatasetSpec(ds, total, size, shuffle, seed)
        for p in raw["plans"]:
            spec = job.datasets[p["dataset_id"]]
            owner = np.frombuffer(p["owner"], dtype=np.int32).astype(np.int64)
            position = np.frombuffer(p["position"], dtype=np.int32).astype(np.int64)
            done = np.unpackbits(np.frombuffer(p["done"], dtype=np.uint8))[: owner.size]
            plan = Plan(spec, p["epoch"], list(p["members"]), owner, position, p["version"])
            plan.done = done.astype(np.bool_)
            job.plans[(p["dataset_id"], p["epoch"])] = EpochPlan(
                plan,
                {int(s): int(o) for s, o in p["offsets"]},
                frozenset(int(s) for s in p["restored"]),
            )
    return state
