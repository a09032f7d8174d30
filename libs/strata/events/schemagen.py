"""Generate `schemas/` from the models: one JSON Schema per event and an AsyncAPI 3 document.

`python -m strata.events.schemagen` writes the files; `--check` compares the committed files with
what the models produce now and fails, naming each stale file, so schemas never drift.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import strata
from strata.events import subjects
from strata.events.models import EVENT_MODELS, TELEMETRY_TYPES, Event
from strata.events.requests import WorkerNotice, WorldNotice
from strata.events.rpc import (
    RPC_ENDPOINTS,
    STATUS_INTERVAL_S,
    ErrorReply,
    OkReply,
    PingResult,
    RpcEndpoint,
)

DEFAULT_OUT = Path("schemas")
REF_TEMPLATE = "#/components/schemas/{model}"


def _event_type(model: type[Event]) -> str:
    return str(model.model_fields["type"].default)


def event_schema(model: type[Event]) -> dict[str, Any]:
    """The standalone JSON Schema of one event."""
    schema = model.model_json_schema()
    event_type = _event_type(model)
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"https://strata.dev/schemas/events/{event_type}.json",
        **schema,
    }


def _hoist(schema: dict[str, Any], components: dict[str, Any]) -> dict[str, Any]:
    """Move a model schema's `$defs` into the shared components; return the rest."""
    for name, definition in schema.pop("$defs", {}).items():
        components[name] = definition
    return schema


def _component(model: Any, components: dict[str, Any]) -> dict[str, str]:
    schema = _hoist(model.model_json_schema(ref_template=REF_TEMPLATE), components)
    components[model.__name__] = schema
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def _event_channel(model: type[Event]) -> tuple[str, dict[str, Any]]:
    event_type = _event_type(model)
    area, name = event_type.split(".")
    if event_type == "worker.heartbeat":
        address = f"{subjects.HEARTBEATS}.{{job}}.{{worker}}"
        params = {"job": {"description": "Job id ('.' written as '~')."}, "worker": {}}
    elif event_type == "metric.sampled":
        address = f"{subjects.METRICS}.{{job}}.{{worker}}.{{metric}}"
        params = {
            "job": {"description": "Job id ('.' written as '~')."},
            "worker": {"description": "The worker sampled (else the source)."},
            "metric": {},
        }
    else:
        address = f"{subjects.EVENTS}.{{job}}.{area}.{name}"
        params = {"job": {"description": "Job id ('.' written as '~')."}}
    stream = subjects.TELEMETRY_STREAM if event_type in TELEMETRY_TYPES else subjects.EVENTS_STREAM
    channel_id = event_type.replace(".", "_")
    return channel_id, {
        "address": address,
        "title": event_type,
        "description": f"{(model.__doc__ or event_type).strip()} Stored in stream {stream}.",
        "parameters": params,
        "messages": {channel_id: {"$ref": f"#/components/messages/{channel_id}"}},
    }


def _rpc_channel(endpoint: RpcEndpoint) -> tuple[str, dict[str, Any]]:
    channel_id = f"rpc_{endpoint.service}_{endpoint.verb}"
    group = subjects.rpc_queue_group(endpoint.service)
    who = {
        "open": "Anyone may ask.",
        "job": "A worker may ask about its own job only (else `forbidden`).",
        "worker": "A worker may ask for itself only: the body's job and worker_id must be the "
        "subject's (else `forbidden`; a worker_id left out is the subject's).",
    }[endpoint.scope]
    return channel_id, {
        "address": f"{subjects.rpc_subject(endpoint.service, endpoint.verb)}.{{job}}.{{worker}}",
        "title": f"{endpoint.service}.{endpoint.verb}",
        "description": (
            f"{endpoint.summary} Queue group {group}. The subject ends with the caller, which "
            f"NATS permissions tie to its credential; {who} Without the caller, "
            f"{subjects.rpc_subject(endpoint.service, endpoint.verb)} is an operator's request "
            "(the services' credential, or an unsecured NATS)."
        ),
        "parameters": {
            "job": {"description": "The caller's job ('.' written as '~')."},
            "worker": {"description": "The calling worker ('.' written as '~')."},
        },
        "x-strata-scope": endpoint.scope,
        "messages": {
            "request": {"$ref": f"#/components/messages/{channel_id}_request"},
            "reply": {"$ref": f"#/components/messages/{channel_id}_reply"},
        },
    }


