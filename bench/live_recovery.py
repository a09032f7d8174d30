"""Time from a SIGKILLed rank to the survivors' next optimizer step, and steps lost, for three ways
of recovering the same 3-rank data-parallel job (an MLP, gloo, CPU):

- `live`: `strata.torch.live.LiveGroup`, the survivors re-form their group in place;
- `restart`: Strata through torchrun, which restarts every rank, each resuming from the latest
  committed `save_state` checkpoint (every 10 steps) with `Lockstep` data;
- `torchft`: torchft 0.2.0's Manager (one replica group per process, its lighthouse with the same
  heartbeat timeout as the registry's), skipped with a message when torchft is not installed.

Every rank appends `commit <step> <wall time> <ranks in the step>` per optimizer step to a file of
its own. Once the job has committed `--kill-at` steps with all three ranks (torchft's third replica
may join the quorum late), rank 1 is SIGKILLed; the figure is the wall time from the
kill to the first commit after it on any other rank. Steps lost: for `restart`, the steps
committed before the kill that were done again (the last step before the kill minus the
checkpoint resumed from); for the others, the steps discarded. Rounds alternate the ways; the
figures are the median and the spread (min-max), and each way's median over `restart`'s.

Once the survivors have taken that step, a replacement starts (`w3`; torchrun starts its own): the
second figure is the time from the kill to the first step of 3 ranks again, and of it the time
from the replacement's start. The replacement's script notes when each stage of its start ended
(`import torch`, the model and data made, the library imported, registered, joined), printed per
round and as medians; for `live`, each round also says what ended the dead rank's registration:
a survivor's report (its probe found no responder) or the heartbeat timeout.

`--faults` adds two more faults, each measured the same way: `double`, rank 2 killed as well
once the two survivors have taken a step (from the second kill to rank 0's next step alone, then
a replacement to a world of 2), and `heal`, a replacement that kills itself once the state it
heals from has arrived, before loading it (from its death to the survivors' next step, then a
second replacement to a world of 3). torchft's last rank of `double` trains under a lighthouse
of its own that forms a quorum of one.

First, the steady state: the same job without a kill, on a wider MLP (32-2048-2048-2, tens of ms
of compute per step), `LiveGroup` (and torchft's Manager, when installed) against plain
`DistributedDataParallel` over gloo with a `DistributedSampler` on the same data, in an order
that rotates each round; the figure is the median time between rank 0's steps over `--steps`
steps after `--warmup`, each way's median over DDP's, and the ratio to DDP of each round (DDP
run beside it), median and min-max. The load average is printed at the start and the end.
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from strata.bus.server import NatsServer
from strata.config import Env

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tests.rendezvous import children, env_of, kill_tree  # noqa: E402
from tests.support import HEARTBEAT_TIMEOUT, new_job, running_services  # noqa: E402

COMMON = """
import time
STARTED = time.time()
import os, sys
import torch
IMPORTED = time.time()
import torch.nn.functional as F
from torch import nn

SAMPLES = 100_000
generator = torch.Generator().manual_seed(0)
inputs = torch.randn(SAMPLES, 32, generator=generator)
labels = (inputs.sum(1) > 0).long()
torch.manual_seed(0)
WIDE = int(os.environ.get("BENCH_WIDE", "0"))
if WIDE:  # the steady-state figure: a step with tens of ms of compute
    model = nn.Sequential(
        nn.Linear(32, WIDE), nn.ReLU(), nn.Linear(WIDE, WIDE), nn.ReLU(), nn.Linear(WIDE, 2)
    )
else:
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Linear(256, 2))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
LOG = open(os.environ["BENCH_LOG"], "a", buffering=1)

def note(*words):
    LOG.write(" ".join(str(w) for w in words) + "\\n")

def stage(name):
    note("stage", name, time.time())

note("stage", "started", STARTED)
note("stage", "torch", IMPORTED)
stage("model")
"""

LIVE = """
import strata
from strata.torch.live import LiveGroup
from torch.utils.data import TensorDataset

