"""Which services are up, and the subject layout, for people and scripts watching a deployment."""

from __future__ import annotations

import asyncio
import time
from typing import Any

from fastapi import APIRouter, Request
from strata.errors import StrataError
from strata.events import subjects
from strata.events.rpc import RPC_SERVICES, STATUS_INTERVAL_S, PingResult
from strata.services.gateway.context import gateway

router = APIRouter(tags=["status"])


@router.get("/services")
async def services(request: Request) -> dict[str, Any]:
    """Which services are up: each announces itself every few seconds; one not heard from
    within three announcements is down. Before the gateway has listened that long, a
    service not yet heard from is asked with a ping."""
    state = gateway(request)
    if state.bus is None:
        return {"services": {name: {"up": False, "error": "no NATS"} for name in RPC_SERVICES}}
    connected = state.bus
    stale_after = 3 * STATUS_INTERVAL_S
    now = time.monotonic()

    async def status(name: str) -> dict[str, Any]:
        heard = state.announced.get(name)
        if heard is not None and now - heard[1] <= stale_after:
            return {
                "up": True,
                **heard[0].model_dump(),
                "heard_s_ago": round(now - heard[1], 2),
            }
        listening = state.listening_since
        if listening is not None and now - listening > stale_after:
            silent = f"no announcement for {stale_after:g}s" if heard else "never announced"
            return {"up": False, "error": silent, "code": "unavailable"}
        try:
            result = await connected.rpc.call(name, "ping", result=PingResult, timeout=1.0)
        except StrataError as exc:
            return {"up": False, "error": exc.message, "code": exc.code}
        return {"up": True, **result.model_dump()}

    answers = await asyncio.gather(*(status(name) for name in RPC_SERVICES))
    return {"services": dict(zip(RPC_SERVICES, answers, strict=True))}


@router.get("/subjects")
async def subject_layout() -> dict[str, str]:
    """The subject layout, for people writing their own consumers."""
    return {
        "events": subjects.all_events(),
        "heartbeats": subjects.all_heartbeats(),
        "metrics": subjects.all_metrics(),
        "rpc": subjects.rpc_layout(),
    }
