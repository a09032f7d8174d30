"""The live push stream: Server-Sent Events of a job's dashboard whenever it changes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Final

from fastapi import APIRouter, Request
from fastapi.responses import StreamingResponse
from strata.services.gateway.context import JobId, live
from strata.services.gateway.live import LiveModel
from strata.services.readmodel import LiveRates

PUSH_INTERVAL_S: Final = 0.25
"""At most four pushes a second per stream: changes in between are coalesced into the next."""
RATES_CHECK_S: Final = 1.0
KEEPALIVE_S: Final = 15.0

router = APIRouter(tags=["state"])


@router.get(
    "/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"text/event-stream": {}}}},
)
async def stream(request: Request, job: JobId) -> StreamingResponse:
    """Server-Sent Events: `event: dashboard` with the whole dashboard whenever it changed
    (at most four a second, within a second of a change), and `: keepalive` every 15 s."""
    return StreamingResponse(
        _pushes(live(request), job),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _pushes(live: LiveModel, job: str) -> AsyncIterator[bytes]:
    """The body of one push stream; ends when the client goes (Starlette cancels it)."""
    with live.watching(job) as signal:
        yield b": connected\n\n"
        sent: tuple[int, LiveRates] | None = None
        last_push = -PUSH_INTERVAL_S
        last_write = time.monotonic()
        while True:
            state = live.job(job)
            now = time.monotonic()
            if state is not None and sent != (state.version, live.live_rates(job)):
                pause = PUSH_INTERVAL_S - (now - last_push)
                if pause > 0:
                    # Coalescing: whatever else changes during the pause goes out together.
                    await asyncio.sleep(pause)
                    continue
                body, rates = live.dashboard_json(state)
                sent = (state.version, rates)
                yield b"event: dashboard\ndata: " + body + b"\n\n"
                last_push = last_write = time.monotonic()
                continue
            quiet = KEEPALIVE_S - (now - last_write)
            if quiet <= 0:
                yield b": keepalive\n\n"
                last_write = now
                continue
            # Rates move with the clock as well as with events: look again within a second.
            await signal.wait(min(RATES_CHECK_S, quiet))
