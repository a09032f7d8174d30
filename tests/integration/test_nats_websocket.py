"""nats-py's WebSocket transport still works in a process that imported Strata first.

Importing `strata` keeps aiohttp out of nats-py's import (`strata._imports`); nats-py imports it
when a `ws://` server is used. This connects to a real nats-server's WebSocket listener from a
fresh interpreter, as a program that imported Strata would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from strata.bus.server import NatsServer
from strata.procutil import free_port

pytestmark = pytest.mark.nats

CLIENT = """
import asyncio, json, sys
import strata.bus
import nats

async def echo(msg):
    await msg.respond(msg.data[::-1])

async def main(url):
    before = "aiohttp" in sys.modules
    nc = await nats.connect(url, connect_timeout=10)
    try:
        sub = await nc.subscribe("echo", cb=echo)
        reply = await nc.request("echo", b"strata", timeout=10)
        await sub.unsubscribe()
    finally:
        await nc.close()
    print(json.dumps({"before": before, "after": "aiohttp" in sys.modules,
                      "reply": reply.data.decode()}))

asyncio.run(main(sys.argv[1]))
"""


def test_a_ws_url_connects_after_strata_was_imported(tmp_path: Path) -> None:
    port = free_port()
    websocket = f'websocket {{\n  listen: "127.0.0.1:{port}"\n  no_tls: true\n}}'
    with NatsServer(store_dir=tmp_path / "nats", extra_config=websocket):
        done = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(CLIENT), f"ws://127.0.0.1:{port}"],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    assert done.returncode == 0, done.stderr
    found = json.loads(done.stdout.splitlines()[-1])
    assert found == {"before": False, "after": True, "reply": "atarts"}
