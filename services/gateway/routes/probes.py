"""Kubernetes probes and Prometheus metrics: never behind the API token."""

from __future__ import annotations

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from strata.services.gateway.context import gateway

router = APIRouter(tags=["probes"])


@router.get("/healthz")
async def healthz() -> dict[str, str]:
    """The process is alive."""
    return {"status": "ok"}


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    """Connected to NATS, the streams exist, the events stored at start are folded, and no
    task of the gateway has died."""
    state = gateway(request)
    connected = state.bus is not None and state.bus.nc.is_connected
    folded = state.live is None or state.live.caught_up.is_set()
    failure = state.live.tasks.failure if state.live is not None else None
    ready = connected and state.streams_ready and folded and failure is None
    if ready:
        detail = "ok"
    elif failure is not None:
        detail = failure.message
    elif not connected:
        detail = "no NATS"
    elif not state.streams_ready:
        detail = "streams not provisioned"
    else:
        detail = "folding the event stream"
    return JSONResponse({"ready": ready, "detail": detail}, status_code=200 if ready else 503)


@router.get("/metrics")
async def metrics() -> Response:
    """Prometheus metrics of this process."""
    return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)
