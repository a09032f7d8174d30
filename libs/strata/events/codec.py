"""Wire encoding of events and RPC payloads: msgpack on the bus, JSON at the HTTP edge.

Decoding is where untrusted bytes meet the models, so every failure becomes a typed error:
`CodecError` for bytes that are not a message at all, `ValidationError` (naming the field) for a
message that breaks the contract. Nothing else escapes.
"""

from __future__ import annotations

import functools
import json
from typing import Any, Final, TypeVar

import msgpack
import pydantic

from strata.errors import CodecError, ValidationError
from strata.events.models import EVENT_TYPES, MAX_SHARDS, MAX_WORKERS, AnyEvent, Event

MAX_MESSAGE_BYTES: Final = 8 * 1024 * 1024
MAX_MAP_ENTRIES: Final = MAX_WORKERS
"""The largest map any message holds (a plan's loads, one per worker)."""
MAX_ARRAY_ITEMS: Final = MAX_SHARDS
"""The largest list any message holds (an epoch's completed shards)."""


M = TypeVar("M", bound=pydantic.BaseModel)


def _no_ext(code: int, data: bytes) -> object:
    raise CodecError(f"msgpack extension type {code} is not allowed in Strata messages")


def pack(obj: Any) -> bytes:
    """msgpack bytes of plain data (dicts, lists, str, int, float, bool, None, bytes)."""
    try:
        return msgpack.packb(obj, use_bin_type=True)  # type: ignore[no-any-return]
    except (TypeError, ValueError, OverflowError) as exc:
        raise CodecError(f"cannot encode message: {exc}") from None


def unpack(data: bytes, *, bounded: bool = True) -> Any:
    """Plain data from msgpack bytes; `CodecError` for anything that is not exactly one message.

    A map or list longer than any message holds is refused from its header, before it is built:
    eight megabytes of tiny entries would otherwise cost a second to unpack. `bounded=False` lifts
    those two limits for what only the services write (their snapshots of a whole job's state).
    """
    if len(data) > MAX_MESSAGE_BYTES:
        raise CodecError(f"message of {len(data)} bytes exceeds the limit of {MAX_MESSAGE_BYTES}")
    if not data:
        raise CodecError("empty message")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            strict_map_key=True,
            ext_hook=_no_ext,
            use_list=True,
            max_map_len=MAX_MAP_ENTRIES if bounded else -1,
            max_array_len=MAX_ARRAY_ITEMS if bounded else -1,
        )
    except CodecError:
        raise
    except msgpack.ExtraData:
        raise CodecError("trailing bytes after the message") from None
    except (ValueError, TypeError, msgpack.UnpackException, RecursionError) as exc:
        raise CodecError(f"not a valid msgpack message: {type(exc).__name__}: {exc}") from None


def validation_error(exc: pydantic.ValidationError, what: str) -> ValidationError:
    """A `ValidationError` naming the first offending field of a pydantic error."""
    first = exc.errors(include_url=False)[0]
    # Discriminated unions put the tag first in the location; drop it so the field reads plainly.
    loc = [str(part) for part in first["loc"]]
    if loc and loc[0] in EVENT_TYPES:
        loc = loc[1:]
    field = ".".join(loc) or None
    count = exc.error_count()
    more = f" (and {count - 1} more problems)" if count > 1 else ""
    where = f"field {field!r}" if field else what
    return ValidationError(f"invalid {what}: {where}: {first['msg']}{more}", field=field)


def _as_mapping(obj: Any, what: str) -> dict[str, Any]:
    if not isinstance(obj, dict):
        raise CodecError(f"{what} must be a map, got {type(obj).__name__}")
    return obj


def _check_type(obj: dict[str, Any]) -> None:
    event_type = obj.get("type")
    if not isinstance(event_type, str):
        raise ValidationError("event has no 'type' field", field="type")
    if event_type not in EVENT_TYPES:
        raise ValidationError(f"unknown event type {event_type[:80]!r}", field="type")


def event_from_data(obj: Any) -> AnyEvent:
    """The event a decoded (msgpack or JSON) mapping stands for."""
    mapping = _as_mapping(obj, "an event")
    _check_type(mapping)
    try:
        # The model of its type, as the `AnyEvent` union's discriminator would pick it, but built
        # (`defer_build`) only for the types a process meets: a worker decodes a few of them.
        # The core validator itself, without `model_validate`'s forwarding (a replay decodes
        # every event).
        validator = EVENT_TYPES[mapping["type"]].__pydantic_validator__
        return validator.validate_python(mapping)  # type: ignore[no-any-return]
    except pydantic.ValidationError as exc:
        raise validation_error(exc, "event") from None


def encode_event(event: Event) -> bytes:
    # The serializer directly: the same output as model_dump(), without its per-call set-up.
    return pack(event.__pydantic_serializer__.to_python(event))


def decode_event(data: bytes) -> AnyEvent:
    """The event in msgpack bytes. Raises `CodecError` or `ValidationError`."""
    return event_from_data(unpack(data))


_SHARED_MAX_BYTES: Final = 64 * 1024


@functools.lru_cache(maxsize=256)
def _decode_once(data: bytes) -> AnyEvent:
    return decode_event(data)


def decode_shared_event(data: bytes) -> AnyEvent:
    """`decode_event` for bytes that many subscribers in one process receive (membership and
    barrier events reach every in-process worker): the same bytes are decoded once and the frozen
    event is shared. Failures are not remembered; large messages are decoded each time."""
    if len(data) > _SHARED_MAX_BYTES:
        return decode_event(data)
    return _decode_once(data)


def decode_model(data: bytes, model: type[M], what: str | None = None) -> M:
    """A specific model (an RPC request, say) from msgpack bytes."""
    obj = _as_mapping(unpack(data), what or model.__name__)
    try:
        return model.model_validate(obj)
    except pydantic.ValidationError as exc:
        raise validation_error(exc, what or model.__name__) from None


def event_to_json(event: Event) -> str:
    return event.model_dump_json()


def event_from_json(text: str | bytes) -> AnyEvent:
    """An event from JSON (HTTP edge, exported files)."""
    try:
        obj = json.loads(text)
    except (ValueError, RecursionError) as exc:
        raise CodecError(f"not valid JSON: {exc}") from None
    mapping = _as_mapping(obj, "an event")
    _check_type(mapping)
    try:
        model = EVENT_TYPES[mapping["type"]]
        return model.model_validate_json(text)  # type: ignore[return-value]
    except pydantic.ValidationError as exc:
        raise validation_error(exc, "event") from None
