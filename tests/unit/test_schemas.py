"""The committed schemas are exactly what the models produce, and the AsyncAPI document is whole."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from strata.events import EVENT_TYPES
from strata.events.rpc import RPC_ENDPOINTS
from strata.events.schemagen import asyncapi_document, check, write

SCHEMAS = Path(__file__).resolve().parents[2] / "schemas"


def test_committed_schemas_match_the_models() -> None:
    problems = check(SCHEMAS)
    assert problems == [], "stale schemas, run `make schemas`:\n" + "\n".join(problems)


def test_drift_is_detected(tmp_path: Path) -> None:
    write(tmp_path)
    assert check(tmp_path) == []
    target = tmp_path / "events" / "worker.failed.json"
    target.write_text(target.read_text().replace('"reason"', '"cause"'))
    (tmp_path / "events" / "worker.exploded.json").write_text("{}")
    assert check(tmp_path) == [
        "events/worker.failed.json: differs from the models",
        "events/worker.exploded.json: no model produces it",
    ]


def _refs(node: Any) -> list[str]:
    if isinstance(node, dict):
        found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
        return found + [ref for value in node.values() for ref in _refs(value)]
    if isinstance(node, list):
        return [ref for value in node for ref in _refs(value)]
    return []


def _resolve(document: dict[str, Any], ref: str) -> Any:
    node: Any = document
    for part in ref.removeprefix("#/").split("/"):
        node = node[part]
    return node


def test_asyncapi_lists_every_subject_and_every_ref_resolves() -> None:
    document = asyncapi_document()
    assert document["asyncapi"] == "3.0.0"
    titles = {channel["title"] for channel in document["channels"].values()}
    assert set(EVENT_TYPES) <= titles
    assert {f"{e.service}.{e.verb}" for e in RPC_ENDPOINTS} <= titles
    addresses = {channel["address"] for channel in document["channels"].values()}
    assert "strata.hb.{bucket}.{job}.{worker}" in addresses
    assert "strata.evt.{job}.checkpoint.committed" in addresses
    for ref in _refs(document):
        assert _resolve(document, ref) is not None, ref
    committed = json.loads((SCHEMAS / "asyncapi.json").read_text())
    assert committed == json.loads(json.dumps(document))
