"""Jobs' history, read from JetStream on demand: pages of events, and the state at a past point.

A replay starts from the gateway's nearest snapshot of the job (`LiveModel.snapshots`) unless
heartbeats are asked for, and is bounded in what it folds (`ReplayLimits`), in time, and in how
many run at once (`ReplaySlots`), so no caller can tie the gateway up.
"""

from __future__ import annotations

import contextlib
from typing import Annotated, Any, Final

from fastapi import APIRouter, HTTPException, Query, Request, Response
from strata.history import ReplayLimits, job_history, stream_records, summarize, type_filter
from strata.services.gateway.api import Dashboard, EventPage
from strata.services.gateway.context import (
    MAX_PAGE,
    MAX_SEQ,
    JobId,
    JobInPath,
    ReplaySlots,
    bus,
    gateway,
    json_response,
)
from strata.services.readmodel import JobState, fold_history, render_dashboard

MAX_EVENTS_SCANNED: Final = 50_000

router = APIRouter(tags=["history"])


@router.get("/jobs/{job}/events", response_model=EventPage)
async def events(
    request: Request,
    job: JobInPath,
    after_seq: Annotated[int, Query(ge=0, le=MAX_SEQ)] = 0,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 200,
    type: Annotated[
        str | None, Query(max_length=64, description="Event type prefix, e.g. 'barrier.'")
    ] = None,
) -> Response:
    """A job's events after a stream sequence, from JetStream, with their full JSON."""
    subject, prefix = type_filter(job, type)
    items: list[dict[str, Any]] = []
    last_seq, scanned = after_seq, 0
    records = stream_records(bus(request).js, "events", subject, start_seq=after_seq + 1)
    async with contextlib.aclosing(records):
        async for record in records:
            last_seq, scanned = record.seq, scanned + 1
            event = record.event
            if prefix is None or event.type.startswith(prefix):
                items.append(
                    {
                        "seq": record.seq,
                        "ts": event.ts,
                        "type": event.type,
                        "summary": summarize(event),
                        "event": event.model_dump(mode="json"),
                    }
                )
            if len(items) >= limit or scanned >= MAX_EVENTS_SCANNED:
                break
    return json_response({"items": items, "last_seq": last_seq})


@router.get("/replay", response_model=Dashboard)
async def replay(
    request: Request,
    job: JobId,
    seq: Annotated[
        int | None, Query(ge=0, le=MAX_SEQ, description="Fold events up to this seq")
    ] = None,
    at: Annotated[
        int | None,
        Query(ge=0, le=MAX_SEQ, description="Fold what was stored at or before (ns)"),
    ] = None,
    telemetry: Annotated[
        bool, Query(description="Fold heartbeats too (last heartbeat, step, epoch)")
    ] = False,
) -> Response:
    """The dashboard of a job as it was at a point of its history; live rates are null.
    Without heartbeats it folds from the gateway's nearest snapshot before the point, with
    them from the job's first event. Bounded: too many events to fold is a 422 (`too_large`),
    too long a 504 (`deadline_exceeded`), too many replays at once a 429 (`busy`)."""
    if (seq is None) == (at is None):
        raise HTTPException(422, detail="give exactly one of seq (a stream sequence) or at (ns)")
    narrow = "ask for an earlier point (a smaller seq or at)" + (
        ", or leave heartbeats out (telemetry=false)" if telemetry else ""
    )
    replays: ReplaySlots = request.app.state.replays
    limits: ReplayLimits = request.app.state.replay_limits
    live = gateway(request).live
    with replays.hold():
        start = JobState(job)
        if live is not None and not telemetry:
            # The nearest snapshot at or before the point: only the events after it are read.
            start = live.snapshots.nearest(job, seq=seq, at_ns=at)
        if seq is not None and start.events and start.seq == seq:
            rebuilt = start
        else:
            history = job_history(
                bus(request).js,
                job,
                from_seq=start.seq + 1 if start.events else None,
                until_seq=seq,
                until_ns=at,
                telemetry=telemetry,
            )
            rebuilt = await fold_history(history, start, limits, narrow)
    if rebuilt.events == 0:
        raise HTTPException(404, detail=f"job {job!r} has no events at that point")
    return json_response(render_dashboard(rebuilt))
