"""An inbox whose messages reach a plain function as the bytes the server sent, for bulk reads.

Reading history is the one place Strata takes in tens of thousands of messages a second on one
subscription, and nats-py's per-message path (a `Msg` object, its headers parsed, a queue, a
callback task) costs more than decoding and folding the message does: a read of a stream with
an ordered consumer that only counts stayed near 100,000 messages a second on an idle machine.
`RawInbox` takes a subscription's messages off the client's dispatch before that work (the
client's `_process_msg`, wrapped once per connection), so a read costs little more than the
parser's own. The wrapping depends on nats-py's private `_process_msg(sid, subject, reply, data,
headers)`; where a client version lacks it, the inbox falls back to an ordinary subscription
callback, slower and equivalent (`RAW_DISPATCH` says which one runs).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Awaitable, Callable
from typing import Any, Final

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

Deliver = Callable[[str, str, bytes, bytes | None], None]
"""Called with (subject, reply, payload, raw headers or None) for every message, in order."""

_EXPECTED = ["self", "sid", "subject", "reply", "data", "headers"]


def _has_raw_dispatch() -> bool:
    method = getattr(NATS, "_process_msg", None)
    if method is None or not inspect.iscoroutinefunction(method):
        return False
    return list(inspect.signature(method).parameters) == _EXPECTED


RAW_DISPATCH: Final = _has_raw_dispatch()
"""Whether this nats-py lets `RawInbox` take messages before the client builds them."""


class _Dispatch:
    """Stands in for one client's `_process_msg`: messages of the raw inboxes go to their
    functions, every other message to the client's own method, as before."""

    def __init__(self, nc: NATS) -> None:
        self.original: Callable[..., Awaitable[None]] = nc._process_msg
        self.handlers: dict[int, Deliver] = {}

    async def __call__(
        self, sid: int, subject: bytes, reply: bytes, data: bytes, headers: bytes | None
    ) -> None:
        handler = self.handlers.get(sid)
        if handler is None:
            await self.original(sid, subject, reply, data, headers)
            return
        handler(subject.decode(), reply.decode(), data, headers)


_DISPATCHES: weakref.WeakKeyDictionary[NATS, _Dispatch] = weakref.WeakKeyDictionary()


def _headers_of(msg: Msg) -> bytes | None:
    """The status line and headers of a message the client parsed, in their wire form."""
    if not msg.headers:
        return None
    fields = dict(msg.headers)
    status = fields.pop("Status", "")
    description = fields.pop("Description", "")
    first = f"NATS/1.0 {status} {description}".rstrip() if status else "NATS/1.0"
    lines = [first, *(f"{name}: {value}" for name, value in fields.items())]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


class RawInbox:
    """A subscription to a fresh inbox of `nc` whose messages go to `deliver` as they are parsed.

    `deliver` runs on the client's reading task, between two parsed messages: it must not block
    or raise. Close the inbox when done; the client's own dispatch is restored with the last one.
    """

    def __init__(self, nc: NATS, deliver: Deliver, raw: bool = RAW_DISPATCH) -> None:
        self._nc = nc
        self._deliver = deliver
        self.raw = raw and RAW_DISPATCH
        """Whether messages skip the client's dispatch (else: an ordinary callback)."""
        self.subject = nc.new_inbox()
        self._sub: Subscription | None = None

    async def open(self) -> RawInbox:
        if not self.raw:

            async def parsed(msg: Msg) -> None:
                self._deliver(msg.subject, msg.reply, msg.data, _headers_of(msg))

            self._sub = await self._nc.subscribe(self.subject, cb=parsed, pending_msgs_limit=-1)
            return self
        self._sub = await self._nc.subscribe(self.subject)
        dispatch = _DISPATCHES.get(self._nc)
        if dispatch is None:
            dispatch = _DISPATCHES[self._nc] = _Dispatch(self._nc)
            vars(self._nc)["_process_msg"] = dispatch
        dispatch.handlers[self._sub._id] = self._deliver
        return self

    async def close(self) -> None:
        sub, self._sub = self._sub, None
        if sub is None:
            return
        dispatch = _DISPATCHES.get(self._nc)
        if dispatch is not None:
            dispatch.handlers.pop(sub._id, None)
            if not dispatch.handlers:
                del _DISPATCHES[self._nc]
                if vars(self._nc).get("_process_msg") is dispatch:
                    del vars(self._nc)["_process_msg"]
        if not self._nc.is_closed:
            await sub.unsubscribe()

    async def __aenter__(self) -> RawInbox:
        return await self.open()

    async def __aexit__(self, *exc: Any) -> None:
        await self.close()
