"""Reading the event streams: an ordered feed (replay, then follow) and a durable, acked consumer.

Services are projections, so they mostly use `EventFeed`: an ephemeral ordered consumer from a start
sequence that says when it has caught up with the stream; with `provenance`, it also drops events
stored on another subject than their own or claiming a source that may not emit them
(`strata.events.provenance`), which is how every service and the gateway fold only what its owner
decided. `DurableConsumer` is for work that must be acknowledged. Both decode through the codec and
drop malformed messages with a counted reason (and a warning now and then, not one per message);
they never stop on one.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections import Counter
from collections.abc import AsyncGenerator, Awaitable, Callable
from dataclasses import dataclass

import nats.errors
import nats.js.errors
import structlog
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from strata.errors import StrataError
from strata.events import decode_event, provenance
from strata.events.models import AnyEvent
from strata.logs import Throttle
from strata.metrics import EVENTS_CONSUMED, MESSAGES_REJECTED

log = structlog.get_logger("strata.bus")

RejectHook = Callable[[str, StrataError], None]
FEED_BUFFER = 4096
"""Messages a feed holds for its reader; past that, nats-py's own pending limit takes over."""


@dataclass(frozen=True)
class Delivered:
    """One event read from a stream, with its stream sequence and publish time (ns)."""

    seq: int
    subject: str
    event: AnyEvent
    stored_ns: int


def _decode(msg: Msg) -> Delivered:
    meta = msg.metadata
    return Delivered(
        seq=meta.sequence.stream,
        subject=msg.subject,
        event=decode_event(msg.data),
        stored_ns=int(meta.timestamp.timestamp() * 1e9),
    )


class EventFeed:
    """Ordered events of one stream matching `filter_subject`, from a start point, then live.

    Iterate it (`async for d in feed`); `caught_up` is set once everything stored when the feed
    started has been delivered. Malformed messages are skipped and counted in `rejected`.
    """

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        filter_subject: str,
        *,
        start_seq: int | None = None,
        start_time: datetime.datetime | None = None,
        name: str = "feed",
        on_reject: RejectHook | None = None,
        provenance: bool = False,
    ) -> None:
        self._js = js
        self._provenance = provenance
        self._reject_log = Throttle()
        self._stream = stream
        self._filter = filter_subject
        self._start_seq = start_seq
        self._start_time = start_time
        self._name = name
        self._on_reject = on_reject
        self._sub: object | None = None
        # Filled by the subscription's callback and read here: nats-py's message iterator costs
        # a task and an asyncio.wait per message, the larger part of reading an event.
        self._buffer: asyncio.Queue[Msg | None] = asyncio.Queue(maxsize=FEED_BUFFER)
        self._consumed = EVENTS_CONSUMED.labels(name)
        self.caught_up = asyncio.Event()
        self._caught_up_at: int | None = None
        self.rejected: Counter[str] = Counter()
        self.last_seq = 0
        self.position = 0
        """Stream sequence of the last message taken, valid or rejected."""

    async def start(self) -> EventFeed:
        self._buffer = asyncio.Queue(maxsize=FEED_BUFFER)
        config = ConsumerConfig()
        if self._start_seq is not None and self._start_seq > 1:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self._start_seq
        elif self._start_time is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            config.opt_start_time = self._start_time
        sub = await self._js.subscribe(
            self._filter,
            stream=self._stream,
            cb=self._buffer.put,
            ordered_consumer=True,
            config=config,
            idle_heartbeat=2.0,
            pending_msgs_limit=65_536,
            pending_bytes_limit=256 * 1024 * 1024,
        )
        try:
            info = await sub.consumer_info()
        except BaseException:
            # Left subscribed, a retried start would leave a second consumer behind.
            with contextlib.suppress(nats.errors.Error):
                await sub.unsubscribe()
            raise
        self._sub = sub
        if (info.num_pending or 0) == 0:
            delivered = info.delivered
            if delivered is None or delivered.consumer_seq == 0:
                self.caught_up.set()
            else:
                # The server pushes at once, so "nothing pending" can mean "all of it is already
                # in this client's buffer": caught up once the last of that is delivered.
                self._caught_up_at = delivered.stream_seq
        return self

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()  # type: ignore[attr-defined]
            self._sub = None
            # The reader stops at this mark; what it has not taken yet is no longer wanted.
            while self._buffer.full():
                self._buffer.get_nowait()
            self._buffer.put_nowait(None)

    async def __aenter__(self) -> EventFeed:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    def _reject(self, subject: str, error: StrataError) -> None:
        self.rejected[error.code] += 1
        MESSAGES_REJECTED.labels(self._name, error.code).inc()
        held_back = self._reject_log(error.code)
        if held_back is not None:
            log.warning(
                "event_rejected",
                consumer=self._name,
                subject=subject[:300],
                error=str(error),
                held_back=held_back,
            )
        if self._on_reject is not None:
            self._on_reject(subject, error)

    async def __aiter__(self) -> AsyncGenerator[Delivered, None]:
        if self._sub is None:
            await self.start()
        buffer = self._buffer
        while (msg := await buffer.get()) is not None:
            meta = msg.metadata
            self.position = meta.sequence.stream
            # Set before handing the event out, so the code handling the last stored event
            # already sees `caught_up`.
            if meta.num_pending == 0 or (
                self._caught_up_at is not None and meta.sequence.stream >= self._caught_up_at
            ):
                self.caught_up.set()
            try:
                delivered = _decode(msg)
            except StrataError as exc:
                self._reject(msg.subject, exc)
                continue
            if self._provenance:
                refused = provenance.refusal(msg.subject, delivered.event)
                if refused is not None:
                    self._reject(msg.subject, StrataError(refused.message, code=refused.code))
                    continue
            self.last_seq = delivered.seq
            self._consumed.inc()
            yield delivered


