"""Reading a job's history from JetStream: its events and heartbeats in stored order, within bounds.

What is read passes the provenance rule first (an event on its own subject from a source that may
emit it, a heartbeat on its own worker's subject: `strata.events.provenance`); what does not is
skipped and counted in `strata_messages_rejected_total`, like a malformed message.
"""

from __future__ import annotations

import asyncio
import contextlib
import datetime
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Final

from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import ConsumerConfig, DeliverPolicy

from strata.errors import StrataError
from strata.events import (
    AnyEvent,
    MetricSampled,
    WorkerHeartbeat,
    decode_event,
    provenance,
    subjects,
)
from strata.history.records import Record, Stream
from strata.metrics import MESSAGES_REJECTED

READ_AHEAD_MSGS: Final = 8192
READ_BUFFER_MSGS: Final = 65_536
STALLED_S: Final = 10.0


REPLAY_CONSUMER: Final = "replay"
"""How reads of history name themselves in `strata_messages_rejected_total`."""


async def stream_records(
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
    too). An ordered push consumer feeding a callback: nats-py's pull `fetch` and its message
    iterator both cost a task per message, which made reading slower than folding."""
    name = subjects.EVENTS_STREAM if stream == "events" else subjects.TELEMETRY_STREAM
    config = ConsumerConfig()
    if start_seq is not None and start_seq > 1:
        config.deliver_policy = DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = start_seq
    elif start_ns is not None:
        config.deliver_policy = DeliverPolicy.BY_START_TIME
        config.opt_start_time = datetime.datetime.fromtimestamp(start_ns / 1e9, datetime.UTC)
    inbox: asyncio.Queue[Msg] = asyncio.Queue(maxsize=READ_AHEAD_MSGS)
    sub = await js.subscribe(
        filter_subject,
        stream=name,
        ordered_consumer=True,
        config=config,
        cb=inbox.put,
        idle_heartbeat=2.0,
        pending_msgs_limit=READ_BUFFER_MSGS,
    )
    try:
        info = await sub.consumer_info()
        # Nothing pending may also mean "all of it is already in our buffer": only a consumer
        # that has delivered nothing at all has nothing to read.
        delivered = info.delivered.consumer_seq if info.delivered is not None else 0
        if (info.num_pending or 0) == 0 and not delivered:
            return
        while True:
            try:
                msg = inbox.get_nowait()
            except asyncio.QueueEmpty:
                # Only when the read ran dry: one timer per batch the server sends, not per message.
                try:
                    msg = await asyncio.wait_for(inbox.get(), STALLED_S)
                except TimeoutError:
                    return  # a message deleted while it was being read, say: end, don't hang
            meta = msg.metadata
            seq = meta.sequence.stream
            stored_ns = int(meta.timestamp.timestamp() * 1e9)
            if (until_seq is not None and seq > until_seq) or (
                until_ns is not None and stored_ns > until_ns
            ):
                return
            try:
                event: AnyEvent | None = decode_event(msg.data)
            except StrataError as exc:
                MESSAGES_REJECTED.labels(REPLAY_CONSUMER, exc.code).inc()
                event = None
            if event is not None:
                if stream == "telemetry" and not isinstance(event, WorkerHeartbeat | MetricSampled):
                    refused: provenance.Refusal | None = provenance.Refusal("not_a_heartbeat", "")
                else:
                    refused = provenance.refusal(msg.subject, event)
                if refused is None:
                    yield Record(seq, stored_ns, event, stream)
                else:
                    MESSAGES_REJECTED.labels(REPLAY_CONSUMER, refused.code).inc()
            if meta.num_pending == 0 or seq == until_seq:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def job_history(
    js: JetStreamContext,
    job: str,
    *,
    from_seq: int | None = None,
    since_ns: int | None = None,
    until_seq: int | None = None,
    until_ns: int | None = None,
    telemetry: bool = True,
) -> AsyncGenerator[Record, None]:
    """A job's events (and heartbeats, with `telemetry`) merged in stored order, within bounds.

    Bounds are events-stream sequences or stored times. Heartbeats start with the first event
    read, and with `until_seq` they stop at the last one, so the two streams stay one consistent
    cut of the history.
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
    async with contextlib.aclosing(events):
        head = await anext(events, None)
        if head is None:
            return
        if not telemetry:
            yield head
            async for record in events:
                yield record
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
