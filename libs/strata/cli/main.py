"""`strata`: run the stack (`up`), one service (`serve`), and inspect jobs.

Each verb lives in its own function; errors a person can fix are printed as one line with their
code, never as a traceback, and the exit status is non-zero. The verbs need the `server` extra
(`demo` also `torch`); without it they say so in that one line, so nothing here imports what the
SDK alone does not install.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Final

import strata
from strata import extras
from strata.config import load_settings
from strata.errors import StrataError
from strata.logs import configure_logging

if TYPE_CHECKING:
    from rich.console import Console

VERB_EXTRAS: Final = {"demo": ("server", "torch")}
"""The extras each verb needs beyond `server`, which every verb needs."""


def _add_nats(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--nats-url", help="NATS server URL(s), comma-separated (default: $STRATA_NATS_URL)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="strata", description="Control plane for distributed training jobs."
    )
    parser.add_argument("--version", action="version", version=f"strata {strata.__version__}")
    verbs = parser.add_subparsers(dest="verb", required=True, metavar="VERB")

    up = verbs.add_parser("up", help="run the whole stack on this machine (embedded NATS)")
    up.add_argument("--nats-port", type=int, default=4222, help="NATS client port (4222)")
    up.add_argument("--http-port", type=int, default=8080, help="gateway/dashboard port (8080)")
    up.add_argument("--data-dir", type=Path, default=None, help="state directory (./.strata)")
    up.add_argument("--host", default="127.0.0.1", help="address to listen on (127.0.0.1)")
    up.add_argument(
        "--secure",
        action="store_true",
        help="NATS with passwords and per-role permissions (credentials in the data dir)",
    )
    up.add_argument(
        "--worker-credentials", type=int, default=16, help="worker users made by --secure (16)"
    )
    up.add_argument(
        "--registry-partitions",
        type=int,
        default=1,
        metavar="N",
        help="registry processes sharing the heartbeat intake (1); partition 0 decides membership",
    )
    up.add_argument(
        "--job",
        default=None,
        help="the job --secure makes worker users for, worker-N@JOB ($STRATA_JOB, default)",
    )

    demo = verbs.add_parser(
        "demo", help="run a real PyTorch training job on a local stack, killing a worker midway"
    )
    demo.add_argument("--workers", type=int, default=3, help="worker processes (3)")
    demo.add_argument("--epochs", type=int, default=2, help="epochs to train (2)")
    demo.add_argument(
        "--kill-one",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="SIGKILL a worker midway and recover (default: yes)",
    )
    demo.add_argument(
        "--no-keep", action="store_true", help="stop the stack when the job ends (for CI)"
    )
    demo.add_argument("--nats-port", type=int, default=4222, help="NATS client port (4222)")
    demo.add_argument("--http-port", type=int, default=8080, help="dashboard port (8080)")
    demo.add_argument("--data-dir", type=Path, default=None, help="state directory (./.strata)")

    serve = verbs.add_parser("serve", help="run one service in this process (as in a container)")
    serve.add_argument("service", help="registry, sharding, barrier, checkpoint or gateway")
    _add_nats(serve)
    serve.add_argument("--health-port", type=int, help="probe/metrics port ($STRATA_HEALTH_PORT)")
    serve.add_argument("--http-port", type=int, help="gateway HTTP port ($STRATA_HTTP_PORT)")

    status = verbs.add_parser("status", help="which services answer, and the streams' state")
    _add_nats(status)

    from strata.cli import replay

    replay.add_parsers(verbs)

    return parser


def _serve(args: argparse.Namespace) -> int:
    from strata.services import catalog
    from strata.services.runtime import run

    settings = load_settings(
        nats_url=args.nats_url, health_port=args.health_port, http_port=args.http_port
    )
    run(catalog.create(args.service), settings)
    return 0


async def _status(nats_url: str | None) -> int:
    from rich.console import Console
    from rich.table import Table

    from strata.bus import Bus
    from strata.events import subjects
    from strata.events.rpc import RPC_SERVICES, PingResult

    settings = load_settings(nats_url=nats_url)
    async with await Bus.connect(settings=settings, name="strata-cli", deadline=5.0) as bus:
        table = Table(title=f"Strata at {settings.nats_url}")
        for column in ("service", "state", "instance", "uptime"):
            table.add_column(column)
        down = 0
        for name in RPC_SERVICES:
            try:
                ping = await bus.rpc.call(name, "ping", result=PingResult, timeout=1.0)
                table.add_row(name, "[green]up", ping.instance, f"{ping.uptime_s:.0f}s")
            except StrataError as exc:
                down += 1
                table.add_row(name, f"[red]{exc.code}", "-", "-")
        Console().print(table)
        for stream in (subjects.EVENTS_STREAM, subjects.TELEMETRY_STREAM):
            try:
                info = await bus.js.stream_info(stream)
                Console().print(f"{stream}: {info.state.messages} messages")
            except Exception as exc:
                Console().print(f"{stream}: [red]unavailable ({type(exc).__name__})")
    return 0 if down == 0 else 3


def _stderr_console() -> Console | None:
    try:
        from rich.console import Console
    except ImportError:
        return None
    return Console(stderr=True)


def _print_error(exc: StrataError) -> None:
    """One line on stderr: a JSON object under STRATA_LOG_FORMAT=json, else readable text (in
    red where rich is installed: it is part of the server extra)."""
    try:
        as_json = load_settings().log_format == "json"
    except StrataError:
        as_json = False  # the settings themselves are what is wrong
    if as_json:
        line = {"level": "error", "code": exc.code, "message": exc.message}
        print(json.dumps(line), file=sys.stderr)
        return
    console = _stderr_console()
    if console is None:
        print(f"error {exc}", file=sys.stderr)
        return
    from rich.markup import escape

    console.print(f"[red]error[/] {escape(str(exc))}", soft_wrap=True)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        extras.require(*VERB_EXTRAS.get(args.verb, ("server",)), what=f"strata {args.verb}")
        if args.verb == "up":
            from strata.cli.up import up

            return up(args)
        if args.verb == "demo":
            from strata.demo.driver import demo

            if not 1 <= args.workers <= 64 or not 1 <= args.epochs <= 100:
                parser.error("--workers must be in 1..64 and --epochs in 1..100")
            return demo(args)
        if args.verb == "serve":
            return _serve(args)
        if args.verb == "status":
            settings = load_settings(nats_url=args.nats_url)
            configure_logging(settings.log_format, "warning")
            return asyncio.run(_status(args.nats_url))
        if args.verb in ("replay", "export"):
            from strata.cli import replay

            run = replay.replay if args.verb == "replay" else replay.export
            console = _stderr_console()
            assert console is not None  # rich is part of the server extra, required above
            return run(args, console)
        parser.error(f"unknown verb {args.verb!r}")
    except StrataError as exc:
        _print_error(exc)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
