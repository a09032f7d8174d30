"""Time for torchrun to form a world: the Strata rendezvous backend next to c10d, in the same run.

One torchrun agent starts N local processes (2, 8 and 32 by default) of a trivial script:
`init_process_group("gloo")`, a barrier, exit. A round times one launch with each backend, in
alternating order, from starting torchrun to the last rank past the barrier ("formed") and to
torchrun's exit ("done"); and the agent's rendezvous alone, from torch's log ("rendezvous"), the
part the backend does, without Python's and torch's start-up. The figures are the median over the
rounds with the spread (min-max), and the ratio strata / c10d of the medians (below 1: Strata is
faster). 32 processes on 2 cores take a while, so keep `--rounds` small.

`--import-cost` measures instead what installing Strata adds to every torchrun agent, whatever
its backend: torch imports every `torchrun.handlers` entry point when its rendezvous package is
imported. Each round imports `torch.distributed.elastic.rendezvous` in a fresh process (torch
already imported, so only that import is timed) with Strata's entry point and without any (as
without Strata installed), in alternating order.

    python bench/rendezvous.py [--procs 2,8,32] [--rounds 3] [--nats-url nats://...] [--check]
    python bench/rendezvous.py --import-cost [--rounds 15]
"""

from __future__ import annotations

import argparse
import re
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from strata import procutil
from strata.bus.server import NatsServer

from tests.rendezvous import Agent, entry_point_path, torchrun_env

SCRIPT = """\
import time
import torch.distributed as dist

dist.init_process_group("gloo")
dist.barrier()
print(f"formed {time.time():.6f}", flush=True)
dist.destroy_process_group()
"""
FORMED = re.compile(r"formed (\d+\.\d+)")
IMPORT_PROBE = """\
import sys
import time

import torch
import torch.distributed

if sys.argv[1] == "without":  # as without Strata installed: the same look-up, no `strata` in it
    import importlib.metadata as metadata

    every = metadata.entry_points

    def others(**select):
        found = every(**select)
        return metadata.EntryPoints(ep for ep in found if not ep.value.startswith("strata."))

    metadata.entry_points = others
started = time.perf_counter()
import torch.distributed.elastic.rendezvous as rendezvous

took = time.perf_counter() - started
assert ("strata" in rendezvous.rendezvous_handler_registry._registry) == (sys.argv[1] == "with")
print(f"imported {took:.6f}")
"""
IMPORTED = re.compile(r"imported (\d+\.\d+)")
# torch's own log lines (LOGLEVEL=INFO) around the agent's rendezvous: what the backend does.
AGENT_LOG = r"^I\d{4} (\d\d):(\d\d):(\d\d\.\d+) .*"
RDZV_START = re.compile(AGENT_LOG + "Rendezvous'ing worker group", re.M)
RDZV_DONE = re.compile(AGENT_LOG + "Rendezvous complete for workers", re.M)
BACKENDS = ("c10d", "strata")
CHECK_RATIO = 1.10
"""`--check` fails when Strata's median time to form a world is more than 10% over c10d's."""


def clock(match: re.Match[str] | None) -> float:
    if match is None:
        raise SystemExit("torchrun logged no rendezvous (is LOGLEVEL=INFO passed on?)")
    return int(match[1]) * 3600 + int(match[2]) * 60 + float(match[3])


def launch(
    backend: str, procs: int, work: Path, nats_url: str, env: dict[str, str]
) -> tuple[float, float]:
    """(formed, done) in seconds for one torchrun launch of `procs` processes."""
    endpoint = nats_url if backend == "strata" else f"127.0.0.1:{procutil.free_port()}"
    log = work / f"{backend}-{procs}-{uuid.uuid4().hex[:6]}.log"
    started = time.time()
    agent = Agent(
        work / "form.py",
        backend=backend,
        endpoint=endpoint,
        run_id=f"bench-{uuid.uuid4().hex[:8]}",
        nnodes="1",
        nproc=procs,
        log=log,
        env=env,
        max_restarts=0,
    )
    code = agent.wait(600)
    done = time.time() - started
    stamps = [float(m[1]) for m in FORMED.finditer(agent.output())]
    if code != 0 or len(stamps) != procs:
        raise SystemExit(f"{backend} with {procs} processes failed ({code}):\n{agent.output()}")
    output = agent.output()
    rendezvous = clock(RDZV_DONE.search(output)) - clock(RDZV_START.search(output))
    return rendezvous, max(stamps) - started, done


