"""The read model: every domain of a job folded with the services' own `evolve`, and rendered.

The gateway keeps one live (`strata.services.gateway.live`); `strata replay` rebuilds one from a
history read from NATS or from an exported file (`strata.history`); snapshots of it (`snapshots`)
let a time travel fold from the nearest one instead of from the first event. Its documents are
typed once, in `views`, which the gateway's OpenAPI document (and the dashboard's types) are
made from.
"""

from strata.services.readmodel.render import render_dashboard, shard_distribution, with_rates
from strata.services.readmodel.snapshots import SnapshotStore, freeze, thaw
from strata.services.readmodel.state import (
    DOMAINS,
    RECENT_EVENTS,
    REQUEST_TYPES,
    Beat,
    JobState,
    LiveRates,
    ReadModel,
    event_type,
    fold_history,
    rebuild,
    routes_for,
)

__all__ = [
    "DOMAINS",
    "RECENT_EVENTS",
    "REQUEST_TYPES",
    "Beat",
    "JobState",
    "LiveRates",
    "ReadModel",
    "SnapshotStore",
    "event_type",
    "fold_history",
    "freeze",
    "rebuild",
    "render_dashboard",
    "routes_for",
    "shard_distribution",
    "thaw",
    "with_rates",
]
