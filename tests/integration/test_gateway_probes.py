"""The gateway's probes and service status, and a service's own probe port, against real NATS."""

from __future__ import annotations

import asyncio
import urllib.request

import httpx
import pytest
from strata.bus import Bus, RpcServer
from strata.services.gateway.app import GatewayState, create_app
from strata.services.health import HealthServer

pytestmark = pytest.mark.nats


async def test_readyz_follows_the_nats_connection(nats_url: str) -> None:
    state = GatewayState()
    app = create_app(state, dashboard_dir=None)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app), base_url="http://gw") as http:
        assert (await http.get("/healthz")).json() == {"status": "ok"}
        not_ready = await http.get("/readyz")
        assert not_ready.status_code == 503
        assert not_ready.json()["detail"] == "no NATS"
        bus = await Bus.connect(nats_url, name="gateway-test")
        try:
            state.bus = bus
            await bus.ensure_streams()
            state.streams_ready = True
            ready = await http.get("/readyz")
            assert ready.status_code == 200
            assert ready.json() == {"ready": True, "detail": "ok"}
        finally:
            await bus.close()
        assert (await http.get("/readyz")).status_code == 503


async def test_services_endpoint_pings_each_service(nats_url: str) -> None:
    state = GatewayState()
    app = create_app(state, dashboard_dir=None)
    bus = await Bus.connect(nats_url, name="gateway-test")
    state.bus = bus
    registry = await RpcServer(bus.nc, "registry").start()
    try:
        async with httpx.AsyncClient(
            transport=httpx.ASGITransport(app), base_url="http://gw"
        ) as http:
            services = (await http.get("/api/services")).json()["services"]
            assert services["registry"]["up"] is True
            assert services["registry"]["instance"] == registry.instance
            assert services["barrier"] == {
                "up": False,
                "code": "unavailable",
                "error": services["barrier"]["error"],
            }
            assert "strata serve barrier" in services["barrier"]["error"]
            metrics = (await http.get("/metrics")).text
            assert 'strata_rpc_requests_total{outcome="ok",service="registry",verb="ping"}' in (
                metrics
            )
            openapi = (await http.get("/openapi.json")).json()
            assert "/api/services" in openapi["paths"]
    finally:
        await registry.stop()
        await bus.close()


async def test_health_server_answers_probes_and_metrics() -> None:
    ready = {"value": (False, "warming up")}
    health = await HealthServer("registry", lambda: ready["value"], host="127.0.0.1").start()

    def get(path: str) -> tuple[int, bytes]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{health.port}{path}", timeout=2) as r:
                return r.status, r.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    try:
        assert await asyncio.to_thread(get, "/healthz") == (200, b'{"status": "ok"}')
        status, body = await asyncio.to_thread(get, "/readyz")
        assert status == 503
        assert b"warming up" in body
        ready["value"] = (True, "ok")
        assert (await asyncio.to_thread(get, "/readyz"))[0] == 200
        status, body = await asyncio.to_thread(get, "/metrics")
        assert status == 200
        assert b"strata_rpc_requests_total" in body
        assert (await asyncio.to_thread(get, "/nope"))[0] == 404
    finally:
        await health.stop()
