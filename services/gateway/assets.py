"""Where the gateway finds the files it serves: the built dashboard and the API docs' assets.

A wheel of strata-ctl carries the dashboard as package data (`strata/dashboard/dist`); a source
tree or an editable install has it in `dashboard/dist` once `make dashboard` has run. Swagger UI
comes from the fastapi-offline package, so `/docs` loads nothing from another host. Nothing here
imports a web framework: `strata up` asks the same questions before it starts.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Final

import strata
import strata.services
from strata.errors import MissingExtra
from strata.extras import DISTRIBUTION, install_command

PACKAGED_DASHBOARD: Final = Path(strata.__file__).resolve().parent / "dashboard" / "dist"
"""The dashboard inside an installed wheel."""
SOURCE_DASHBOARD: Final = (
    Path(strata.services.__file__).resolve().parent.parent / "dashboard" / "dist"
)
"""The dashboard of a source tree (editable installs); in a wheel, the same as the packaged one."""
BUILD_HINT: Final = (
    "build it with `make dashboard` (or `cd dashboard && npm ci && npm run build`) in the "
    f"repository, or install a {DISTRIBUTION} wheel, which carries it"
)
DOCS_ASSETS: Final = (
    "swagger-ui-bundle.js",
    "swagger-ui.css",
    "favicon.png",
)


def dashboard_candidates() -> tuple[Path, ...]:
    """Where the built dashboard is looked for, in order."""
    return tuple(dict.fromkeys((PACKAGED_DASHBOARD, SOURCE_DASHBOARD)))


def find_dashboard() -> Path | None:
    """The first directory holding a built dashboard, or None when there is none."""
    for candidate in dashboard_candidates():
        if (candidate / "index.html").is_file():
            return candidate
    return None


def missing_dashboard_message() -> str:
    looked = ", ".join(str(path) for path in dashboard_candidates())
    return f"the dashboard is not built (looked in {looked}): {BUILD_HINT}"


def docs_assets_dir() -> Path:
    """Swagger UI's files, as fastapi-offline ships them."""
    spec = importlib.util.find_spec("fastapi_offline")
    if spec is None or spec.origin is None:
        raise MissingExtra(
            f"the gateway's API docs need fastapi-offline: {install_command('server')}"
        )
    static = Path(spec.origin).resolve().parent / "static"
    absent = [name for name in DOCS_ASSETS if not (static / name).is_file()]
    if absent:
        raise MissingExtra(
            f"fastapi-offline at {static} lacks {', '.join(absent)}: the gateway needs "
            "fastapi-offline>=1.7,<2, as strata-ctl[server] requires"
        )
    return static