Handler = Callable[[Delivered], Awaitable[None]]


class DurableConsumer:
    """A durable pull consumer: each event is handed to `handler` and acked once it returns.

    A handler that raises gets the event again after a delay (up to `max_deliver` times); a
    malformed message is terminated at once (it would never decode) and counted.
    """

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        durable: str,
        filter_subjects: list[str],
        handler: Handler,
        *,
        ack_wait: float = 30.0,
        max_deliver: int = 10,
        batch: int = 256,
        retry_delay: float = 1.0,
        on_reject: RejectHook | None = None,
    ) -> None:
        self._js = js
        self._stream = stream
        self._durable = durable
        self._filters = filter_subjects
        self._handler = handler
        self._ack_wait = ack_wait
        self._max_deliver = max_deliver
        self._batch = batch
        self._retry_delay = retry_delay
        self._on_reject = on_reject
        self._task: asyncio.Task[None] | None = None
        self._sub: JetStreamContext.PullSubscription | None = None
        self.rejected: Counter[str] = Counter()
        self.handled = 0

    async def start(self) -> DurableConsumer:
        config = ConsumerConfig(
            durable_name=self._durable,
            ack_policy=AckPolicy.EXPLICIT,
            ack_wait=self._ack_wait,
            max_deliver=self._max_deliver,
            max_ack_pending=self._batch * 4,
        )
        if len(self._filters) == 1:
            config.filter_subject = self._filters[0]
        else:
            config.filter_subjects = list(self._filters)
        await self._js.add_consumer(self._stream, config)
        sub = await self._js.pull_subscribe_bind(self._durable, self._stream)
        self._sub = sub
        self._task = asyncio.create_task(self._run(sub), name=f"consumer-{self._durable}")
        return self

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        # Left subscribed, replies to the cancelled fetch stay unread and a later drain of the
        # connection waits for them until its timeout.
        if self._sub is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._sub.unsubscribe()
            self._sub = None

    async def _run(self, sub: JetStreamContext.PullSubscription) -> None:
        while True:
            try:
                msgs = await sub.fetch(self._batch, timeout=1.0)
            except (TimeoutError, nats.errors.TimeoutError):
                continue
            except nats.errors.ConnectionClosedError:
                return
            except nats.errors.Error as exc:
                log.warning("fetch_failed", consumer=self._durable, error=str(exc))
                await asyncio.sleep(self._retry_delay)
                continue
            for msg in msgs:
                await self._handle(msg)

    async def _handle(self, msg: Msg) -> None:
        try:
            delivered = _decode(msg)
        except StrataError as exc:
            self.rejected[exc.code] += 1
            MESSAGES_REJECTED.labels(self._durable, exc.code).inc()
            log.warning(
                "event_rejected", consumer=self._durable, subject=msg.subject, error=str(exc)
            )
            if self._on_reject is not None:
                self._on_reject(msg.subject, exc)
            with contextlib.suppress(nats.errors.Error):
                await msg.term()
            return
        try:
            await self._handler(delivered)
        except Exception as exc:  # the handler's failure must not stop the consumer
            log.exception(
                "handler_failed", consumer=self._durable, seq=delivered.seq, error=str(exc)
            )
            with contextlib.suppress(nats.errors.Error):
                await msg.nak(delay=self._retry_delay)
            return
        self.handled += 1
        EVENTS_CONSUMED.labels(self._durable).inc()
        with contextlib.suppress(nats.errors.Error):
            await msg.ack()
