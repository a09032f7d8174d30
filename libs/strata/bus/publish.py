"""Publishing events to JetStream so that an acknowledged event is stored exactly once.

Each event's id is its `Nats-Msg-Id`, so a publish can be retried through the transient failures of
a cluster (no responders while a stream elects a leader, timeouts, a reconnect) until a deadline
without ever storing a second copy. Optimistic concurrency goes through
`Nats-Expected-Last-Subject-Sequence`; a lost race is a `ConflictError`, never retried. With an
`AckJournal` (`STRATA_ACK_JOURNAL`), every acknowledged id is also appended to a file, so a test can
check from the outside that nothing acknowledged went missing from the stream.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck

from strata.bus.connection import backoff_delays, is_transient
from strata.errors import BusError, ConflictError, PublishTimeout
from strata.events import encode_event, subject_for
from strata.events.models import Event

MSG_ID = "Nats-Msg-Id"
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
EXPECTED_SUBJECT = "Nats-Expected-Last-Subject-Sequence-Subject"
"""The subject (wildcards allowed) the expected last sequence is checked on, when it is not the
one published to (nats-server 2.11 and later)."""
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-sequence check


class AckJournal:
    """Appends `<msg id> <stream> <seq>` for every acknowledged publish to a file.

    Each line is one write to a file opened for appending, so several processes can share the
    file and a process killed mid-run leaves whole lines behind.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self._file = path.open("ab", buffering=0)

    def record(self, msg_id: str, ack: PubAck) -> None:
        if not self._file.closed:
            self._file.write(f"{msg_id} {ack.stream} {ack.seq}\n".encode())

    def close(self) -> None:
        self._file.close()


@dataclass(frozen=True)
class PublishOptions:
    attempt_timeout: float = 2.0
    deadline: float = 30.0
    initial_backoff: float = 0.02
    max_backoff: float = 1.0
    journal: AckJournal | None = None
    """Where acknowledged ids are recorded, if anywhere."""


DEFAULT_PUBLISH = PublishOptions()


def _refusal(
    exc: BaseException, subject: str, expected_last_subject_seq: int | None
) -> Exception | None:
    """The error to raise at once for a failed attempt, or None when it is worth retrying."""
    if isinstance(exc, nats.js.errors.APIError) and exc.err_code == WRONG_LAST_SEQUENCE:
        return ConflictError(
            f"{subject} moved on since sequence {expected_last_subject_seq}: "
            "another writer got there first; reload the state and decide again"
        )
    if isinstance(exc, nats.errors.ConnectionClosedError):
        return BusError(f"cannot publish to {subject}: the NATS connection is closed")
    if is_transient(exc):
        return None
    if isinstance(exc, nats.js.errors.APIError):
        return BusError(f"JetStream refused the publish to {subject}: {exc}")
    return BusError(f"cannot publish to {subject}: {type(exc).__name__}: {exc}")


async def publish_bytes(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    msg_id: str,
    *,
    expected_last_subject_seq: int | None = None,
    expected_subject: str | None = None,
    options: PublishOptions = DEFAULT_PUBLISH,
) -> PubAck:
    """Publish with dedup id and retries; returns the ack (`duplicate` set if already stored).

    With `expected_last_subject_seq`, stored only if the last message on `subject` (or on
    `expected_subject`, which may hold wildcards) has that sequence (0: none)."""
    ack = await _publish_with_retries(
        js, subject, payload, msg_id, expected_last_subject_seq, options, expected_subject
    )
    if options.journal is not None:
        options.journal.record(msg_id, ack)
    return ack


