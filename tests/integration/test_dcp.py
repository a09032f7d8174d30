"""DCP through Strata's commit: real registry and checkpoint services, local disk and S3 (moto).

A state dict of DTensors saved by 4 gloo ranks with `dcp.async_save` (each rank its own
process, rank and world from Strata) loads into 2 ranks and into 1; the checkpoint is visible to
`latest()` only once every rank's data and the coordinator's metadata are stored; `async_save`
commits the same way and retention prunes DCP steps like any other; a damaged item is refused; a
checkpoint that is not DCP's is a clear error.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import strata
import torch
import torch.distributed.checkpoint as dcp
from strata.bus.server import NatsServer
from strata.config import Env
from strata.errors import ValidationError
from strata.torch.dcp import ItemLocation, Reader, Writer
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

from tests.s3 import S3Endpoint, moto_server  # noqa: F401
from tests.support import new_job, running_services, wait_until

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parents[2]


# Seven rank processes importing torch on a small shared machine can starve a heartbeat thread
# for longer than the suite's usual 1 s timeout; this suite is not about failure detection.
RELAXED = {Env.HEARTBEAT_INTERVAL: "0.5", Env.HEARTBEAT_TIMEOUT: "10"}
SERVICES = ("registry", "checkpoint")


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with running_services(own_nats_server.url, tmp_path / "logs", SERVICES, env=RELAXED):
        yield own_nats_server.url


def run_ranks(
    mode: str, world: int, *, job: str, nats_url: str, path: str, tmp: Path, env: dict[str, str]
) -> list[dict[str, Any]]:
    """`world` processes of tests/integration/dcp_rank.py; each one's JSON result, by rank."""
    store = tmp / f"{mode}-{world}.store"
    procs = []
    for index in range(world):
        out = tmp / f"{mode}-{world}-{index}.json"
        command = [
            sys.executable,
            "-m",
            "tests.integration.dcp_rank",
            mode,
            f"--job={job}",
            f"--nats-url={nats_url}",
            f"--path={path}",
            f"--world={world}",
            "--step=10",
            f"--store={store}",
            f"--out={out}",
            f"--id={mode}{world}-{index}",
        ]
        log = (tmp / f"{mode}-{world}-{index}.log").open("wb")
        procs.append((subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=log), out))
    results = []
    for index, (proc, out) in enumerate(procs):
        try:
            code = proc.wait(timeout=240)
        finally:
            for other, _ in procs:
                if other.poll() is None and proc.returncode != 0:
                    other.kill()
        log_text = (tmp / f"{mode}-{world}-{index}.log").read_text(errors="replace")
        assert code == 0, f"{mode} rank process {index} exited {code}:\n{log_text[-3000:]}"
        results.append(json.loads(out.read_text()))
    return sorted(results, key=lambda result: result["rank"])


def resharding(nats_url: str, path: str, tmp: Path, env: dict[str, str]) -> None:
    job = new_job("dcp")
    saved = run_ranks("save", 4, job=job, nats_url=nats_url, path=path, tmp=tmp, env=env)
    assert [result["rank"] for result in saved] == [0, 1, 2, 3]
    # dcp.save returned on every rank only once the step was committed with all 4 shards.
    for result in saved:
        assert result["latest"] == 10
        assert result["world_size"] == 4
        assert sorted(result["ranks"]) == [0, 1, 2, 3]
    for world in (2, 1):
        loaded = run_ranks("load", world, job=job, nats_url=nats_url, path=path, tmp=tmp, env=env)
        assert [result["rank"] for result in loaded] == list(range(world))
        assert [result["problems"] for result in loaded] == [[]] * world


def test_saved_by_4_ranks_loads_into_2_and_into_1(stack: str, tmp_path: Path) -> None:
    resharding(stack, str(tmp_path / "ckpt"), tmp_path, dict(os.environ))


def test_resharding_on_s3(
    own_nats_server: NatsServer,
    tmp_path: Path,
    moto_server: S3Endpoint,  # noqa: F811
) -> None:
    bucket = moto_server.new_bucket()
    env = {
        **os.environ,
        Env.S3_ENDPOINT_URL: moto_server.url,
        Env.AWS_REGION: moto_server.region,
        "AWS_ACCESS_KEY_ID": moto_server.access_key,
        "AWS_SECRET_ACCESS_KEY": moto_server.secret_key,
    }
    # The checkpoint service checks the shards and writes the manifest in the same bucket.
    url = own_nats_server.url
    with running_services(url, tmp_path / "logs", SERVICES, env={**RELAXED, **env}):
        resharding(url, f"s3://{bucket}/runs", tmp_path, env)
    keys = [item["Key"] for item in moto_server.client().list_objects_v2(Bucket=bucket)["Contents"]]
    assert sum(key.endswith(".bin") for key in keys) == 4
    assert sum(key.endswith("MANIFEST.json") for key in keys) == 1


