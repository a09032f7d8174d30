"""Reading a job's history from JetStream: its events and heartbeats in stored order, within bounds.

A read is one push consumer of its own (no acknowledgements, flow control, idle heartbeats) whose
messages reach a `RawInbox`: the stream position and stored time come from the reply subject the
server sends with each message, so nothing is parsed that the bounds do not need, and a message
is decoded only once it is known to be within them. Where the consumer's own sequence skips (a
message lost in a reconnect) or the server says the consumer is gone, the read goes on from the
last stream sequence taken with a new consumer, as nats-py's ordered consumer does.

What is read passes the provenance rule first (an event on its own subject from a source that may
emit it, a heartbeat on its own worker's subject: `strata.events.provenance`); what does not is
skipped and counted in `strata_messages_rejected_total`, like a malformed message.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
import enum
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Final

import nats.errors
import nats.js.errors
import structlog
from nats.js import JetStreamContext
from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

from strata.errors import BusError, StrataError
from strata.events import (
    EVENT_TYPES,
    AnyEvent,
    MetricSampled,
    WorkerHeartbeat,
    decode_event,
    provenance,
    subjects,
)
from strata.history.inbox import RawInbox
from strata.history.records import Record, Stream
from strata.logs import Throttle
from strata.metrics import MESSAGES_REJECTED

log = structlog.get_logger("strata.history")

STALLED_S: Final = 10.0
"""A read that receives nothing for this long ends (a message deleted while being read, say)."""
IDLE_HEARTBEAT_S: Final = 2.0
INACTIVE_S: Final = 60.0
"""The server removes a read's consumer this long after its reader went away without a word."""
MAX_RESTARTS: Final = 5
"""Consumers one read may start again in a row before it gives up with `BusError`."""
_JUDGED_KEPT: Final = 65_536
HEARTBEATS_MISSED: Final = 3
"""A following read that hears nothing for this many heartbeat intervals starts anew."""

REPLAY_CONSUMER: Final = "replay"
"""How reads of history name themselves in `strata_messages_rejected_total`."""

_STATUS: Final = b"NATS/1.0 "
_STALLED_HEADER: Final = b"Nats-Consumer-Stalled:"
_LAST_CONSUMER_HEADER: Final = b"Nats-Last-Consumer:"

Raw = tuple[int, int, str, bytes]
"""(stream sequence, stored time in ns, subject, payload) of one stored message."""


def _header(headers: bytes, name: bytes) -> str | None:
    at = headers.find(name)
    if at < 0:
        return None
    end = headers.find(b"\r\n", at)
    return headers[at + len(name) : end if end >= 0 else None].strip().decode()


class _Outcome(enum.Enum):
    MORE = "more"
    CAUGHT_UP = "caught_up"
    """The batch ends with the last message stored when the consumer started."""
    RESTART = "restart"
    """The consumer skipped or lost messages, or went away: read on from the last one taken."""


