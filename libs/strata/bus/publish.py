"""Publishing events to JetStream so that an acknowledged event is stored exactly once.

Each event's id is its `Nats-Msg-Id`, so a publish can be retried through the transient failures of
a cluster (no responders while a stream elects a leader, timeouts, a reconnect) until a deadline
without ever storing a second copy. Optimistic concurrency goes through
`Nats-Expected-Last-Subject-Sequence`; a lost race is a `ConflictError`, never retried.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from dataclasses import dataclass

import nats.errors
import nats.js.errors
from nats.aio.client import Client as NATS
from nats.js import JetStreamContext
from nats.js.api import PubAck

from strata.bus.connection import backoff_delays
from strata.errors import BusError, ConflictError, PublishTimeout
from strata.events import encode_event, subject_for
from strata.events.models import Event

MSG_ID = "Nats-Msg-Id"
EXPECTED_LAST_SUBJECT_SEQ = "Nats-Expected-Last-Subject-Sequence"
WRONG_LAST_SEQUENCE = 10071  # JetStream's error code for a failed expected-sequence check
_TRANSIENT_STATUS = {408, 503}


@dataclass(frozen=True)
class PublishOptions:
    attempt_timeout: float = 2.0
    deadline: float = 30.0
    initial_backoff: float = 0.02
    max_backoff: float = 1.0


DEFAULT_PUBLISH = PublishOptions()


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, nats.js.errors.APIError) and not isinstance(
        exc, nats.js.errors.NoStreamResponseError
    ):
        return (exc.code or 0) in _TRANSIENT_STATUS
    return isinstance(
        exc,
        (
            nats.errors.TimeoutError,
            asyncio.TimeoutError,
            nats.errors.NoRespondersError,
            nats.js.errors.NoStreamResponseError,
            nats.errors.ConnectionReconnectingError,
            nats.errors.OutboundBufferLimitError,
            nats.errors.StaleConnectionError,
        ),
    )


async def publish_bytes(
    js: JetStreamContext,
    subject: str,
    payload: bytes,
    msg_id: str,
    *,
    expected_last_subject_seq: int | None = None,
    options: PublishOptions = DEFAULT_PUBLISH,
) -> PubAck:
    """Publish with dedup id and retries; returns the ack (`duplicate` set if already stored)."""
    headers = {MSG_ID: msg_id}
    if expected_last_subject_seq is not None:
        headers[EXPECTED_LAST_SUBJECT_SEQ] = str(expected_last_subject_seq)
    deadline = time.monotonic() + options.deadline
    delays = backoff_delays(options.initial_backoff, options.max_backoff)
    attempts = 0
    while True:
        attempts += 1
        remaining = deadline - time.monotonic()
        try:
            return await js.publish(
                subject,
                payload,
                timeout=max(0.001, min(options.attempt_timeout, remaining)),
                headers=dict(headers),
            )
        except nats.js.errors.APIError as exc:
            if exc.err_code == WRONG_LAST_SEQUENCE:
                raise ConflictError(
                    f"{subject} moved on since sequence {expected_last_subject_seq}: "
                    "another writer got there first; reload the state and decide again"
                ) from None
            if not _is_transient(exc):
                raise BusError(f"JetStream refused the publish to {subject}: {exc}") from None
            last_error: BaseException = exc
        except nats.errors.ConnectionClosedError:
            raise BusError(f"cannot publish to {subject}: the NATS connection is closed") from None
        except (TimeoutError, nats.errors.Error) as exc:
            if not _is_transient(exc):
                raise BusError(
                    f"cannot publish to {subject}: {type(exc).__name__}: {exc}"
                ) from None
            last_error = exc
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            hint = "Is the stream's cluster up and does it have a leader?"
            if isinstance(last_error, nats.js.errors.NoStreamResponseError):
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


async def publish_event(
    js: JetStreamContext,
    event: Event,
    *,
    expected_last_subject_seq: int | None = None,
    options: PublishOptions = DEFAULT_PUBLISH,
) -> PubAck:
    return await publish_bytes(
        js,
        subject_for(event),
        encode_event(event),
        event.id,
        expected_last_subject_seq=expected_last_subject_seq,
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

    Each event is retried on its own, so one slow ack never makes the others re-send.
    """
    if window < 1:
        raise ValueError("window must be at least 1")
    encoded = [(subject_for(e), encode_event(e), e.id) for e in events]
    results: list[PubAck | None] = [None] * len(encoded)
    gate = asyncio.Semaphore(window)

    async def one(index: int) -> None:
        subject, payload, msg_id = encoded[index]
        async with gate:
            results[index] = await publish_bytes(js, subject, payload, msg_id, options=options)

    await asyncio.gather(*(one(i) for i in range(len(encoded))))
    return [ack for ack in results if ack is not None]


async def publish_telemetry(nc: NATS, event: Event) -> None:
    """Fire-and-forget publish (heartbeats, samples): the client buffers through a reconnect."""
    await nc.publish(subject_for(event), encode_event(event), headers={MSG_ID: event.id})
