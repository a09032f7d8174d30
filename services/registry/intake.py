"""Heartbeat intake below nats-py's per-message machinery: a client that hands the messages of
chosen subscriptions straight to a plain function, in the order they arrive.

nats-py matches every control line with a regular expression, gives every message a `Msg`, parses
its headers, and passes it through a queue to a task per subscription: more than what the
registry's own checks of a heartbeat cost. Heartbeats need none of it (their one header,
`Nats-Msg-Id`, is for the telemetry stream's deduplication). The messages of the chosen
subscriptions are cut from what the socket delivered by the parser the services' request intake
uses (`strata.bus.intake.DirectParser`), and anything else (PING, INFO, errors, other
subscriptions' messages) goes through nats-py's parser as before. A heartbeat is applied before
the next one is read, so once a `flush()` returns, every heartbeat the server routed to this
client before it has been applied.
"""

from __future__ import annotations

from typing import Any

import structlog
from nats.aio.subscription import Subscription
from strata.bus.intake import FAST_LANE, DirectIntakeClient, FrameHandler

__all__ = ["FAST_LANE", "IntakeClient"]


class IntakeClient(DirectIntakeClient):
    """A nats-py client whose direct subscriptions skip the parser's regular expressions, `Msg`,
    headers and queues."""

    log: Any = structlog.get_logger("strata.registry")

    async def subscribe_direct(self, subject: str, handler: FrameHandler) -> Subscription:
        """Subscribe `subject`, every message of it handed to `handler` (subject, reply subject or
        b"", payload) as it is read. The subscription keeps its id through reconnects (nats-py
        subscribes it again under the same one), so the handler stays attached."""
        return await self._subscribe_direct(subject, handler)
