"""The gateway's FastAPI application: probes, metrics, service status, and the dashboard's files.

The app reads everything through the `Bus` it is given, so tests can build it against any server.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import strata
from fastapi import FastAPI, Response
from fastapi.responses import JSONResponse
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from strata.bus import Bus
from strata.errors import StrataError
from strata.events import subjects
from strata.events.rpc import SERVICES, PingResult

DASHBOARD_DIST = Path(__file__).resolve().parents[2] / "dashboard" / "dist"


class GatewayState:
    """What the HTTP handlers need; `bus` is None until NATS is connected."""

    def __init__(self) -> None:
        self.bus: Bus | None = None
        self.streams_ready = False


def create_app(state: GatewayState, dashboard_dir: Path | None = DASHBOARD_DIST) -> FastAPI:
    app = FastAPI(
        title="Strata gateway",
        version=strata.__version__,
        description="State of Strata training jobs, for the dashboard and for scripts.",
    )

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"])
    async def readyz() -> JSONResponse:
        """Connected to NATS and the streams exist."""
        connected = state.bus is not None and state.bus.nc.is_connected
        ready = connected and state.streams_ready
        detail = "ok" if ready else ("streams not provisioned" if connected else "no NATS")
        return JSONResponse({"ready": ready, "detail": detail}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["probes"])
    async def metrics() -> Response:
        """Prometheus metrics of this process."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/api/services", tags=["status"])
    async def services() -> dict[str, Any]:
        """Which services answer a ping right now."""
        bus = state.bus
        if bus is None:
            return {"services": {name: {"up": False, "error": "no NATS"} for name in SERVICES}}

        async def ping(name: str) -> dict[str, Any]:
            try:
                result = await bus.rpc.call(name, "ping", result=PingResult, timeout=1.0)
            except StrataError as exc:
                return {"up": False, "error": exc.message, "code": exc.code}
            return {"up": True, **result.model_dump()}

        names = [name for name in SERVICES if name != "gateway"]
        answers = await asyncio.gather(*(ping(name) for name in names))
        return {"services": dict(zip(names, answers, strict=True))}

    @app.get("/api/subjects", tags=["status"])
    async def subject_layout() -> dict[str, str]:
        """The subject layout, for people writing their own consumers."""
        return {
            "events": subjects.all_events(),
            "heartbeats": subjects.all_heartbeats(),
            "metrics": subjects.all_metrics(),
            "rpc": f"{subjects.RPC}.<service>.<verb>",
        }

    if dashboard_dir is not None and (dashboard_dir / "index.html").is_file():
        app.mount("/", StaticFiles(directory=dashboard_dir, html=True), name="dashboard")
    return app
