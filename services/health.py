"""A tiny HTTP endpoint for Kubernetes probes and Prometheus: /healthz, /readyz, /metrics.

Services other than the gateway have no web framework in them; this answers the three paths with
asyncio streams alone, so a probe never waits behind the service's own work.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Callable

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

ReadyCheck = Callable[[], tuple[bool, str]]

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}


class HealthServer:
    def __init__(self, service: str, ready: ReadyCheck, host: str = "0.0.0.0", port: int = 0):
        self.service = service
        self._ready = ready
        self._host = host
        self._port = port
        self._server: asyncio.Server | None = None

    @property
    def port(self) -> int:
        if self._server is None:
            return self._port
        return int(self._server.sockets[0].getsockname()[1])

    async def start(self) -> HealthServer:
        self._server = await asyncio.start_server(self._handle, self._host, self._port)
        return self

    async def stop(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await self._server.wait_closed()
            self._server = None

    def _route(self, method: str, path: str) -> tuple[int, str, bytes]:
        path = path.split("?", 1)[0]
        if method != "GET":
            return 405, "text/plain", b"only GET\n"
        if path == "/healthz":
            return 200, "application/json", json.dumps({"status": "ok"}).encode()
        if path == "/readyz":
            ready, detail = self._ready()
            body = json.dumps({"ready": ready, "service": self.service, "detail": detail})
            return (200 if ready else 503), "application/json", body.encode()
        if path == "/metrics":
            return 200, CONTENT_TYPE_LATEST, generate_latest()
        return 404, "text/plain", b"try /healthz, /readyz or /metrics\n"

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (
                b"\r\n",
                b"\n",
                b"",
            ):
                pass
            parts = request_line.decode("latin-1").split()
            status, ctype, body = (
                self._route(parts[0], parts[1]) if len(parts) >= 2 else (400, "text/plain", b"")
            )
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, 'Bad Request')}\r\n"
                f"Content-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode() + body)
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
