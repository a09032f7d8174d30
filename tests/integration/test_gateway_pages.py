"""The gateway's pages: the dashboard when one is built, how to build it when not, and API docs
whose every script and style comes from the gateway itself (no CDN, so they work air-gapped)."""

from __future__ import annotations

import re
from pathlib import Path

import httpx
from strata.services.gateway.app import DOCS_ASSETS_URL, GatewayState, create_app
from strata.services.gateway.assets import BUILD_HINT

# src="...", href="...", url: '...': every address the page has the browser fetch.
ADDRESS = re.compile(r"""(?:src|href)\s*=\s*["']([^"']+)["']|\burl\s*:\s*["']([^"']+)["']""")


def _client(dashboard_dir: Path | None) -> httpx.AsyncClient:
    app = create_app(GatewayState(), dashboard_dir=dashboard_dir)
    return httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw")


async def test_a_built_dashboard_is_served_at_the_root(tmp_path: Path) -> None:
    (tmp_path / "assets").mkdir()
    (tmp_path / "index.html").write_text('<script src="/assets/app.js"></script>')
    (tmp_path / "assets" / "app.js").write_text("console.log('strata')")
    async with _client(tmp_path) as http:
        page = await http.get("/")
        assert page.status_code == 200
        assert "/assets/app.js" in page.text
        script = await http.get("/assets/app.js")
        assert script.status_code == 200
        assert script.headers["content-type"].startswith(("text/javascript", "application/js"))


async def test_without_a_dashboard_the_root_says_how_to_build_one(tmp_path: Path) -> None:
    async with _client(None) as http:
        page = await http.get("/")
        assert page.status_code == 503
        assert page.headers["content-type"].startswith("text/html")
        assert "the dashboard is not built" in page.text
        assert "make dashboard" in page.text
        assert "npm run build" in page.text
        assert (await http.get("/healthz")).status_code == 200
    async with _client(tmp_path) as http:  # a directory with no index.html in it
        page = await http.get("/")
        assert page.status_code == 503
        assert str(tmp_path) in page.text
        assert BUILD_HINT.split("`")[1] in page.text


async def test_api_docs_load_only_from_the_gateway() -> None:
    async with _client(None) as http:
        page = await http.get("/docs")
        assert page.status_code == 200
        addresses = [a or b for a, b in ADDRESS.findall(page.text)]
        for address in addresses:
            assert address.startswith("/"), f"/docs loads {address}"
            assert not address.startswith("//"), f"/docs loads {address}"
            assert (await http.get(address)).status_code == 200, address
        assets = {a.rsplit("/", 1)[1] for a in addresses if a.startswith(DOCS_ASSETS_URL)}
        assert {"swagger-ui-bundle.js", "swagger-ui.css", "favicon.png"} <= assets
        assert "/openapi.json" in addresses
        assert '"validatorUrl": null' in page.text
        # FastAPI's own pages load from a CDN: neither is served.
        assert (await http.get("/redoc")).status_code == 404
