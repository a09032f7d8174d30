"""One rank of the DCP resharding test: `python -m tests.integration.dcp_rank save|load ...`.

It registers a Strata worker, waits for the world the test started, joins a gloo process group
with Strata's rank and world (a FileStore the test names), then saves or loads a state dict of
DTensors (sharded on dim 0 and dim 1), a replicated plain tensor and a non-tensor value through
`strata.torch.dcp` (the save with `dcp.async_save`). It writes what it found to `--out` as JSON
for the test to judge.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import signal
import time
from pathlib import Path
from typing import Any

import strata
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from strata.torch.dcp import Reader, Writer

ROWS, COLS = 16, 6
WIDE = 12


def full_tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(7)
    return {
        "weight": torch.arange(ROWS * COLS, dtype=torch.float32).reshape(ROWS, COLS),
        "moment": torch.randn(5, WIDE, generator=generator, dtype=torch.float64),
        "bias": torch.arange(COLS, dtype=torch.int64) * 3,
    }


def state_dict(world: int, fill: bool) -> dict[str, Any]:
    """The state each rank holds: the full values (`fill`) or zeros of the same layout."""
    full = full_tensors()
    if not fill:
        full = {name: torch.zeros_like(tensor) for name, tensor in full.items()}
    state: dict[str, Any] = {"bias": full["bias"], "extra": {"epoch": 3 if fill else -1}}
    if world == 1:
        state["model"] = {"weight": full["weight"]}
        state["optim"] = {"moment": full["moment"]}
        return state
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    state["model"] = {"weight": distribute_tensor(full["weight"], mesh, [Shard(0)])}
    state["optim"] = {"moment": distribute_tensor(full["moment"], mesh, [Shard(1)])}
    return state


def local(value: Any) -> torch.Tensor:
    return value.to_local() if hasattr(value, "to_local") else value


def check(state: dict[str, Any], world: int, rank: int) -> list[str]:
    """What differs from the saved values, for this rank's part of each tensor."""
    full = full_tensors()
    problems = []
    rows, cols = ROWS // world, WIDE // world
    expected = {
        "weight": full["weight"][rank * rows : (rank + 1) * rows],
        "moment": full["moment"][:, rank * cols : (rank + 1) * cols],
    }
    got = {"weight": local(state["model"]["weight"]), "moment": local(state["optim"]["moment"])}
    for name, tensor in expected.items():
        if not torch.equal(got[name], tensor):
            problems.append(f"{name} differs on rank {rank}")
    if not torch.equal(state["bias"], full["bias"]):
        problems.append("bias differs")
    if state["extra"] != {"epoch": 3}:
        problems.append(f"extra is {state['extra']!r}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=["save", "load"])
    parser.add_argument("--job", required=True)
    parser.add_argument("--nats-url", required=True)
    parser.add_argument("--path", required=True)
    parser.add_argument("--world", type=int, required=True)
    parser.add_argument("--step", type=int, required=True)
    parser.add_argument("--store", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--id", required=True)
    args = parser.parse_args()
    faulthandler.register(signal.SIGUSR1)  # the test dumps every thread's stack on a hang

    with strata.Worker(args.job, args.nats_url, worker_id=args.id) as worker:
        deadline = time.monotonic() + 60
        while worker.world_size != args.world:
            if time.monotonic() > deadline:
                raise SystemExit(f"world stayed {worker.world_size}, not {args.world}")
            time.sleep(0.02)
        rank = worker.rank
        if args.world > 1:
            dist.init_process_group(
                "gloo", init_method=f"file://{args.store}", rank=rank, world_size=args.world
            )
        checkpoints = strata.CheckpointManager(worker, args.path)
        result: dict[str, Any] = {"rank": rank}
        if args.mode == "save":
            state = state_dict(args.world, fill=True)
            # async_save: the Writer stages the DTensors' local shards, then writes them.
            writer = Writer(checkpoints, step=args.step)
            dcp.async_save(state, storage_writer=writer).result(timeout=180)
            manifest = checkpoints.latest()
            result["latest"] = None if manifest is None else manifest.step
            result["world_size"] = None if manifest is None else manifest.world_size
            result["ranks"] = [] if manifest is None else [s.rank for s in manifest.shards]
        else:
            state = state_dict(args.world, fill=False)
            dcp.load(state, storage_reader=Reader(checkpoints, step=args.step))
            result["problems"] = check(state, args.world, rank)
        if args.world > 1:
            dist.destroy_process_group()
        checkpoints.close()
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
