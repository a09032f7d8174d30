"""docs/pytorch.md's DDP and DCP examples, run as written: as several processes against a stack.

`ddp_strata.py` as 2 ranks must end with one loss and the same weights on both; `fsdp_dcp.py`
saves an FSDP2 model from 2 ranks and, started again as 1 rank, loads that checkpoint resharded
and prints the same parameter sum.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.bus.server import NatsServer
from strata.config import Env

from tests.docs import write_example
from tests.docs_environment import environment
from tests.support import new_job, running_services

pytestmark = [pytest.mark.nats, pytest.mark.slow, pytest.mark.timeout(600)]

DOC = "docs/pytorch.md"


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[tuple[str, Path]]:
    data = tmp_path / "data"
    env = {Env.DATA_DIR: str(data)}
    names = ("registry", "checkpoint", "barrier")
    with running_services(own_nats_server.url, tmp_path / "logs", names, env=env):
        yield own_nats_server.url, data


def run_ranks(script: Path, world: int, nats_url: str, data: Path, job: str) -> list[str]:
    """`python SCRIPT` started `world` times with WORLD set, as the text says; their outputs."""
    env = environment(
        **{Env.NATS_URL: nats_url, Env.DATA_DIR: str(data), Env.JOB: job},
        WORLD=str(world),
        OMP_NUM_THREADS="1",
    )
    procs = [
        subprocess.Popen(
            [sys.executable, script.name],
            cwd=script.parent,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(world)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"{script.name} exited {proc.returncode}:\n{out}\n{err}"
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return outputs


def test_ddp_example_ranks_end_with_one_model(stack: tuple[str, Path], tmp_path: Path) -> None:
    nats_url, data = stack
    script = write_example(DOC, "ddp_strata.py", tmp_path)
    outputs = run_ranks(script, 2, nats_url, data, new_job("ddp"))
    found = [re.search(r"rank (\d): loss ([\d.]+), weights (\[.*\])", out) for out in outputs]
    assert all(found), outputs
    ranks = sorted(int(m[1]) for m in found if m)
    assert ranks == [0, 1]
    assert len({m[2] for m in found if m}) == 1, "the ranks report different losses"
    assert len({m[3] for m in found if m}) == 1, "the ranks ended with different weights"


def test_fsdp_example_saves_in_2_ranks_and_resumes_in_1(
    stack: tuple[str, Path], tmp_path: Path
) -> None:
    nats_url, data = stack
    script = write_example(DOC, "fsdp_dcp.py", tmp_path)
    job = new_job("fsdp")
    saved = run_ranks(script, 2, nats_url, data, job)
    sums = set()
    for out in saved:
        match = re.search(r"saved step 1 in a world of 2; parameter sum (-?[\d.]+)", out)
        assert match, saved
        sums.add(match[1])
    assert len(sums) == 1
    step = data / "checkpoints" / job / "step-000000000001"
    assert sorted(p.name for p in step.iterdir()) == [
        "MANIFEST.json",
        "rank-00000.bin",
        "rank-00001.bin",
    ]
    (loaded,) = run_ranks(script, 1, nats_url, data, job)
    match = re.search(
        r"loaded step 1 \(saved by 2 ranks\) into 1; parameter sum (-?[\d.]+)", loaded
    )
    assert match, loaded
    assert match[1] in sums
