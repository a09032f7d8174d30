"""Hypothesis strategies for Strata's models, and their simplest valid instances, derived from their
generated JSON Schemas.

Driving generation from the schemas keeps one source of truth: a constraint added to a model shows
up here without touching the tests.
"""

from __future__ import annotations

import re
from typing import Any, TypeVar

from hypothesis import strategies as st
from pydantic import BaseModel

M = TypeVar("M", bound=BaseModel)

MAX_LIST = 5


def from_json_schema(schema: dict[str, Any], defs: dict[str, Any]) -> st.SearchStrategy[Any]:
    if "$ref" in schema:
        return from_json_schema(defs[schema["$ref"].split("/")[-1]], defs)
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "anyOf" in schema:
        return st.one_of(*(from_json_schema(s, defs) for s in schema["anyOf"]))
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema:
            text = st.from_regex(schema["pattern"], fullmatch=True)
            return text.filter(lambda s: "\n" not in s)
        return st.text(
            min_size=schema.get("minLength", 0), max_size=min(schema.get("maxLength", 40), 40)
        )
    if kind == "integer":
        lo = schema.get(
            "minimum", schema.get("exclusiveMinimum", -(2**63)) + ("exclusiveMinimum" in schema)
        )
        hi = schema.get(
            "maximum", schema.get("exclusiveMaximum", 2**63) - ("exclusiveMaximum" in schema)
        )
        return st.integers(min_value=lo, max_value=hi)
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
            max_value=schema.get("maximum", schema.get("exclusiveMaximum")),
            exclude_min="exclusiveMinimum" in schema,
            exclude_max="exclusiveMaximum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "boolean":
        return st.booleans()
    if kind == "null":
        return st.none()
    if kind == "array":
        return st.lists(
            from_json_schema(schema["items"], defs),
            min_size=schema.get("minItems", 0),
            max_size=min(schema.get("maxItems", MAX_LIST), MAX_LIST),
        )
    if kind == "object" and "properties" in schema:
        required = set(schema.get("required", []))
        fields = {name: from_json_schema(sub, defs) for name, sub in schema["properties"].items()}
        return st.fixed_dictionaries(
            {k: v for k, v in fields.items() if k in required},
            optional={k: v for k, v in fields.items() if k not in required},
        )
    if kind == "object":
        keys = from_json_schema(schema.get("propertyNames", {"type": "string"}), defs)
        values = from_json_schema(schema.get("additionalProperties", {"type": "string"}), defs)
        return st.dictionaries(keys, values, max_size=min(schema.get("maxProperties", 3), 3))
    raise NotImplementedError(f"no strategy for schema {schema}")


def instances(model: type[BaseModel]) -> st.SearchStrategy[Any]:
    """Valid instances of `model`; draws only cross-field rules can refuse are skipped."""
    schema = model.model_json_schema()

    def build(data: dict[str, Any]) -> BaseModel | None:
        try:
            return model.model_validate(data)
        except ValueError:
            return None

    return (
        from_json_schema(schema, schema.get("$defs", {}))
        .map(build)
        .filter(lambda obj: obj is not None)
    )


SIMPLE_STRINGS = ("x0", "0", "a", "sha256:0123456789abcdef")
"""Candidates for a string with a pattern: the first that matches is taken."""


def _simplest(schema: dict[str, Any], defs: dict[str, Any]) -> Any:
    if "$ref" in schema:
        return _simplest(defs[schema["$ref"].split("/")[-1]], defs)
    if "const" in schema:
        return schema["const"]
    if "enum" in schema:
        return schema["enum"][0]
    if "anyOf" in schema:
        return _simplest(schema["anyOf"][0], defs)
    kind = schema.get("type")
    if kind == "string":
        if "pattern" in schema:
            return next(s for s in SIMPLE_STRINGS if re.search(schema["pattern"], s))
        return "x" * max(1, schema.get("minLength", 0))
    if kind == "integer":
        return schema.get("minimum", schema.get("exclusiveMinimum", -1) + 1)
    if kind == "number":
        if "minimum" in schema:
            return float(schema["minimum"])
        return min(float(schema.get("exclusiveMinimum", 0.0)) + 1.0, schema.get("maximum", 1e9))
    if kind == "boolean":
        return False
    if kind == "null":
        return None
    if kind == "array":
        return [_simplest(schema["items"], defs) for _ in range(schema.get("minItems", 0))]
    if kind == "object":
        properties = schema.get("properties", {})
        return {name: _simplest(properties[name], defs) for name in schema.get("required", [])}
    raise NotImplementedError(f"no simplest value for schema {schema}")


def simplest(model: type[M]) -> M:
    """A valid instance of `model` with only its required fields, each at its simplest value.

    Deterministic and cheap (no search), for templates that tests then vary one field at a time.
    """
    schema = model.model_json_schema()
    return model.model_validate(_simplest(schema, schema.get("$defs", {})))
