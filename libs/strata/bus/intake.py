"""Message intake below nats-py's per-message machinery: the connections a service takes its
workers' requests on (`RpcServer`'s partitions), and the registry's heartbeat intake
(`services/registry/intake.py`), share one frame parser here.

nats-py matches every control line with a regular expression, builds a `Msg` for every message,
and passes it through a queue to a task per subscription, about 10 µs a request: a service that
refuses a flood at that cost receives it more slowly than one client sends it, and the flood's
backlog then delays every later turn of the service's event loop. Here the leading run of whole
`MSG`/`HMSG` frames of the chosen subscriptions in each read is cut from the bytes and handed to
a plain function (subject, reply, payload), which sorts the request and may answer it at once
(`reply_now`) without an await; anything else (PING, INFO, errors, other subscriptions) goes
through nats-py's parser as before.

A flood arrives faster than it is read, so a read is always waiting and nats-py's read loop
would hand out one read after another without giving the event loop a turn: every other
connection of the process (another job's requests, the JetStream acknowledgements a handler
awaits) would wait behind tens of milliseconds of the flood. The parser hands out at most
`FRAMES_PER_TURN` frames between two turns of the event loop.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import structlog
from nats.aio.client import Client as NATS
from nats.aio.client import __version__ as nats_version
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.protocol.parser import AWAITING_CONTROL_LINE, Parser

log = structlog.get_logger("strata.rpc")

FAST_LANE_RELEASES = ("2.16.",)
"""nats-py releases whose parser, `_process_msg` and outgoing buffer this module is written
against and tested with. With any other, a direct subscription is a plain one (correct, and as
slow as nats-py is)."""
FAST_LANE = nats_version.startswith(FAST_LANE_RELEASES)

FRAMES_PER_TURN = 512
"""Direct frames handed out between two turns of the event loop: 0.5-2.5 ms of work at 1-5 µs a
frame (a turn costs about what 10-25 frames do: fewer a turn would cost a flood's reading more).
Counted across reads, since nats-py's read loop takes the next read without a turn of the event
loop while the socket's bytes are already buffered."""

FrameHandler = Callable[[bytes, bytes, bytes], None]
"""Takes (subject, reply subject or b"", payload) of one message; must not block. An exception it
raises is counted and logged, and the next message is read as usual."""
RequestHandler = FrameHandler


class ReadingClient(NATS):
    """A nats-py client whose read loop survives a late PONG, and that says whether it reads."""

    @property
    def reader_alive(self) -> bool:
        """Whether the connection's read loop still runs. nats-py keeps a client whose read loop
        died "connected" (and then answers `flush()` at once): such a client hears nothing."""
        task = self._reading_task
        return task is not None and not task.done()

    async def _process_pong(self) -> None:
        # nats-py 2.16's `flush(timeout)` cancels its future when the PONG is late and leaves it
        # queued; the late PONG then sets the result of a cancelled future, and the
        # InvalidStateError ends the read loop. A PONG for a wait given up is dropped here.
        if self._pongs:
            future = self._pongs.pop(0)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


class DirectIntakeClient(ReadingClient):
    """A nats-py client whose direct subscriptions skip the parser's regular expressions, `Msg`,
    headers and queues: each of their messages is handed to a plain function as it is read."""

    failure_event = "message_not_taken"
    """The log line of a handler's exception."""
    log: Any = log

    def __init__(self) -> None:
        super().__init__()
        self.direct: dict[int, FrameHandler] = {}
        self.after_read: list[Callable[[], None]] = []
        """Called once after each run of direct messages was handed out: a handler may keep its
        counts until then."""
        self.handler_errors = 0
        if FAST_LANE:
            self._ps = DirectParser(self)

    async def _subscribe_direct(
        self,
        subject: str,
        handler: FrameHandler,
        queue: str = "",
        after_read: Callable[[], None] | None = None,
    ) -> Subscription:
        """Subscribe `subject` (in `queue`), every message of it handed to `handler` as it is
        read, and `after_read` called after each run that handed one out. The subscription keeps
        its id through reconnects (nats-py subscribes it again under the same one), so the
        handler stays attached."""
        if after_read is not None and after_read not in self.after_read:
            self.after_read.append(after_read)
        if not FAST_LANE:

            async def take(msg: Msg) -> None:
                try:
                    handler(msg.subject.encode(), msg.reply.encode(), msg.data)
                except Exception:
                    self.handler_failed()
                self.read_done()

            return await self.subscribe(subject, queue=queue, cb=take)
        sub = await self.subscribe(subject, queue=queue)
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
            handler(subject, reply, data)
        except Exception:
            self.handler_failed()
        self.read_done()

    def read_done(self) -> None:
        """Run the `after_read` callbacks."""
        for callback in self.after_read:
            try:
                callback()
            except Exception:
                self.handler_failed()

    def handler_failed(self) -> None:
        """Count and log (sparingly) the exception being handled: one message must never stop
        the connection's reader."""
        self.handler_errors += 1
        if self.handler_errors == 1 or self.handler_errors % 1000 == 0:
            self.log.exception(self.failure_event, errors=self.handler_errors)


class RequestIntakeClient(DirectIntakeClient):
    """The intake of a service's requests: direct subscriptions in a queue group, and answers
    queued without an await."""

    failure_event = "request_not_taken"

    async def subscribe_direct(
        self,
        subject: str,
        handler: RequestHandler,
        *,
        queue: str = "",
        after_read: Callable[[], None] | None = None,
    ) -> Subscription:
        """Subscribe `subject` (in `queue`), every message of it handed to `handler` as it is
        read, and `after_read` called after each run of them."""
        return await self._subscribe_direct(subject, handler, queue, after_read)

    def reply_now(self, subject: bytes, payload: bytes) -> bool:
        """Queue a message on `subject` for the connection's flusher, without an await: a flood's
        refusals are written in one go after the read that brought them. False (nothing queued)
        while the connection is down or its outgoing buffer is full: the caller's request then
        goes unanswered, as it would had the connection dropped it."""
        if not FAST_LANE:
            return False
        if not self.is_connected or self._flush_queue is None:
            return False
        command = b"PUB %s %d\r\n%s\r\n" % (subject, len(payload), payload)
        if 0 < self._max_pending_size < self._pending_data_size + len(command):
            return False
        self._pending.append(command)
        self._pending_data_size += len(command)
        self.stats["out_msgs"] += 1
        self.stats["out_bytes"] += len(payload)
        if self._flush_queue.empty():
            self._flush_queue.put_nowait(asyncio.get_running_loop().create_future())  # wake it
        return True


class DirectParser(Parser):
    """nats-py's protocol parser with a fast lane: the run of whole `MSG`/`HMSG` frames of direct
    subscriptions at the start of what is buffered is handed out here, `FRAMES_PER_TURN` at a
    time with a turn of the event loop between; the first thing of any other kind, and
    everything after it, is nats-py's to parse as it always does."""

    def __init__(self, nc: DirectIntakeClient, frames_per_turn: int = FRAMES_PER_TURN) -> None:
        super().__init__(nc)
        self._intake = nc
        self.frames_per_turn = frames_per_turn
        self._handed = 0
        """Frames handed out since the event loop last had a turn here."""

    async def parse(self, data: bytes = b"") -> None:
        if self.state == AWAITING_CONTROL_LINE and self._intake.direct:
            if self.buf:  # the partial frame the last read ended with
                self.buf.extend(data)
                data = bytes(self.buf)
                self.buf.clear()
            at = 0
            while True:
                at = self._take_direct(data, at)
                if self._handed < self.frames_per_turn:
                    break
                # Another connection's messages (and this one's PINGs) get their turn.
                self._handed = 0
                await asyncio.sleep(0)
            if at:
                data = data[at:]
        await super().parse(data)

    def _take_direct(self, data: bytes, at: int) -> int:
        """Hand out the whole frames of direct subscriptions from `at` on, up to the turn's
        count; where they end."""
        intake = self._intake
        direct = intake.direct
        size = len(data)
        messages = payload_bytes = 0
        for _ in range(self.frames_per_turn - self._handed):
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
            extra = len(fields) - (4 if with_headers else 3)
            if extra == 0:
                reply = b""
            elif extra == 1:
                reply = fields[2]
            else:
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
                if not fields[-2].isdigit():
                    break
                body_at += int(fields[-2])
            payload = data[body_at:end]
            try:
                handler(fields[0], reply, payload)
            except Exception:
                intake.handler_failed()
            messages += 1
            payload_bytes += end - body_at
            at = end + 2
        if messages:
            self._handed += messages
            intake.stats["in_msgs"] += messages
            intake.stats["in_bytes"] += payload_bytes
            intake.read_done()
        return at
