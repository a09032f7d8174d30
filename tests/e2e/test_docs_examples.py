"""The code examples of docs/*.md, run as written (README.md's are in test_readme.py, and
test_torchrun.py kills ranks of docs/sdk.md's DDP example).

Python examples run as a reader runs them: a file of their own, `python NAME`, against a stack
of the test's own (a nats-server and the four services) with `STRATA_NATS_URL` pointing at it,
since the examples name their jobs ("resnet") as a user would.
"""

from __future__ import annotations

import asyncio
import os
import re
import subprocess
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import AnyEvent, WorkerLeft, WorkerRegistered

from tests.docs import write_example
from tests.support import ServiceProcess, job_events, new_job

pytestmark = pytest.mark.timeout(600)

SERVICES = ("registry", "sharding", "checkpoint", "barrier")
BIN = Path(sys.executable).parent  # the `strata` and `torchrun` of this environment


# -- running examples -----------------------------------------------------------------------------


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}


def run_python(
    document: str, name: str, directory: Path, nats_url: str, **extra: str
) -> subprocess.CompletedProcess[str]:
    """`python NAME` in `directory`, as a reader runs the example, exit status checked."""
    script = write_example(document, name, directory)
    done = subprocess.run(
        [sys.executable, script.name],
        cwd=directory,
        env=environment(**{Env.NATS_URL: nats_url, **extra}),
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert done.returncode == 0, f"{name} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
    return done


def stored_events(nats_url: str, job: str) -> list[AnyEvent]:
    async def read() -> list[AnyEvent]:
        bus = await Bus.connect(nats_url, deadline=10)
        try:
            return await job_events(bus, job)
        finally:
            await bus.close()

    return asyncio.run(read())


# -- a stack per example --------------------------------------------------------------------------


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    """The four services on a server of the test's own; its NATS URL."""
    env = {Env.DATA_DIR: str(tmp_path / "data")}
    services = [
        ServiceProcess(name, own_nats_server.url, tmp_path / "logs", env=env) for name in SERVICES
    ]
    for service in services:
        service.launch()
    try:
        for service in services:
            service.wait_ready()
        yield own_nats_server.url
    finally:
        for service in services:
            service.stop()


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    directory = tmp_path / "work"
    directory.mkdir()
    return directory


# -- docs/architecture.md -------------------------------------------------------------------------


def test_architecture_codec_round_trip(workdir: Path) -> None:
    done = run_python("docs/architecture.md", "codec.py", workdir, "nats://127.0.0.1:1")
    assert done.stdout == "strata.evt.resnet.worker.left\n"


def test_architecture_bus_publishes_once(own_nats_server: NatsServer, workdir: Path) -> None:
    done = run_python("docs/architecture.md", "bus.py", workdir, own_nats_server.url)
    seq = int(done.stdout.split()[-1])
    assert done.stdout == f"stored once, at seq {seq}\n"
    events = stored_events(own_nats_server.url, "resnet")
    assert [(type(e), getattr(e, "worker_id", None)) for e in events] == [(WorkerLeft, "w-3")]


# -- docs/barriers.md -----------------------------------------------------------------------------


def test_barriers_epoch_end(stack: str, workdir: Path) -> None:
    done = run_python("docs/barriers.md", "epoch_end.py", workdir, stack)
    assert done.stdout.splitlines() == [
        f"epoch {epoch} done everywhere (generation {epoch})" for epoch in range(3)
    ]


def test_barriers_demo_releases_four_processes_together(stack: str, workdir: Path) -> None:
    done = run_python("docs/barriers.md", "barrier_demo.py", workdir, stack)
    line = re.compile(
        r"rank (\d): step (\d) released as generation (\d+) after waiting (\d+\.\d{3})s"
    )
    releases = [line.fullmatch(text) for text in done.stdout.splitlines()]
    assert all(releases), done.stdout
    seen = Counter((int(m[1]), int(m[2])) for m in releases if m)
    assert seen == Counter({(rank, step): 1 for rank in range(4) for step in range(5)})
    # Each rank's n-th call at "step" is released as generation n, the same one everywhere.
    assert all(int(m[3]) == int(m[2]) for m in releases if m), done.stdout


# -- docs/registry.md, docs/sdk.md, docs/deployment.md: joining ----------------------------------


def test_registry_membership(stack: str, workdir: Path) -> None:
    done = run_python("docs/registry.md", "membership.py", workdir, stack)
    joined, members = done.stdout.splitlines()
    worker_id, rank, world_size, epoch = joined.split()
    assert (rank, world_size, int(epoch) >= 1) == ("0", "1", True), joined
    assert members == repr([(worker_id, 0, "training")])
    kinds = [type(e) for e in stored_events(stack, "resnet")]
    assert kinds[0] is WorkerRegistered
    assert kinds[-1] is WorkerLeft


def test_sdk_worker_under_torchrun_takes_torchs_rank(stack: str, workdir: Path) -> None:
    job = new_job("rank")
    run_python("docs/sdk.md", "torchrun_rank.py", workdir, stack, RANK="3", STRATA_JOB=job)
    registered = [e for e in stored_events(stack, job) if isinstance(e, WorkerRegistered)]
    assert [(e.worker_id, e.rank) for e in registered] == [("rank-3", 3)]


def test_deployment_worker_joins_and_leaves(stack: str, workdir: Path) -> None:
    job = new_job("chart")
    run_python("docs/deployment.md", "chart_worker.py", workdir, stack, STRATA_JOB=job)
    events = stored_events(stack, job)
    assert [type(e) for e in events if isinstance(e, WorkerRegistered | WorkerLeft)] == [
        WorkerRegistered,
        WorkerLeft,
    ]


# -- docs/sharding.md -----------------------------------------------------------------------------


def test_sharding_register_and_ask(stack: str, workdir: Path) -> None:
    done = run_python("docs/sharding.md", "shards.py", workdir, stack)
    assert done.stdout.splitlines() == [
        "129 True",
        "ShardRange(shard_id=33, start=330000, end=340000)",
        "1 of 129",
    ]


def test_sharding_sampler_feeds_a_dataloader(stack: str, workdir: Path) -> None:
    done = run_python("docs/sharding.md", "sampler.py", workdir, stack)
    assert done.stdout == "256 samples, all of shard {33}\n"


def test_sharding_epochs_end_when_every_shard_is_done(stack: str, workdir: Path) -> None:
    done = run_python("docs/sharding.md", "epochs.py", workdir, stack)
    assert done.stdout.splitlines() == [
        "epoch 0: 10 of 10 shards done",
        "epoch 1: 10 of 10 shards done",
    ]


def test_sharding_resume_from_a_checkpoint(stack: str, workdir: Path) -> None:
    done = run_python("docs/sharding.md", "resume.py", workdir, stack)
    match = re.fullmatch(r"resumed in \[(\d+), 5000\] read twice: 0\n", done.stdout)
    assert match, done.stdout
    assert list(workdir.glob("checkpoints/resnet/step-000000000100/MANIFEST.json"))


def test_sharding_toy_training_in_two_processes(stack: str, workdir: Path) -> None:
    script = write_example("docs/sharding.md", "train_toy.py", workdir)
    env = environment(**{Env.NATS_URL: stack, Env.JOB: new_job("toy"), "OMP_NUM_THREADS": "1"})
    procs = [
        subprocess.Popen(
            [sys.executable, script.name],
            cwd=workdir,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    outputs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=300)
            assert proc.returncode == 0, f"exited {proc.returncode}:\n{out}\n{err}"
            outputs.append(out)
    finally:
        for proc in procs:
            proc.kill()
    line = re.compile(r"(\S+) epoch (\d): (\d+) samples, loss (\S+)")
    per_epoch: Counter[int] = Counter()
    for out in outputs:
        matches = [line.fullmatch(text) for text in out.splitlines()]
        assert all(matches), out
        assert [int(m[2]) for m in matches if m] == [0, 1, 2], out
        for m in matches:
            assert m is not None
            per_epoch[int(m[2])] += int(m[3])
    # Between them, the two processes read every sample of every epoch once.
    assert per_epoch == {0: 20_000, 1: 20_000, 2: 20_000}, outputs
