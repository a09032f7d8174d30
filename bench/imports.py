"""What importing the SDK costs a process that has already imported torch.

A replacement rank's time to rejoin a `LiveGroup` includes its imports. Each round starts one
fresh Python process per case; the process imports torch, then the case's modules, and reports
the wall and CPU time of that second import alone (and of torch's, for the baseline). The cases
run in an order that rotates every round, so load from other processes falls on all of them
alike. Printed: the median of the rounds and their range, and the ratio of each case's whole
process (torch and the case) to the baseline process that imports torch alone.

    python bench/imports.py [--rounds 7] [--cases live,strata,torchft] [--before DIR]

Cases: `live` (`import strata.torch.live`), `strata` (`import strata`), `worker`
(`from strata import Worker`), `torchft` (`import torchft`, skipped when it is not installed).
`--before DIR` times Strata's cases a second time with the `libs/` of another tree first on the
path, in the same rounds: `git archive <commit> libs | tar -x -C DIR` gives a commit's figures
next to the working tree's.

`import torch` leaves Python's collector close to a full collection (one comes about 11,000
new objects later, and takes 0.05-0.1 s over torch's objects): whatever a program does next
pays for it, in a training script mostly the building of its model and data. `--gc-collect`
runs that collection before the timer, so each case's own cost is what is timed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

PROBE = """\
import gc, json, sys, time
w0, c0 = time.perf_counter(), time.process_time()
import torch
if sys.argv[1] == "collect":
    gc.collect()
w1, c1 = time.perf_counter(), time.process_time()
for statement in sys.argv[2:]:
    exec(statement)
w2, c2 = time.perf_counter(), time.process_time()
print(json.dumps({"torch_wall": w1 - w0, "torch_cpu": c1 - c0,
                  "wall": w2 - w1, "cpu": c2 - c1, "total_wall": w2 - w0}))
"""
CASES = {
    "torch": [],
    "live": ["import strata.torch.live"],
    "strata": ["import strata"],
    "worker": ["from strata import Worker"],
    "torchft": ["import torchft"],
}
ROOT = Path(__file__).resolve().parents[1]


def probe(case: str, before: Path | None, collect: bool) -> dict[str, float]:
    env = dict(os.environ)
    if before is not None:
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(before / "libs"), env.get("PYTHONPATH")])
        )
    done = subprocess.run(
        [sys.executable, "-c", PROBE, "collect" if collect else "as-is", *CASES[case]],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if done.returncode != 0:
        raise SystemExit(f"the import probe failed ({case}):\n{done.stderr}")
    figures: dict[str, float] = json.loads(done.stdout.splitlines()[-1])
    return figures


def summary(values: list[float], unit: float = 1000.0) -> str:
    low, high = unit * min(values), unit * max(values)
    return f"{unit * statistics.median(values):7.0f} ({low:.0f}-{high:.0f})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cases", default="live,strata,torchft", help="comma-separated")
    parser.add_argument("--before", type=Path, help="a tree whose libs/ to time as well")
    parser.add_argument(
        "--gc-collect",
        action="store_true",
        help="run a full garbage collection after `import torch`, before the timed import",
    )
    args = parser.parse_args(argv)
    cases = [case.strip() for case in args.cases.split(",") if case.strip()]
    unknown = [case for case in cases if case not in CASES]
    if unknown:
        raise SystemExit(f"unknown cases {unknown}: choose from {sorted(CASES)}")
    if "torchft" in cases and importlib.util.find_spec("torchft") is None:
        print("torchft is not installed: its case is skipped")
        cases.remove("torchft")
    if args.before is not None and not (args.before / "libs" / "strata").is_dir():
        raise SystemExit(f"{args.before} has no libs/strata")
    before = [f"{case}@before" for case in cases if case != "torchft"] if args.before else []
    order = ["torch", *cases, *before]
    runs: dict[str, list[dict[str, float]]] = {case: [] for case in order}
    for round_ in range(args.rounds):
        shift = round_ % len(order)
        for label in order[shift:] + order[:shift]:
            case, _, tree = label.partition("@")
            runs[label].append(probe(case, args.before if tree else None, args.gc_collect))
        print(f"  round {round_ + 1} of {args.rounds} done", flush=True)

    base_total = [run["total_wall"] for run in runs["torch"]]
    collected = ", a full collection in between" if args.gc_collect else ""
    print(f"\nimports after `import torch`{collected}, {args.rounds} rounds: median (range), ms")
    print(f"  {'case':14s} {'wall':>18s} {'CPU':>18s}   process wall / torch alone")
    torch_wall = [run["torch_wall"] for run in runs["torch"]]
    torch_cpu = [run["torch_cpu"] for run in runs["torch"]]
    itself = f"{summary(torch_wall):>18s} {summary(torch_cpu):>18s}"
    print(f"  {'torch':14s} {itself}   (import torch itself)")
    for case in [*cases, *before]:
        wall = [run["wall"] for run in runs[case]]
        cpu = [run["cpu"] for run in runs[case]]
        pairs = zip(runs[case], base_total, strict=True)
        ratios = [run["total_wall"] / base for run, base in pairs]
        print(
            f"  {case:14s} {summary(wall):>18s} {summary(cpu):>18s}   "
            f"{statistics.median(ratios):.2f}x ({min(ratios):.2f}-{max(ratios):.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
