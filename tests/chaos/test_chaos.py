"""Chaos: a training job on a 3-node NATS cluster survives crashes of everything around it.

While the demo job runs (3 workers, 2 epochs, 3-replica streams), a seeded schedule SIGKILLs each
of the four services once (restarted at once), the leader node of the event stream once (started
again a few seconds later) and two workers (each replaced once the registry has failed it, as
`strata demo` does). Then: the job completed; every committed checkpoint loads with valid
checksums; every event a publisher (service or worker) journaled as acknowledged is in the stream;
the last committed cursors of each epoch cover every shard exactly once; no barrier waited past its
timeout.
Recovery times are printed and written to test-artifacts/chaos/recovery.json.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import functools
import io
import json
import os
import queue
import random
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import nats.errors
import pytest
import torch
from strata import procutil
from strata.bus import Bus, EventFeed
from strata.bus.server import NatsCluster
from strata.config import Env
from strata.errors import StrataError
from strata.events import subjects
from strata.events.requests import Manifest, MembersRequest, MembersResult
from strata.storage import open_storage

from tests.support import ServiceProcess, new_job

pytestmark = [pytest.mark.cluster, pytest.mark.slow, pytest.mark.chaos]

SEED = 20261121
SERVICES = ("registry", "sharding", "barrier", "checkpoint")
STREAM = "STRATA_EVENTS"
WORLD = 3
EPOCHS = 2
SAMPLES = 3072
SHARD_SIZE = 64
SHARDS = SAMPLES // SHARD_SIZE
HEARTBEAT_INTERVAL = 0.25
HEARTBEAT_TIMEOUT = 1.5
BARRIER_TIMEOUT = 60.0
BARRIER_GRACE = 1.0
"""The SDK's own slack past a barrier's timeout before it gives up on the service."""
ROUND_BATCHES = 4
BATCH_SIZE = 32
ROUND_EVENTS = EPOCHS * SHARDS * SHARD_SIZE // (ROUND_BATCHES * BATCH_SIZE)
"""`round` lines the workers print in a run without failures (each prints one per round)."""
CHAOS_WINDOW = (0.05, 0.6)
"""The schedule falls in this part of the run, counted in `round` lines: the machine's speed
varies too much (a round takes from 0.2 to 3 s here) for moments in seconds."""
NATS_DOWN_S = (2.0, 5.0)
JOB_DEADLINE_S = 200.0
ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "test-artifacts" / "chaos"


@dataclass
class Slot:
    """One worker process (a replacement gets a slot of its own)."""

    index: int
    proc: subprocess.Popen[str]
    log_file: Path
    worker_id: str | None = None
    rank: int | None = None
    round: int = 0
    done: bool = False
    killed: bool = False
    started_at: float = field(default_factory=time.monotonic)


@dataclass
class Recovery:
    what: str
    target: str
    killed_at: float
    recovered_at: float | None = None
    note: str = ""

    @property
    def seconds(self) -> float | None:
        return None if self.recovered_at is None else self.recovered_at - self.killed_at


@dataclass
class Chaos:
    """What the schedule did, shared by the test's threads."""

    lock: threading.Lock = field(default_factory=threading.Lock)
    progress: threading.Condition = field(default_factory=threading.Condition)
    rounds: int = 0
    """`round` lines seen from every worker, repeated rounds after a restart included."""
    recoveries: list[Recovery] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def add(self, recovery: Recovery) -> Recovery:
        with self.lock:
            self.recoveries.append(recovery)
        return recovery

    def tick(self) -> None:
        with self.progress:
            self.rounds += 1
            self.progress.notify_all()

    def wait_rounds(self, rounds: int, stop: threading.Event) -> bool:
        with self.progress:
            while self.rounds < rounds and not stop.is_set():
                self.progress.wait(0.2)
        return not stop.is_set()

    def error(self, message: str) -> None:
        with self.lock:
            self.errors.append(message)