def sample_state(seed: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(seed)
    return {
        "w": torch.randn(64, 32, generator=generator),
        "half": torch.randn(7, generator=generator).to(torch.bfloat16),
        "flags": torch.tensor([True, False, True]),
        "empty": torch.empty(0, 3),
        "note": {"text": f"rank state {seed}", "n": seed},
    }


def zeros_like(state: dict[str, Any]) -> dict[str, Any]:
    return {
        key: torch.zeros_like(value) if isinstance(value, torch.Tensor) else {"text": "", "n": -1}
        for key, value in state.items()
    }


def two_rank_save(
    writers: list[Writer], states: list[dict[str, Any]]
) -> tuple[Any, list[list[Any]]]:
    """What dcp.save does on two ranks, in DCP's own order, up to (not including) `finish`."""
    planners = [DefaultSavePlanner() for _ in writers]
    local_plans = []
    for rank, (writer, planner, state) in enumerate(zip(writers, planners, states, strict=True)):
        writer.set_up_storage_writer(rank == 0)
        planner.set_up_planner(state, None, rank == 0)
        local_plans.append(writer.prepare_local_plan(planner.create_local_plan()))
    global_plans, metadata = planners[0].create_global_plan(local_plans)
    global_plans = writers[0].prepare_global_plan(global_plans)
    results = []
    for writer, planner, plan in zip(writers, planners, global_plans, strict=True):
        final = planner.finish_plan(plan)
        results.append(writer.write_data(final, planner).wait())
    return metadata, results


def test_visible_only_with_every_rank_and_the_metadata(stack: str, tmp_path: Path) -> None:
    job = new_job("dcp")
    path = str(tmp_path / "ckpt")
    with (
        strata.Worker(job, stack, worker_id="a") as first,
        strata.Worker(job, stack, worker_id="b") as second,
    ):
        for worker in (first, second):
            wait_until(lambda w=worker: w.world_size == 2, 20, "both workers to see a world of 2")
        managers = [strata.CheckpointManager(w, path) for w in (first, second)]
        by_rank = sorted(managers, key=lambda m: m.aio._worker.rank)
        # Different values per rank under different names: both ranks' items land in the
        # checkpoint (DCP deduplicates only what both ranks hold under the same name).
        states = [{f"r{rank}": sample_state(rank)} for rank in range(2)]
        writers = [Writer(manager, step=3) for manager in by_rank]
        metadata, results = two_rank_save(writers, states)
        # Rank 1's shard is written and acked; rank 0's waits for the metadata: not committed.
        assert by_rank[1].aio.saved
        assert by_rank[1].aio.saved[-1].step == 3
        assert by_rank[0].latest() is None
        answer = first.runner.run(by_rank[0].aio.status(3))
        assert answer.checkpoint is not None
        assert answer.checkpoint.status == "open"
        writers[0].finish(metadata, results)
        manifest = by_rank[0].latest()
        assert manifest is not None
        assert manifest.step == 3
        assert manifest.world_size == 2
        # Any one process reads the whole state back, whichever shard each item is in.
        loaded = {f"r{rank}": zeros_like(states[rank][f"r{rank}"]) for rank in range(2)}
        dcp.load(loaded, storage_reader=Reader(by_rank[1]), no_dist=True)
        for rank in range(2):
            for key, value in states[rank][f"r{rank}"].items():
                got = loaded[f"r{rank}"][key]
                assert torch.equal(got, value) if isinstance(value, torch.Tensor) else got == value
        locations = [loc for loc in metadata.storage_data.values()]
        assert {loc.rank for loc in locations if isinstance(loc, ItemLocation)} == {0, 1}


def test_async_save_commits_loads_and_is_retained_like_any_checkpoint(
    stack: str, tmp_path: Path
) -> None:
    job = new_job("dcp")
    with strata.Worker(job, stack) as worker:
        manager = strata.CheckpointManager(worker, str(tmp_path / "ckpt"), keep_count=1)
        state = sample_state(5)
        expected = {key: value for key, value in state.items() if key != "w"}
        expected["w"] = state["w"].clone()
        future = dcp.async_save(state, storage_writer=Writer(manager, step=1), no_dist=True)
        # The training loop may change its state as soon as async_save returns (it was staged).
        state["w"].zero_()
        state["note"]["n"] = 99
        future.result(timeout=120)
        manifest = manager.latest()
        assert manifest is not None
        assert manifest.step == 1
        loaded = zeros_like(state)
        dcp.load(loaded, storage_reader=Reader(manager), no_dist=True)  # the latest one
        assert torch.equal(loaded["w"], expected["w"])
        assert torch.equal(loaded["half"], expected["half"])
        assert loaded["note"] == {"text": "rank state 5", "n": 5}
        # Retention keeps keep_count=1: the next DCP step's commit prunes step 1's files.
        dcp.async_save(state, storage_writer=Writer(manager, step=2), no_dist=True).result(120)
        first = tmp_path / "ckpt" / job / "step-000000000001"
        wait_until(lambda: not first.exists(), 20, "step 1 to be pruned")
        assert [m.step for m in manager.manifests()] == [2]


def test_damaged_item_and_foreign_checkpoint_are_refused(stack: str, tmp_path: Path) -> None:
    job = new_job("dcp")
    root = tmp_path / "ckpt"
    with strata.Worker(job, stack) as worker:
        manager = strata.CheckpointManager(worker, str(root))
        state = sample_state(1)
        dcp.save(state, storage_writer=Writer(manager, step=1), no_dist=True)
        manager.save(b"not a DCP checkpoint", step=2)
        manager.wait_committed(2)
        # DCP reports a failure of its storage layer as a CheckpointException with the message.
        with pytest.raises(CheckpointException, match=r"\[dcp_format\] .* not a DCP checkpoint"):
            dcp.load(zeros_like(state), storage_reader=Reader(manager, step=2), no_dist=True)
        with pytest.raises(ValidationError, match="takes no checkpoint_id"):
            dcp.save(state, checkpoint_id="/tmp/x", storage_writer=Writer(manager, step=3))
        # Flip one byte of the first item of step 1's shard: that item's checksum catches it.
        shard = manager.manifests()[-1].shards[0]
        file = root / shard.key
        data = bytearray(file.read_bytes())
        data[0] ^= 0xFF
        file.write_bytes(bytes(data))
        with pytest.raises(CheckpointException, match=r"\[checksum_mismatch\] .* its checksum"):
            dcp.load(zeros_like(state), storage_reader=Reader(manager, step=1), no_dist=True)
