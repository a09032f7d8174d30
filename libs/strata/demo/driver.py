"""`strata demo`: start the stack, run the training job, kill a worker midway, and report.

The job's workers are separate processes (`python -m strata.demo.worker`), as on a cluster. With
`--kill-one`, one is SIGKILLed once every worker has checkpointed a couple of rounds; a replacement
is started once the registry has marked it failed, and the job finishes from the latest committed
checkpoint. The stack stays up afterwards (for the dashboard) until Ctrl-C, unless `--no-keep`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table

from strata import procutil
from strata.bus import Bus
from strata.cli.up import LocalStack, install_stop_signals
from strata.config import Env, load_settings
from strata.events.requests import CheckpointAnswer, CheckpointQuery, MembersRequest, MembersResult

console = Console(stderr=True)

HEARTBEAT_INTERVAL_S = 0.5
HEARTBEAT_TIMEOUT_S = 2.0
KILL_AFTER_ROUND = 2
JOB_TIMEOUT_S = 600.0


@dataclass
class Slot:
    """One worker process of the job (a replacement takes a new slot)."""

    index: int
    proc: subprocess.Popen[str]
    worker_id: str | None = None
    rank: int | None = None
    round: int = 0
    epoch: int = 0
    loss: float | None = None
    restarts: int = 0
    done: bool = False
    killed: bool = False
    task: Any = None
    log: list[str] = field(default_factory=list)


def _pump(slot: Slot, stream: IO[str], events: queue.Queue[tuple[Slot, dict[str, Any]]]) -> None:
    for line in stream:
        try:
            events.put((slot, json.loads(line)))
        except ValueError:
            slot.log.append(line.rstrip())


async def _ask(nats_url: str, service: str, verb: str, request: Any, result: Any) -> Any:
    async with await Bus.connect(nats_url, name="strata-demo", deadline=10.0) as bus:
        return await bus.rpc.call(service, verb, request, result=result, timeout=5.0)


def demo(args: argparse.Namespace) -> int:
    settings = load_settings(data_dir=args.data_dir)
    data_dir = Path(settings.data_dir).resolve()
    job = f"demo-{time.strftime('%Y%m%d-%H%M%S')}"
    env = {
        Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL_S),
        Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT_S),
        Env.LOG_FORMAT: "json",
        Env.LOG_LEVEL: "warning",
    }
    stop = install_stop_signals()
    stack = LocalStack(data_dir, nats_port=args.nats_port, http_port=args.http_port, env=env)
    console.print(f"[bold]Strata demo[/]: starting the stack in {data_dir} ...")
    try:
        stack.start(stop)
        console.print(f"stack up: NATS {stack.nats.url}, dashboard {stack.dashboard_url}")
        ok = _run_job(args, job, stack.nats.url, data_dir, env, stop)
        if ok and not args.no_keep and not stop.is_set():
            console.print(
                f"\nThe stack stays up: dashboard at [bold]{stack.dashboard_url}[/] "
                f"(job {job}). Ctrl-C stops it."
            )
            stack.supervise(stop)
        return 0 if ok else 1
    finally:
        stack.stop()


def _run_job(
    args: argparse.Namespace,
    job: str,
    nats_url: str,
    data_dir: Path,
    env: dict[str, str],
    stop: threading.Event,
) -> bool:
    logs = data_dir / "logs"
    events: queue.Queue[tuple[Slot, dict[str, Any]]] = queue.Queue()
    slots: list[Slot] = []

    def spawn() -> Slot:
        command = [
            sys.executable,
            "-m",
            "strata.demo.worker",
            "--job",
            job,
            "--nats-url",
            nats_url,
            "--checkpoints",
            str(data_dir / "checkpoints"),
            "--world-size",
            str(args.workers),
            "--epochs",
            str(args.epochs),
        ]
        index = len(slots)
        with (logs / f"{job}-worker-{index}.log").open("ab") as log:
            proc = subprocess.Popen(
                command,
                env={**os.environ, **env, Env.NATS_URL: nats_url, Env.JOB: job},
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                preexec_fn=procutil.child_preexec,
            )
        slot = Slot(index, proc)
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(slot, proc.stdout, events), daemon=True).start()
        slots.append(slot)
        return slot

    started = time.monotonic()
    killed_at: float | None = None
    recovered_at: float | None = None
    round_at_kill = 0
    victim: Slot | None = None
    for _ in range(args.workers):
        spawn()
    progress = Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        TextColumn("{task.fields[status]}"),
        console=console,
        transient=False,
    )
    with progress:
        for slot in slots:
            slot.task = progress.add_task(f"worker {slot.index}", total=1, status="starting")
        while not stop.is_set():
            if time.monotonic() - started > JOB_TIMEOUT_S:
                console.print(f"[red]the job did not finish within {JOB_TIMEOUT_S:.0f}s[/]")
                break
            try:
                slot, event = events.get(timeout=0.2)
            except queue.Empty:
                pass
            else:
                _apply(progress, slot, event)
                if (
                    event["event"] == "round"
                    and killed_at is not None
                    and recovered_at is None
                    and event["round"] > round_at_kill
                ):
                    recovered_at = time.monotonic()
            live = [s for s in slots if not s.killed]
            if (
                args.kill_one
                and victim is None
                and len(live) == args.workers
                and all(s.round >= KILL_AFTER_ROUND for s in live)
            ):
                victim = live[-1]
                round_at_kill = max(s.round for s in live)
                victim.proc.kill()
                victim.killed = True
                killed_at = time.monotonic()
                progress.update(victim.task, status="[red]SIGKILLed")
                console.print(f"[red]SIGKILL[/] worker {victim.index} ({victim.worker_id})")
                _replace_when_failed(nats_url, job, victim, spawn, progress)
            for s in slots:
                if not s.killed and not s.done and s.proc.poll() not in (None, 0):
                    console.print(
                        f"[red]worker {s.index} exited with {s.proc.returncode}[/]; "
                        f"see {logs / f'{job}-worker-{s.index}.log'}"
                    )
                    return False
            if (
                all(s.done for s in slots if not s.killed)
                and len([s for s in slots if not s.killed]) == args.workers
            ):
                break
    finished = all(s.done for s in slots if not s.killed)
    for s in slots:
        if s.proc.poll() is None:
            try:
                s.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                s.proc.kill()
    _summary(args, job, nats_url, slots, started, killed_at, recovered_at, finished)
    return finished


def _apply(progress: Progress, slot: Slot, event: dict[str, Any]) -> None:
    kind = event["event"]
    if kind == "started":
        slot.worker_id, slot.rank = event["worker"], event["rank"]
        progress.update(slot.task, description=f"rank {slot.rank} ({slot.worker_id[:12]})")
    elif kind == "round":
        slot.round, slot.epoch, slot.loss = event["round"], event["epoch"], event["loss"]
        progress.update(
            slot.task,
            total=event["total_shards"],
            completed=event["done_shards"],
            status=f"epoch {slot.epoch} round {slot.round} loss {slot.loss:.3f}",
        )
    elif kind == "resumed":
        progress.update(slot.task, status=f"[yellow]resumed from checkpoint round {event['round']}")
    elif kind == "restart":
        slot.restarts += 1
        progress.update(slot.task, status="[yellow]barrier broken: restarting")
    elif kind == "done":
        slot.done, slot.loss = True, event["loss"]
        progress.update(slot.task, status=f"[green]done, loss {slot.loss:.3f}")


def _replace_when_failed(
    nats_url: str, job: str, victim: Slot, spawn: Any, progress: Progress
) -> None:
    """Start the replacement once the registry has failed the victim, so it takes its rank."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        members: MembersResult = asyncio.run(
            _ask(nats_url, "registry", "members", MembersRequest(job=job), MembersResult)
        )
        if all(m.worker_id != victim.worker_id for m in members.members):
            break
        time.sleep(0.2)
    replacement = spawn()
    replacement.task = progress.add_task(
        f"worker {replacement.index} (replacement)", total=1, status="starting"
    )
    console.print(f"worker {victim.index} marked failed; replacement worker {replacement.index}")