def _pump(slot: Slot, stream: IO[str], events: queue.Queue[tuple[Slot, dict[str, Any]]]) -> None:
    # Every line is kept beside the worker's log too (its SDK's log lines among them), to read
    # what a worker did after a failed run.
    with slot.log_file.with_suffix(".out").open("a", encoding="utf-8") as kept:
        for line in stream:
            kept.write(line)
            kept.flush()
            with contextlib.suppress(ValueError):
                events.put((slot, json.loads(line)))
    # After the process's last line, so whoever reads the queue has seen all of them.
    events.put((slot, {"event": "eof"}))


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as exc:
        return f"({path}: {exc})"


def _thread_frames(log_text: str, limit: int = 6) -> str:
    """Where each busy thread of the last stack dump in a worker's log is: the innermost frames
    of Strata's, the demo's and nats' code, innermost first (`current`: the thread that took
    the signal, the main one). Threads idle in a selector or an executor's queue are left out."""
    dump = log_text.rsplit("Fatal Python error", 1)[-1]
    starts = [m.start() for m in re.finditer(r"^(Current thread|Thread) 0x", dump, re.M)]
    if not starts:
        return "no stack dump"
    # The last dump: from the first thread header after the last gap between dumps.
    sections = [dump[a:b] for a, b in zip(starts, [*starts[1:], len(dump)], strict=True)]
    last_current = max(i for i, section in enumerate(sections) if section.startswith("Current"))
    first = last_current
    while first > 0 and sections[first - 1].startswith("Thread"):
        first -= 1
    described = []
    for section in sections[first : last_current + 1]:
        frames, raw = [], []
        for line in section.splitlines()[1:]:
            line = line.strip()
            if not line.startswith("File "):
                break
            path, _, rest = line[len('File "') :].partition('", line ')
            number, _, function = rest.partition(" in ")
            raw.append((path, function))
            if "/strata/" in path or "/nats/" in path:
                short = path.split("/strata/", 1)[-1] if "/strata/" in path else path
                frames.append(f"{short.rsplit('/nats/', 1)[-1]}:{number} {function}")
        top = raw[0] if raw else ("", "")
        if top[0].endswith(("selectors.py", "concurrent/futures/thread.py")):
            continue
        name = "current" if section.startswith("Current") else "thread"
        where = " < ".join(frames[:limit]) or f"{top[0].rsplit('/', 1)[-1]} {top[1]}"
        described.append(f"{name}: {where}")
    return " | ".join(described) or "every thread idle"


def _last_log_line(log_text: str) -> str:
    """The worker's last structured log line (its SDK's), shortened."""
    for line in reversed(log_text.splitlines()):
        if line.startswith("{"):
            return line[:300]
    return "-"


def _failures_decided(logs: Path) -> list[str]:
    """The registry's `worker_failed` lines (every instance's), shortened, oldest first."""
    lines = []
    for path in logs.glob("registry-*.log"):
        for line in path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if record.get("event") == "worker_failed":
                    lines.append(
                        f"{record.get('timestamp', '?')} {record.get('worker_id')}: "
                        f"{record.get('reason', '')[:120]}"
                    )
    return sorted(lines)


