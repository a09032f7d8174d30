"""`strata export` and `strata replay`: a job's history as a file, a timeline, or rebuilt state.

Both read through `strata.history` and fold with `strata.services.readmodel` (imported inside
the functions that need it), the fold the gateway runs, so `strata replay --file F --state`
prints, with no server at all, the `/api/dashboard` document the gateway showed at the end of F
(live rates aside). rich is imported where something is printed: `add_parsers` runs on every
`strata` call, with or without the server extra that installs it.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import datetime
import json
import re
import sys
import time
from collections.abc import Callable, Coroutine, Iterable, Iterator
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any, Final, TypeVar

from strata.config import load_settings
from strata.errors import ConfigError, NotFound
from strata.events import ID_PATTERN
from strata.logs import configure_logging

if TYPE_CHECKING:
    from rich.console import Console

    from strata.bus import Bus
    from strata.history import Record, ReplayLimits
    from strata.services.readmodel import JobState

_RELATIVE = re.compile(r"^(\d+(?:\.\d+)?)(ms|s|m|h|d)$")
_UNITS: Final = {"ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86_400.0}
_AREA_STYLES: Final = {
    "worker": "cyan",
    "dataset": "blue",
    "shard": "blue",
    "barrier": "magenta",
    "checkpoint": "green",
    "request": "red",
}
_TROUBLE: Final = ("worker.failed", "barrier.broken", "barrier.timed_out", "checkpoint.aborted")


def parse_time(text: str, now: float | None = None) -> int:
    """Unix time in ns from ISO 8601 (`2026-11-21T10:00:00Z`; local time without an offset),
    a relative `10m` / `2h` / `30s` / `1d` ago, or a plain integer of nanoseconds."""
    value = text.strip()
    if value.isdigit():
        return int(value)
    relative = _RELATIVE.match(value)
    if relative is not None:
        seconds = float(relative.group(1)) * _UNITS[relative.group(2)]
        return int(((time.time() if now is None else now) - seconds) * 1e9)
    try:
        moment = datetime.datetime.fromisoformat(value)
    except ValueError:
        raise ConfigError(
            f"{text!r} is not a time: use ISO 8601 (2026-11-21T10:00:00Z), a span ago "
            "(30s, 10m, 2h, 1d) or nanoseconds since 1970"
        ) from None
    if moment.tzinfo is None:
        moment = moment.astimezone()
    return int(moment.timestamp() * 1e9)


def _add_bounds(parser: argparse.ArgumentParser) -> None:
    start = parser.add_mutually_exclusive_group()
    start.add_argument("--from-seq", type=int, metavar="N", help="start at stream sequence N")
    start.add_argument("--since", metavar="T", help="start at a time (ISO 8601, or 10m ago)")
    end = parser.add_mutually_exclusive_group()
    end.add_argument("--until-seq", type=int, metavar="M", help="stop after stream sequence M")
    end.add_argument("--until", metavar="T", help="stop at a time (ISO 8601, or 10m ago)")


def add_parsers(verbs: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    replay = verbs.add_parser(
        "replay",
        help="a job's events as a timeline, or its rebuilt state (also offline, from a file)",
        description="Print a job's history as a timeline, or with --state the state it folds "
        "into (the JSON of /api/dashboard, without live rates). Reads from NATS with --job, or "
        "from a file written by `strata export` with --file (no server needed).",
    )
    source = replay.add_argument_group("source")
    source.add_argument("--job", help="the job to replay (with --file: pick it from the file)")
    source.add_argument("--file", type=Path, help="an export file (JSON lines)")
    source.add_argument(
        "--nats-url", help="NATS server URL(s), comma-separated (default: $STRATA_NATS_URL)"
    )
    _add_bounds(replay)
    replay.add_argument("--state", action="store_true", help="print the rebuilt state as JSON")
    replay.add_argument("--type", metavar="PREFIX", help="timeline: only event types so prefixed")
    replay.add_argument(
        "--heartbeats",
        action="store_true",
        help="timeline: show heartbeats too; --state: fold them too (last heartbeat, step)",
    )
    replay.add_argument(
        "--max-events",
        type=int,
        metavar="N",
        help="--state from NATS: fold at most N events and heartbeats "
        "(default: $STRATA_REPLAY_MAX_EVENTS, 250000)",
    )
    replay.add_argument(
        "--timeout",
        type=float,
        metavar="S",
        help="--state from NATS: give up after S seconds (default: $STRATA_REPLAY_TIMEOUT, 30)",
    )
    replay.add_argument(
        "--max-planned-shards",
        type=int,
        metavar="N",
        help="--state: plan at most N shards in all, registrations and re-plans (default 8000000)",
    )
    replay.add_argument(
        "--max-memory-mb",
        type=float,
        metavar="MB",
        help="--file: grow by at most MB MiB of memory (default 1024)",
    )

    export = verbs.add_parser(
        "export",
        help="write a job's events (and heartbeats) to a file, one JSON object a line",
        description="Each line is {seq, stored_ns, stream, event}; the file replays offline "
        "with `strata replay --file F`.",
    )
    export.add_argument("--job", required=True, help="the job to export")
    export.add_argument(
        "--nats-url", help="NATS server URL(s), comma-separated (default: $STRATA_NATS_URL)"
    )
    export.add_argument("--output", required=True, help="file to write ('-' for standard output)")
    export.add_argument(
        "--no-heartbeats", action="store_true", help="leave the telemetry stream out"
    )
    _add_bounds(export)


def _check_job(job: str | None) -> str | None:
    if job is not None and not re.match(ID_PATTERN, job):
        raise ConfigError(f"{job!r} is not a job id (letters, digits, '_', '.', '-')")
    return job


class _Bounds:
    def __init__(self, args: argparse.Namespace) -> None:
        self.from_seq: int | None = args.from_seq
        self.since_ns = parse_time(args.since) if args.since else None
        self.until_seq: int | None = args.until_seq
        self.until_ns = parse_time(args.until) if args.until else None

    @property
    def from_start(self) -> bool:
        return self.from_seq is None and self.since_ns is None

    def select(self, records: Iterable[Record]) -> Iterator[Record]:
        """The records of a file within the bounds (a file is in stored order); heartbeats start
        with the first event selected, as `job_history` reads them from NATS."""
        started = self.from_seq is None
        # With --until-seq, heartbeats after the last event so far count only if another follows.
        held: list[Record] = []
        for record in records:
            if record.stored_ns < (self.since_ns or 0):
                continue
            if self.until_ns is not None and record.stored_ns > self.until_ns:
                return
            if record.stream == "events":
                if record.seq < (self.from_seq or 0):
                    continue
                if self.until_seq is not None and record.seq > self.until_seq:
                    return
                started = True
                yield from held
                held.clear()
            elif not started:
                continue
            elif self.until_seq is not None:
                held.append(record)
                continue
            yield record


_T = TypeVar("_T")


async def _connect(nats_url: str | None) -> Bus:
    from strata.bus import Bus

    settings = load_settings(nats_url=nats_url)
    return await Bus.connect(settings=settings, name="strata-cli", deadline=5.0)


def _from_nats(reading: Coroutine[Any, Any, _T], nats_url: str | None) -> _T:
    """Run a read of the streams; a server without them is a one-line error, not a traceback."""
    import nats.js.errors

    try:
        return asyncio.run(reading)
    except nats.js.errors.NotFoundError:
        url = nats_url or load_settings().nats_url
        raise NotFound(
            f"NATS at {url} has no Strata streams: is it the stack's server (--nats-url, "
            "STRATA_NATS_URL), and has the stack run there?"
        ) from None


@contextlib.contextmanager
def _progress(console: Console, verb: str) -> Iterator[Callable[[], None]]:
    """A count of the records read so far, on a terminal only (a pipe gets nothing)."""
    if not console.is_terminal:
        yield lambda: None
        return
    count = 0
    with console.status(f"{verb} 0 records") as status:

        def tick() -> None:
            nonlocal count
            count += 1
            if count % 1000 == 0:
                status.update(f"{verb} {count:,} records")

        yield tick


# -- export ---------------------------------------------------------------------------------------


async def _export(
    args: argparse.Namespace, out: IO[str], console: Console
) -> tuple[int, int, int, int]:
    from strata.history import job_history

    bounds = _Bounds(args)
    events = beats = first = last = 0
    async with await _connect(args.nats_url) as bus:
        history = job_history(
            bus.js,
            args.job,
            from_seq=bounds.from_seq,
            since_ns=bounds.since_ns,
            until_seq=bounds.until_seq,
            until_ns=bounds.until_ns,
            telemetry=not args.no_heartbeats,
        )
        async with contextlib.aclosing(history):
            with _progress(console, "exported") as progress:
                async for record in history:
                    out.write(record.to_json())
                    out.write("\n")
                    progress()
                    if record.stream == "events":
                        events += 1
                        first, last = first or record.seq, record.seq
                    else:
                        beats += 1
        return events, beats, first, last


def _quiet_logs() -> None:
    # Standard output carries the timeline, the state or the export: logs go to standard error,
    # and the connection's info lines not at all.
    configure_logging(load_settings().log_format, level="warning")


def export(args: argparse.Namespace, console: Console) -> int:
    from rich.console import Console
    from rich.markup import escape

    _check_job(args.job)
    _quiet_logs()
    if args.output == "-":
        quiet = Console(stderr=True, force_terminal=False)  # the export itself is on stdout
        counts = _from_nats(_export(args, sys.stdout, quiet), args.nats_url)
    else:
        target = Path(args.output)
        partial = target.with_name(target.name + ".partial")
        with partial.open("w", encoding="utf-8") as out:
            counts = _from_nats(_export(args, out, console), args.nats_url)
        if counts[0] == 0:
            partial.unlink()
        else:
            partial.replace(target)  # a reader never sees half an export under the real name
    events, beats, first, last = counts
    if events == 0:
        raise NotFound(f"job {args.job!r} has no events in that range of STRATA_EVENTS")
    console.print(
        f"exported {events} events (seq {first}..{last}) and {beats} heartbeats of "
        f"[bold]{escape(args.job)}[/] to {escape(args.output)}"
    )
    return 0


# -- replay ---------------------------------------------------------------------------------------


def _timeline_line(record: Record, show_job: bool) -> str:
    from rich.markup import escape

    from strata.history import summarize

    event = record.event
    when = datetime.datetime.fromtimestamp(event.ts / 1e9, datetime.UTC)
    stamp = when.strftime("%Y-%m-%dT%H:%M:%S.") + f"{when.microsecond // 1000:03d}Z"
    style = "bold red" if event.type in _TROUBLE else _AREA_STYLES.get(event.type.split(".")[0], "")
    seq = f"{record.seq:>8}" if record.stream == "events" else f"{'hb':>8}"
    job = f"{escape(event.job)}  " if show_job else ""
    kind = f"[{style}]{event.type:<24}[/]" if style else f"{event.type:<24}"
    return f"[dim]{stamp}[/] {seq}  {job}{kind} {escape(summarize(event))}"


class _Timeline:
    """Prints records as timeline lines, as they come."""

    def __init__(self, args: argparse.Namespace, show_job: bool) -> None:
        from rich.console import Console

        self._out = Console(highlight=False, soft_wrap=True)
        self._heartbeats: bool = args.heartbeats
        self._prefix: str | None = args.type
        self._show_job = show_job
        self.shown = 0

    def add(self, record: Record) -> None:
        if record.stream == "telemetry" and not self._heartbeats:
            return
        if self._prefix and not record.event.type.startswith(self._prefix):
            return
        self._out.print(_timeline_line(record, self._show_job))
        self.shown += 1


def _print_state(state: JobState) -> None:
    from strata.services.readmodel import render_dashboard

    if state.events == 0:
        raise NotFound(f"no events of job {state.job!r} in that range")
    print(json.dumps(render_dashboard(state), indent=2, ensure_ascii=False))


def _jobs_in(path: Path) -> list[str]:
    """The jobs an export file holds: a quick look (plain JSON), before the validated read."""
    import pydantic_core

    from strata.history import read_lines

    jobs: set[str] = set()
    for _, line in read_lines(path):
        # A malformed line is reported, with its number, by the validated read that follows.
        # pydantic's parser bounds the nesting (json.loads would recurse until it crashed).
        with contextlib.suppress(ValueError, KeyError, TypeError):
            job = pydantic_core.from_json(line)["event"]["job"]
            if isinstance(job, str):
                jobs.add(job)
    return sorted(jobs)


def _file_job(path: Path, wanted: str | None) -> str:
    from strata.history import read_records

    jobs = _jobs_in(path)
    if not jobs:
        for _ in read_records(path):  # names the first line that is not an event
            pass
    if wanted is not None:
        if wanted not in jobs:
            raise NotFound(f"{path} has no events of job {wanted!r} (it has: {', '.join(jobs)})")
        return wanted
    if len(jobs) != 1:
        raise ConfigError(
            f"{path} holds {len(jobs)} jobs ({', '.join(jobs[:10])}): pick one with --job"
        )
    return jobs[0]


def _replay_limits(args: argparse.Namespace, *, own_process: bool = False) -> ReplayLimits:
    from strata.history import ReplayLimits

    settings = load_settings(
        nats_url=args.nats_url, replay_max_events=args.max_events, replay_timeout=args.timeout
    )
    defaults = ReplayLimits()
    return ReplayLimits(
        settings.replay_max_events,
        settings.replay_timeout,
        args.max_planned_shards or defaults.max_planned_shards,
        # Only a process of its own can tell that its memory grew because of the replay.
        int((args.max_memory_mb or FILE_REPLAY_MEMORY_MB) * 2**20) if own_process else None,
    )


FILE_REPLAY_MEMORY_MB: Final = 1024
_NARROW_FILE: Final = (
    "stop earlier (--until-seq, --until) or raise --max-events / --timeout / "
    "--max-planned-shards / --max-memory-mb"
)


async def _replay_nats(args: argparse.Namespace, bounds: _Bounds) -> int:
    from strata.history import job_history, stream_records, type_filter
    from strata.services.readmodel import JobState, fold_history

    async with await _connect(args.nats_url) as bus:
        if args.type and not args.state and not args.heartbeats:
            # A timeline of one kind of event: the server selects it by subject, so the others
            # are neither sent nor decoded.
            subject, _ = type_filter(args.job, args.type)
            history = stream_records(
                bus.js,
                "events",
                subject,
                start_seq=bounds.from_seq,
                start_ns=bounds.since_ns,
                until_seq=bounds.until_seq,
                until_ns=bounds.until_ns,
            )
        else:
            history = job_history(
                bus.js,
                args.job,
                from_seq=bounds.from_seq,
                since_ns=bounds.since_ns,
                until_seq=bounds.until_seq,
                until_ns=bounds.until_ns,
                telemetry=args.heartbeats,
            )
        if args.state:
            narrow = "stop earlier (--until-seq, --until)" + (
                ", leave heartbeats out (no --heartbeats)" if args.heartbeats else ""
            )
            narrow += " or raise --max-events / --timeout"
            narrow += " / --max-planned-shards"
            state = await fold_history(history, JobState(args.job), _replay_limits(args), narrow)
            _print_state(state)
            return state.events
        async with contextlib.aclosing(history):
            timeline = _Timeline(args, show_job=False)
            async for record in history:
                timeline.add(record)
            return timeline.shown


def replay(args: argparse.Namespace, console: Console) -> int:
    # The fold pulls in the services' domains (and numpy): only for the verbs that need it.
    from strata.history import ReplayBudget, read_records
    from strata.services.readmodel import rebuild

    _check_job(args.job)
    _quiet_logs()
    if args.job is None and args.file is None:
        raise ConfigError("say what to replay: --job J (from NATS) or --file F (an export)")
    bounds = _Bounds(args)
    if args.state and not bounds.from_start:
        raise ConfigError(
            "--state rebuilds from the first event; drop --from-seq/--since "
            "(use --until-seq/--until to stop earlier)"
        )
    if args.file is not None:
        if not args.file.is_file():
            raise NotFound(f"no such export file: {args.file}")
        # The same bounds as a replay from NATS: a file is written by whoever handed it over.
        limits = _replay_limits(args, own_process=True)
        if args.state:
            job = _file_job(args.file, args.job)
            budget = ReplayBudget(limits, f"job {job!r} from {args.file}", _NARROW_FILE)
            records = budget.bounded(bounds.select(read_records(args.file)))
            _print_state(rebuild(records, job, bounds.until_seq))
            return 0
        several = args.job is None and len(_jobs_in(args.file)) > 1
        timeline = _Timeline(args, show_job=several)
        budget = ReplayBudget(limits, str(args.file), _NARROW_FILE)
        for record in budget.bounded(bounds.select(read_records(args.file))):
            if args.job is None or record.event.job == args.job:
                timeline.add(record)
        shown = timeline.shown
    else:
        shown = _from_nats(_replay_nats(args, bounds), args.nats_url)
    if not args.state and shown == 0:
        where = f"job {args.job!r}" if args.job else str(args.file)
        raise NotFound(f"{where}: no events in that range (is the job id right?)")
    return 0
