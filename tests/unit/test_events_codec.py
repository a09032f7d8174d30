"""The event catalogue and its codec: every event round-trips, bad input raises typed errors."""

from __future__ import annotations

import json
from typing import Any, get_origin

import msgpack
import pydantic
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from strata.errors import CodecError, StrataError, ValidationError
from strata.events import (
    EVENT_MODELS,
    EVENT_TYPES,
    DatasetRegistered,
    WorkerLeft,
    WorkerRegistered,
    decode_event,
    decode_shared_event,
    encode_event,
    event_from_json,
    event_to_json,
    models,
    pack,
    requests,
    subject_for,
    subjects,
)
from strata.events.codec import MAX_ARRAY_ITEMS, MAX_MAP_ENTRIES, unpack
from strata.events.models import MAX_SHARDS, Event, StrictModel

from tests.strategies import instances
from tests.tiers import examples


@pytest.mark.parametrize("model", EVENT_MODELS, ids=lambda m: m.model_fields["type"].default)
def test_every_event_type_round_trips_through_msgpack_and_json(model: type[Event]) -> None:
    @settings(
        max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow]
    )
    @given(instances(model))
    def round_trip(event: Event) -> None:
        assert decode_event(encode_event(event)) == event
        assert event_from_json(event_to_json(event)) == event
        assert type(decode_event(encode_event(event))) is model

    round_trip()


def test_catalogue_has_one_model_per_type() -> None:
    assert len(EVENT_TYPES) == len(EVENT_MODELS) == 26
    for event_type, model in EVENT_TYPES.items():
        assert model.model_fields["type"].default == event_type


def _registered(**overrides: Any) -> dict[str, Any]:
    event = WorkerRegistered(
        job="job-1",
        source="registry",
        worker_id="w-1",
        instance="p1",
        rank=0,
        world_size=2,
        membership_epoch=1,
        heartbeat_interval=1.0,
        heartbeat_timeout=5.0,
    )
    return {**event.model_dump(), **overrides}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("rank", "3"),  # no coercion from strings
        ("rank", -1),
        ("rank", 10_000),
        ("job", "../etc"),
        ("job", ""),
        ("job", "a" * 129),
        ("worker_id", "has space"),
        ("heartbeat_interval", float("nan")),
        ("heartbeat_interval", 0.0),
        ("world_size", True),
        ("id", "x/y"),
    ],
)
def test_invalid_field_raises_validation_error_naming_it(field: str, value: Any) -> None:
    with pytest.raises(ValidationError) as caught:
        decode_event(pack(_registered(**{field: value})))
    assert caught.value.field == field
    assert caught.value.code == "invalid_field"
    assert field in caught.value.message


def test_unknown_field_is_refused() -> None:
    with pytest.raises(ValidationError) as caught:
        decode_event(pack(_registered(surprise=1)))
    assert caught.value.field == "surprise"


def test_missing_field_is_named() -> None:
    data = _registered()
    del data["rank"]
    with pytest.raises(ValidationError) as caught:
        decode_event(pack(data))
    assert caught.value.field == "rank"


@pytest.mark.parametrize(
    ("payload", "fragment"),
    [
        (b"", "empty"),
        (b"\xc1", "msgpack"),
        (msgpack.packb([1, 2]), "must be a map"),
        (msgpack.packb({"type": "worker.registered"}) + b"\x00", "trailing"),
        (msgpack.packb(msgpack.ExtType(5, b"x")), "extension"),
        (b"\x00" * (8 * 1024 * 1024 + 1), "exceeds"),
    ],
)
def test_malformed_bytes_raise_codec_error(payload: bytes, fragment: str) -> None:
    with pytest.raises(CodecError) as caught:
        decode_event(payload)
    assert caught.value.code == "malformed"
    assert fragment in caught.value.message


@pytest.mark.parametrize(
    ("event_type", "message"),
    [(None, "no 'type'"), ("worker.exploded", "unknown event type"), (7, "no 'type'")],
)
def test_unknown_or_missing_type_is_a_validation_error(event_type: Any, message: str) -> None:
    data = _registered(type=event_type)
    with pytest.raises(ValidationError) as caught:
        decode_event(pack(data))
    assert caught.value.field == "type"
    assert message in caught.value.message