def _where_workers_are(
    slots: list[Slot], chaos: Chaos, cluster: NatsCluster, logs: Path, started: float
) -> str:
    """What each worker last said, and the threads' stacks of those still running (each writes
    them to its log on SIGUSR1, through faulthandler): where a job that stopped is waiting.

    The details come first and a summary of a few lines per worker last, so that a report that
    keeps only the start and the end of a long failure still shows every worker."""
    running = [slot for slot in slots if not slot.killed and slot.proc.poll() is None]
    sizes = {slot.index: slot.log_file.stat().st_size for slot in running}
    for slot in running:
        slot.proc.send_signal(signal.SIGUSR1)
    _poll(
        lambda: all(slot.log_file.stat().st_size > sizes[slot.index] for slot in running),
        15,
        threading.Event(),
    )
    details, summary = [], []
    for slot in slots:
        try:
            log_text = slot.log_file.read_text(errors="replace")
        except OSError as exc:
            log_text = f"({exc})"
        head = (
            f"worker {slot.index} ({slot.worker_id}, rank {slot.rank}): started at "
            f"+{slot.started_at - started:.1f}s, round {slot.round}, done {slot.done}, "
            f"killed {slot.killed}, exit {slot.proc.poll()}"
        )
        last_lines = _tail(slot.log_file.with_suffix(".out"), 5)
        stacks = "\n".join(log_text.splitlines()[-60:]) if slot.index in sizes else "-"
        details.append(f"{head}; last lines:\n{last_lines}\nstacks:\n{stacks}")
        last_event = last_lines.splitlines()[-1][:200] if last_lines.strip() else "-"
        waiting = _thread_frames(log_text) if slot.index in sizes else "-"
        summary.append(
            f"{head}\n  last event: {last_event}\n  threads: {waiting}\n"
            f"  last SDK log: {_last_log_line(log_text)}"
        )
    with chaos.lock:
        recoveries = [
            f"{r.what} {r.target} at +{r.killed_at - started:.1f}s: "
            f"{'never' if r.seconds is None else f'{r.seconds:.1f}s'}"
            for r in chaos.recoveries
        ]
        errors = list(chaos.errors)
    return "\n".join(
        [
            *details,
            "",
            "summary:",
            f"nats: {cluster!r}",
            f"schedule so far: {'; '.join(recoveries) or 'nothing'}",
            f"schedule errors: {errors or 'none'}",
            f"the registry failed: {'; '.join(_failures_decided(logs)) or 'nobody'}",
            f"now: +{time.monotonic() - started:.1f}s",
            *summary,
        ]
    )


def _poll(condition: Callable[[], bool], timeout: float, stop: threading.Event) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline or stop.wait(0.1):
            return False
    return True


def _new_leader(cluster: NatsCluster, old: str) -> bool:
    return cluster.stream_leader(STREAM) not in (None, old)


async def _wait_member_gone(
    nats_url: str, job: str, worker_id: str | None, timeout: float, stop: threading.Event
) -> bool:
    """Until the registry no longer lists `worker_id` as a live member of `job`."""
    deadline = time.monotonic() + timeout
    async with await Bus.connect(nats_url, name="chaos-replacer", deadline=timeout) as bus:
        while time.monotonic() < deadline and not stop.is_set():
            # The registry, or the NATS node of this connection, may be down in the schedule.
            with contextlib.suppress(StrataError, nats.errors.Error, TimeoutError):
                members = await bus.rpc.call(
                    "registry", "members", MembersRequest(job=job), result=MembersResult
                )
                if all(m.worker_id != worker_id for m in members.members):
                    return True
            await asyncio.sleep(0.1)
    return False


class Stack:
    """The four services as processes, each replaced by a fresh one when the schedule kills it."""

    def __init__(self, cluster: NatsCluster, logs: Path, env: dict[str, str]) -> None:
        self.cluster, self.logs, self.env = cluster, logs, env
        self.services: dict[str, ServiceProcess] = {}

    def _process(self, name: str) -> ServiceProcess:
        return ServiceProcess(
            name,
            self.cluster.url,
            self.logs,
            heartbeat_interval=HEARTBEAT_INTERVAL,
            heartbeat_timeout=HEARTBEAT_TIMEOUT,
            env=self.env,
        )

    def start(self, name: str) -> None:
        self.services[name] = self._process(name).start(timeout=60.0)

    def start_all(self, names: tuple[str, ...]) -> None:
        """Launch every service, then wait for each: they start side by side."""
        for name in names:
            self.services[name] = self._process(name).launch()
        for name in names:
            self.services[name].wait_ready(timeout=60.0)

    def stop(self) -> None:
        for service in self.services.values():
            service.stop()


@dataclass(frozen=True)
class Action:
    """One background kill: after `rounds` `round` lines and `delay` seconds more."""

    rounds: int
    delay: float
    kind: str
    target: str
    down_s: float = 0.0
    """How long a killed NATS node stays down."""


