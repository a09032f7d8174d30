"""The `/api/dashboard` document of a job, rendered from its folded state into `views.Dashboard`.

The live rates (events, requests and heartbeats per second) are known only to a running gateway:
`with_rates` is the one place they enter a document; a replay leaves them null. The job's figures
(`job_figures`) are computed here once, from the rendered rows, for every reader of the document.
"""

from __future__ import annotations

from strata.services.readmodel.state import JobState, LiveRates
from strata.services.readmodel.views import (
    Dashboard,
    DatasetView,
    JobFigures,
    ShardDistribution,
    WorkerView,
)


def shard_distribution(shards: dict[str, int]) -> ShardDistribution:
    if not shards:
        return {"max_over_mean": None, "min": None, "max": None}
    counts = list(shards.values())
    mean = sum(counts) / len(counts)
    return {
        "max_over_mean": round(max(counts) / mean, 4) if mean > 0 else None,
        "min": min(counts),
        "max": max(counts),
    }


def job_figures(
    state: JobState, workers: list[WorkerView], datasets: list[DatasetView]
) -> JobFigures:
    """The overview's figures of `state`, from its rendered rows (`workers()`, `datasets()`)."""
    live_steps = [(worker["step"], worker["epoch"]) for worker in workers if worker["live"]]
    log = state.restart_log
    checkpoints = state.checkpoints.jobs.get(state.job)
    return {
        "workers": len(workers),
        "live": len(live_steps),
        "failed": sum(1 for worker in workers if worker["status"] == "failed"),
        "left": sum(1 for worker in workers if worker["status"] == "left"),
        "max_step": max((step for step, _ in live_steps), default=None),
        "min_step": min((step for step, _ in live_steps), default=None),
        "max_epoch": max((epoch for _, epoch in live_steps), default=None),
        "ranks_lost": log.lost,
        "last_loss_at": log.losses[-1].at if log.losses else None,
        "restarts": log.restarted,
        "last_restart_at": log.restarts[-1].at if log.restarts else None,
        "done_shards": sum(dataset["done_shards"] for dataset in datasets),
        "total_shards": sum(dataset["num_shards"] for dataset in datasets),
        "last_committed_step": max(checkpoints.committed, default=None)
        if checkpoints is not None
        else None,
        "open_checkpoints": 0 if checkpoints is None else len(checkpoints.open),
    }


def render_dashboard(state: JobState, rates: LiveRates | None = None) -> Dashboard:
    """The `/api/dashboard` document; without `rates` (a replay) the live rates are null."""
    shards = state.shards_per_worker()
    workers = state.workers(shards)
    datasets = state.datasets()
    document: Dashboard = {
        "job": state.job,
        "seq": state.seq,
        "ts": state.ts,
        "figures": job_figures(state, workers, datasets),
        "workers": workers,
        "losses": state.restart_log.loss_views(),
        "restarts": state.restart_log.restart_views(),
        "live": state.live_log.view(),
        "datasets": datasets,
        "checkpoints": state.checkpoint_rows(),
        "barriers": state.barrier_rows(),
        "metrics": {
            "checkpoint_mb_s": state.checkpoint_mb_s(),
            "requests_per_s": None,
            "heartbeats_per_s": None,
            "events_per_s": None,
            "barrier_p99_ms": state.barrier_p99_ms(),
            "shard_distribution": shard_distribution(shards),
        },
        "recent_events": state.recent_rows(),
    }
    return document if rates is None else with_rates(document, rates)


def with_rates(document: Dashboard, rates: LiveRates) -> Dashboard:
    """`document` with the live rates in it, as a new document: the one given is left as it was
    (the gateway renders a job once per change and adds the rates, which move with the clock)."""
    metrics = document["metrics"].copy()
    metrics["events_per_s"] = rates.events_per_s
    metrics["requests_per_s"] = rates.requests_per_s
    metrics["heartbeats_per_s"] = rates.heartbeats_per_s
    merged = document.copy()
    merged["metrics"] = metrics
    return merged
