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


JOB_PARAMETER = {"description": "Job id ('.' written as '~')."}


def _event_channel(model: type[Event]) -> tuple[str, dict[str, Any]]:
    event_type = _event_type(model)
    params: dict[str, Any]
    if event_type == "worker.heartbeat":
        address = subjects.heartbeat_address()
        params = {
            "bucket": {
                "description": "First two hex digits of the SHA-256 of the worker id "
                "(the registry partitions split heartbeats by it)."
            },
            "job": JOB_PARAMETER,
            "worker": {},
        }
    elif event_type == "metric.sampled":
        address = subjects.metric_address()
        params = {
            "job": JOB_PARAMETER,
            "worker": {"description": "The worker sampled (else the source)."},
            "metric": {},
        }
    else:
        address = subjects.event_address(event_type)
        params = {"job": JOB_PARAMETER}
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
        "address": subjects.rpc_address(endpoint.service, endpoint.verb),
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


class _Document:
    """The parts of the AsyncAPI document as they are gathered: channels, their messages, the
    operations on them, and the schemas every message refers to."""

    def __init__(self) -> None:
        self.schemas: dict[str, Any] = {}
        self.messages: dict[str, Any] = {}
        self.channels: dict[str, Any] = {}
        self.operations: dict[str, Any] = {}

    def component(self, model: Any) -> dict[str, str]:
        return _component(model, self.schemas)

    def send(self, operation: str, channel_id: str, **more: Any) -> None:
        self.operations[operation] = {
            "action": "send",
            "channel": {"$ref": f"#/channels/{channel_id}"},
            **more,
        }

    def core_channel(
        self,
        channel_id: str,
        title: str,
        operation: str,
        *,
        address: str,
        description: str,
        parameters: dict[str, Any],
        payload: Any,
    ) -> None:
        """A channel of core NATS (not stored) with one kind of message, sent by the services."""
        self.channels[channel_id] = {
            "address": address,
            "title": title,
            "description": f"{description} Core NATS, not stored.",
            "parameters": parameters,
            "messages": {channel_id: {"$ref": f"#/components/messages/{channel_id}"}},
        }
        self.messages[channel_id] = {
            "name": title,
            "contentType": "application/msgpack",
            "payload": self.component(payload),
        }
        self.send(operation, channel_id)

    def events(self) -> None:
        for model in EVENT_MODELS:
            channel_id, channel = _event_channel(model)
            self.channels[channel_id] = channel
            self.messages[channel_id] = {
                "name": _event_type(model),
                "contentType": "application/msgpack",
                "headers": {
                    "type": "object",
                    "properties": {"Nats-Msg-Id": {"type": "string", "description": "= event id"}},
                },
                "payload": self.component(model),
            }
            self.send(f"publish_{channel_id}", channel_id)

    def notices(self) -> None:
        self.core_channel(
            "worker_notice",
            "worker notice",
            "notify_worker",
            address=subjects.control_address(),
            description=(WorkerNotice.__doc__ or "").strip(),
            parameters={"job": {}, "worker": {}},
            payload=WorkerNotice,
        )
        self.core_channel(
            "world_notice",
            "world notice",
            "announce_world",
            address=subjects.world_address(),
            description=(WorldNotice.__doc__ or "").strip(),
            parameters={"job": {}},
            payload=WorldNotice,
        )
        self.core_channel(
            "service_status",
            "service status",
            "announce_status",
            address=subjects.status_address(),
            description=(
                f"Each service replica announces itself every {STATUS_INTERVAL_S:g} s; readers "
                "that may not send requests (the gateway) learn from it who is up."
            ),
            parameters={"service": {}},
            payload=PingResult,
        )

    def requests(self) -> None:
        error_ref = self.component(ErrorReply)
        self.component(OkReply)
        for endpoint in RPC_ENDPOINTS:
            channel_id, channel = _rpc_channel(endpoint)
            self.channels[channel_id] = channel
            result_ref = self.component(endpoint.result)
            self.messages[f"{channel_id}_request"] = {
                "name": f"{endpoint.service}.{endpoint.verb} request",
                "contentType": "application/msgpack",
                "payload": self.component(endpoint.request),
            }
            self.messages[f"{channel_id}_reply"] = {
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
            self.send(
                f"request_{channel_id}",
                channel_id,
                messages=[{"$ref": f"#/channels/{channel_id}/messages/request"}],
                reply={
                    "address": {"location": "$message.header#/reply_to"},
                    "channel": {"$ref": f"#/channels/{channel_id}"},
                    "messages": [{"$ref": f"#/channels/{channel_id}/messages/reply"}],
                },
            )


def asyncapi_document() -> dict[str, Any]:
    """Every subject Strata uses, with its message schemas (AsyncAPI 3.0)."""
    doc = _Document()
    doc.events()
    doc.notices()
    doc.requests()
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
        "channels": doc.channels,
        "operations": doc.operations,
        "components": {"schemas": dict(sorted(doc.schemas.items())), "messages": doc.messages},
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