def _act(action: Action, stack: Stack, chaos: Chaos, stop: threading.Event) -> None:
    """Wait for the action's moment, then kill and recover its target.

    Each action has a thread of its own, so a slow recovery (a NATS node catching up) never
    holds back the next moment of the schedule.
    """
    cluster = stack.cluster
    kind, target = action.kind, action.target
    if not chaos.wait_rounds(action.rounds, stop) or stop.wait(action.delay):
        chaos.error(f"{kind} {target} after {action.rounds} rounds never happened: the job ended")
    else:
        try:
            if kind == "service":
                stack.services[target].kill()
                rec = chaos.add(Recovery("service", target, time.monotonic(), note="-> ready"))
                stack.start(target)
                rec.recovered_at = time.monotonic()
            else:
                # The leader of the event stream: the node whose loss costs an election.
                leader = cluster.stream_leader(STREAM) or cluster.nodes[0].name
                index = next(i for i, n in enumerate(cluster.nodes) if n.name == leader)
                cluster.kill(index)
                rec = chaos.add(
                    Recovery("nats node", leader, time.monotonic(), note="-> new stream leader")
                )
                if _poll(functools.partial(_new_leader, cluster, leader), 60, stop):
                    rec.recovered_at = time.monotonic()
                stop.wait(action.down_s)
                cluster.restart(index, timeout=60.0)
        except BaseException as exc:  # pytest.fail() raises a BaseException
            chaos.error(f"{kind} {target}: {type(exc).__name__}: {exc}")
    # The processes this thread started die with it (PR_SET_PDEATHSIG): it lives as long as
    # the job does.
    stop.wait()


