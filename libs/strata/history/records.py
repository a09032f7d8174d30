"""A job's history as records, and the export format that keeps it in a file.

A `Record` is one event with where JetStream stored it (stream, sequence, time). `strata export`
writes one JSON line per record (`Record.to_json`); `read_records` reads such a file back, every
line validated against the event models, so `strata replay --file` needs no server.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Final, Literal, NamedTuple

import pydantic

from strata.errors import CodecError, TooLarge
from strata.events import AnyEvent
from strata.events.codec import validation_error

Stream = Literal["events", "telemetry"]


class Record(NamedTuple):
    """An event as read from a stream (or an exported line): its stream sequence and stored time.

    A named tuple: a replay makes one per stored event, and a tuple is built in a fraction of
    the time a frozen dataclass takes."""

    seq: int
    stored_ns: int
    event: AnyEvent
    stream: Stream = "events"

    def to_json(self) -> str:
        """One line of an export file."""
        return (
            f'{{"seq":{self.seq},"stored_ns":{self.stored_ns},"stream":"{self.stream}",'
            f'"event":{self.event.model_dump_json()}}}'
        )


class _Line(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid", frozen=True)

    seq: int = pydantic.Field(ge=0)
    stored_ns: int = pydantic.Field(ge=0)
    stream: Stream = "events"
    event: AnyEvent


def record_from_json(line: str | bytes, where: str = "line") -> Record:
    """A `Record` from one export line; `ValidationError` or `CodecError` naming `where`."""
    try:
        parsed = _Line.model_validate_json(line)
    except pydantic.ValidationError as exc:
        first = exc.errors(include_url=False)[0]
        if first["type"] == "json_invalid":
            raise CodecError(f"{where} is not valid JSON: {first['msg']}") from None
        raise validation_error(exc, where) from None
    return Record(parsed.seq, parsed.stored_ns, parsed.event, parsed.stream)


MAX_LINE_BYTES: Final = 32 * 1024 * 1024
"""Longer than any event's JSON (the largest, a progress report of a million shards, is ~8 MB)."""


def read_lines(path: Path, max_line_bytes: int = MAX_LINE_BYTES) -> Iterator[tuple[int, bytes]]:
    """(number, line) of every non-blank line of `path`; `TooLarge` for a line longer than
    `max_line_bytes`, which is never read whole."""
    with path.open("rb") as lines:
        number = 0
        while line := lines.readline(max_line_bytes + 1):
            number += 1
            if len(line) > max_line_bytes:
                raise TooLarge(
                    f"line {number} of {path} is longer than {max_line_bytes:,} bytes, longer "
                    "than any event; the file is not an export of Strata's",
                    limit=max_line_bytes,
                )
            if line.strip():
                yield number, line


def read_records(path: Path) -> Iterator[Record]:
    """Every record of an export file, in file order; blank lines are skipped.

    Each line is validated against the event models by pydantic's parser, which bounds how
    deeply JSON may nest, so a hostile file gives a one-line error, never a RecursionError."""
    for number, line in read_lines(path):
        yield record_from_json(line, f"line {number} of {path}")


def dumps(document: Any) -> str:
    """Compact JSON, as the gateway and `strata replay --state` write it."""
    return json.dumps(document, separators=(",", ":"), ensure_ascii=False)
