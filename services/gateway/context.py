"""What every route of the gateway shares: its connections, the replay slots, error answers, auth.

`GatewayState` holds the NATS side (`bus`, `live`, the services' announcements); a route reaches it
through the request (`gateway(request)`), and `live`/`bus`/`job_state` answer 503 (not connected
yet) or 404 (no such job) the same way for every route. Every error answer is
`{"detail": message, "code": code}`: `add_error_handlers` installs that for Strata's errors, HTTP
errors and invalid requests alike.
"""

from __future__ import annotations

import contextlib
import hmac
import time
from collections.abc import Iterator, Mapping
from typing import Annotated, Any, Final

import pydantic
from fastapi import Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from nats.aio.msg import Msg
from starlette.exceptions import HTTPException as StarletteHTTPException
from strata.bus import Bus
from strata.config import Env
from strata.errors import (
    BusError,
    Busy,
    DeadlineExceeded,
    LimitExceeded,
    NotFound,
    StrataError,
    ValidationError,
)
from strata.events import ID_PATTERN, subjects
from strata.events.codec import unpack
from strata.events.rpc import PingResult
from strata.history import dumps
from strata.services.gateway.live import LiveModel
from strata.services.readmodel import JobState

API_TOKEN_ENV: Final = Env.API_TOKEN
"""When set, `/api/*` answers only requests with `Authorization: Bearer <token>`."""
REPLAY_RETRY_AFTER_S: Final = 1
MAX_PAGE: Final = 1000
MAX_SEQ: Final = 2**63 - 1
"""The largest stream sequence or nanosecond time a parameter may name (JetStream's sequences
are 64-bit): a larger one is a 422, not an overflow further down."""
MAX_OFFSET: Final = 100_000_000

JobId = Annotated[str, Query(pattern=ID_PATTERN, description="Job id")]
JobInPath = Annotated[str, PathParam(pattern=ID_PATTERN, description="Job id")]


class GatewayState:
    """What the HTTP handlers need; `bus` and `live` are None until NATS is connected."""

    def __init__(self) -> None:
        self.bus: Bus | None = None
        self.streams_ready = False
        self.live: LiveModel | None = None
        self.announced: dict[str, tuple[PingResult, float]] = {}
        """The latest status each service announced, and when (monotonic seconds)."""
        self.listening_since: float | None = None
        """When the gateway began to hear announcements (None: it does not)."""

    async def listen_for_status(self, bus: Bus) -> None:
        """Follow the services' announcements: the gateway's credential may not send requests."""

        async def heard(msg: Msg) -> None:
            try:
                status = PingResult.model_validate(unpack(msg.data))
            except (StrataError, pydantic.ValidationError):
                return
            if msg.subject == subjects.status_subject(status.service):
                self.announced[status.service] = (status, time.monotonic())

        await bus.nc.subscribe(subjects.all_status(), cb=heard)
        self.listening_since = time.monotonic()


class ReplaySlots:
    """At most `size` replays at once: each holds a JetStream consumer and folds on the event
    loop that also serves the dashboard, so more are refused rather than queued."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.running = 0

    @contextlib.contextmanager
    def hold(self) -> Iterator[None]:
        if self.running >= self.size:
            raise Busy(
                f"{self.running} replays are running, the most this gateway runs at once "
                f"(${Env.REPLAY_CONCURRENCY}); retry in a second",
                retry_after_s=REPLAY_RETRY_AFTER_S,
            )
        self.running += 1
        try:
            yield
        finally:
            self.running -= 1


# -- reaching the gateway's state from a request ---------------------------------------------------


def gateway(request: Request) -> GatewayState:
    state: GatewayState = request.app.state.gateway
    return state


def live(request: Request) -> LiveModel:
    found = gateway(request).live
    if found is None:
        raise HTTPException(503, detail="the gateway is not connected to NATS yet")
    return found


def bus(request: Request) -> Bus:
    found = gateway(request).bus
    if found is None:
        raise HTTPException(503, detail="the gateway is not connected to NATS yet")
    return found


def job_state(request: Request, job: str) -> JobState:
    found = live(request).job(job)
    if found is None:
        raise HTTPException(404, detail=f"no events of job {job!r} (yet)")
    return found


def json_response(document: Any, status_code: int = 200) -> Response:
    return Response(dumps(document), status_code=status_code, media_type="application/json")


# -- errors and auth -------------------------------------------------------------------------------

_STATUS_CODES: Final = {
    401: "unauthorized",
    404: NotFound.code,
    422: ValidationError.code,
    503: "unavailable",
}
"""The `code` of an error answer raised as a plain HTTP status."""


def _status_of(error: StrataError) -> int:
    if isinstance(error, NotFound):
        return 404
    if isinstance(error, Busy):
        return 429
    if isinstance(error, LimitExceeded | ValidationError):
        return 422
    if isinstance(error, DeadlineExceeded):
        return 504
    if isinstance(error, BusError):
        return 503
    return 500


def _error(
    status: int, code: str, detail: Any, headers: Mapping[str, str] | None = None
) -> Response:
    return JSONResponse({"detail": detail, "code": code}, status_code=status, headers=headers)


def add_error_handlers(app: FastAPI) -> None:
    """Every error answer as `{"detail": message, "code": code}`."""

    @app.exception_handler(StrataError)
    async def strata_error(request: Request, exc: StrataError) -> Response:
        retry_after = exc.details.get("retry_after_s")
        headers = {"Retry-After": str(retry_after)} if retry_after is not None else None
        return _error(_status_of(exc), exc.code, exc.message, headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> Response:
        code = _STATUS_CODES.get(exc.status_code, "error")
        return _error(exc.status_code, code, exc.detail, exc.headers)

    @app.exception_handler(RequestValidationError)
    async def invalid_request(request: Request, exc: RequestValidationError) -> Response:
        return _error(422, ValidationError.code, jsonable_encoder(exc.errors()))


_BEARER = HTTPBearer(auto_error=False, description=f"The token in ${API_TOKEN_ENV}")


async def authorize(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> None:
    """With an API token set, every `/api` path asks for it in the `Authorization` header."""
    token: str | None = request.app.state.api_token
    if token is None:
        return
    given = credentials.credentials if credentials is not None else ""
    if hmac.compare_digest(given.encode(), token.encode()):
        return
    if not given and "access_token" in request.query_params:
        # Tokens in URLs end up in proxy logs and browser history; the dashboard reads the push
        # stream with fetch, which sends the header.
        detail = (
            "a token in the URL (access_token) is not accepted: send it in the header "
            "'Authorization: Bearer <token>'"
        )
    else:
        detail = (
            "missing or wrong API token: send 'Authorization: Bearer <token>' "
            f"(the gateway's ${API_TOKEN_ENV})"
        )
    raise HTTPException(401, detail=detail, headers={"WWW-Authenticate": "Bearer"})
