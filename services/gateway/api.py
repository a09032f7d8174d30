"""The shapes of the gateway's JSON answers, for the OpenAPI document and the handlers.

The read model's documents (`Dashboard`, its rows, `JobSummary`) are typed once, in
`strata.services.readmodel.views`; the answers only the gateway gives are typed here, the same way.
Handlers send JSON built to these types straight out; the tests validate every answer against them.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import ConfigDict, Field, with_config
from strata.services.readmodel.views import (
    BarrierView,
    CheckpointView,
    Dashboard,
    DatasetView,
    JobSummary,
    Metrics,
    RecentEvent,
    ShardDistribution,
    WorkerView,
)
from typing_extensions import TypedDict

_STRICT = ConfigDict(extra="forbid")


@with_config(_STRICT)
class JobList(TypedDict):
    jobs: list[JobSummary]


@with_config(_STRICT)
class WorkerPage(TypedDict):
    total: int
    items: list[WorkerView]


@with_config(_STRICT)
class EventItem(TypedDict):
    seq: int
    ts: int
    type: str
    summary: str
    event: dict[str, Any]


@with_config(_STRICT)
class EventPage(TypedDict):
    items: list[EventItem]
    last_seq: Annotated[
        int, Field(description="The last sequence examined: pass it as the next after_seq")
    ]


__all__ = [
    "BarrierView",
    "CheckpointView",
    "Dashboard",
    "DatasetView",
    "EventItem",
    "EventPage",
    "JobList",
    "JobSummary",
    "Metrics",
    "RecentEvent",
    "ShardDistribution",
    "WorkerPage",
    "WorkerView",
]