def test_job_survives_chaos(nats_cluster: NatsCluster, tmp_path: Path) -> None:
    rng = random.Random(SEED)
    cluster = nats_cluster
    job = new_job("chaos")
    logs, checkpoints, records = tmp_path / "logs", tmp_path / "checkpoints", tmp_path / "records"
    logs.mkdir()
    journals = {role: tmp_path / f"acked-by-{role}.journal" for role in ("services", "workers")}
    env = {
        Env.STREAM_REPLICAS: "3",
        Env.DATA_DIR: str(tmp_path / "data"),
        Env.LOG_LEVEL: "info",
    }
    stack = Stack(cluster, logs, {**env, Env.ACK_JOURNAL: str(journals["services"])})
    stack.start_all(SERVICES)

    events: queue.Queue[tuple[Slot, dict[str, Any]]] = queue.Queue()
    slots: list[Slot] = []
    slots_lock = threading.Lock()
    chaos = Chaos()
    stop = threading.Event()

    def spawn() -> Slot:
        with slots_lock:
            index = len(slots)
            log_file = logs / f"worker-{index}.log"
            with log_file.open("ab") as log:
                proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "strata.demo.worker",
                        *("--job", job, "--nats-url", cluster.url),
                        *("--checkpoints", str(checkpoints), "--world-size", str(WORLD)),
                        *("--epochs", str(EPOCHS), "--samples", str(SAMPLES)),
                        *("--shard-size", str(SHARD_SIZE), "--batch-size", str(BATCH_SIZE)),
                        *("--round-batches", str(ROUND_BATCHES)),
                        *("--barrier-timeout", str(BARRIER_TIMEOUT), "--keep-count", "1000"),
                        *("--record", str(records)),
                    ],
                    env={
                        **os.environ,
                        **env,
                        Env.NATS_URL: cluster.url,
                        Env.JOB: job,
                        Env.HEARTBEAT_INTERVAL: str(HEARTBEAT_INTERVAL),
                        Env.HEARTBEAT_TIMEOUT: str(HEARTBEAT_TIMEOUT),
                        Env.LOG_FORMAT: "json",
                        Env.ACK_JOURNAL: str(journals["workers"]),
                    },
                    stdout=subprocess.PIPE,
                    stderr=log,
                    text=True,
                    preexec_fn=procutil.child_preexec,
                )
            slot = Slot(index, proc, log_file)
            assert proc.stdout is not None
            threading.Thread(target=_pump, args=(slot, proc.stdout, events), daemon=True).start()
            slots.append(slot)
            return slot

    def replace_when_failed(victim: Slot) -> None:
        # The replacement must take the victim's rank, so it starts only once the registry
        # has failed the victim.
        if not asyncio.run(_wait_member_gone(cluster.url, job, victim.worker_id, 90, stop)):
            chaos.error(f"the registry never failed worker {victim.index} ({victim.worker_id})")
        # The main thread starts it: children die with the thread that started them
        # (PR_SET_PDEATHSIG), and this one is about to end.
        events.put((victim, {"event": "replace"}))

    # The schedule: seeded moments in the first part of the run, each a number of `round`
    # lines and, for the background kills, a delay after it to land anywhere within a round.
    low, high = (int(ROUND_EVENTS * f) for f in CHAOS_WINDOW)
    background = [Action(rng.randint(low, high), rng.uniform(0, 1), "service", s) for s in SERVICES]
    background.append(
        Action(
            rng.randint(low, high),
            rng.uniform(0, 1),
            "nats",
            "stream leader",
            down_s=rng.uniform(*NATS_DOWN_S),
        )
    )
    worker_kills = sorted(rng.randint(low, high) for _ in range(2))
    print(f"\nchaos schedule (seed {SEED}), after so many `round` lines of {ROUND_EVENTS}:")
    for rounds, delay, kind, target in sorted(
        [(a.rounds, a.delay, a.kind, a.target) for a in background]
        + [(m, 0.0, "worker", "a live worker") for m in worker_kills]
    ):
        print(f"  {rounds:3d} +{delay:.2f}s  SIGKILL {kind} {target}")

    actors: list[threading.Thread] = []
    job_seconds = 0.0
    replacers: list[threading.Thread] = []
    started = time.monotonic()
    try:
        for _ in range(WORLD):
            spawn()
        for action in background:
            actor = threading.Thread(target=_act, args=(action, stack, chaos, stop), daemon=True)
            actor.start()
            actors.append(actor)
        pending_kills = list(worker_kills)
        open_worker_recoveries: list[tuple[Recovery, int]] = []
        while True:
            if time.monotonic() - started > JOB_DEADLINE_S:
                with slots_lock:
                    where = _where_workers_are(list(slots), chaos, cluster, logs, started)
                pytest.fail(f"the job did not finish within {JOB_DEADLINE_S:.0f}s:\n{where}")
            with contextlib.suppress(queue.Empty):
                slot, event = events.get(timeout=0.2)
                kind = event["event"]
                if kind == "started":
                    slot.worker_id, slot.rank = event["worker"], event["rank"]
                elif kind == "round":
                    slot.round = event["round"]
                    chaos.tick()
                    for rec, past in list(open_worker_recoveries):
                        if event["round"] > past:
                            rec.recovered_at = time.monotonic()
                            open_worker_recoveries.remove((rec, past))
                elif kind == "done":
                    slot.done = True
                elif kind == "replace":
                    spawn()
                elif kind == "eof" and not slot.killed:
                    code = slot.proc.wait(timeout=60)
                    if code != 0 or not slot.done:
                        when = "after" if slot.done else "before"
                        pytest.fail(
                            f"worker {slot.index} exited with {code} ({when} `done`):\n"
                            f"{_tail(slot.log_file)}"
                        )
            with slots_lock:
                live = [s for s in slots if not s.killed]
            if (
                pending_kills
                and chaos.rounds >= pending_kills[0]
                # One victim at a time: the next waits until the last one's replacement runs.
                and len(live) == WORLD
                and all(s.rank is not None and not s.done for s in live)
            ):
                pending_kills.pop(0)
                victim = rng.choice(live)
                past = max(s.round for s in live)
                victim.proc.kill()
                victim.killed = True
                rec = chaos.add(
                    Recovery(
                        "worker",
                        f"rank {victim.rank} (#{victim.index})",
                        time.monotonic(),
                        note=f"-> round > {past}",
                    )
                )
                open_worker_recoveries.append((rec, past))
                replacer = threading.Thread(target=replace_when_failed, args=(victim,), daemon=True)
                replacer.start()
                replacers.append(replacer)
            if len(live) == WORLD and all(s.done for s in live) and not pending_kills:
                break
            if pending_kills and live and all(s.done for s in live):
                pytest.fail(f"the job finished before the worker kills at {pending_kills}")
        job_seconds = time.monotonic() - started
        for s in live:
            assert s.proc.wait(timeout=60) == 0, _tail(s.log_file)
        stop.set()
        for actor in actors:
            actor.join(timeout=90)
        for replacer in replacers:
            replacer.join(timeout=10)
    finally:
        stop.set()
        with slots_lock:
            for s in slots:
                if s.proc.poll() is None:
                    s.proc.kill()
                    s.proc.wait()
        stack.stop()

    _report(chaos, job_seconds)
    assert not chaos.errors, chaos.errors
    assert len(chaos.recoveries) == len(SERVICES) + 1 + len(worker_kills)
    unrecovered = [r for r in chaos.recoveries if r.recovered_at is None]
    assert not unrecovered, unrecovered

    manifests = _check_checkpoints(checkpoints, job)
    recorded = [json.loads(line) for f in records.glob("*.jsonl") for line in f.open()]
    _check_acked_events(cluster, journals, recorded)
    _check_exactly_once(checkpoints, manifests)
    _check_barriers(recorded)


