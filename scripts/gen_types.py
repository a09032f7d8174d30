"""Generate the dashboard's TypeScript event types from the JSON Schemas in `schemas/events/`.

One interface per event (named by the schema's title), one per shared `$defs` model, the union of
every event, and `EVENT_TYPES`, the list of event type names the event log filters on. Standard
library only, so it runs before anything else is installed; `--check` fails when the file on disk
differs from what the schemas produce.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_SCHEMAS = ROOT / "schemas" / "events"
DEFAULT_OUT = ROOT / "dashboard" / "src" / "generated" / "events.ts"
IDENTIFIER = re.compile(r"^[A-Za-z_$][A-Za-z0-9_$]*$")

Schema = dict[str, Any]


class SchemaError(Exception):
    """A schema uses a construct this generator cannot express in TypeScript."""


@dataclass
class Definitions:
    """Interfaces for `$defs` models, shared between events when identical."""

    bodies: dict[str, Schema] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)

    def add(self, name: str, schema: Schema, origin: str) -> None:
        known = self.bodies.get(name)
        if known is not None and known != schema:
            raise SchemaError(f"{origin}: $defs/{name} differs from an earlier definition")
        if known is None:
            self.bodies[name] = schema
            self.order.append(name)


def _literal(value: Any) -> str:
    return json.dumps(value)


def ts_type(schema: Schema, origin: str) -> str:
    """The TypeScript type of one JSON Schema node."""
    if "$ref" in schema:
        ref = str(schema["$ref"])
        prefix = "#/$defs/"
        if not ref.startswith(prefix):
            raise SchemaError(f"{origin}: unsupported $ref {ref!r}")
        return ref[len(prefix) :]
    if "const" in schema:
        return _literal(schema["const"])
    if "enum" in schema:
        return " | ".join(_literal(value) for value in schema["enum"])
    for combinator in ("anyOf", "oneOf"):
        if combinator in schema:
            options = [ts_type(option, origin) for option in schema[combinator]]
            return " | ".join(dict.fromkeys(options))
    kind = schema.get("type")
    if isinstance(kind, list):
        return " | ".join(ts_type({**schema, "type": one}, origin) for one in kind)
    if kind == "string":
        return "string"
    if kind in ("integer", "number"):
        return "number"
    if kind == "boolean":
        return "boolean"
    if kind == "null":
        return "null"
    if kind == "array":
        item = ts_type(schema.get("items", {}), origin)
        return f"Array<{item}>"
    if kind == "object":
        if "properties" in schema:
            return _object_literal(schema, origin, indent="  ")
        values = [ts_type(sub, origin) for sub in schema.get("patternProperties", {}).values()]
        extra = schema.get("additionalProperties")
        if isinstance(extra, dict):
            values.append(ts_type(extra, origin))
        value = " | ".join(dict.fromkeys(values)) or "unknown"
        return f"Record<string, {value}>"
    if not schema:
        return "unknown"
    raise SchemaError(f"{origin}: unsupported schema {json.dumps(schema)[:120]}")


def _doc(text: str | None, indent: str) -> list[str]:
    if not text:
        return []
    clean = " ".join(text.split()).replace("*/", "*\\/")
    return [f"{indent}/** {clean} */"]


def _members(schema: Schema, origin: str, indent: str) -> list[str]:
    # The types describe events as the gateway serializes them (pydantic's model_dump), where
    # every field is present, defaulted ones included; `required` only matters to publishers.
    lines: list[str] = []
    for name, prop in schema.get("properties", {}).items():
        key = name if IDENTIFIER.match(name) else _literal(name)
        lines += _doc(prop.get("description"), indent)
        lines.append(f"{indent}readonly {key}: {ts_type(prop, f'{origin}.{name}')};")
    return lines


def _object_literal(schema: Schema, origin: str, indent: str) -> str:
    inner = _members(schema, origin, indent + "  ")
    return "{\n" + "\n".join(inner) + f"\n{indent}}}"


def _interface(name: str, schema: Schema, origin: str) -> list[str]:
    return [
        *_doc(schema.get("description"), ""),
        f"export interface {name} {{",
        *_members(schema, origin, "  "),
        "}",
        "",
    ]


def load_schemas(directory: Path) -> list[Schema]:
    files = sorted(directory.glob("*.json"))
    if not files:
        raise SchemaError(f"no event schemas in {directory}; run `make schemas` first")
    return [json.loads(path.read_text(encoding="utf-8")) for path in files]


def event_type_of(schema: Schema) -> str:
    kind = schema.get("properties", {}).get("type", {})
    if "const" not in kind:
        raise SchemaError(f"{schema.get('title')}: the `type` property has no const")
    return str(kind["const"])


def render(schemas: list[Schema]) -> str:
    definitions = Definitions()
    events: list[tuple[str, str, Schema]] = []
    for schema in schemas:
        title = str(schema["title"])
        if not IDENTIFIER.match(title):
            raise SchemaError(f"schema title {title!r} is not a TypeScript identifier")
        for name, body in schema.get("$defs", {}).items():
            definitions.add(name, body, title)
        events.append((event_type_of(schema), title, schema))
    events.sort(key=lambda entry: entry[0])

    out = [
        "// Generated by scripts/gen_types.py from schemas/events/*.json. Do not edit.",
        "// Integers are JSON numbers: nanosecond timestamps lose sub-microsecond precision.",
        "",
    ]
    for name in definitions.order:
        out += _interface(name, definitions.bodies[name], name)
    for _, title, schema in events:
        out += _interface(title, schema, title)

    out.append("/** Every event Strata records, discriminated by `type`. */")
    out.append("export type StrataEvent =")
    out += [f"  | {title}" for _, title, _ in events]
    out[-1] += ";"
    out.append("")
    out.append("/** Every event type name, sorted; the event log's type filter offers these. */")
    out.append("export const EVENT_TYPES = [")
    out += [f"  {_literal(event_type)}," for event_type, _, _ in events]
    out.append("] as const;")
    out.append("")
    out.append("export type EventType = (typeof EVENT_TYPES)[number];")
    out.append("")
    out.append("/** The areas (`worker`, `checkpoint`, ...) the event types fall in, sorted. */")
    areas = sorted({event_type.split(".", 1)[0] for event_type, _, _ in events})
    out.append(f"export const EVENT_AREAS = {json.dumps(areas)} as const;")
    out.append("")
    out.append("/** What each event type means, from the schemas' descriptions. */")
    out.append("export const EVENT_DESCRIPTIONS: Readonly<Record<EventType, string>> = {")
    for event_type, _, schema in events:
        description = " ".join(str(schema.get("description", "")).split())
        out.append(f"  {_literal(event_type)}: {_literal(description)},")
    out.append("};")
    out.append("")
    out.append("/** The event of one type. */")
    out.append("export type EventOf<T extends EventType> = Extract<StrataEvent, { type: T }>;")
    out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--schemas", type=Path, default=DEFAULT_SCHEMAS)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument(
        "--check", action="store_true", help="fail if the file differs instead of writing it"
    )
    args = parser.parse_args(argv)
    try:
        text = render(load_schemas(args.schemas))
    except (SchemaError, OSError, ValueError, KeyError) as exc:
        print(f"gen_types: {exc}", file=sys.stderr)
        return 1
    return write_generated("gen_types", args.out, text, check=args.check)


def write_generated(tool: str, out: Path, text: str, *, check: bool) -> int:
    """Write `text` to `out` (left untouched when it already holds it); with `check`, only say
    whether `out` is stale. The exit status of `tool`."""
    if check:
        current = out.read_text(encoding="utf-8") if out.is_file() else None
        if current != text:
            print(f"{tool}: {out} is stale; run scripts/{tool}.py", file=sys.stderr)
            return 1
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    if not out.is_file() or out.read_text(encoding="utf-8") != text:
        out.write_text(text, encoding="utf-8")
    print(f"{tool}: {len(text.splitlines())} lines -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