stage("library")
worker = strata.Worker(worker_id=os.environ["WORKER_ID"])
worker.start()
stage("registered")
registry = strata.DatasetRegistry(worker)
registry.register_dataset("bench", total_samples=SAMPLES, shard_size=200, shuffle=True, seed=0)
# Indexed in place, as the other ways read the same tensors: a list of 100,000 (x, y) pairs
# takes seconds to build at a load of 10, in the replacement too.
data = TensorDataset(inputs, labels)

def loss_fn(batch):
    x, y = batch
    return F.cross_entropy(model(x), y, reduction="sum")

live = LiveGroup(worker, model, optimizer, wait_for=3)
if os.environ.get("BENCH_DIE_IN_HEAL"):
    def die(data):  # the state to heal from has arrived: die before loading it
        note("dying", time.time())
        os.kill(os.getpid(), 9)
    live._load_state = die
live.join()
stage("joined")
for epoch in range(100):
    live.train_epoch(registry, "bench", data, loss_fn, batch_size=32, epoch=epoch,
                     on_commit=lambda step: note("commit", step, time.time(), live.world_size))
"""

RESTART = """
import strata
import torch.distributed as dist
from strata.torch import Lockstep
from torch.utils.data import TensorDataset

dist.init_process_group("gloo")
rank = dist.get_rank()
worker = strata.Worker(worker_id=f"rank-{rank}", rank=rank)
worker.start()
registry = strata.DatasetRegistry(worker)
registry.register_dataset("bench", total_samples=SAMPLES, shard_size=200, shuffle=True, seed=0)
checkpoints = strata.CheckpointManager(worker, keep_count=2)
ddp = nn.parallel.DistributedDataParallel(model)
data = TensorDataset(inputs, labels)
manifest = checkpoints.latest()
step, first_epoch = 0, 0
if manifest is not None:
    state = checkpoints.load_state(step=manifest.step, rank=0)
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    step, first_epoch = manifest.step, manifest.epoch
note("resume", step, time.time())
carried = registry.restore_from(manifest, "bench")
dist.barrier()
for epoch in range(first_epoch, 100):
    lockstep = Lockstep(registry, "bench", data, batch_size=32, epoch=epoch)
    for batch in lockstep:
        x, y = batch.batch
        loss = F.cross_entropy(ddp(x), y, reduction="sum") * batch.scale
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        lockstep.trained(batch)
        step += 1
        note("commit", step, time.time(), dist.get_world_size())
        if step % 10 == 0:
            lockstep.flush()
            state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
            cursors = [lockstep.cursor(carried)]
            checkpoints.save_state(state, step=step, epoch=epoch, cursors=cursors)
    carried = None
"""

DDP = """
import torch.distributed as dist
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

dist.init_process_group("gloo")
ddp = nn.parallel.DistributedDataParallel(model)
data = TensorDataset(inputs, labels)
step = 0
for epoch in range(100):
    sampler = DistributedSampler(data, shuffle=True, seed=0)
    sampler.set_epoch(epoch)
    for x, y in DataLoader(data, batch_size=32, sampler=sampler):
        loss = F.cross_entropy(ddp(x), y, reduction="sum")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        step += 1
        note("commit", step, time.time(), dist.get_world_size())
"""

TORCHFT = """
from datetime import timedelta
import torch.distributed as dist
from torchft import Manager, ProcessGroupGloo