def _report(chaos: Chaos, job_seconds: float) -> None:
    rows = sorted(chaos.recoveries, key=lambda r: r.killed_at)
    first = rows[0].killed_at if rows else 0.0
    print(f"\njob finished in {job_seconds:.1f}s; recovery times:")
    print(f"  {'at':>7}  {'killed':<10} {'target':<18} {'recovery':>9}  measured")
    for r in rows:
        seconds = f"{r.seconds:.2f}s" if r.seconds is not None else "never"
        print(f"  +{r.killed_at - first:5.1f}s  {r.what:<10} {r.target:<18} {seconds:>9}  {r.note}")
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    (ARTIFACTS / "recovery.json").write_text(
        json.dumps(
            {
                "seed": SEED,
                "job_seconds": round(job_seconds, 2),
                "recoveries": [
                    {
                        "what": r.what,
                        "target": r.target,
                        "at_s": round(r.killed_at - first, 2),
                        "recovery_s": None if r.seconds is None else round(r.seconds, 3),
                        "measured": r.note,
                    }
                    for r in rows
                ],
            },
            indent=2,
        )
        + "\n"
    )


def _check_checkpoints(checkpoints: Path, job: str) -> list[tuple[Manifest, dict[int, Any]]]:
    """Every committed checkpoint: its manifest and each rank's state, read checksum-checked.

    Each holds a shard of every rank of its world: a rank that fails before the step opens, or
    while it is open, aborts it. A world smaller than the job's commits only if the saving
    workers had already seen the failure (the job never resumes from one of those, but it must
    load all the same).
    """
    paths = sorted((checkpoints / job).glob("step-*/MANIFEST.json"))
    assert paths, f"no committed checkpoint under {checkpoints / job}"
    storage = open_storage(str(checkpoints))

    async def load() -> list[tuple[Manifest, dict[int, Any]]]:
        loaded = []
        for path in paths:
            manifest = Manifest.model_validate_json(path.read_text())
            ranks = sorted(shard.rank for shard in manifest.shards)
            assert ranks == sorted(p.rank for p in manifest.participants), f"{path}: {ranks}"
            assert manifest.complete, f"{path}: ranks {ranks} of a world of {manifest.world()}"
            states = {}
            for shard in manifest.shards:
                data = await storage.read(shard.key, shard.checksum)
                states[shard.rank] = torch.load(io.BytesIO(data), weights_only=True)
            loaded.append((manifest, states))
        return loaded

    loaded = asyncio.run(load())
    short = [m.step for m, _ in loaded if len(m.shards) < WORLD]
    print(
        f"committed checkpoints: {len(loaded)}, every shard checksum-checked and loaded"
        + (f" ({len(short)} committed by a short world: steps {short})" if short else "")
    )
    return loaded


def _read_journal(path: Path) -> set[str]:
    """The ids in an `AckJournal` file (`<msg id> <stream> <seq>` lines)."""
    if not path.exists():
        return set()
    return {line.split()[0] for line in path.read_text().splitlines() if line.strip()}