async def _publish_with_retries(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    msg_id: str,
    expected_last_subject_seq: int | None,
    options: PublishOptions,
    expected_subject: str | None = None,
) -> PubAck:
    headers = {MSG_ID: msg_id}
    if expected_last_subject_seq is not None:
        headers[EXPECTED_LAST_SUBJECT_SEQ] = str(expected_last_subject_seq)
        if expected_subject is not None:
            headers[EXPECTED_SUBJECT] = expected_subject
    # The first attempt carries no retry bookkeeping: it is the one that almost always succeeds.
    try:
        return await js.publish(subject, payload, timeout=options.attempt_timeout, headers=headers)
    except (TimeoutError, nats.errors.Error) as exc:
        refusal = _refusal(exc, subject, expected_last_subject_seq)
        if refusal is not None:
            raise refusal from None
        last_error: BaseException = exc
    # Remembered across attempts: a last attempt cut short by the deadline ends in a timeout.
    no_stream = isinstance(last_error, nats.js.errors.NoStreamResponseError)
    deadline = time.monotonic() + options.deadline
    delays = backoff_delays(options.initial_backoff, options.max_backoff)
    attempts = 1
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            hint = "Is the stream's cluster up and does it have a leader?"
            if no_stream:
                hint = (
                    "No stream answered for this subject: are the streams provisioned "
                    "(Bus.ensure_streams, or strata up) and does the stream have a leader?"
                )
            raise PublishTimeout(
                f"no acknowledgement for {subject} (msg id {msg_id}) after {attempts} attempts "
                f"over {options.deadline:.1f}s; last error: {type(last_error).__name__} "
                f"{last_error}. {hint}"
            )
        await asyncio.sleep(min(next(delays), remaining))
        attempts += 1
        remaining = deadline - time.monotonic()
        try:
            return await js.publish(
                subject,
                payload,
                timeout=max(0.001, min(options.attempt_timeout, remaining)),
                headers=headers,
            )
        except (TimeoutError, nats.errors.Error) as exc:
            refusal = _refusal(exc, subject, expected_last_subject_seq)
            if refusal is not None:
                raise refusal from None
            last_error = exc
            no_stream = no_stream or isinstance(exc, nats.js.errors.NoStreamResponseError)


async def publish_event(
    js: JetStreamContext,
    event: Event,
    *,
    expected_last_subject_seq: int | None = None,
    expected_subject: str | None = None,
    options: PublishOptions = DEFAULT_PUBLISH,
) -> PubAck:
    return await publish_bytes(
        js,
        subject_for(event),
        encode_event(event),
        event.id,
        expected_last_subject_seq=expected_last_subject_seq,
        expected_subject=expected_subject,
        options=options,
    )


async def publish_events(
    js: JetStreamContext,
    events: Sequence[Event],
    *,
    window: int = 256,
    options: PublishOptions = DEFAULT_PUBLISH,
) -> list[PubAck]:
    """Publish many events with up to `window` acks outstanding; acks come back in input order.

    Events are sent pipelined on the connection (so they are stored in input order), each ack
    awaited for at most one attempt's timeout. An event whose first attempt fails goes through
    `publish_bytes`'s retries alone: its id makes a re-send harmless if it was stored after all.
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    encoded = [(subject_for(e), encode_event(e), e.id) for e in events]
    results: list[PubAck | None] = [None] * len(encoded)
    failed: list[int] = []
    in_flight: deque[tuple[int, float, asyncio.Future[PubAck]]] = deque()
    loop = asyncio.get_running_loop()

    async def settle_oldest() -> None:
        index, sent_at, future = in_flight.popleft()
        if not future.done():
            # Only a late ack costs a timed wait; most are in by the time the window is full.
            late_by = sent_at + options.attempt_timeout - loop.time()
            if late_by > 0:
                await asyncio.wait((future,), timeout=late_by)
            if not future.done():
                future.cancel()
                failed.append(index)
                return
        if future.cancelled() or future.exception() is not None:
            failed.append(index)
        else:
            results[index] = ack = future.result()
            if options.journal is not None:
                options.journal.record(encoded[index][2], ack)

    for index, (subject, payload, msg_id) in enumerate(encoded):
        while in_flight and (len(in_flight) >= window or in_flight[0][2].done()):
            await settle_oldest()
        try:
            # No wait_stall: with one, nats-py yields to the loop on every call, which sends each
            # message in its own write. The window keeps us far below its pending limit anyway.
            future = await js.publish_async(subject, payload, headers={MSG_ID: msg_id})
        except (TimeoutError, nats.errors.Error):
            failed.append(index)
            continue
        in_flight.append((index, loop.time(), future))
    while in_flight:
        await settle_oldest()
    for index in sorted(failed):
        subject, payload, msg_id = encoded[index]
        results[index] = await publish_bytes(js, subject, payload, msg_id, options=options)
    return [ack for ack in results if ack is not None]


async def publish_telemetry(nc: NATS, event: Event) -> None:
    """Fire-and-forget publish (heartbeats, samples): the client buffers through a reconnect."""
    await nc.publish(subject_for(event), encode_event(event), headers={MSG_ID: event.id})
