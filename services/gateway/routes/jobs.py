"""Jobs' state now, from the live read model: the job list, the dashboard, pages of workers."""

from __future__ import annotations

from typing import Annotated, Final, get_args

from fastapi import APIRouter, HTTPException, Query, Request, Response
from strata.events import WorkerState
from strata.services.gateway.api import Dashboard, JobList, WorkerPage, WorkerView
from strata.services.gateway.context import (
    MAX_OFFSET,
    MAX_PAGE,
    JobId,
    JobInPath,
    job_state,
    json_response,
    live,
)

WORKER_STATUSES: Final = frozenset(get_args(WorkerState))

router = APIRouter(tags=["state"])


@router.get("/jobs", response_model=JobList)
async def jobs(request: Request) -> Response:
    """Every job seen, the one with the latest event first."""
    states = sorted(live(request).model.jobs.values(), key=lambda s: (-s.ts, s.job))
    return json_response({"jobs": [s.summary() for s in states]})


@router.get("/dashboard", response_model=Dashboard)
async def dashboard(request: Request, job: JobId) -> Response:
    """Workers, datasets, checkpoints, barriers, metrics and recent events of a job, now."""
    body, _ = live(request).dashboard_json(job_state(request, job))
    return Response(body, media_type="application/json")


@router.get("/jobs/{job}/workers", response_model=WorkerPage)
async def workers(
    request: Request,
    job: JobInPath,
    offset: Annotated[int, Query(ge=0, le=MAX_OFFSET)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
    status: Annotated[
        str | None,
        Query(max_length=200, description="One status or several, comma-separated"),
    ] = None,
) -> Response:
    """A page of a job's workers in rank order, optionally of some statuses only."""
    rows: list[WorkerView] = live(request).static_dashboard(job_state(request, job))["workers"]
    if status:
        wanted = {s.strip() for s in status.split(",") if s.strip()}
        unknown = wanted - WORKER_STATUSES
        if unknown:
            raise HTTPException(
                422, detail=f"unknown status {sorted(unknown)}; use {sorted(WORKER_STATUSES)}"
            )
        rows = [row for row in rows if row["status"] in wanted]
    return json_response({"total": len(rows), "items": rows[offset : offset + limit]})