stage("library")
store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
state = lambda: {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
def load(s):
    if os.environ.get("BENCH_DIE_IN_HEAL"):  # the state to heal from has arrived: die first
        note("dying", time.time())
        os.kill(os.getpid(), 9)
    model.load_state_dict(s["model"])
    optimizer.load_state_dict(s["optimizer"])
manager = Manager(
    pg=ProcessGroupGloo(timeout=timedelta(seconds=10)), min_replica_size=1,
    load_state_dict=load, state_dict=state, replica_id=os.environ["WORKER_ID"],
    lighthouse_addr=os.environ["TORCHFT_LIGHTHOUSE"], store_addr="127.0.0.1",
    store_port=store.port, rank=0, world_size=1, timeout=timedelta(seconds=10),
    hostname="127.0.0.1",
)
stage("registered")
rank = int(os.environ["WORKER_ID"][1:])
position = rank * 32
while True:
    manager.start_quorum()
    x, y = inputs[position:position + 32], labels[position:position + 32]
    position = (position + 96) % (SAMPLES - 32)
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    for p in model.parameters():
        manager.allreduce(p.grad).wait()
    if manager.should_commit():
        optimizer.step()
        note("commit", manager.current_step(), time.time(), manager.num_participants())
    else:
        note("discard", time.time())
"""

LIVE_DISCARD = re.compile(r"live_step_discarded")
SUSPECT_VERDICT = re.compile(r"live_peer_not_failed.*?verdict=(\w+)")


def log_lines(path: Path) -> list[list[str]]:
    """The complete lines of a rank's log, split; a line still being written (no newline yet,
    read while its rank appends it) waits for the next read."""
    if not path.exists():
        return []
    complete = path.read_text().rpartition("\n")[0]
    return [line.split() for line in complete.splitlines() if line]


COMPUTE = """
import statistics
torch.set_num_threads(1)
x, y = inputs[:32], labels[:32]
times = []
for i in range(int(os.environ["BENCH_STEPS"])):
    start = time.perf_counter()
    optimizer.zero_grad()
    F.cross_entropy(model(x), y).backward()
    optimizer.step()
    times.append(time.perf_counter() - start)
print(statistics.median(times[5:]))
"""


def compute_time(work: Path, wide: int, steps: int) -> float:
    """One rank's step without any collective (forward, backward, optimizer step of the steady
    state's model, batch 32, one thread as every rank has): the compute the overhead is against."""
    script = work / "compute.py"
    script.write_text(COMMON + COMPUTE, encoding="utf-8")
    env = {
        **os.environ,
        "OMP_NUM_THREADS": "1",
        "BENCH_WIDE": str(wide),
        "BENCH_STEPS": str(steps + 5),
        "BENCH_LOG": os.devnull,
    }
    out = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, check=True
    )
    return float(out.stdout.split()[-1])


