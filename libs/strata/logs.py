"""Structured logs: JSON lines in containers and pipes, readable colours in a terminal.

Context travels in contextvars, so `bind(job=..., worker=..., step=...)` once and every later line
of that task carries it, rendered as `[job/worker - step N]` on a terminal.
"""

from __future__ import annotations

import logging
import sys
from typing import Any

import structlog
import structlog.tracebacks
from structlog.typing import EventDict, WrappedLogger

from strata.config import LogFormat


def _context_prefix(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Fold job/worker/step into one `[job/worker - step N]` prefix for humans."""
    job, worker = event_dict.pop("job", None), event_dict.pop("worker", None)
    rank, step = event_dict.pop("rank", None), event_dict.pop("step", None)
    if job is None and worker is None and step is None:
        return event_dict
    who = "/".join(str(p) for p in (job, worker if rank is None else f"{worker}#{rank}") if p)
    prefix = f"[{who}" + (f" - step {step}" if step is not None else "") + "]"
    event_dict["event"] = f"{prefix} {event_dict.get('event', '')}"
    return event_dict


class _CurrentStderr:
    """Writes to whatever `sys.stderr` is at the time, so a replaced stream is followed."""

    def write(self, text: str) -> int:
        return sys.stderr.write(text)

    def flush(self) -> None:
        sys.stderr.flush()


def configure_logging(fmt: LogFormat = "auto", level: str = "info") -> None:
    """Set up structlog (and stdlib logging, for libraries) for this process."""
    use_json = fmt == "json" or (fmt == "auto" and not sys.stderr.isatty())
    numeric = logging.getLevelNamesMapping()[level.upper()]
    shared: list[Any] = [
        structlog.contextvars.merge_contextvars,
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if use_json:
        renderer: list[Any] = [
            structlog.processors.ExceptionRenderer(
                structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
            ),
            structlog.processors.JSONRenderer(),
        ]
    else:
        renderer = [_context_prefix, structlog.dev.ConsoleRenderer(colors=sys.stderr.isatty())]
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, force=True)


def bind(**context: Any) -> None:
    """Attach context (job, worker, rank, step, ...) to every later log line of this task."""
    structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


__all__ = ["bind", "configure_logging", "get_logger"]
