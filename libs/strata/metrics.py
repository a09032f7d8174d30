"""Prometheus metrics shared by the bus helpers, the services and the gateway.

They live in one registry per process (prometheus_client's default), labelled by service, so a test
process that runs several services still exposes each figure once.
"""

from __future__ import annotations

from typing import Final

from prometheus_client import Counter, Histogram

RPC_REQUESTS: Final = Counter(
    "strata_rpc_requests_total",
    "RPC requests handled, by outcome (ok or an error code).",
    ["service", "verb", "outcome"],
)
RPC_LATENCY: Final = Histogram(
    "strata_rpc_handler_seconds",
    "Time from receiving an RPC request to sending its reply.",
    ["service"],
    buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.5, 1.0),
)
MESSAGES_REJECTED: Final = Counter(
    "strata_messages_rejected_total",
    "Messages refused or dropped (malformed, invalid, no reply subject), by reason code.",
    ["consumer", "code"],
)
EVENTS_CONSUMED: Final = Counter(
    "strata_events_consumed_total",
    "Events applied from a stream, by consumer.",
    ["consumer"],
)