class Run:
    """One job's ranks, the log of each, and how to kill rank 1."""

    def __init__(
        self, way: str, work: Path, nats_url: str, lighthouse: str | None, wide: int = 0
    ) -> None:
        self.way = way
        self.work = work
        self.job = new_job(f"bench-{way}")
        self.procs: list[subprocess.Popen[bytes]] = []
        body = {"live": LIVE, "restart": RESTART, "torchft": TORCHFT, "ddp": DDP}[way]
        self.script = work / f"train_{way}.py"  # not torchft.py: it would shadow the package
        self.script.write_text(COMMON + body, encoding="utf-8")
        script = self.script
        base = {
            **os.environ,
            Env.NATS_URL: nats_url,
            Env.JOB: self.job,
            Env.DATA_DIR: str(work / "data"),
            "OMP_NUM_THREADS": "1",
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        if lighthouse is not None:
            base["TORCHFT_LIGHTHOUSE"] = lighthouse
        if wide:
            base["BENCH_WIDE"] = str(wide)
        if way == "restart":
            env = {**base, "BENCH_LOG": str(work / "rank.log")}
            out = (work / "torchrun.out").open("wb")
            self.procs.append(
                subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        "--nproc-per-node=3",
                        "--max-restarts=2",
                        "--monitor-interval=0.2",
                        str(script),
                    ],
                    cwd=work,
                    env=env,
                    stdout=out,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,
                )
            )
            return
        if way == "ddp":
            base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="3")
        self.base = base
        for i in range(3):
            self.start(i)

    def start(self, i: int, *, die_in_heal: bool = False) -> subprocess.Popen[bytes]:
        """Start process `w<i>` (rank i for `ddp`); i >= 3 is a replacement, one that kills
        itself once the state it heals from has arrived when `die_in_heal`."""
        env = {**self.base, "WORKER_ID": f"w{i}", "BENCH_LOG": str(self.work / f"w{i}.log")}
        if self.way == "ddp":
            env.update(RANK=str(i), LOCAL_RANK=str(i))
        if die_in_heal:
            env["BENCH_DIE_IN_HEAL"] = "1"
        out = (self.work / f"w{i}.out").open("wb")
        proc = subprocess.Popen(
            [sys.executable, str(self.script)],
            cwd=self.work,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.procs.append(proc)
        return proc

    def lines(self) -> list[list[str]]:
        """Every complete line of the ranks' logs, split (`log_lines`)."""
        found = []
        for path in self.work.glob("*.log"):
            found += log_lines(path)
        return found

    def out(self, i: int) -> str:
        """What process `w<i>` printed so far."""
        path = self.work / f"w{i}.out"
        return path.read_text(errors="replace") if path.exists() else ""

    def committed(self) -> int:
        """The last step committed by all three ranks together."""
        lines = self.lines()
        return max((int(w[1]) for w in lines if w[0] == "commit" and w[3] == "3"), default=0)

    def kill_rank_1(self) -> None:
        if self.way == "restart":
            pid = next((p for p in children(self.procs[0].pid) if env_of(p, "RANK") == "1"), None)
            assert pid is not None, "no rank 1 under torchrun"
            os.kill(pid, signal.SIGKILL)
        else:
            self.procs[1].send_signal(signal.SIGKILL)

    def stop(self) -> None:
        for proc in self.procs:
            kill_tree(proc)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise TimeoutError(f"no {what} within {timeout}s")
        time.sleep(0.02)


class Recovery(NamedTuple):
    next_step: float
    """Seconds from the kill to the survivors' next optimizer step."""
    lost: int
    full: float
    """Seconds from the kill to the first step taken by a world of 3 again."""
    joined: float | None
    """Of which from the replacement's start (None for `restart`: torchrun starts it)."""
    stages: dict[str, float]
    """Seconds from the replacement's start to each stage its script noted (`STAGES`), and to
    its first step of 3 (`step`)."""
    decided: str
    """For `live`: what ended the dead rank's registration, `report` (a survivor's report, its
    probe finding no responder) or `timeout` (the heartbeat timeout); empty for the others."""


FAULTS = ("kill", "double", "heal")


def measure(run: Run, kill_at: int, fault: str = "kill") -> Recovery:
    """Kill rank 1 once `kill_at` steps are committed, wait for the survivors' next step, and
    then, by `fault` (`FAULTS`; `restart` has `kill` alone):

    - `kill`: the figures are from that kill;
    - `double`: rank 2 is killed as well; the figures are from the second kill, to rank 0's next
      step alone;
    - `heal`: a replacement starts that kills itself once the state it heals from has arrived,
      before loading it; the figures are from its death, to the survivors' next step.

    Then a replacement starts (torchrun starts its own), and the last figure is the time to a
    step of the job's world before the fault again (3 ranks; 2 for `double`)."""

    def started() -> bool:
        if all(proc.poll() is not None for proc in run.procs):
            out = "".join(p.read_text(errors="replace")[-3000:] for p in run.work.glob("*.out"))
            raise RuntimeError(f"every process of {run.way} exited:\n{out}")
        return run.committed() >= kill_at

    wait_for(started, 300, f"{kill_at} steps of {run.way}")
    before = run.committed()
    survivors, world, whole, newcomer = [0, 2], "2", "3", 3
    # What the survivors printed before the fault: its discards and reports come after.
    seen = {i: len(run.out(i)) for i in survivors}
    killed = time.time()
    run.kill_rank_1()

    def steps(since: float, world: str) -> list[float]:
        """Commits after `since` of steps taken by a world of `world` ranks (not a step
        all-reduced before the fault and committed just after it)."""
        return [
            float(w[2])
            for w in run.lines()
            if w[0] == "commit" and float(w[2]) > since and w[3] == world
        ]

    def restarted() -> list[float]:
        """Commits after the restarted ranks resumed."""
        lines = run.lines()
        resumed = [float(w[2]) for w in lines if w[0] == "resume" and float(w[2]) > killed]
        since = min(resumed, default=float("inf"))
        return [float(w[2]) for w in lines if w[0] == "commit" and float(w[2]) > since]

    if run.way == "restart":
        wait_for(lambda: bool(restarted()), 300, "a step of restart after the kill")
        seconds = min(restarted()) - killed
        resumed = [int(w[1]) for w in run.lines() if w[0] == "resume" and float(w[2]) > killed]
        lost = before - min(resumed) if resumed else -1
        return Recovery(seconds, lost, seconds, None, {}, "")

    wait_for(lambda: bool(steps(killed, "2")), 300, f"a step of {run.way} after the kill")
    fault_at = killed
    if fault == "double":
        survivors, world, whole = [0], "1", "2"
        seen = {0: len(run.out(0))}
        fault_at = time.time()
        run.procs[2].send_signal(signal.SIGKILL)
    elif fault == "heal":
        seen = {i: len(run.out(i)) for i in survivors}
        doomed = run.start(3, die_in_heal=True)
        wait_for(lambda: doomed.poll() is not None, 300, "the replacement dying in its heal")
        dying = [float(w[1]) for w in log_lines(run.work / "w3.log") if w[0] == "dying"]
        if not dying:
            raise RuntimeError(
                f"the replacement of {run.way} exited before its heal:\n{run.out(3)}"
            )
        fault_at, newcomer = dying[0], 4
    wait_for(lambda: bool(steps(fault_at, world)), 300, f"a step of {run.way} after the {fault}")
    seconds = min(steps(fault_at, world)) - fault_at
    if run.way == "torchft":
        discards = sum(1 for w in run.lines() if w[0] == "discard" and float(w[1]) > fault_at)
        lost = discards // len(survivors)  # each survivor discards the same steps
    else:
        since_fault = "".join(run.out(i)[seen[i] :] for i in survivors)
        lost = len(LIVE_DISCARD.findall(since_fault)) // len(survivors)
    replaced = time.time()
    run.start(newcomer)
    wait_for(lambda: bool(steps(replaced, whole)), 300, f"a step of {whole} ranks of {run.way}")
    back = min(steps(replaced, whole))
    stages: dict[str, float] = {}
    for w in log_lines(run.work / f"w{newcomer}.log"):
        if w[0] == "stage":
            stages[w[1]] = float(w[2]) - replaced
    stages["step"] = back - replaced
    decided = ""
    if run.way == "live":
        since_fault = "".join(run.out(i)[seen[i] :] for i in survivors)
        if "live_peer_failed" in since_fault:
            decided = "report"
        else:
            verdicts = sorted(set(SUSPECT_VERDICT.findall(since_fault)))
            decided = f"timeout (reports: {', '.join(verdicts) or 'none'})"
    return Recovery(seconds, lost, back - fault_at, back - replaced, stages, decided)


def step_time(run: Run, warmup: int, steps: int) -> float:
    """The median time between rank 0's optimizer steps, over `steps` steps after `warmup`."""

    def times() -> list[float]:
        return [float(w[2]) for w in log_lines(run.work / "w0.log") if w[0] == "commit"]

    def enough() -> bool:
        if any(proc.poll() is not None for proc in run.procs):
            out = "".join(p.read_text(errors="replace")[-3000:] for p in run.work.glob("*.out"))
            raise RuntimeError(f"a process of {run.way} exited:\n{out}")
        return len(times()) > warmup + steps

    wait_for(enough, 600, f"{warmup + steps} steps of {run.way}")
    found = times()[warmup : warmup + steps + 1]
    return statistics.median(b - a for a, b in itertools.pairwise(found))


def spread(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s ({min(values):.2f}-{max(values):.2f})"


def load() -> str:
    return ", ".join(f"{value:.1f}" for value in os.getloadavg())


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of each way (default 3)")
    parser.add_argument(
        "--kill-at", type=int, default=40, help="steps committed before the kill (default 40)"
    )
    parser.add_argument(
        "--ways",
        default="live,restart,torchft",
        help="which ways to measure, comma separated (default live,restart,torchft)",
    )
    parser.add_argument(
        "--faults",
        default="kill",
        help=f"which faults, comma separated, of {', '.join(FAULTS)} (default kill; restart "
        "has kill alone)",
    )
    parser.add_argument(
        "--work", default=None, help="where the runs' logs go (default: a temporary folder)"
    )
    parser.add_argument(
        "--steps",
        type=int,
        default=60,
        help="steady state: steps timed per round, LiveGroup against plain DDP (0 skips it; "
        "default 60)",
    )
    parser.add_argument(
        "--steady-ways",
        default="live,ddp,torchft",
        help="steady state: which ways to time, comma separated, ddp among them (default "
        "live,ddp,torchft; torchft only when installed)",
    )
    parser.add_argument(
        "--warmup", type=int, default=10, help="steady state: steps not timed first (default 10)"
    )
    parser.add_argument(
        "--wide", type=int, default=2048, help="steady state: the MLP's width (default 2048)"
    )
    args = parser.parse_args()
    ways = [way for way in args.ways.split(",") if way]
    faults = [fault for fault in args.faults.split(",") if fault]
    if not set(faults) <= set(FAULTS):
        parser.error(f"--faults: one of {', '.join(FAULTS)}")
    steady_ways = [way for way in args.steady_ways.split(",") if way]
    if "live" not in steady_ways or "ddp" not in steady_ways:
        parser.error("--steady-ways needs live and ddp")
    lighthouse = alone = None
    if "torchft" in ways or (args.steps and "torchft" in steady_ways):
        os.environ.setdefault("RUST_LOG", "warn")  # the lighthouse logs every quorum otherwise
        try:
            from torchft.coordination import LighthouseServer
        except ImportError:
            print("torchft is not installed (pip install torchft==0.2.0): skipping it")
            if "torchft" in ways:
                ways.remove("torchft")
            if "torchft" in steady_ways:
                steady_ways.remove("torchft")
        else:
            servers = [
                LighthouseServer(
                    bind=f"[::]:{free_port()}",
                    min_replicas=least,
                    join_timeout_ms=100,
                    heartbeat_timeout_ms=int(HEARTBEAT_TIMEOUT * 1000),
                )
                for least in (2, 1)
            ]
            # A quorum of 2 at least, as a job of 3 wants; one of 1 for `double`'s last rank.
            lighthouse, alone = (server.address() for server in servers)
    results: dict[tuple[str, str], list[Recovery]] = {}
    overhead: dict[str, list[float]] = {way: [] for way in steady_ways}
    print(f"load average at the start: {load()}", flush=True)
    with (
        tempfile.TemporaryDirectory(dir=args.work) as tmp,
        NatsServer(store_dir=Path(tmp) / "nats") as nats,
        running_services(nats.url, Path(tmp) / "logs"),
    ):
        compute = compute_time(Path(tmp), args.wide, args.steps) if args.steps else 0.0
        if args.steps:
            print(f"compute alone (one rank, no collective): {compute * 1000:.1f} ms/step")
        for round_ in range(args.rounds if args.steps else 0):
            turn = round_ % len(steady_ways)
            for way in steady_ways[turn:] + steady_ways[:turn]:
                work = Path(tmp) / f"steady-{way}-{round_}"
                work.mkdir()
                run = Run(way, work, nats.url, lighthouse, wide=args.wide)
                try:
                    seconds = step_time(run, args.warmup, args.steps)
                finally:
                    run.stop()
                overhead[way].append(seconds)
                print(f"round {round_ + 1} steady {way}: {seconds * 1000:.1f} ms/step", flush=True)
        for fault in faults:
            for round_ in range(args.rounds):
                for way in ways if round_ % 2 == 0 else list(reversed(ways)):
                    if way == "restart" and fault != "kill":
                        continue
                    work = Path(tmp) / f"{way}-{fault}-{round_}"
                    work.mkdir()
                    run = Run(way, work, nats.url, alone if fault == "double" else lighthouse)
                    try:
                        found = measure(run, args.kill_at, fault)
                    finally:
                        run.stop()
                    results.setdefault((fault, way), []).append(found)
                    report_round(round_, fault, way, found)
    print(f"load average at the end: {load()}", flush=True)
    if overhead["live"]:
        ddp = overhead["ddp"]
        print(
            f"\nsteady state, 3 ranks, MLP 32-{args.wide}-{args.wide}-2, batch 32 per rank, "
            f"median step of {args.steps} after {args.warmup}, median (min-max) of "
            f"{args.rounds} rounds; compute alone {compute * 1000:.1f} ms/step:"
        )
        for way, times in overhead.items():
            print(
                f"  {way:8s} {statistics.median(times) * 1000:.1f} ms/step "
                f"({min(times) * 1000:.1f}-{max(times) * 1000:.1f})"
            )
        for way, times in overhead.items():
            if way == "ddp":
                continue
            ratio = statistics.median(times) / statistics.median(ddp)
            rounds = [t / d for t, d in zip(times, ddp, strict=True)]
            print(
                f"  {way} / DDP: {ratio:.3f} ({(ratio - 1) * 100:+.1f}%); per round "
                f"{statistics.median(rounds):.3f} ({min(rounds):.3f}-{max(rounds):.3f})"
            )
    for fault in faults:
        report_fault(fault, {way: r for (f, way), r in results.items() if f == fault})


WHOLE = {"kill": 3, "double": 2, "heal": 3}
"""The world a replacement makes whole again after each fault."""
FAULT_NAMES = {
    "kill": "kill",
    "double": "second kill (rank 2, after rank 1's)",
    "heal": "death of a replacement in its heal (after rank 1's kill)",
}


def report_round(round_: int, fault: str, way: str, found: Recovery) -> None:
    joined = "" if found.joined is None else f" ({found.joined:.2f} s after it started)"
    decided = f" (failed on the {found.decided})" if found.decided else ""
    print(
        f"round {round_ + 1} {way} {fault}: {found.next_step:.2f} s to the next step{decided}, "
        f"{found.lost} steps lost, {found.full:.2f} s to a world of {WHOLE[fault]}{joined}",
        flush=True,
    )
    if found.stages:
        marks = ", ".join(f"{name} {t:.2f}" for name, t in found.stages.items())
        print(f"  the replacement, seconds from its start: {marks}", flush=True)


def report_fault(fault: str, results: dict[str, list[Recovery]]) -> None:
    """The medians and spreads of one fault's rounds, each way."""
    if not results:
        return
    rounds = max(len(values) for values in results.values())
    print(
        f"\n{FAULT_NAMES[fault]} to the next optimizer step, heartbeat timeout "
        f"{HEARTBEAT_TIMEOUT} s, median (min-max) of {rounds} rounds:"
    )
    base = (
        statistics.median(r.next_step for r in results["restart"]) if "restart" in results else None
    )
    for way, values in results.items():
        nexts = [r.next_step for r in values]
        against = f", {statistics.median(nexts) / base:.2f}x restart's" if base else ""
        decided = [r.decided for r in values if r.decided]
        how = f"; failed on the {', '.join(decided)}" if decided else ""
        print(f"  {way:8s} {spread(nexts)}{against}; steps lost {[r.lost for r in values]}{how}")
    print(
        f"\n{FAULT_NAMES[fault]} to a step of {WHOLE[fault]} ranks again (a replacement started "
        "after the survivors' step):"
    )
    for way, values in results.items():
        full = spread([r.full for r in values])
        joins = [r.joined for r in values if r.joined is not None]
        joined = f"; from the replacement's start {spread(joins)}" if joins else ""
        print(f"  {way:8s} {full}{joined}")
    staged = {way: values for way, values in results.items() if values and values[0].stages}
    if staged:
        print(
            "\nthe replacement, seconds from its start to the end of each stage, median (min-max):"
        )
        for way, values in staged.items():
            names = list(dict.fromkeys(name for r in values for name in r.stages))
            marks = "; ".join(
                f"{name} {spread([r.stages[name] for r in values if name in r.stages])}"
                for name in names
            )
            print(f"  {way:8s} {marks}")


if __name__ == "__main__":
    main()
