"""The gateway's HTTP edge: how long a connection may take to send a request's headers, and how
many connections it may hold.

uvicorn waits for a request's headers as long as the client likes, and accepts every connection,
so clients that open sockets and send half a request line hold the gateway's file descriptors
until none are left. `EdgeGuard` closes a connection that has not sent a request's headers
within `header_timeout` of being opened (or of its previous response), and, past
`max_connections`, closes the oldest connection still waiting for headers to make room for a new
one: a request whose headers arrived is never cut, and a real client, which sends its headers at
once, always gets in ahead of those that never finish theirs. uvicorn's own keep-alive timeout
still closes idle connections between requests.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from prometheus_client import Counter
from strata.config import GATEWAY_HEADER_TIMEOUT_S, GATEWAY_MAX_CONNECTIONS
from uvicorn.protocols.http.h11_impl import H11Protocol

CONNECTIONS_CLOSED = Counter(
    "strata_gateway_connections_closed_total",
    "HTTP connections the gateway closed before a request's headers arrived, by reason",
    ["reason"],
)


@dataclass
class EdgeGuard:
    """The connections of one HTTP server and the bounds they are held to."""

    header_timeout: float = GATEWAY_HEADER_TIMEOUT_S
    max_connections: int = GATEWAY_MAX_CONNECTIONS
    waiting: dict[H11Protocol, asyncio.TimerHandle] = field(default_factory=dict)
    """Connections waiting for a request's headers, oldest first, with their deadline."""
    open: set[H11Protocol] = field(default_factory=set)

    def admit(self, conn: H11Protocol) -> None:
        """A new connection: it waits for headers; past the bound, the oldest waiting one goes
        (this one, when every other is busy with a request)."""
        self.open.add(conn)
        self.wait(conn)
        if len(self.open) > self.max_connections:
            oldest = next(iter(self.waiting))
            self.close(oldest, "max_connections")

    def wait(self, conn: H11Protocol) -> None:
        """`conn` waits for the headers of its next request (again)."""
        if conn.transport is None or conn.transport.is_closing():
            return
        self.started(conn)
        self.waiting[conn] = conn.loop.call_later(
            self.header_timeout, self.close, conn, "header_timeout"
        )

    def started(self, conn: H11Protocol) -> None:
        """A request's headers arrived on `conn`: it no longer waits."""
        timer = self.waiting.pop(conn, None)
        if timer is not None:
            timer.cancel()

    def forget(self, conn: H11Protocol) -> None:
        self.started(conn)
        self.open.discard(conn)

    def close(self, conn: H11Protocol, reason: str) -> None:
        if conn not in self.waiting:
            return
        self.forget(conn)
        CONNECTIONS_CLOSED.labels(reason=reason).inc()
        if not conn.transport.is_closing():
            conn.transport.close()


def guarded_protocol(guard: EdgeGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol, held to `guard` (pass it as `uvicorn.Config(http=...)`)."""

    class GuardedH11Protocol(H11Protocol):
        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            guard.admit(self)

        def connection_lost(self, exc: Exception | None) -> None:
            guard.forget(self)
            super().connection_lost(exc)

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:
                guard.started(self)

        def on_response_complete(self) -> None:
            # Before uvicorn's own, which may start a pipelined request at once.
            guard.wait(self)
            super().on_response_complete()

    return GuardedH11Protocol
