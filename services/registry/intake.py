"""Heartbeat intake below nats-py's per-message machinery: a client that hands the messages of
chosen subscriptions straight to a plain function, in the order its protocol parser reads them.

nats-py gives every message a `Msg`, parses its headers, and passes it through a queue to a task
per subscription: more than half of what one heartbeat costs a registry. Heartbeats need none of
it (their one header, `Nats-Msg-Id`, is for the telemetry stream's deduplication). Taken here,
a heartbeat is applied before the parser reads the next message, so once a `flush()` returns,
every heartbeat the server routed to this client before it has been applied.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from nats.aio.client import Client as NATS
from nats.aio.subscription import Subscription

log = structlog.get_logger("strata.registry")

Handler = Callable[[bytes, bytes], None]
"""Takes (subject, payload) of one message; must not block, and never raises (see below)."""


class IntakeClient(NATS):
    """A nats-py client whose direct subscriptions skip `Msg`, headers and queues."""

    def __init__(self) -> None:
        super().__init__()
        self._direct: dict[int, Handler] = {}
        self.handler_errors = 0

    async def subscribe_direct(self, subject: str, handler: Handler) -> Subscription:
        """Subscribe `subject`, every message of it handed to `handler` as it is parsed.

        The subscription keeps its id through reconnects (nats-py subscribes it again under the
        same one), so the handler stays attached.
        """
        sub = await self.subscribe(subject)
        self._direct[sub._id] = handler
        return sub

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        handler = self._direct.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        stats = self.stats
        stats["in_msgs"] += 1
        stats["in_bytes"] += len(data)
        try:
            handler(subject, data)
        except Exception:  # one message must never stop the connection's reader
            self.handler_errors += 1
            if self.handler_errors == 1 or self.handler_errors % 1000 == 0:
                log.exception("heartbeat_not_taken", errors=self.handler_errors)
