"""DCP through Strata against DCP's own `FileSystemWriter`, in one run, on one disk.

(a) `dcp.save` of a 512 MiB state dict (8 tensors of 64 MiB) with `strata.torch.dcp.Writer`
    (declare, checksummed durable write, ack, and the wait for the commit) against
    `FileSystemWriter` (fsync on) into the same directory. Rounds alternate, rotating who goes
    first, after an untimed `os.sync()`; figures are medians with the spread (min-max). Aim: at
    least 90% of FileSystemWriter's MB/s.
(b) How long `dcp.async_save` blocks its caller (staging the state dict off the training state)
    with each writer, and how long it takes until the Strata checkpoint is committed.

One process, no process group (DCP's single-process mode). It starts its own nats-server,
registry and checkpoint service: `.venv/bin/python bench/dcp.py [--size 512M] [--rounds 5]`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Sequence
from pathlib import Path

import strata
import torch
import torch.distributed.checkpoint as dcp
from strata.torch.dcp import Writer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from bench.checkpoint import alternate, clean, stack
from bench.storage import format_size, parse_size

SAVE_AIM = 0.90
TENSORS = 8


def state_dict(size: int) -> dict[str, torch.Tensor]:
    per = size // TENSORS // 4
    return {f"layer{i}": torch.randn(per) for i in range(TENSORS)}


def spread(values: list[float], scale: float) -> str:
    return f"{min(values) * scale:.0f}-{max(values) * scale:.0f}"


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--size", default="512M")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--dir", type=Path, default=None, help="directory on the disk to test")
    args = parser.parse_args(argv)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    size = parse_size(args.size)
    base = Path(tempfile.mkdtemp(dir=args.dir or "/tmp"))
    state = state_dict(size)
    nbytes = sum(t.numel() * t.element_size() for t in state.values())
    lines = [
        f"DCP through strata vs FileSystemWriter, {time.strftime('%Y-%m-%d')}, Python "
        f"{platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} cores, "
        f"{args.rounds} rounds, state dict {format_size(nbytes)} ({TENSORS} tensors)"
    ]
    plain_dir = base / "plain"
    plain_dir.mkdir()
    try:
        with stack(base) as url, strata.Worker(job="bench-dcp", nats_url=url) as worker:
            # Old steps are removed untimed before each round (below), not by retention in the
            # background of the next measurement.
            manager = strata.CheckpointManager(worker, str(base / "ckpt"), keep_count=10_000)
            steps = [0]

            def run_strata(number: int) -> None:
                steps.append(steps[-1] + 1)
                dcp.save(state, storage_writer=Writer(manager, step=steps[-1]), no_dist=True)

            def run_plain(number: int) -> None:
                dcp.save(
                    state,
                    storage_writer=dcp.FileSystemWriter(plain_dir / f"r{number}"),
                    no_dist=True,
                )

            def before() -> None:
                clean(plain_dir)
                clean(base / "ckpt")
                os.sync()

            strata_times: list[float] = []
            plain_times: list[float] = []
            variants = [(strata_times, run_strata), (plain_times, run_plain)]
            alternate(variants, args.rounds, before)
            s = nbytes / statistics.median(strata_times) / 1e6
            p = nbytes / statistics.median(plain_times) / 1e6
            lines += [
                f"  (a) dcp.save, strata Writer          {s:7.0f} MB/s  "
                f"(rounds {spread([nbytes / t / 1e6 for t in strata_times], 1)})",
                f"      dcp.save, FileSystemWriter       {p:7.0f} MB/s  "
                f"(rounds {spread([nbytes / t / 1e6 for t in plain_times], 1)})",
                f"      ratio                            {s / p:7.2f}       "
                f"({'met' if s / p >= SAVE_AIM else 'missed'}, aim >= {SAVE_AIM:.2f})",
            ]

            blocking: dict[str, list[float]] = {"strata": [], "plain": []}
            durable: list[float] = []

            def async_strata(number: int) -> None:
                steps.append(steps[-1] + 1)
                started = time.perf_counter()
                writer = Writer(manager, step=steps[-1])
                future = dcp.async_save(state, storage_writer=writer, no_dist=True)
                blocking["strata"].append(time.perf_counter() - started)
                future.result()
                durable.append(time.perf_counter() - started)

            def async_plain(number: int) -> None:
                started = time.perf_counter()
                writer = dcp.FileSystemWriter(plain_dir / f"a{number}")
                future = dcp.async_save(state, storage_writer=writer, no_dist=True)
                blocking["plain"].append(time.perf_counter() - started)
                future.result()

            ignored: list[float] = []
            alternate([(ignored, async_strata), (ignored, async_plain)], args.rounds, before)
            b = statistics.median(blocking["strata"])
            bp = statistics.median(blocking["plain"])
            save = statistics.median(strata_times)
            lines += [
                f"  (b) dcp.async_save blocks, strata    {b * 1000:7.0f} ms    "
                f"(rounds {spread(blocking['strata'], 1000)} ms)",
                f"      dcp.async_save blocks, FS writer {bp * 1000:7.0f} ms    "
                f"(rounds {spread(blocking['plain'], 1000)} ms)   ratio {b / bp:.2f}",
                f"      strata: blocking / dcp.save      {b / save:7.2f}",
                f"      strata: until committed          {statistics.median(durable):9.2f} s",
            ]
    finally:
        shutil.rmtree(base, ignore_errors=True)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