def _check_acked_events(
    cluster: NatsCluster, journals: dict[str, Path], recorded: list[dict[str, Any]]
) -> None:
    acked = {role: _read_journal(path) for role, path in journals.items()}
    # The workers' own record of their checkpoint acks: the id of the event the checkpoint
    # service recorded for each, from its answer. Each must be stored too. It need not be in
    # the services' journal: a service killed between the stream's ack and its journal line
    # never answers, and the worker's retry is answered by the next one from its state.
    by_worker = {r["id"] for r in recorded if r["kind"] == "acked"}
    assert by_worker, "the workers recorded no acknowledged checkpoint event"
    assert not acked["workers"], "workers publish nothing on the event stream"
    everything = set().union(*acked.values()) | by_worker

    async def stored_types() -> dict[str, str]:
        found: dict[str, str] = {}
        bus = await Bus.connect(cluster.url, name="chaos-check", deadline=30.0)
        async with bus, EventFeed(bus.js, STREAM, subjects.all_events()) as feed:
            async for delivered in feed:
                found[delivered.event.id] = delivered.event.type
                if feed.caught_up.is_set():
                    break
        return found

    # A node restarted by the schedule may still be catching up: a timed-out read is retried.
    deadline = time.monotonic() + 90
    while True:
        try:
            stored = asyncio.run(asyncio.wait_for(stored_types(), timeout=60))
            break
        except (TimeoutError, nats.errors.TimeoutError):
            if time.monotonic() >= deadline:
                raise
    lost = sorted(everything - stored.keys())
    assert not lost, f"{len(lost)} of {len(everything)} acknowledged events missing: {lost[:10]}"
    types = collections.Counter(stored[i] for i in acked["services"])
    for wanted in (
        "worker.failed",
        "shard.plan_changed",
        "barrier.released",
        "checkpoint.committed",
    ):
        assert types[wanted], f"no acknowledged {wanted} in the services' journal: {types}"
    print(
        f"acknowledged events journaled: {len(acked['services'])} by the services, "
        f"{len(acked['workers'])} by the workers; all in the stream "
        f"({', '.join(f'{t} {n}' for t, n in sorted(types.items()))})"
    )


def _check_exactly_once(checkpoints: Path, loaded: list[tuple[Manifest, dict[int, Any]]]) -> None:
    for epoch in range(EPOCHS):
        finished = [
            (manifest, states)
            for manifest, states in loaded
            if manifest.epoch == epoch
            and len(manifest.shards) == WORLD
            and all(state["epoch_done"] for state in states.values())
        ]
        assert finished, f"no committed checkpoint ends epoch {epoch}"
        manifest, _ = max(finished, key=lambda item: item[0].committed_ts)
        per_rank: dict[int, set[int]] = {}
        for shard in manifest.shards:
            for cursor in shard.cursors:
                if cursor.epoch == epoch:
                    per_rank.setdefault(shard.rank, set()).update(cursor.completed)
        seen: dict[int, int] = {}
        for rank, done in sorted(per_rank.items()):
            twice = {s: (seen[s], rank) for s in done if s in seen}
            assert not twice, f"epoch {epoch} step {manifest.step}: shards read twice {twice}"
            seen.update(dict.fromkeys(done, rank))
        missing = sorted(set(range(SHARDS)) - set(seen))
        assert not missing, f"epoch {epoch} step {manifest.step}: shards never read {missing}"
        print(
            f"epoch {epoch}: committed cursors of step {manifest.step} cover all {SHARDS} shards "
            f"once ({', '.join(f'rank {r}: {len(d)}' for r, d in sorted(per_rank.items()))})"
        )


def _check_barriers(recorded: list[dict[str, Any]]) -> None:
    waits = [r for r in recorded if r["kind"] == "barrier"]
    assert waits, "the workers recorded no barrier wait"
    late = [
        w for w in waits if w["outcome"] == "timeout" or w["seconds"] > w["timeout"] + BARRIER_GRACE
    ]
    assert not late, f"barriers waited past their timeout: {late}"
    slowest = max(waits, key=lambda w: w["seconds"])
    broken = sum(w["outcome"] == "broken" for w in waits)
    print(
        f"barrier waits: {len(waits)} ({broken} broken by failures), longest "
        f"{slowest['seconds']:.2f}s at {slowest['name']!r} (timeout {slowest['timeout']:g}s)"
    )
