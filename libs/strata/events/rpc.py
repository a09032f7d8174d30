"""Request/reply contracts: the reply envelope and the catalogue of every RPC endpoint.

Requests go to `strata.rpc.<service>.<verb>.<job>.<worker>` (the caller) as msgpack maps; every
request gets a reply, `{ok: true, result: ...}` or `{ok: false, error: {code, message}}`. Services
add their endpoints to `RPC_ENDPOINTS` (through `endpoint`) so the AsyncAPI document lists every
subject, with whom each verb's requests may speak for (its `scope`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Final, Literal

from pydantic import Field, StringConstraints

from strata.events.models import Id, StrictModel

SERVICES: Final = ("registry", "sharding", "barrier", "checkpoint", "gateway")
RPC_SERVICES: Final = ("registry", "sharding", "barrier", "checkpoint")
"""The services that answer requests (and announce their status); the gateway only reads."""

ErrorCode = Annotated[str, StringConstraints(pattern=r"^[a-z][a-z_]{0,63}$")]

Scope = Literal["open", "job", "worker"]
"""Whom a verb's requests may speak for. `open`: anyone (ping). `job`: the caller's own job only
(reads such as members, plan, status). `worker`: the calling worker only (register, leave,
arrive, begin, ack, progress): a body's `worker_id` must be the caller's, or is filled in with it
when left out."""


class ErrorBody(StrictModel):
    code: ErrorCode
    message: Annotated[str, StringConstraints(max_length=4000)]


class OkReply(StrictModel):
    ok: Literal[True] = True
    result: Any = None


class ErrorReply(StrictModel):
    ok: Literal[False] = False
    error: ErrorBody


class PingRequest(StrictModel):
    """Every service answers `ping`; an empty map is a valid request."""


STATUS_INTERVAL_S = 2.0
"""How often each service replica announces its `PingResult` on `strata.status.<service>`."""


class PingResult(StrictModel):
    service: Id
    instance: Id
    uptime_s: Annotated[float, Field(ge=0)]
    version: str


@dataclass(frozen=True)
class RpcEndpoint:
    service: str
    verb: str
    request: type[StrictModel]
    result: type[StrictModel]
    summary: str
    scope: Scope


RPC_ENDPOINTS: list[RpcEndpoint] = [
    RpcEndpoint(
        service, "ping", PingRequest, PingResult, f"Liveness of the {service} service.", "open"
    )
    for service in RPC_SERVICES
]


def endpoint(
    service: str,
    verb: str,
    request: type[StrictModel],
    result: type[StrictModel],
    summary: str,
    *,
    scope: Scope,
) -> RpcEndpoint:
    """Declare an RPC endpoint (once, at import of the service's contract module)."""
    declared = RpcEndpoint(service, verb, request, result, summary, scope)
    if all((e.service, e.verb) != (service, verb) for e in RPC_ENDPOINTS):
        RPC_ENDPOINTS.append(declared)
    return declared
