"""A job's history, apart from what it means: records and their export format, the timeline text,
and reading from JetStream. What the history folds into (the read model the gateway and
`strata replay` show) lives with the services, in `strata.services.readmodel`.
"""

from strata.history.budget import ReplayBudget
from strata.history.reading import (
    REPLAY_CONSUMER,
    ReplayLimits,
    follow_records,
    job_history,
    stream_records,
    type_filter,
)
from strata.history.records import (
    Record,
    Stream,
    dumps,
    read_lines,
    read_records,
    record_from_json,
)
from strata.history.timeline import summarize

__all__ = [
    "REPLAY_CONSUMER",
    "Record",
    "ReplayBudget",
    "ReplayLimits",
    "Stream",
    "dumps",
    "follow_records",
    "job_history",
    "read_lines",
    "read_records",
    "record_from_json",
    "stream_records",
    "summarize",
    "type_filter",
]
