"""The gateway as a Strata service: uvicorn serving the app, on the runtime's NATS connection."""

from __future__ import annotations

import asyncio
import contextlib

import uvicorn
from strata.bus import Bus
from strata.config import Settings
from strata.services.gateway.app import GatewayState, create_app


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service runtime owns SIGTERM and SIGINT."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


class Gateway:
    name = "gateway"

    def __init__(self, host: str = "0.0.0.0") -> None:
        self._host = host
        self.state = GatewayState()
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self, bus: Bus, settings: Settings) -> None:
        self.state.bus = bus
        self.state.streams_ready = True  # the runtime provisions the streams before start()
        config = uvicorn.Config(
            create_app(self.state),
            host=self._host,
            port=settings.http_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
        )
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(), name="gateway-http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why the HTTP server could not start
                raise RuntimeError("gateway HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    def ready(self) -> tuple[bool, str]:
        started = self._server is not None and self._server.started
        return (True, "ok") if started else (False, "HTTP server not started")


def create() -> Gateway:
    return Gateway()
