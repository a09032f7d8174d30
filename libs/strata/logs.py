"""Structured logs: JSON lines in containers and pipes, readable colours in a terminal.

Context travels in contextvars, so `bind(job=..., worker=..., step=...)` once and every later line
of that task carries it, rendered as `[job/worker - step N]` on a terminal.
"""

from __future__ import annotations

import logging
import sys
import time
from collections.abc import Hashable
from typing import Any, TextIO

import structlog
import structlog.tracebacks
from structlog.typing import EventDict, ExceptionRenderer, ExcInfo, WrappedLogger

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


def _console_exceptions(colors: bool) -> ExceptionRenderer:
    """rich's tracebacks on a terminal when rich is installed, else plain ones.

    Importing `strata` keeps rich out of structlog's own import (`strata._imports`: rich and
    pygments cost a rank's start about 0.1 s), so the console renderer is given them here, the
    one place they are shown.
    """
    try:
        from rich.console import Console
        from rich.traceback import Traceback
    except ImportError:
        return structlog.dev.plain_traceback

    def rich_traceback(sio: TextIO, exc_info: ExcInfo) -> None:
        sio.write("\n")
        console = Console(file=sio, color_system="truecolor" if colors else None)
        console.print(Traceback.from_exception(*exc_info, show_locals=True))

    return rich_traceback


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
        colors = sys.stderr.isatty()
        console = structlog.dev.ConsoleRenderer(
            colors=colors, exception_formatter=_console_exceptions(colors)
        )
        renderer = [_context_prefix, console]
    structlog.configure(
        processors=shared + renderer,
        wrapper_class=structlog.make_filtering_bound_logger(numeric),
        logger_factory=structlog.PrintLoggerFactory(file=_CurrentStderr()),  # type: ignore[arg-type]
        cache_logger_on_first_use=False,
    )
    logging.basicConfig(level=max(numeric, logging.WARNING), stream=sys.stderr, force=True)


def configure_library_logging(fmt: LogFormat = "auto") -> None:
    """For the SDK inside someone else's program, which owns the process's logging.

    structlog hands each line, rendered as `event key=value ...`, to the stdlib logger named
    after the module (`strata.checkpoint`, ...), so the program's own logging set-up decides
    where it goes: its handlers and levels, a `train.log` included. Nothing is installed on the
    root logger; with no logging set up at all, Python's last-resort handler shows warnings and
    errors on stderr. Call it only while structlog is unconfigured: a program that configured
    structlog itself keeps its configuration. `fmt="json"` (STRATA_LOG_FORMAT) renders each line
    as a JSON object with its level and time, for log collectors.
    """
    renderer: list[Any] = (
        [
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.JSONRenderer(),
        ]
        if fmt == "json"
        else [structlog.processors.KeyValueRenderer(key_order=["event"], repr_native_str=False)]
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.stdlib.filter_by_level,
            *renderer,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


def bind(**context: Any) -> None:
    """Attach context (job, worker, rank, step, ...) to every later log line of this task."""
    structlog.contextvars.bind_contextvars(**{k: v for k, v in context.items() if v is not None})


def get_logger(name: str) -> Any:
    return structlog.get_logger(name)


class Throttle:
    """Lets one log line per key through every `every_s` seconds, counting the ones it held back.

    For lines a sender controls the rate of (refused messages, forged requests): a flood of them
    must not become a flood of log lines. Keys are forgotten wholesale past `keep`, so a stream of
    made-up keys cannot grow it without bound.
    """

    def __init__(self, every_s: float = 10.0, keep: int = 4096) -> None:
        self._every = every_s
        self._keep = keep
        self._last: dict[Hashable, tuple[float, int]] = {}

    def __call__(self, key: Hashable) -> int | None:
        """None: hold this line back. Else let it through; the number held back since the last."""
        now = time.monotonic()
        last = self._last.get(key)
        if last is not None and now - last[0] < self._every:
            self._last[key] = (last[0], last[1] + 1)
            return None
        if len(self._last) >= self._keep:
            self._last.clear()
        self._last[key] = (now, 0)
        return 0 if last is None else last[1]


__all__ = ["Throttle", "bind", "configure_library_logging", "configure_logging", "get_logger"]