class _StreamRead:
    """The stored messages of one stream matching a filter, in batches, oldest first: up to what
    was stored when the read caught up, or, with `follow`, for as long as it is iterated (then
    `caught_up` is set once the first catch-up is taken)."""

    def __init__(
        self,
        js: JetStreamContext,
        stream: str,
        filter_subject: str,
        start_seq: int | None,
        start_ns: int | None,
        follow: bool = False,
        caught_up: asyncio.Event | None = None,
    ) -> None:
        self._js = js
        self._stream = stream
        self._filter = filter_subject
        self._start_seq = start_seq
        self._start_ns = start_ns
        self._follow = follow
        self.caught_up = caught_up if caught_up is not None else asyncio.Event()
        self._items: list[tuple[str, str, bytes]] = []
        """What arrived and was not taken yet: messages, and markers (an empty subject) for the
        control messages that must be handled in order (flow control, heartbeats)."""
        self._waiter: asyncio.Future[None] | None = None
        self._inbox: RawInbox | None = None
        self._consumer: str | None = None
        self._last_seq = 0
        self._last_delivered = 0

    # -- the server's side ------------------------------------------------------------------------

    def _arrived(self, subject: str, reply: str, data: bytes, headers: bytes | None) -> None:
        # Runs on the client's reading task for every message: append, wake, nothing more.
        if data or headers is None or not headers.startswith(_STATUS):
            self._items.append((subject, reply, data))
        elif reply:
            self._items.append(("", reply, b""))  # flow control: answered once all before is taken
        elif headers.startswith(b"NATS/1.0 100"):
            stalled = _header(headers, _STALLED_HEADER)
            if stalled:
                self._items.append(("", stalled, b""))
            last = _header(headers, _LAST_CONSUMER_HEADER)
            # An idle heartbeat: the consumer's last sequence sent, a check for a lost tail.
            self._items.append(("", "", (last if last and last.isdigit() else "0").encode()))
        else:
            self._items.append(("", "", b"restart"))  # the consumer is gone (409), say
        waiter = self._waiter
        if waiter is not None:
            self._waiter = None
            if not waiter.done():
                waiter.set_result(None)

    async def _start(self) -> int:
        """A consumer from where the read stands; how many messages it has to deliver."""
        await self._stop()
        self._items = []
        self._last_delivered = 0
        self._inbox = await RawInbox(self._js._nc, self._arrived).open()
        config = ConsumerConfig(
            deliver_subject=self._inbox.subject,
            ack_policy=AckPolicy.NONE,
            max_deliver=1,
            flow_control=True,
            idle_heartbeat=IDLE_HEARTBEAT_S,
            filter_subject=self._filter,
            mem_storage=True,
            num_replicas=1,
            inactive_threshold=INACTIVE_S,
        )
        if self._last_seq:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self._last_seq + 1
        elif self._start_seq is not None and self._start_seq > 1:
            config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = self._start_seq
        elif self._start_ns is not None:
            config.deliver_policy = DeliverPolicy.BY_START_TIME
            # Floored to the microsecond a datetime holds (a float would round some up, past
            # the message asked for); what the floor lets in early is dropped by `_records`.
            seconds, nanoseconds = divmod(self._start_ns, 1_000_000_000)
            config.opt_start_time = datetime.datetime.fromtimestamp(
                seconds, datetime.UTC
            ) + datetime.timedelta(microseconds=nanoseconds // 1000)
        info = await self._js.add_consumer(self._stream, config=config)
        self._consumer = info.name
        return info.num_pending or 0

    async def _restart(self, restarts: int) -> int:
        """`_start` again: a read gives up after `MAX_RESTARTS` in a row with `BusError`; one
        that follows keeps trying (NATS may be away for a while)."""
        if self._follow:
            while True:
                try:
                    return await self._start()
                except (nats.errors.Error, nats.js.errors.Error, TimeoutError) as exc:
                    log.warning("history_follow_restarting", stream=self._stream, error=str(exc))
                    await asyncio.sleep(min(5.0, 0.1 * 2 ** min(restarts, 6)))
        if restarts > MAX_RESTARTS:
            raise BusError(
                f"reading {self._stream} lost messages {restarts} times in a row; is the "
                "connection to NATS stable?"
            )
        return await self._start()

    async def _stop(self) -> None:
        inbox, self._inbox = self._inbox, None
        consumer, self._consumer = self._consumer, None
        if inbox is not None:
            await inbox.close()
        if consumer is not None:
            with contextlib.suppress(nats.errors.Error, nats.js.errors.Error, TimeoutError):
                await self._js.delete_consumer(self._stream, consumer)

    async def _arrival(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for something to arrive; False when nothing did."""
        if self._items:
            return True
        waiter = self._waiter = asyncio.get_running_loop().create_future()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(waiter, max(0.0, timeout))
        return bool(self._items)

    # -- the reader's side ------------------------------------------------------------------------

    async def batches(self) -> AsyncGenerator[list[Raw], None]:
        """Lists of stored messages, oldest first. A batch ends where a control message must be
        answered, so flow control is answered only once the reader has taken what came before:
        the server sends no further ahead of the reader than its flow control window."""
        restarts = 0
        try:
            pending = await self._restart(restarts)
            if pending == 0:
                self.caught_up.set()
                if not self._follow:
                    return
            last_data = time.monotonic()
            while True:
                wait = HEARTBEATS_MISSED * IDLE_HEARTBEAT_S
                if not self._follow:
                    wait = last_data + STALLED_S - time.monotonic()
                if await self._arrival(wait):
                    batch, outcome = await self._take()
                elif self._follow:
                    batch, outcome = [], _Outcome.RESTART  # not even a heartbeat: start anew
                elif time.monotonic() - last_data >= STALLED_S:
                    return
                else:
                    continue
                if batch:
                    restarts = 0
                    last_data = time.monotonic()
                    yield batch
                if outcome is _Outcome.CAUGHT_UP:
                    self.caught_up.set()
                    if not self._follow:
                        return
                elif outcome is _Outcome.RESTART:
                    restarts += 1
                    if await self._restart(restarts) == 0:
                        self.caught_up.set()
                        if not self._follow:
                            return
        finally:
            await self._stop()

    async def _take(self) -> tuple[list[Raw], _Outcome]:
        """What has arrived, up to the first control message that must wait for the reader
        (answered here once nothing is before it), and what the read does next."""
        items = self._items
        batch: list[Raw] = []
        delivered = self._last_delivered
        outcome = _Outcome.MORE
        caught_up = self.caught_up.is_set()
        first = 0
        index = 0
        while index < len(items):  # more may arrive while flow control is answered
            subject, reply, data = items[index]
            index += 1
            if subject:
                # $JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>, or with
                # the domain and account hash after ACK and a token more at the end.
                parts = reply.rsplit(".", 5)
                if not first:
                    first = 2 if reply.count(".") == 8 else 1
                consumer_seq = int(parts[first + 1])
                if consumer_seq != delivered + 1:
                    outcome = _Outcome.RESTART
                    break
                delivered = consumer_seq
                batch.append((int(parts[first]), int(parts[first + 2]), subject, data))
                if parts[first + 3] == "0" and not caught_up:
                    outcome = _Outcome.CAUGHT_UP
                    break
            elif reply:
                if batch:
                    index -= 1  # answered once the reader has taken the batch before it
                    break
                await self._js._nc.publish(reply, b"")
            elif data == b"restart" or int(data) > delivered:
                outcome = _Outcome.RESTART
                break
        self._last_delivered = delivered
        if batch:
            self._last_seq = batch[-1][0]
        del items[:index]
        return batch, outcome


AREAS: Final = frozenset(event_type.split(".")[0] for event_type in EVENT_TYPES)


def type_filter(job: str, prefix: str | None) -> tuple[str, str | None]:
    """The subject that selects a job's events of type `prefix` on the server (an area such as
    `barrier` or `barrier.`, or a full type), and what is left for the reader to check: a read
    of one kind of event then neither receives nor decodes the others."""
    if not prefix:
        return subjects.job_events(job), None
    if prefix in EVENT_TYPES:
        return subjects.event_subject(job, prefix), None
    area = prefix.removesuffix(".")
    if area in AREAS:
        return subjects.area_events(job, area), None
    return subjects.job_events(job), prefix


def stream_records(
    js: JetStreamContext,
    stream: Stream,
    filter_subject: str,
    *,
    start_seq: int | None = None,
    start_ns: int | None = None,
    until_seq: int | None = None,
    until_ns: int | None = None,
) -> AsyncGenerator[Record, None]:
    """Records of one stream matching `filter_subject`, oldest first, up to the bounds or to what
    is stored when the read catches up. Malformed messages are skipped (a live feed drops them
    too). A message past the bounds ends the read before it is decoded."""
    name = subjects.EVENTS_STREAM if stream == "events" else subjects.TELEMETRY_STREAM
    read = _StreamRead(js, name, filter_subject, start_seq, start_ns)
    return _records(read, stream, REPLAY_CONSUMER, until_seq, until_ns, start_ns)


def follow_records(
    js: JetStreamContext,
    stream: Stream,
    filter_subject: str,
    *,
    start_seq: int | None = None,
    caught_up: asyncio.Event | None = None,
    consumer: str = REPLAY_CONSUMER,
) -> AsyncGenerator[Record, None]:
    """Like `stream_records`, then every message stored after, for as long as it is iterated
    (through reconnects). `caught_up` is set once every message stored when it started has
    been taken; refusals are counted under `consumer`. The server sends no further ahead than
    its flow control window, so a slow reader holds a bounded buffer and loses nothing."""
    name = subjects.EVENTS_STREAM if stream == "events" else subjects.TELEMETRY_STREAM
    read = _StreamRead(js, name, filter_subject, start_seq, None, follow=True, caught_up=caught_up)
    return _records(read, stream, consumer, None, None, warn=Throttle())


async def _records(
    read: _StreamRead,
    stream: Stream,
    consumer: str,
    until_seq: int | None,
    until_ns: int | None,
    since_ns: int | None = None,
    warn: Throttle | None = None,
) -> AsyncGenerator[Record, None]:
    """The records of `read`'s messages within the bounds that decode and pass provenance; with
    `warn`, what is refused is logged now and then (never once per message: a sender controls
    how many it sends)."""
    telemetry = stream == "telemetry"

    def rejected(subject: str, code: str, message: str) -> None:
        MESSAGES_REJECTED.labels(consumer, code).inc()
        held_back = warn(code) if warn is not None else None
        if held_back is not None:
            log.warning(
                "event_rejected",
                consumer=consumer,
                subject=subject[:300],
                error=message,
                held_back=held_back,
            )

    # An event's provenance depends on its subject, job, type and source alone, and a history
    # repeats few of those: each is judged once.
    judged: dict[tuple[str, str, str, str], provenance.Refusal | None] = {}
    async with contextlib.aclosing(read.batches()) as batches:
        async for batch in batches:
            for seq, stored_ns, subject, data in batch:
                if (until_seq is not None and seq > until_seq) or (
                    until_ns is not None and stored_ns > until_ns
                ):
                    return
                if since_ns is not None and stored_ns < since_ns:
                    continue
                try:
                    event: AnyEvent = decode_event(data)
                except StrataError as exc:
                    rejected(subject, exc.code, exc.message)
                else:
                    refused: provenance.Refusal | None
                    if telemetry:
                        if isinstance(event, WorkerHeartbeat | MetricSampled):
                            refused = provenance.refusal(subject, event)
                        else:
                            refused = provenance.Refusal("not_a_heartbeat", "")
                    else:
                        key = (subject, event.job, event.type, event.source)
                        if key in judged:
                            refused = judged[key]
                        else:
                            refused = provenance.refusal(subject, event)
                            if isinstance(event, WorkerHeartbeat | MetricSampled):
                                pass  # their rule reads more fields: never remembered
                            elif len(judged) < _JUDGED_KEPT:
                                judged[key] = refused
                    if refused is None:
                        yield Record(seq, stored_ns, event, stream)
                    else:
                        rejected(subject, refused.code, refused.message)
                if seq == until_seq:
                    return


def job_history(
    js: JetStreamContext,
    job: str,
    *,
    from_seq: int | None = None,
    since_ns: int | None = None,
    until_seq: int | None = None,
    until_ns: int | None = None,
    telemetry: bool = False,
) -> AsyncGenerator[Record, None]:
    """A job's events (and heartbeats, with `telemetry=True`) merged in stored order, within bounds.

    Bounds are events-stream sequences or stored times. Heartbeats start with the first event
    read, and with `until_seq` they stop at the last one, so the two streams stay one consistent
    cut of the history. Without heartbeats this is the events' read itself, with no generator
    in between.
    """
    events = stream_records(
        js,
        "events",
        subjects.job_events(job),
        start_seq=from_seq,
        start_ns=since_ns,
        until_seq=until_seq,
        until_ns=until_ns,
    )
    if not telemetry:
        return events
    return _with_heartbeats(js, job, events, from_seq, since_ns, until_seq, until_ns)


async def _with_heartbeats(
    js: JetStreamContext,
    job: str,
    events: AsyncGenerator[Record, None],
    from_seq: int | None,
    since_ns: int | None,
    until_seq: int | None,
    until_ns: int | None,
) -> AsyncGenerator[Record, None]:
    async with contextlib.aclosing(events):
        head = await anext(events, None)
        if head is None:
            return
        beats = stream_records(
            js,
            "telemetry",
            subjects.job_heartbeats(job),
            start_ns=head.stored_ns if from_seq is not None else since_ns,
            until_ns=until_ns,
        )
        last_event_ns = head.stored_ns
        async with contextlib.aclosing(beats):
            async for beat in beats:
                while head is not None and head.stored_ns <= beat.stored_ns:
                    yield head
                    last_event_ns = head.stored_ns
                    head = await anext(events, None)
                if head is None and until_seq is not None and beat.stored_ns > last_event_ns:
                    break
                yield beat
        while head is not None:
            yield head
            head = await anext(events, None)


@dataclass(frozen=True)
class ReplayLimits:
    """How much one replay from NATS may take: a replay reads a job's whole history up to the
    point asked for, so without bounds one request could hold a reader for as long as the
    history is long. Defaults as in `strata.config.Settings`."""

    max_records: int = 250_000
    """Events, plus heartbeats when they are asked for."""
    timeout_s: float = 30.0
    max_planned_shards: int = 8_000_000
    """Shards planned over by the dataset registrations and re-plans folded: each costs work and
    memory in proportion to its dataset's shards, so a few small events can ask for a lot."""
    max_memory_bytes: int | None = None
    """Growth of the process's peak memory the replay may cause (None: not checked; a process of
    its own, like `strata replay --file`, checks it, a shared server cannot tell whose it is)."""
