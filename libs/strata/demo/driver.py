"""`strata demo`: start the stack, run the training job, kill a worker midway, and report.

The job's workers are separate processes (`python -m strata.demo.worker`), as on a cluster, the
ranks of one model trained with DDP over gloo; the summary shows that model's loss, whether every
rank ended with the same parameters and whether every sample was trained exactly once per epoch
(the demo fails if not). With
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
    parameters: str | None = None
    """A digest of the model's parameters at the end (the same on every rank under DDP)."""
    exactly_once: bool | None = None
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
    run = JobRun(args, job, nats_url, data_dir, env)
    for _ in range(args.workers):
        run.spawn()
    with run.progress:
        for slot in run.slots:
            slot.task = run.progress.add_task(f"worker {slot.index}", total=1, status="starting")
        while not stop.is_set() and not run.over():
            run.step()
    finished = run.finished()
    run.wait_for_exits()
    agreed = _summary(
        args, job, nats_url, run.slots, run.started, run.killed_at, run.recovered_at, finished
    )
    return finished and agreed


class JobRun:
    """The demo job's worker processes, as the driver follows them: spawn, read their progress
    lines, SIGKILL one once every worker has checkpointed a few rounds, replace it."""

    def __init__(
        self, args: argparse.Namespace, job: str, nats_url: str, data_dir: Path, env: dict[str, str]
    ) -> None:
        self.args, self.job, self.nats_url, self.data_dir, self.env = (
            args,
            job,
            nats_url,
            data_dir,
            env,
        )
        self.logs = data_dir / "logs"
        self.events: queue.Queue[tuple[Slot, dict[str, Any]]] = queue.Queue()
        self.slots: list[Slot] = []
        self.started = time.monotonic()
        self.killed_at: float | None = None
        self.recovered_at: float | None = None
        self.round_at_kill = 0
        self.victim: Slot | None = None
        self.failed = False
        self.progress = Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            TextColumn("{task.fields[status]}"),
            console=console,
            transient=False,
        )

    def spawn(self) -> Slot:
        args = self.args
        command = [
            sys.executable,
            "-m",
            "strata.demo.worker",
            *("--job", self.job, "--nats-url", self.nats_url),
            *("--checkpoints", str(self.data_dir / "checkpoints")),
            *("--world-size", str(args.workers), "--epochs", str(args.epochs)),
        ]
        index = len(self.slots)
        with (self.logs / f"{self.job}-worker-{index}.log").open("ab") as log:
            proc = subprocess.Popen(
                command,
                env={**os.environ, **self.env, Env.NATS_URL: self.nats_url, Env.JOB: self.job},
                stdout=subprocess.PIPE,
                stderr=log,
                text=True,
                preexec_fn=procutil.child_preexec,
            )
        slot = Slot(index, proc)
        assert proc.stdout is not None
        threading.Thread(target=_pump, args=(slot, proc.stdout, self.events), daemon=True).start()
        self.slots.append(slot)
        return slot

    def live(self) -> list[Slot]:
        return [s for s in self.slots if not s.killed]

    def step(self) -> None:
        """Take the next progress line (waiting a little for one), then act on the job's state."""
        try:
            slot, event = self.events.get(timeout=0.2)
        except queue.Empty:
            pass
        else:
            _apply(self.progress, slot, event)
            self.note_recovery(event)
        self.maybe_kill()
        self.check_exits()

    def note_recovery(self, event: dict[str, Any]) -> None:
        if (
            event["event"] == "round"
            and self.killed_at is not None
            and self.recovered_at is None
            and event["round"] > self.round_at_kill
        ):
            self.recovered_at = time.monotonic()

    def maybe_kill(self) -> None:
        live = self.live()
        if (
            not self.args.kill_one
            or self.victim is not None
            or len(live) != self.args.workers
            or not all(s.round >= KILL_AFTER_ROUND for s in live)
        ):
            return
        victim = self.victim = live[-1]
        self.round_at_kill = max(s.round for s in live)
        victim.proc.kill()
        victim.killed = True
        self.killed_at = time.monotonic()
        self.progress.update(victim.task, status="[red]SIGKILLed")
        console.print(f"[red]SIGKILL[/] worker {victim.index} ({victim.worker_id})")
        _replace_when_failed(self.nats_url, self.job, victim, self.spawn, self.progress)

    def check_exits(self) -> None:
        for s in self.slots:
            if not s.killed and not s.done and s.proc.poll() not in (None, 0):
                console.print(
                    f"[red]worker {s.index} exited with {s.proc.returncode}[/]; "
                    f"see {self.logs / f'{self.job}-worker-{s.index}.log'}"
                )
                self.failed = True

    def over(self) -> bool:
        if self.failed:
            return True
        if time.monotonic() - self.started > JOB_TIMEOUT_S:
            console.print(f"[red]the job did not finish within {JOB_TIMEOUT_S:.0f}s[/]")
            return True
        live = self.live()
        return len(live) == self.args.workers and all(s.done for s in live)

    def finished(self) -> bool:
        return not self.failed and all(s.done for s in self.live())

    def wait_for_exits(self) -> None:
        for s in self.slots:
            if s.proc.poll() is None:
                try:
                    s.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    s.proc.kill()


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
        slot.parameters, slot.exactly_once = event.get("parameters"), event.get("exactly_once")
        progress.update(slot.task, status=f"[green]done, loss {slot.loss:.3f}")


def _model_summary(args: argparse.Namespace, done: list[Slot]) -> bool:
    """One model, trained by every rank: its loss, and whether the ranks agree on it and trained
    every sample exactly once per epoch (what the demo checks for itself)."""
    if not done:
        return False
    digests = {s.parameters for s in done}
    same = len(digests) == 1 and None not in digests
    once = all(s.exactly_once for s in done)
    Console().print(
        f"model (DDP over gloo, {args.workers} ranks): final loss {done[0].loss:.4f} "
        f"(mean over every rank's samples); parameters identical on every rank: "
        f"{'yes' if same else 'NO'} ({', '.join(sorted(str(d) for d in digests))}); "
        f"every sample trained exactly once per epoch: {'yes' if once else 'NO'}"
    )
    return same and once


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
) -> bool:
    """Print what the job did; whether its ranks agreed on one model trained exactly once."""
    table = Table(title=f"job {job}: {'finished' if finished else 'NOT finished'}")
    for column in ("worker", "rank", "epochs", "rounds", "restarts", "fate"):
        table.add_column(column)
    for s in slots:
        fate = "killed" if s.killed else ("done" if s.done else "unfinished")
        table.add_row(
            str(s.index), str(s.rank), str(s.epoch + 1), str(s.round), str(s.restarts), fate
        )
    Console().print(table)
    agreed = _model_summary(args, [s for s in slots if s.done])
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
    return agreed
