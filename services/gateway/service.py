"""The gateway as a Strata service: the live read model and uvicorn serving the app over it."""

from __future__ import annotations

import asyncio
import contextlib
import os

import structlog
import uvicorn
from fastapi import FastAPI
from strata._supervise import Supervisor
from strata.bus import Bus
from strata.config import Settings
from strata.history import ReplayLimits
from strata.services.gateway.app import API_TOKEN_ENV, DASHBOARD_DIST, GatewayState, create_app
from strata.services.gateway.assets import missing_dashboard_message
from strata.services.gateway.edge import EdgeGuard, guarded_protocol
from strata.services.gateway.live import LiveModel
from strata.services.gateway.metrics_history import MetricHistory
from strata.services.readmodel import SnapshotStore

log = structlog.get_logger("strata.gateway")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own signal handling: the service runtime owns SIGTERM and SIGINT."""

    def capture_signals(self) -> contextlib.AbstractContextManager[None]:  # type: ignore[override]
        return contextlib.nullcontext()


class Gateway:
    name = "gateway"
    provisions_streams = False

    def __init__(self, host: str | None = None, api_token: str | None = None) -> None:
        self._host = host
        """None: the settings' `listen_host`."""
        self._api_token = api_token
        self.state = GatewayState()
        self.live: LiveModel | None = None
        self.app: FastAPI | None = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None
        self.tasks = Supervisor(self.name)
        """The HTTP server's task and the live model's: one that dies makes the gateway unready
        and ends its process."""

    @property
    def port(self) -> int:
        """The port uvicorn listens on (the one chosen when settings asked for port 0)."""
        if self._server is None or not self._server.servers:
            raise RuntimeError("gateway HTTP server not started")
        return int(self._server.servers[0].sockets[0].getsockname()[1])

    async def start(self, bus: Bus, settings: Settings) -> None:
        if DASHBOARD_DIST is None:
            log.warning("dashboard_not_built", detail=missing_dashboard_message())
        self.state.bus = bus
        self.state.streams_ready = True  # the runtime provisions the streams before start()
        await self.state.listen_for_status(bus)
        snapshots = SnapshotStore(budget_bytes=settings.replay_snapshot_mb * 1024 * 1024)
        history = MetricHistory(budget_bytes=settings.gateway_metrics_mb * 1024 * 1024)
        self.live = await LiveModel(
            snapshots=snapshots, metric_history=history, tasks=self.tasks
        ).start(bus)
        self.state.live = self.live
        token = self._api_token if self._api_token is not None else os.environ.get(API_TOKEN_ENV)
        self.app = create_app(
            self.state,
            api_token=token or None,
            replay_limits=ReplayLimits(settings.replay_max_events, settings.replay_timeout),
            replay_concurrency=settings.replay_concurrency,
        )
        config = uvicorn.Config(
            self.app,
            host=self._host if self._host is not None else settings.listen_host,
            port=settings.http_port,
            log_level="warning",
            access_log=False,
            lifespan="off",
            # Push streams never end on their own: after this, stopping cuts them.
            timeout_graceful_shutdown=2,
            http=guarded_protocol(
                EdgeGuard(settings.gateway_header_timeout, settings.gateway_max_connections)
            ),
        )
        self._server = _EmbeddedServer(config)
        self._task = self.tasks.spawn(self._server.serve(), "http")
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why the HTTP server could not start
                raise RuntimeError("gateway HTTP server stopped during start-up")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._task is not None:
            # Its end is the supervisor's to report (a death is logged once, there).
            await asyncio.wait([self._task])
        if self.live is not None:
            await self.live.stop()

    def ready(self) -> tuple[bool, str]:
        if self.tasks.failure is not None:
            return self.tasks.status()
        if self._server is None or not self._server.started:
            return False, "HTTP server not started"
        if self.live is None or not self.live.caught_up.is_set():
            return False, "folding the event stream"
        return True, "ok"


def create() -> Gateway:
    return Gateway()