def import_cost(rounds: int, work: Path, env: dict[str, str]) -> int:
    """Seconds to import torch's rendezvous package with Strata's entry point and without."""
    (work / "probe.py").write_text(IMPORT_PROBE)
    times: dict[str, list[float]] = {"without": [], "with": []}
    for round_ in range(rounds):
        order = ("without", "with") if round_ % 2 == 0 else ("with", "without")
        for case in order:
            done = subprocess.run(
                [sys.executable, str(work / "probe.py"), case],
                env=env,
                capture_output=True,
                text=True,
                timeout=300,
                check=False,
            )
            found = IMPORTED.search(done.stdout)
            if done.returncode != 0 or found is None:
                raise SystemExit(f"the import probe failed ({case}):\n{done.stderr}")
            times[case].append(float(found[1]))
    without, with_ = (statistics.median(times[case]) for case in ("without", "with"))
    print(f"import torch.distributed.elastic.rendezvous, {rounds} rounds, torch already imported")
    print(f"  without Strata's entry point   {summary(times['without'])}")
    print(f"  with Strata's                  {summary(times['with'])}")
    print(f"  Strata adds {1000 * (with_ - without):.0f} ms (ratio {with_ / without:.2f})")
    return 0


def summary(values: list[float]) -> str:
    return f"{statistics.median(values):6.3f}s ({min(values):.3f}-{max(values):.3f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--procs", default="2,8,32", help="world sizes, comma-separated")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--nats-url", help="a running server (default: one of its own)")
    parser.add_argument("--check", action="store_true", help="fail when an aim is missed")
    parser.add_argument(
        "--import-cost", action="store_true", help="time what the entry point adds to an agent"
    )
    args = parser.parse_args(argv)
    sizes = [int(size) for size in args.procs.split(",") if size.strip()]
    if args.import_cost:
        with tempfile.TemporaryDirectory() as tmp:
            env = torchrun_env(entry_point_path(Path(tmp) / "entry-point"))
            return import_cost(args.rounds, Path(tmp), env)

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        (work / "form.py").write_text(SCRIPT)
        env = torchrun_env(entry_point_path(work / "entry-point"), LOGLEVEL="INFO")
        server = None if args.nats_url else NatsServer(store_dir=work / "nats").__enter__()
        nats_url = args.nats_url or (server.url if server else "")
        try:
            results: dict[tuple[str, int], list[tuple[float, float, float]]] = {}
            for procs in sizes:
                for round_ in range(args.rounds):
                    # Alternate which backend goes first, so neither always meets a warm cache.
                    order = BACKENDS if round_ % 2 == 0 else BACKENDS[::-1]
                    for backend in order:
                        figure = launch(backend, procs, work, nats_url, env)
                        results.setdefault((backend, procs), []).append(figure)
                        print(
                            f"  {procs:3d} procs, round {round_ + 1}, {backend:6s}: rendezvous "
                            f"{figure[0]:.3f}s, formed {figure[1]:.2f}s, done {figure[2]:.2f}s",
                            flush=True,
                        )
        finally:
            if server is not None:
                server.__exit__(None, None, None)

    missed = []
    for index, name in enumerate(("rendezvous", "formed", "done")):
        print(f"\n{name:>10}  {'c10d':>22}  {'strata':>22}  ratio")
        for procs in sizes:
            c10d = [figure[index] for figure in results[("c10d", procs)]]
            strata = [figure[index] for figure in results[("strata", procs)]]
            ratio = statistics.median(strata) / statistics.median(c10d)
            print(f"{procs:4d} procs  {summary(c10d):>22}  {summary(strata):>22}  {ratio:5.2f}")
            if name == "formed" and ratio > CHECK_RATIO:
                missed.append(f"{procs} procs: {ratio:.2f}x c10d")
    if args.check and missed:
        print("aim missed (no slower than c10d): " + "; ".join(missed))
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