def asyncapi_document() -> dict[str, Any]:
    """Every subject Strata uses, with its message schemas (AsyncAPI 3.0)."""
    schemas: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    for model in EVENT_MODELS:
        channel_id, channel = _event_channel(model)
        channels[channel_id] = channel
        messages[channel_id] = {
            "name": _event_type(model),
            "contentType": "application/msgpack",
            "headers": {
                "type": "object",
                "properties": {"Nats-Msg-Id": {"type": "string", "description": "= event id"}},
            },
            "payload": _component(model, schemas),
        }
        operations[f"publish_{channel_id}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel_id}"},
        }
    channels["worker_notice"] = {
        "address": f"{subjects.CONTROL}.{{job}}.{{worker}}",
        "title": "worker notice",
        "description": f"{(WorkerNotice.__doc__ or '').strip()} Core NATS, not stored.",
        "parameters": {"job": {}, "worker": {}},
        "messages": {"worker_notice": {"$ref": "#/components/messages/worker_notice"}},
    }
    messages["worker_notice"] = {
        "name": "worker notice",
        "contentType": "application/msgpack",
        "payload": _component(WorkerNotice, schemas),
    }
    operations["notify_worker"] = {
        "action": "send",
        "channel": {"$ref": "#/channels/worker_notice"},
    }
    channels["world_notice"] = {
        "address": f"{subjects.WORLD}.{{job}}",
        "title": "world notice",
        "description": f"{(WorldNotice.__doc__ or '').strip()} Core NATS, not stored.",
        "parameters": {"job": {}},
        "messages": {"world_notice": {"$ref": "#/components/messages/world_notice"}},
    }
    messages["world_notice"] = {
        "name": "world notice",
        "contentType": "application/msgpack",
        "payload": _component(WorldNotice, schemas),
    }
    operations["announce_world"] = {
        "action": "send",
        "channel": {"$ref": "#/channels/world_notice"},
    }
    channels["service_status"] = {
        "address": f"{subjects.STATUS}.{{service}}",
        "title": "service status",
        "description": (
            f"Each service replica announces itself every {STATUS_INTERVAL_S:g} s; readers that "
            "may not send requests (the gateway) learn from it who is up. Core NATS, not stored."
        ),
        "parameters": {"service": {}},
        "messages": {"service_status": {"$ref": "#/components/messages/service_status"}},
    }
    messages["service_status"] = {
        "name": "service status",
        "contentType": "application/msgpack",
        "payload": _component(PingResult, schemas),
    }
    operations["announce_status"] = {
        "action": "send",
        "channel": {"$ref": "#/channels/service_status"},
    }
    error_ref = _component(ErrorReply, schemas)
    _component(OkReply, schemas)
    for endpoint in RPC_ENDPOINTS:
        channel_id, channel = _rpc_channel(endpoint)
        channels[channel_id] = channel
        result_ref = _component(endpoint.result, schemas)
        messages[f"{channel_id}_request"] = {
            "name": f"{endpoint.service}.{endpoint.verb} request",
            "contentType": "application/msgpack",
            "payload": _component(endpoint.request, schemas),
        }
        messages[f"{channel_id}_reply"] = {
            "name": f"{endpoint.service}.{endpoint.verb} reply",
            "contentType": "application/msgpack",
            "payload": {
                "oneOf": [
                    {
                        "type": "object",
                        "required": ["ok", "result"],
                        "properties": {"ok": {"const": True}, "result": result_ref},
                    },
                    error_ref,
                ]
            },
        }
        operations[f"request_{channel_id}"] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            "messages": [{"$ref": f"#/channels/{channel_id}/messages/request"}],
            "reply": {
                "address": {"location": "$message.header#/reply_to"},
                "channel": {"$ref": f"#/channels/{channel_id}"},
                "messages": [{"$ref": f"#/channels/{channel_id}/messages/reply"}],
            },
        }
    return {
        "asyncapi": "3.0.0",
        "info": {
            "title": "Strata",
            "version": strata.__version__,
            "description": (
                "Subjects of the Strata control plane. Events are msgpack maps with the envelope "
                "type, v, id, job, ts, source; replies are {ok, result} or {ok: false, error}."
            ),
        },
        "defaultContentType": "application/msgpack",
        "servers": {
            "local": {"host": "127.0.0.1:4222", "protocol": "nats", "description": "strata up"}
        },
        "channels": channels,
        "operations": operations,
        "components": {"schemas": dict(sorted(schemas.items())), "messages": messages},
    }


def render(obj: dict[str, Any]) -> str:
    return json.dumps(obj, indent=2, ensure_ascii=False) + "\n"


def expected_files() -> dict[str, str]:
    """Relative path -> content of every generated file."""
    files = {
        f"events/{_event_type(model)}.json": render(event_schema(model)) for model in EVENT_MODELS
    }
    files["asyncapi.json"] = render(asyncapi_document())
    return files


def write(out: Path) -> list[str]:
    """Write every file (and remove stale event schemas); returns the paths written."""
    files = expected_files()
    events_dir = out / "events"
    events_dir.mkdir(parents=True, exist_ok=True)
    for stale in events_dir.glob("*.json"):
        if f"events/{stale.name}" not in files:
            stale.unlink()
    for rel, content in files.items():
        (out / rel).write_text(content)
    return sorted(files)


def check(out: Path) -> list[str]:
    """Paths (relative to `out`) that differ from the models, are missing, or are stale."""
    files = expected_files()
    problems = []
    for rel, content in sorted(files.items()):
        path = out / rel
        if not path.is_file():
            problems.append(f"{rel}: missing")
        elif path.read_text() != content:
            problems.append(f"{rel}: differs from the models")
    for extra in sorted((out / "events").glob("*.json")):
        if f"events/{extra.name}" not in files:
            problems.append(f"events/{extra.name}: no model produces it")
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--check", action="store_true", help="fail if the files are stale")
    args = parser.parse_args(argv)
    if args.check:
        problems = check(args.out)
        for problem in problems:
            print(f"schema drift: {problem}", file=sys.stderr)
        if problems:
            print("run `make schemas` and commit the result", file=sys.stderr)
            return 1
        print(f"schemas up to date ({len(expected_files())} files)")
        return 0
    written = write(args.out)
    print(f"wrote {len(written)} files to {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
