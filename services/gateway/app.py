"""The gateway's FastAPI application: jobs' state, history and live pushes, probes, the dashboard.

State comes from the live read model (`LiveModel`); history (`/api/jobs/{job}/events`,
`/api/replay`) is read from JetStream on demand through the `Bus` it is given, so tests can build
the app against any server. With an API token set, every `/api` path asks for it in the
`Authorization` header (never in the URL, where proxies and browser history would keep it); probes
never do. A replay is bounded in what it folds, in time and in how many run at once, so no caller
can tie the gateway up. Every error answer is `{"detail": message, "code": code}`.

The dashboard and the API docs (Swagger UI at `/docs`) are served from local files (see
`assets`), so the gateway works where no other host can be reached; with no dashboard built, `/`
says how to build one. There is no `/redoc`: ReDoc's page fetches its logo from its maker's CDN.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import html
import time
from collections.abc import AsyncIterator, Iterator, Mapping
from pathlib import Path
from typing import Annotated, Any, Final, get_args

import pydantic
import strata
from fastapi import APIRouter, Depends, FastAPI, HTTPException, Query, Request, Response
from fastapi import Path as PathParam
from fastapi.encoders import jsonable_encoder
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from fastapi.staticfiles import StaticFiles
from nats.aio.msg import Msg
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
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
from strata.events import EVENT_TYPES, ID_PATTERN, WorkerState, subjects
from strata.events.codec import unpack
from strata.events.rpc import RPC_SERVICES, STATUS_INTERVAL_S, PingResult
from strata.replay import (
    JobState,
    LiveRates,
    ReplayLimits,
    dumps,
    fold_history,
    job_history,
    render_dashboard,
    stream_records,
    summarize,
)
from strata.services.gateway.api import Dashboard, EventPage, JobList, WorkerPage
from strata.services.gateway.assets import (
    BUILD_HINT,
    docs_assets_dir,
    find_dashboard,
    missing_dashboard_message,
)
from strata.services.gateway.live import LiveModel
from strata.services.gateway.metrics_history import metric_routes

DASHBOARD_DIST: Final = find_dashboard()
"""The built dashboard this process serves at "/" (None: none is built)."""
DOCS_ASSETS_URL: Final = "/docs-assets"

API_TOKEN_ENV: Final = Env.API_TOKEN
"""When set, `/api/*` answers only requests with `Authorization: Bearer <token>`."""
REPLAY_RETRY_AFTER_S: Final = 1

PUSH_INTERVAL_S: Final = 0.25
"""At most four pushes a second per stream: changes in between are coalesced into the next."""
RATES_CHECK_S: Final = 1.0
KEEPALIVE_S: Final = 15.0
MAX_PAGE: Final = 1000
MAX_EVENTS_SCANNED: Final = 50_000
WORKER_STATUSES: Final = frozenset(get_args(WorkerState))
AREAS: Final = frozenset(event_type.split(".")[0] for event_type in EVENT_TYPES)

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


_BEARER = HTTPBearer(auto_error=False, description=f"The token in ${API_TOKEN_ENV}")

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


async def _authorize(
    request: Request,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_BEARER)],
) -> None:
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


def _json(document: Any, status_code: int = 200) -> Response:
    return Response(dumps(document), status_code=status_code, media_type="application/json")


def _type_filter(job: str, prefix: str | None) -> tuple[str, str | None]:
    """The subject that selects events of `prefix` on the server, and what is left to check here."""
    if not prefix:
        return subjects.job_events(job), None
    if prefix in EVENT_TYPES:
        return subjects.event_subject(job, prefix), None
    area = prefix.removesuffix(".")
    if area in AREAS:
        return subjects.area_events(job, area), None
    return subjects.job_events(job), prefix


def create_app(
    state: GatewayState,
    dashboard_dir: Path | None = DASHBOARD_DIST,
    api_token: str | None = None,
    replay_limits: ReplayLimits | None = None,
    replay_concurrency: int = 2,
) -> FastAPI:
    app = FastAPI(
        title="Strata gateway",
        version=strata.__version__,
        description="State of Strata training jobs, for the dashboard and for scripts. Every "
        "figure is folded from the jobs' events with the services' own code.",
        # Served below from local files: FastAPI's own pages load their scripts from a CDN.
        docs_url=None,
        redoc_url=None,
    )
    app.state.api_token = api_token
    limits = replay_limits if replay_limits is not None else ReplayLimits()
    replays = ReplaySlots(replay_concurrency)
    app.state.replays = replays
    api = APIRouter(prefix="/api", dependencies=[Depends(_authorize)])

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

    def live() -> LiveModel:
        if state.live is None:
            raise HTTPException(503, detail="the gateway is not connected to NATS yet")
        return state.live

    def bus() -> Bus:
        if state.bus is None:
            raise HTTPException(503, detail="the gateway is not connected to NATS yet")
        return state.bus

    def job_state(job: str) -> JobState:
        found = live().job(job)
        if found is None:
            raise HTTPException(404, detail=f"no events of job {job!r} (yet)")
        return found

    # -- probes -----------------------------------------------------------------------------------

    @app.get("/healthz", tags=["probes"])
    async def healthz() -> dict[str, str]:
        """The process is alive."""
        return {"status": "ok"}

    @app.get("/readyz", tags=["probes"])
    async def readyz() -> JSONResponse:
        """Connected to NATS, the streams exist, and the events stored at start are folded."""
        connected = state.bus is not None and state.bus.nc.is_connected
        folded = state.live is None or state.live.caught_up.is_set()
        ready = connected and state.streams_ready and folded
        if ready:
            detail = "ok"
        elif not connected:
            detail = "no NATS"
        elif not state.streams_ready:
            detail = "streams not provisioned"
        else:
            detail = "folding the event stream"
        return JSONResponse({"ready": ready, "detail": detail}, status_code=200 if ready else 503)

    @app.get("/metrics", tags=["probes"])
    async def metrics() -> Response:
        """Prometheus metrics of this process."""
        return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    # -- state ------------------------------------------------------------------------------------

    @api.get("/jobs", tags=["state"], response_model=JobList)
    async def jobs() -> Response:
        """Every job seen, the one with the latest event first."""
        states = sorted(live().model.jobs.values(), key=lambda s: (-s.ts, s.job))
        return _json({"jobs": [s.summary() for s in states]})

    @api.get("/dashboard", tags=["state"], response_model=Dashboard)
    async def dashboard(job: JobId) -> Response:
        """Workers, datasets, checkpoints, barriers, metrics and recent events of a job, now."""
        body, _ = live().dashboard_json(job_state(job))
        return Response(body, media_type="application/json")

    @api.get("/jobs/{job}/workers", tags=["state"], response_model=WorkerPage)
    async def workers(
        job: JobInPath,
        offset: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 100,
        status: Annotated[
            str | None, Query(description="One status or several, comma-separated")
        ] = None,
    ) -> Response:
        """A page of a job's workers in rank order, optionally of some statuses only."""
        rows: list[dict[str, Any]] = live().static_dashboard(job_state(job))["workers"]
        if status:
            wanted = {s.strip() for s in status.split(",") if s.strip()}
            unknown = wanted - WORKER_STATUSES
            if unknown:
                raise HTTPException(
                    422, detail=f"unknown status {sorted(unknown)}; use {sorted(WORKER_STATUSES)}"
                )
            rows = [row for row in rows if row["status"] in wanted]
        return _json({"total": len(rows), "items": rows[offset : offset + limit]})

    # -- history ----------------------------------------------------------------------------------

    @api.get("/jobs/{job}/events", tags=["history"], response_model=EventPage)
    async def events(
        job: JobInPath,
        after_seq: Annotated[int, Query(ge=0)] = 0,
        limit: Annotated[int, Query(ge=1, le=MAX_PAGE)] = 200,
        type: Annotated[
            str | None, Query(max_length=64, description="Event type prefix, e.g. 'barrier.'")
        ] = None,
    ) -> Response:
        """A job's events after a stream sequence, from JetStream, with their full JSON."""
        subject, prefix = _type_filter(job, type)
        items: list[dict[str, Any]] = []
        last_seq, scanned = after_seq, 0
        records = stream_records(bus().js, "events", subject, start_seq=after_seq + 1)
        async with contextlib.aclosing(records):
            async for record in records:
                last_seq, scanned = record.seq, scanned + 1
                event = record.event
                if prefix is None or event.type.startswith(prefix):
                    items.append(
                        {
                            "seq": record.seq,
                            "ts": event.ts,
                            "type": event.type,
                            "summary": summarize(event),
                            "event": event.model_dump(mode="json"),
                        }
                    )
                if len(items) >= limit or scanned >= MAX_EVENTS_SCANNED:
                    break
        return _json({"items": items, "last_seq": last_seq})

    @api.get("/replay", tags=["history"], response_model=Dashboard)
    async def replay(
        job: JobId,
        seq: Annotated[int | None, Query(ge=0, description="Fold events up to this seq")] = None,
        at: Annotated[
            int | None, Query(ge=0, description="Fold what was stored at or before (ns)")
        ] = None,
        telemetry: Annotated[
            bool, Query(description="Fold heartbeats too (last heartbeat, step, epoch)")
        ] = False,
    ) -> Response:
        """The dashboard of a job as it was at a point of its history; live rates are null.
        Bounded: too many events to fold is a 422 (`too_large`), too long a 504
        (`deadline_exceeded`), too many replays at once a 429 (`busy`)."""
        if (seq is None) == (at is None):
            raise HTTPException(
                422, detail="give exactly one of seq (a stream sequence) or at (ns)"
            )
        narrow = "ask for an earlier point (a smaller seq or at)" + (
            ", or leave heartbeats out (telemetry=false)" if telemetry else ""
        )
        with replays.hold():
            history = job_history(bus().js, job, until_seq=seq, until_ns=at, telemetry=telemetry)
            rebuilt = await fold_history(history, JobState(job), limits, narrow)
        if rebuilt.events == 0:
            raise HTTPException(404, detail=f"job {job!r} has no events at that point")
        return _json(render_dashboard(rebuilt))

    # -- live pushes ------------------------------------------------------------------------------

    @api.get(
        "/stream",
        tags=["state"],
        response_class=StreamingResponse,
        responses={200: {"content": {"text/event-stream": {}}}},
    )
    async def stream(job: JobId) -> StreamingResponse:
        """Server-Sent Events: `event: dashboard` with the whole dashboard whenever it changed
        (at most four a second, within a second of a change), and `: keepalive` every 15 s."""
        return StreamingResponse(
            _pushes(live(), job),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )

    # -- services ---------------------------------------------------------------------------------

    @api.get("/services", tags=["status"])
    async def services() -> dict[str, Any]:
        """Which services are up: each announces itself every few seconds; one not heard from
        within three announcements is down. Before the gateway has listened that long, a
        service not yet heard from is asked with a ping."""
        if state.bus is None:
            return {"services": {name: {"up": False, "error": "no NATS"} for name in RPC_SERVICES}}
        connected = state.bus
        stale_after = 3 * STATUS_INTERVAL_S
        now = time.monotonic()

        async def status(name: str) -> dict[str, Any]:
            heard = state.announced.get(name)
            if heard is not None and now - heard[1] <= stale_after:
                return {
                    "up": True,
                    **heard[0].model_dump(),
                    "heard_s_ago": round(now - heard[1], 2),
                }
            listening = state.listening_since
            if listening is not None and now - listening > stale_after:
                silent = f"no announcement for {stale_after:g}s" if heard else "never announced"
                return {"up": False, "error": silent, "code": "unavailable"}
            try:
                result = await connected.rpc.call(name, "ping", result=PingResult, timeout=1.0)
            except StrataError as exc:
                return {"up": False, "error": exc.message, "code": exc.code}
            return {"up": True, **result.model_dump()}

        answers = await asyncio.gather(*(status(name) for name in RPC_SERVICES))
        return {"services": dict(zip(RPC_SERVICES, answers, strict=True))}

    @api.get("/subjects", tags=["status"])
    async def subject_layout() -> dict[str, str]:
        """The subject layout, for people writing their own consumers."""
        return {
            "events": subjects.all_events(),
            "heartbeats": subjects.all_heartbeats(),
            "metrics": subjects.all_metrics(),
            "rpc": f"{subjects.RPC}.<service>.<verb>.<job>.<worker>",
        }

    api.include_router(metric_routes(live))
    app.include_router(api)
    _add_docs(app)
    if dashboard_dir is not None and (dashboard_dir / "index.html").is_file():
        app.mount("/", StaticFiles(directory=dashboard_dir, html=True), name="dashboard")
    else:
        missing = (
            missing_dashboard_message()
            if dashboard_dir is None
            else f"the dashboard is not built (no index.html in {dashboard_dir}): {BUILD_HINT}"
        )

        @app.get("/", include_in_schema=False)
        async def no_dashboard() -> HTMLResponse:
            return HTMLResponse(_NO_DASHBOARD_PAGE.format(message=html.escape(missing)), 503)

    return app