def _summary(
    args: argparse.Namespace,
    job: str,
    nats_url: str,
    slots: list[Slot],
    started: float,
    killed_at: float | None,
    recovered_at: float | None,
    finished: bool,
) -> None:
    table = Table(title=f"job {job}: {'finished' if finished else 'NOT finished'}")
    for column in ("worker", "rank", "epochs", "rounds", "final loss", "restarts", "fate"):
        table.add_column(column)
    for s in slots:
        fate = "killed" if s.killed else ("done" if s.done else "unfinished")
        loss = f"{s.loss:.4f}" if s.loss is not None else "-"
        table.add_row(
            str(s.index), str(s.rank), str(s.epoch + 1), str(s.round), loss, str(s.restarts), fate
        )
    Console().print(table)
    try:
        answer: CheckpointAnswer = asyncio.run(
            _ask(nats_url, "checkpoint", "status", CheckpointQuery(job=job), CheckpointAnswer)
        )
        if answer.found and answer.manifest is not None:
            m = answer.manifest
            Console().print(
                f"latest committed checkpoint: round {m.step} (epoch {m.epoch}), "
                f"{len(m.shards)} shards, {m.total_bytes / 1e6:.2f} MB, at {m.root_uri}"
            )
    except Exception as exc:  # the summary must not hide the job's own outcome
        console.print(f"(checkpoint status unavailable: {exc})")
    Console().print(f"wall time: {time.monotonic() - started:.1f}s")
    if killed_at is not None:
        if recovered_at is not None:
            Console().print(
                f"time to recover (kill -> first round past the checkpoint): "
                f"{recovered_at - killed_at:.1f}s"
            )
        else:
            Console().print("the job did not recover after the kill")
