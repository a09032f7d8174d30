"""The gateway's FastAPI application: jobs' state, history and live pushes, probes, the dashboard.

State comes from the live read model (`LiveModel`); history (`/api/jobs/{job}/events`,
`/api/replay`) is read from JetStream on demand through the `Bus` it is given, so tests can build
the app against any server. With an API token set, every `/api` path asks for it in the
`Authorization` header (never in the URL, where proxies and browser history would keep it); probes
never do. A replay is bounded in what it folds, in time and in how many run at once, so no caller
can tie the gateway up. Every error answer is `{"detail": message, "code": code}`.

The routes live in `routes/` by concern; what they share (the state, errors, auth) in `context`.
The dashboard and the API docs (Swagger UI at `/docs`) are served from local files (see
`assets`), so the gateway works where no other host can be reached; with no dashboard built, `/`
says how to build one. There is no `/redoc`: ReDoc's page fetches its logo from its maker's CDN.
"""

from __future__ import annotations

import html
from pathlib import Path
from typing import Final

import strata
from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse
from fastapi.staticfiles import StaticFiles
from strata.history import ReplayLimits
from strata.services.gateway.assets import (
    BUILD_HINT,
    docs_assets_dir,
    find_dashboard,
    missing_dashboard_message,
)
from strata.services.gateway.context import (
    API_TOKEN_ENV,
    GatewayState,
    ReplaySlots,
    add_error_handlers,
    authorize,
)
from strata.services.gateway.routes import history, jobs, metrics, probes, status, stream

__all__ = ["API_TOKEN_ENV", "DASHBOARD_DIST", "DOCS_ASSETS_URL", "GatewayState", "create_app"]

DASHBOARD_DIST: Final = find_dashboard()
"""The built dashboard this process serves at "/" (None: none is built)."""
DOCS_ASSETS_URL: Final = "/docs-assets"


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
    app.state.gateway = state
    app.state.api_token = api_token
    app.state.replay_limits = replay_limits if replay_limits is not None else ReplayLimits()
    app.state.replays = ReplaySlots(replay_concurrency)
    add_error_handlers(app)

    app.include_router(probes.router)
    api = APIRouter(prefix="/api", dependencies=[Depends(authorize)])
    for routes in (jobs, history, metrics, stream, status):
        api.include_router(routes.router)
    app.include_router(api)
    _add_docs(app)
    _add_dashboard(app, dashboard_dir)
    return app


_NO_DASHBOARD_PAGE: Final = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Strata: no dashboard</title></head>
<body><h1>Strata gateway</h1><p>{message}.</p>
<p>The API answers under <a href="/api/jobs">/api</a>; its documentation is at
<a href="/docs">/docs</a>.</p></body></html>
"""


def _add_dashboard(app: FastAPI, dashboard_dir: Path | None) -> None:
    """The built dashboard at "/", or a page saying how to build one."""
    if dashboard_dir is not None and (dashboard_dir / "index.html").is_file():
        app.mount("/", StaticFiles(directory=dashboard_dir, html=True), name="dashboard")
        return
    missing = (
        missing_dashboard_message()
        if dashboard_dir is None
        else f"the dashboard is not built (no index.html in {dashboard_dir}): {BUILD_HINT}"
    )

    @app.get("/", include_in_schema=False)
    async def no_dashboard() -> HTMLResponse:
        return HTMLResponse(_NO_DASHBOARD_PAGE.format(message=html.escape(missing)), 503)


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