_NO_DASHBOARD_PAGE: Final = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Strata: no dashboard</title></head>
<body><h1>Strata gateway</h1><p>{message}.</p>
<p>The API answers under <a href="/api/jobs">/api</a>; its documentation is at
<a href="/docs">/docs</a>.</p></body></html>
"""


def _add_docs(app: FastAPI) -> None:
    """Swagger UI at /docs, with every script, style and icon served from here."""
    app.mount(DOCS_ASSETS_URL, StaticFiles(directory=docs_assets_dir()), name="docs-assets")
    openapi_url = app.openapi_url or "/openapi.json"

    @app.get("/docs", include_in_schema=False)
    async def swagger_ui(request: Request) -> HTMLResponse:
        root = request.scope.get("root_path", "")
        return get_swagger_ui_html(
            openapi_url=f"{root}{openapi_url}",
            title=f"{app.title}: API",
            swagger_js_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui-bundle.js",
            swagger_css_url=f"{root}{DOCS_ASSETS_URL}/swagger-ui.css",
            swagger_favicon_url=f"{root}{DOCS_ASSETS_URL}/favicon.png",
            # Swagger UI would otherwise send the document to validator.swagger.io.
            swagger_ui_parameters={"validatorUrl": None},
        )


async def _pushes(live: LiveModel, job: str) -> AsyncIterator[bytes]:
    """The body of one push stream; ends when the client goes (Starlette cancels it)."""
    with live.watching(job) as signal:
        yield b": connected\n\n"
        sent: tuple[int, LiveRates] | None = None
        last_push = -PUSH_INTERVAL_S
        last_write = time.monotonic()
        while True:
            state = live.job(job)
            now = time.monotonic()
            if state is not None and sent != (state.version, live.live_rates(job)):
                pause = PUSH_INTERVAL_S - (now - last_push)
                if pause > 0:
                    # Coalescing: whatever else changes during the pause goes out together.
                    await asyncio.sleep(pause)
                    continue
                body, rates = live.dashboard_json(state)
                sent = (state.version, rates)
                yield b"event: dashboard\ndata: " + body + b"\n\n"
                last_push = last_write = time.monotonic()
                continue
            quiet = KEEPALIVE_S - (now - last_write)
            if quiet <= 0:
                yield b": keepalive\n\n"
                last_write = now
                continue
            # Rates move with the clock as well as with events: look again within a second.
            await signal.wait(min(RATES_CHECK_S, quiet))