_MODEL_NAMES = {model.__name__ for model in EVENT_MODELS}


@given(st.binary(max_size=256))
@settings(max_examples=examples(500))
def test_random_bytes_never_escape_the_error_tree(data: bytes) -> None:
    outcome: str
    try:
        outcome = type(decode_event(data)).__name__
    except StrataError as exc:
        outcome = exc.code
    assert outcome in ("malformed", "invalid_field") or outcome in _MODEL_NAMES


def _container_fields() -> list[tuple[type[StrictModel], str]]:
    """Every list or map field of every model that travels on the bus."""
    found = []
    for module in (models, requests):
        for model in vars(module).values():
            if isinstance(model, type) and issubclass(model, StrictModel):
                for name, info in model.model_fields.items():
                    if get_origin(info.annotation) in (list, dict):
                        found.append((model, name))
    return found


@pytest.mark.parametrize(
    ("model", "field"), _container_fields(), ids=lambda x: x if isinstance(x, str) else x.__name__
)
def test_a_list_or_map_of_bad_items_is_refused_with_one_error(
    model: type[StrictModel], field: str
) -> None:
    # One error, not one per item: a megabyte of bad items would otherwise cost seconds to refuse.
    annotation = model.model_fields[field].annotation
    bad = {str(i): None for i in range(1000)} if get_origin(annotation) is dict else [None] * 1000
    with pytest.raises(pydantic.ValidationError) as refused:
        model.model_validate({field: bad})
    assert len([e for e in refused.value.errors() if e["loc"][0] == field]) == 1


def test_maps_and_lists_longer_than_any_message_holds_are_refused_from_their_header() -> None:
    for too_long in ({str(i): 0 for i in range(MAX_MAP_ENTRIES + 1)}, [0] * (MAX_ARRAY_ITEMS + 1)):
        with pytest.raises(CodecError, match="exceeds"):
            unpack(pack(too_long))
    assert len(unpack(pack({str(i): 0 for i in range(MAX_MAP_ENTRIES)}))) == MAX_MAP_ENTRIES
    assert len(unpack(pack([0] * MAX_ARRAY_ITEMS))) == MAX_ARRAY_ITEMS
    # A service's own snapshot of a whole job may hold more.
    snapshot = {"shards": {str(i): [0, 1] for i in range(MAX_MAP_ENTRIES + 1)}}
    assert len(unpack(pack(snapshot), bounded=False)["shards"]) == MAX_MAP_ENTRIES + 1


def test_dataset_shard_count_is_bounded() -> None:
    with pytest.raises(Exception, match="shards"):
        DatasetRegistered(
            job="j",
            source="sharding",
            dataset_id="d",
            total_samples=MAX_SHARDS * 10 + 1,
            shard_size=10,
            shuffle=False,
            seed=1,
        )


def test_events_are_frozen() -> None:
    event = WorkerRegistered.model_validate(_registered())
    with pytest.raises(Exception, match="frozen"):
        event.rank = 4  # type: ignore[misc]


def test_subject_for_routes_by_type() -> None:
    event = WorkerRegistered.model_validate(_registered(job="team.resnet"))
    assert subject_for(event) == "strata.evt.team~resnet.worker.registered"
    assert subjects.parse_event_subject(subject_for(event)) == ("team.resnet", "worker.registered")


def test_json_edge_rejects_garbage_with_codec_error() -> None:
    with pytest.raises(CodecError):
        event_from_json("{not json")
    with pytest.raises(CodecError):
        event_from_json(json.dumps([1]))


def test_bytes_many_subscribers_receive_are_decoded_once_and_shared() -> None:
    event = WorkerLeft(job="j", source="registry", worker_id="w2", rank=2, membership_epoch=6)
    data = encode_event(event)
    first = decode_shared_event(bytes(data))
    assert first == event
    assert decode_shared_event(bytes(data)) is first  # another copy of the same bytes
    for _ in range(2):  # a failure is raised every time, never remembered
        with pytest.raises(CodecError):
            decode_shared_event(b"\xc1")
