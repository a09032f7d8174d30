"""How soon after a process dies NATS says that nobody listens on its subscription: the race
behind the registry's repeated probe of a suspect (`services/registry/suspects.py`).

Each try starts a process that subscribes to a subject and never answers, SIGKILLs it, waits
until it is reaped (its sockets are closed, as a survivor sees when its collective with it
fails), waits `delay`, and sends one request to the subject: "no responders" means that
nats-server has processed the closed connection; a request that times out went into the dead
connection's buffer. The delays are interleaved try by try; the figure is how many tries of
each delay got "no responders".
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import nats
import nats.errors
from strata.bus.server import NatsServer

SUBSCRIBER = """
import asyncio, sys, nats

async def main():
    nc = await nats.connect(sys.argv[1])

    async def ignore(msg):
        pass

    await nc.subscribe("bench.probe", cb=ignore)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def one_try(nc: nats.NATS, url: str, delay: float) -> bool:
    """Whether a request `delay` seconds after the subscriber was reaped found no responders.

    The subscriber is started, killed and reaped with blocking calls on purpose: an event loop's
    child watcher would add its own latency between the reap and the request."""
    proc = subprocess.Popen(  # noqa: ASYNC220 (see above)
        [sys.executable, "-c", SUBSCRIBER, url],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    try:
        assert proc.stdout is not None
        if proc.stdout.readline().strip() != b"ready":
            raise RuntimeError("the subscriber did not start")
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        if delay:
            await asyncio.sleep(delay)
        try:
            await nc.request("bench.probe", b"", timeout=0.25)
        except nats.errors.NoRespondersError:
            return True
        except nats.errors.TimeoutError:
            return False
        raise RuntimeError("the dead subscriber answered")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


async def run(tries: int, delays: list[float]) -> None:
    with tempfile.TemporaryDirectory() as tmp, NatsServer(store_dir=Path(tmp)) as server:
        nc = await nats.connect(server.url)
        found = {delay: 0 for delay in delays}
        try:
            for _ in range(tries):
                for delay in delays:
                    found[delay] += await one_try(nc, server.url, delay)
        finally:
            await nc.close()
    print(f"requests to a SIGKILLed subscriber's subject, {tries} tries per delay:")
    for delay, count in found.items():
        print(f"  {delay * 1000:5.1f} ms after it was reaped: no responders {count} of {tries}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tries", type=int, default=50, help="tries per delay (default 50)")
    parser.add_argument(
        "--delays",
        default="0,0.001,0.005,0.05",
        help="seconds after the subscriber was reaped, comma separated (default 0,0.001,0.005,"
        "0.05; 0.05 is the registry's second probe)",
    )
    args = parser.parse_args()
    asyncio.run(run(args.tries, [float(d) for d in args.delays.split(",")]))


if __name__ == "__main__":
    main()
