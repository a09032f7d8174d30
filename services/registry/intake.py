"""Heartbeat intake below nats-py's per-message machinery: a client that hands the messages of
chosen subscriptions straight to a plain function, in the order they arrive.

nats-py matches every control line with a regular expression, gives every message a `Msg`, parses
its headers, and passes it through a queue to a task per subscription: more than what the
registry's own checks of a heartbeat cost. Heartbeats need none of it (their one header,
`Nats-Msg-Id`, is for the telemetry stream's deduplication). Here the messages of the chosen
subscriptions are cut from what the socket delivered in one loop (`IntakeParser`), and anything
else (PING, INFO, errors, other subscriptions' messages) goes through nats-py's parser as before.
A heartbeat is applied before the next one is read, so once a `flush()` returns, every
heartbeat the server routed to this client before it has been applied.
"""

from __future__ import annotations

from collections.abc import Callable

import structlog
from nats.aio.client import __version__ as nats_version
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser
from strata.bus.intake import ReadingClient

log = structlog.get_logger("strata.registry")

FAST_LANE_RELEASES = ("2.16.",)
"""nats-py releases whose parser and `_process_msg` this module is written against and tested
with. With any other, a direct subscription is a plain one (correct, and as slow as before)."""
FAST_LANE = nats_version.startswith(FAST_LANE_RELEASES)

Handler = Callable[[bytes, bytes], None]
"""Takes (subject, payload) of one message; must not block. An exception it raises is counted
and logged, and the next message is read as usual."""


class IntakeClient(ReadingClient):
    """A nats-py client whose direct subscriptions skip the parser's regular expressions, `Msg`,
    headers and queues."""

    def __init__(self) -> None:
        super().__init__()
        self.direct: dict[int, Handler] = {}
        self.handler_errors = 0
        if FAST_LANE:
            self._ps = IntakeParser(self)

    async def subscribe_direct(self, subject: str, handler: Handler) -> Subscription:
        """Subscribe `subject`, every message of it handed to `handler` as it is read.

        The subscription keeps its id through reconnects (nats-py subscribes it again under the
        same one), so the handler stays attached.
        """
        if not FAST_LANE:

            async def take(msg: Msg) -> None:
                try:
                    handler(msg.subject.encode(), msg.data)
                except Exception:
                    self.handler_failed()

            return await self.subscribe(subject, cb=take)
        sub = await self.subscribe(subject)
        self.direct[sub._id] = handler
        return sub

    async def _process_msg(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        # A direct subscription's message that nats-py's parser read (one behind a PING in the
        # same read, say): handed out the same way.
        handler = self.direct.get(sid)
        if handler is None:
            await super()._process_msg(sid, subject, reply, data, headers)  # type: ignore[arg-type]
            return
        self.stats["in_msgs"] += 1
        self.stats["in_bytes"] += len(data)
        try:
            handler(subject, data)
        except Exception:
            self.handler_failed()

    def handler_failed(self) -> None:
        """Count and log (sparingly) the exception being handled: one message must never stop
        the connection's reader."""
        self.handler_errors += 1
        if self.handler_errors == 1 or self.handler_errors % 1000 == 0:
            log.exception("message_not_taken", errors=self.handler_errors)


class IntakeParser(Parser):
    """nats-py's protocol parser with a fast lane: the run of whole `MSG`/`HMSG` frames of direct
    subscriptions at the start of what is buffered is handed out here; the first thing of any
    other kind, and everything after it, is nats-py's to parse as it always does."""

    def __init__(self, nc: IntakeClient) -> None:
        super().__init__(nc)
        self._intake = nc

    async def parse(self, data: bytes = b"") -> None:
        if self.state == AWAITING_CONTROL_LINE and self._intake.direct:
            if self.buf:  # the partial frame the last read ended with
                self.buf.extend(data)
                data = bytes(self.buf)
                self.buf.clear()
            taken = self._take_direct(data)
            if taken:
                data = data[taken:]
        await super().parse(data)

    def _take_direct(self, data: bytes) -> int:
        """Hand out the leading whole frames of direct subscriptions; the bytes they took."""
        intake = self._intake
        direct = intake.direct
        size = len(data)
        at = messages = payload_bytes = 0
        while True:
            if data.startswith(b"HMSG ", at):
                with_headers, line_at = True, at + 5
            elif data.startswith(b"MSG ", at):
                with_headers, line_at = False, at + 4
            else:
                break
            line_end = data.find(b"\r\n", line_at)
            if line_end < 0:
                break
            # MSG <subject> <sid> [reply] <size>; HMSG <subject> <sid> [reply] <header size> <size>
            fields = data[line_at:line_end].split()
            if len(fields) != (4 if with_headers else 3):  # a reply, or malformed: nats-py's
                break
            sid, total = fields[1], fields[-1]
            if not (sid.isdigit() and total.isdigit()):
                break
            handler = direct.get(int(sid))
            if handler is None:
                break
            body_at = line_end + 2
            end = body_at + int(total)
            if end + 2 > size:
                break
            if with_headers:
                if not fields[2].isdigit():
                    break
                body_at += int(fields[2])
            payload = data[body_at:end]
            try:
                handler(fields[0], payload)
            except Exception:
                intake.handler_failed()
            messages += 1
            payload_bytes += end - body_at
            at = end + 2
        if messages:
            intake.stats["in_msgs"] += messages
            intake.stats["in_bytes"] += payload_bytes
        return at
