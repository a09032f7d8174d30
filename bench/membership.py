"""A job start with real SDK workers: N `strata.aio.Worker`s started at once from several processes.

Each process starts its share of the workers together (every worker its own NATS connection, as
one per training process would be) and reports when all are registered. The baseline, in the same
run and the same layout, is the least such a start can cost: a plain nats-py connect and one
request/reply per worker, against a responder process. Rounds alternate between the two; after a
Strata round the workers keep heartbeating for longer than the heartbeat timeout, and every
`worker.failed` of the job counts as a false failure.

    python -m bench.membership --workers 2000 --procs 4 --rounds 3 [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import nats
import strata.aio
from nats.aio.msg import Msg
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import subjects

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script, or with -m
from bench.barrier import ServiceProcess

ECHO = "bench.membership.echo"
HEARTBEAT_INTERVAL = 1.0
HEARTBEAT_TIMEOUT = 5.0
WARMUP_WORKERS = 200


# -- the children ---------------------------------------------------------------------------------


async def child(mode: str, url: str, job: str, first: int, count: int) -> None:
    # Built before the start, as each training process builds its one worker beforehand.
    made = (
        [strata.aio.Worker(job, url, worker_id=f"w{first + i:05d}") for i in range(count)]
        if mode == "strata"
        else []
    )
    print("ready", flush=True)
    if (await asyncio.to_thread(sys.stdin.readline)).strip() != "go":
        return  # the parent is gone: start nothing
    failures = 0
    held: list[object] = []
    if mode == "strata":
        results = await asyncio.gather(*(w.start() for w in made), return_exceptions=True)
        failures = sum(isinstance(r, BaseException) for r in results)
        held.extend(made)
    else:

        async def one() -> None:
            nc = await nats.connect(url)
            await nc.request(ECHO, b"register", timeout=30)
            held.append(nc)

        results = await asyncio.gather(*(one() for _ in range(count)), return_exceptions=True)
        failures = sum(isinstance(r, BaseException) for r in results)
    print(json.dumps({"done": time.time(), "failures": failures}), flush=True)
    await asyncio.to_thread(sys.stdin.readline)  # "stop"
    for item in held:
        if isinstance(item, strata.aio.Worker):
            await item.stop()
        else:
            await item.close()  # type: ignore[attr-defined]


async def responder(url: str) -> None:
    nc = await nats.connect(url)

    async def answer(msg: Msg) -> None:
        await msg.respond(b"ok")

    await nc.subscribe(ECHO, queue="echo", cb=answer)
    await nc.flush()
    print("ready", flush=True)
    await asyncio.to_thread(sys.stdin.readline)
    await nc.close()


# -- the parent -----------------------------------------------------------------------------------


def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "bench.membership", *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, **(env or {})},
        cwd=Path(__file__).resolve().parents[1],
    )


def expect_ready(proc: subprocess.Popen[str]) -> None:
    line = proc.stdout.readline().strip() if proc.stdout is not None else ""
    if line != "ready":
        raise SystemExit(f"a child process did not start: {line!r}")


def one_round(
    mode: str, url: str, workers: int, procs: int
) -> tuple[float, int, str, list[subprocess.Popen[str]]]:
    job = f"start-{uuid.uuid4().hex[:8]}"
    share = workers // procs
    children = [
        spawn(
            "--child",
            mode,
            "--nats-url",
            url,
            "--job",
            job,
            "--first",
            str(i * share),
            "--count",
            str(share),
        )
        for i in range(procs)
    ]
    for proc in children:
        expect_ready(proc)
    started = time.time()
    for proc in children:
        assert proc.stdin is not None
        proc.stdin.write("go\n")
        proc.stdin.flush()
    reports = [json.loads(proc.stdout.readline()) for proc in children if proc.stdout]
    seconds = max(r["done"] for r in reports) - started
    failures = sum(r["failures"] for r in reports)
    return seconds, failures, job, children


def stop(children: list[subprocess.Popen[str]]) -> None:
    for proc in children:
        if proc.stdin is not None:
            proc.stdin.write("stop\n")
            proc.stdin.flush()
    for proc in children:
        proc.wait(timeout=120)


async def count_failed(url: str, job: str, seconds: float) -> int:
    nc = await nats.connect(url)
    js = nc.jetstream()
    failed = 0
    deadline = time.monotonic() + seconds
    sub = await js.subscribe(subjects.event_subject(job, "worker.failed"), ordered_consumer=True)
    while time.monotonic() < deadline:
        try:
            await sub.next_msg(timeout=max(0.05, deadline - time.monotonic()))
            failed += 1
        except nats.errors.TimeoutError:
            pass
    await nc.close()
    return failed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--workers", type=int, default=2000)
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--check", action="store_true", help="fail when an aim is missed")
    parser.add_argument("--child", choices=["strata", "baseline"])
    parser.add_argument("--responder", action="store_true")
    parser.add_argument("--nats-url")
    parser.add_argument("--job")
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--count", type=int, default=0)
    args = parser.parse_args(argv)
    if args.child:
        asyncio.run(child(args.child, args.nats_url, args.job, args.first, args.count))
        return 0
    if args.responder:
        asyncio.run(responder(args.nats_url))
        return 0

    rates: dict[str, list[float]] = {"baseline": [], "strata": []}
    failures = {"baseline": 0, "strata": 0}
    false_failures = 0
    with tempfile.TemporaryDirectory() as tmp, NatsServer(store_dir=Path(tmp) / "nats") as server:
        url = server.url
        registry = ServiceProcess("registry", url, Path(tmp))
        registry.env.update(
            {
                Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL),
                Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT),
            }
        )
        registry.start()
        echo = spawn("--responder", "--nats-url", url)
        expect_ready(echo)
        try:
            # One small untimed start of each kind first: the first start in a fresh registry,
            # server and page cache pays one-time costs that are no part of either figure.
            for mode in ("baseline", "strata"):
                stop(one_round(mode, url, WARMUP_WORKERS, args.procs)[3])
            for round_index in range(args.rounds):
                for mode in ("baseline", "strata"):
                    seconds, failed, job, children = one_round(mode, url, args.workers, args.procs)
                    rates[mode].append(args.workers / seconds)
                    failures[mode] += failed
                    if mode == "strata":
                        # Heartbeating on for longer than the timeout: any failure is false.
                        false_failures += asyncio.run(
                            count_failed(url, job, HEARTBEAT_TIMEOUT + 2 * HEARTBEAT_INTERVAL)
                        )
                    stop(children)
                    print(
                        f"round {round_index + 1} {mode:8s} {args.workers} workers in "
                        f"{seconds:6.2f}s ({args.workers / seconds:7.0f}/s), {failed} failed",
                        flush=True,
                    )
        finally:
            if echo.stdin is not None:
                echo.stdin.write("stop\n")
                echo.stdin.flush()
            registry.stop()
    baseline = statistics.median(rates["baseline"])
    ours = statistics.median(rates["strata"])
    ratio = ours / baseline
    print(
        f"\nstart of {args.workers} workers from {args.procs} processes (median of {args.rounds}):"
        f"\n  strata.aio.Worker.start  {ours:7.0f}/s  (spread {min(rates['strata']):.0f}-"
        f"{max(rates['strata']):.0f}), {failures['strata']} failed starts"
        f"\n  nats-py connect+request  {baseline:7.0f}/s  (spread {min(rates['baseline']):.0f}-"
        f"{max(rates['baseline']):.0f})"
        f"\n  ratio {ratio:.2f} (aim >= 0.5), false failures {false_failures}"
    )
    met = ratio >= 0.5 and failures["strata"] == 0 and false_failures == 0
    return 0 if met or not args.check else 1


if __name__ == "__main__":
    sys.exit(main())
