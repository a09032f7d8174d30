"""Training metrics of a job (`log_metrics`), from the gateway's metric history."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from strata.events import ID_PATTERN
from strata.history import dumps
from strata.services.gateway.context import MAX_SEQ, live
from strata.services.gateway.metrics_history import MetricsHistoryView

router = APIRouter(tags=["history"])


@router.get("/jobs/{job}/metrics", response_model=MetricsHistoryView)
async def job_metrics(
    request: Request,
    job: Annotated[str, PathParam(pattern=ID_PATTERN, description="Job id")],
    until_ns: Annotated[
        int | None,
        Query(ge=0, le=MAX_SEQ, description="Time travel: the history as stored by then (ns)"),
    ] = None,
    names: Annotated[
        str | None, Query(max_length=2000, description="Metric names, comma-separated")
    ] = None,
) -> Response:
    """A job's training metrics (`log_metrics`), downsampled per bucket of steps: each
    worker's series and the job's mean and total over ranks."""
    model = live(request)
    state = model.job(job)
    ranks: dict[str, int] = {}
    if state is not None:
        registry_job = state.registry.jobs.get(job)
        if registry_job is not None:
            ranks = {w: m.rank for w, m in registry_job.members.items()}
    wanted = {n.strip() for n in names.split(",") if n.strip()} if names else None
    view = model.metric_history.view(job, until_ns=until_ns, names=wanted, ranks=ranks)
    if view is None:
        if state is None:
            raise HTTPException(404, detail=f"no events of job {job!r} (yet)")
        view = {"job": job, "until_ns": until_ns, "metrics": {}}
    return Response(dumps(view), media_type="application/json")
