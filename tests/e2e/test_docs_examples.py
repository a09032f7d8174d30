"""The code examples of docs/*.md, run as written (README.md's are in test_readme.py, and
test_torchrun.py kills ranks of docs/sdk.md's DDP example).

Python examples run as a reader runs them: a file of their own, `python NAME`, against a stack
of the test's own (a nats-server and the four services) with `STRATA_NATS_URL` pointing at it,
since the examples name their jobs ("resnet") as a user would. Shell examples run through
bash, one command at a time, against a stack holding a job's history: a gateway on a free port
stands in for `localhost:8080` and the test's nats-server for the addresses the text makes up;
nothing else in a command is changed. Helm commands need a cluster: they are rendered with
`helm template` and the objects checked. `test_every_example_is_run_or_listed` keeps new
blocks from going untested: a python or shell block is marked as an example (and a test runs
it) or listed in UNRUN with the reason it cannot run here.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from uuid import uuid4

import pytest
import yaml
from strata import procutil
from strata.bus import Bus
from strata.bus.server import NatsServer
from strata.config import Env
from strata.events import AnyEvent, WorkerLeft, WorkerRegistered
from strata.services.gateway.app import API_TOKEN_ENV

from tests.docs import DOCUMENTS, ROOT, Block, blocks, commands, example, write_example
from tests.docs_environment import environment
from tests.support import (
    SERVICES,
    ServiceProcess,
    job_events,
    new_job,
    running_services,
    wait_until,
)
from tests.torchrun import RESULT

pytestmark = pytest.mark.timeout(600)

TIMELINE = re.compile(r"^\S+Z\s+(\d+)\s+([a-z_]+\.[a-z_]+)\s", re.M)

# Blocks no test runs, each with the reason: (document, how the block starts, why).
UNRUN = [
    ("README.md", "make demo", "installs the project and runs the demo (tests/e2e/test_demo.py)"),
    ("README.md", "pip install dist/strata_ctl", "installs the built wheel (test_wheel.py does)"),
    ("README.md", "make lint typecheck", "the project's own make targets: this suite is one"),
    ("docs/deployment.md", "docker build", "no container engine here (test_dockerfile.py)"),
    ("docs/deployment.md", "kubectl -n ml-training get pods", "needs a cluster"),
    ("docs/deployment.md", "kubectl -n ml-training exec", "needs a cluster"),
    ("docs/deployment.md", "kubectl -n ml-training port-forward", "needs a cluster"),
    ("docs/deployment.md", "kubectl -n ml-training get secret", "needs a cluster"),
    ("docs/deployment.md", "kubectl -n ml-training rollout restart", "needs a cluster"),
    ("docs/deployment.md", "helm uninstall", "needs a cluster; renders nothing"),
    ("docs/deployment.md", "kubectl -n ml-training get job", "needs a cluster"),
    ("docs/deployment.md", "helm test", "needs a cluster (test_chart_runs.py runs the test pod)"),
    (
        "docs/deployment.md",
        "kubectl -n ml-training get configmap",
        "needs a cluster and the NATS repo",
    ),
    ("docs/barriers.md", ".venv/bin/python bench/barrier.py", "benchmark: minutes of full load"),
    ("docs/registry.md", ".venv/bin/python bench/registry.py", "benchmark: minutes of full load"),
    (
        "docs/frameworks.md",
        ".venv/bin/python bench/frameworks.py",
        "benchmark: minutes of full load",
    ),
    (
        "docs/registry.md",
        ".venv/bin/python -m bench.membership",
        "benchmark: thousands of workers, minutes of full load",
    ),
    ("docs/sharding.md", ".venv/bin/python bench/sharding.py", "benchmark: minutes of full load"),
    (
        "docs/pytorch.md",
        ".venv/bin/python bench/live_recovery.py",
        "benchmark: minutes of full load",
    ),
    ("docs/storage.md", ".venv/bin/python bench/storage.py", "benchmark: minutes of full load"),
    ("docs/storage.md", ".venv/bin/python bench/checkpoint.py", "benchmark: minutes of full load"),
    ("docs/storage.md", ".venv/bin/python bench/verify_load.py", "benchmark: minutes of full load"),
    ("docs/gateway.md", ".venv/bin/python bench/gateway.py", "benchmark: minutes of full load"),
]
CODE_LANGS = ("python", "py", "bash", "sh", "shell", "console")


# -- running examples -----------------------------------------------------------------------------


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


def shell(command: str, directory: Path, env: dict[str, str], *, stderr: bool = False) -> str:
    """One command of a shell example through bash; its output (and what it said on stderr,
    where the command line reports)."""
    done = subprocess.run(
        ["bash", "-o", "pipefail", "-c", command],
        cwd=directory,
        env=env,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{done.stderr}"
    return done.stdout + (done.stderr if stderr else "")


def first_push(command: str, directory: Path, env: dict[str, str]) -> list[str]:
    """Run a command that streams (`curl -N`) until its first Server-Sent Event; its lines."""
    proc = subprocess.Popen(
        ["bash", "-c", command],
        cwd=directory,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        start_new_session=True,
    )
    lines: list[str] = []
    # The stream sends the dashboard as soon as it opens; past the deadline the command is
    # killed, which ends the loop below, and the caller's assertions say what was missing.
    deadline = threading.Timer(30, os.killpg, (proc.pid, signal.SIGKILL))
    deadline.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if line.startswith("data:"):
                break
    finally:
        deadline.cancel()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    return lines


def json_values(text: str) -> list[Any]:
    """Each JSON value of `jq`'s output, in order."""
    decoder = json.JSONDecoder()
    values, at = [], 0
    while (at := _skip_space(text, at)) < len(text):
        value, at = decoder.raw_decode(text, at)
        values.append(value)
    return values


def _skip_space(text: str, at: int) -> int:
    while at < len(text) and text[at].isspace():
        at += 1
    return at


def documented_output(script: str, start: str) -> str:
    """The output the text shows in a comment line of `script` (`# {...}`)."""
    shown = [line[2:] for line in script.splitlines() if line.startswith(f"# {start}")]
    assert len(shown) == 1, f"no single comment starting {start!r} in:\n{script}"
    return shown[0]


def timeline(output: str) -> list[tuple[int, str]]:
    """(seq, type) of each line `strata replay` printed."""
    return [(int(seq), kind) for seq, kind in TIMELINE.findall(output)]


# -- a stack per example --------------------------------------------------------------------------


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    """The four services on a server of the test's own; its NATS URL."""
    env = {Env.DATA_DIR: str(tmp_path / "data")}
    with running_services(own_nats_server.url, tmp_path / "logs", env=env):
        yield own_nats_server.url


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
    # Four processes print to one pipe: a line may reach it run together with another's.
    releases = list(line.finditer(done.stdout))
    assert len(releases) == 20, done.stdout
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


# -- docs/sdk.md: torchrun ------------------------------------------------------------------------


def test_sdk_torchrun_command(stack: str, workdir: Path) -> None:
    write_example("docs/sdk.md", "train_ddp.py", workdir)
    script = example("docs/sdk.md", "torchrun.sh").replace("nats://127.0.0.1:4222", stack)
    # Run where `strata up` ran, as the text has it: the checkpoints of a CheckpointManager
    # given no path go under its data directory, ./.strata.
    (workdir / ".strata").mkdir()
    env = environment(OMP_NUM_THREADS="1")
    env.pop(Env.DATA_DIR, None)
    proc = subprocess.Popen(
        ["bash", "-e", "-c", script],
        cwd=workdir,
        env=env,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        output, _ = proc.communicate(timeout=400)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, output[-6000:]
    results = {int(m[1]): m for m in RESULT.finditer(output)}
    assert sorted(results) == [0, 1, 2], output[-6000:]
    assert all(m[3] == "True" for m in results.values()), output[-6000:]
    assert len({m[4] for m in results.values()}) == 1, "ranks ended with other weights"


# -- docs/sdk.md and docs/dashboard.md: training metrics ------------------------------------------


def test_training_metrics_logged_then_read_from_the_gateway(
    own_nats_server: NatsServer, stack: str, workdir: Path, tools: None
) -> None:
    port = procutil.free_port()
    gateway = ServiceProcess(
        "gateway", stack, workdir / "logs", env={Env.HTTP_PORT: str(port)}
    ).start()
    try:
        done = run_python("docs/sdk.md", "metrics.py", workdir, stack)
        assert done.stdout == (
            "[invalid_field] metric 'loss' is nan: only finite values can be logged; skip the "
            "sample or log a finite one\n"
        )
        script = example("docs/dashboard.md", "training_metrics.sh")
        documented = json.loads(documented_output(script, "{"))
        (command,) = commands(script.replace("localhost:8080", f"localhost:{port}"))

        def all_steps() -> bool:
            answer = shell(command, workdir, environment())
            return bool(answer.strip()) and json.loads(answer)["steps"] == [0, 1, 2]

        wait_until(all_steps, 15, "the gateway to fold the example's samples")
        assert json.loads(shell(command, workdir, environment())) == documented
    finally:
        gateway.stop()


# -- a job's history, for the gateway and the command line ----------------------------------------

HISTORY_WORKER = """
import sys

import strata

with strata.Worker(job="resnet", worker_id=sys.argv[1]) as w:
    datasets = strata.DatasetRegistry(w)
    datasets.register_dataset("imagenet-1k", total_samples=1_281_167, shard_size=10_000, seed=42)
    datasets.get_shard_for_worker("imagenet-1k", epoch=0)
    w.set_state("training", step=1, epoch=0)
    w.barrier("sync", timeout=60, expected=3)
    checkpoints = strata.CheckpointManager(w, path=sys.argv[2])
    checkpoints.save(b"weights", step=1)
    checkpoints.wait_committed(1)
    print("ready", flush=True)
    sys.stdin.readline()
"""
WORKERS = ("w0", "w1", "w2")
FILLER = 9_000


@dataclass(frozen=True)
class History:
    """Job "resnet" on a busy server: three workers register, read shards, meet at a barrier and
    commit a checkpoint; another job's 9,000 events follow; then w2 is SIGKILLed and fails, and
    w0 and w1 leave. Two gateways read it, one open and one wanting `token`."""

    nats_url: str
    http_port: int
    token_port: int
    token: str


def dashboard(port: int, job: str, token: str | None = None) -> dict[str, Any]:
    url = f"http://127.0.0.1:{port}/api/dashboard?job={job}"
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        with urllib.request.urlopen(
            urllib.request.Request(url, headers=headers), timeout=5
        ) as answer:
            return dict(json.loads(answer.read()))
    except urllib.error.HTTPError as error:
        if error.code == 404:  # no event of the job folded yet
            return {"workers": []}
        raise


def statuses(port: int, token: str | None = None) -> dict[str, str]:
    return {w["id"]: w["status"] for w in dashboard(port, "resnet", token)["workers"]}


async def publish_filler(nats_url: str) -> None:
    bus = await Bus.connect(nats_url, deadline=10)
    try:
        await bus.publish_many(
            [
                WorkerLeft(
                    job="bert", source="registry", worker_id=f"w{i}", rank=i, membership_epoch=i
                )
                for i in range(FILLER)
            ]
        )
    finally:
        await bus.close()


@pytest.fixture(scope="module")
def history(tmp_path_factory: pytest.TempPathFactory) -> Iterator[History]:
    directory = tmp_path_factory.mktemp("history")
    logs = directory / "logs"
    token = uuid4().hex
    http_port, token_port = procutil.free_ports(2)
    with NatsServer(store_dir=directory / "nats") as server:
        env = {Env.DATA_DIR: str(directory / "data")}
        # Beats every 0.5 s, failed after 5 s of silence: w2 is killed and failed well within
        # the 30 s waits below, and a live worker's beats late on a loaded machine are no failure.
        services = [
            ServiceProcess(
                name, server.url, logs, heartbeat_interval=0.5, heartbeat_timeout=5.0, env=env
            )
            for name in SERVICES
        ]
        services += [
            ServiceProcess("gateway", server.url, logs, env={Env.HTTP_PORT: str(http_port)}),
            ServiceProcess(
                "gateway",
                server.url,
                logs,
                env={Env.HTTP_PORT: str(token_port), API_TOKEN_ENV: token},
            ),
        ]
        workers: dict[str, subprocess.Popen[str]] = {}
        try:
            for service in services:
                service.launch()
            for service in services:
                service.wait_ready()
            worker_env = environment(
                **{
                    Env.NATS_URL: server.url,
                    Env.HEARTBEAT_INTERVAL: "0.5",
                    Env.HEARTBEAT_TIMEOUT: "5.0",
                }
            )
            for worker_id in WORKERS:
                with (logs / f"{worker_id}.log").open("w") as log:
                    workers[worker_id] = subprocess.Popen(
                        [sys.executable, "-c", HISTORY_WORKER, worker_id, str(directory / "ckpt")],
                        env=worker_env,
                        stdin=subprocess.PIPE,
                        stdout=subprocess.PIPE,
                        stderr=log,
                        text=True,
                        preexec_fn=procutil.child_preexec,
                    )
            for worker_id, proc in workers.items():
                assert proc.stdout is not None
                line = proc.stdout.readline()  # a worker that fails exits, and this returns ''
                assert line == "ready\n", (logs / f"{worker_id}.log").read_text()[-3000:]
            asyncio.run(publish_filler(server.url))
            workers["w2"].kill()
            wait_until(lambda: statuses(http_port).get("w2") == "failed", 30, "w2 failed")
            for worker_id in ("w0", "w1"):
                proc = workers[worker_id]
                assert proc.stdin is not None
                proc.stdin.write("\n")
                proc.stdin.close()
                assert proc.wait(timeout=60) == 0, (logs / f"{worker_id}.log").read_text()
            expected = {"w0": "left", "w1": "left", "w2": "failed"}
            wait_until(lambda: statuses(http_port) == expected, 30, "the history in a gateway")
            wait_until(lambda: statuses(token_port, token) == expected, 30, "the same with a token")
            yield History(server.url, http_port, token_port, token)
        finally:
            for proc in workers.values():
                proc.kill()
                proc.wait()
                for pipe in (proc.stdin, proc.stdout):
                    if pipe is not None:
                        pipe.close()
            for service in reversed(services):
                service.stop()


def history_env(history: History, **extra: str) -> dict[str, str]:
    return environment(**{Env.NATS_URL: history.nats_url, **extra})


# -- docs/gateway.md ------------------------------------------------------------------------------


@pytest.fixture
def tools() -> None:
    for tool in ("curl", "jq"):
        if shutil.which(tool) is None:
            pytest.skip(f"the gateway examples use {tool}: apt-get install -y {tool}")


def test_gateway_api_with_curl(history: History, workdir: Path, tools: None) -> None:
    script = example("docs/gateway.md", "api.sh")
    documented = json.loads(documented_output(script, "{"))
    script = script.replace("localhost:8080", f"localhost:{history.http_port}")
    env = history_env(history)
    jobs, workers_and_metrics, total, failures, replayed, stream = commands(script)

    answer = json.loads(shell(jobs, workdir, env))
    assert answer["jobs"][0]["job"] == "resnet"  # the job with the latest event first
    assert set(answer["jobs"][0]) == set(documented["jobs"][0])
    assert answer["jobs"][0]["workers"] == 3

    first_worker, metrics = json_values(shell(workers_and_metrics, workdir, env))
    assert (first_worker["id"] in WORKERS, first_worker["rank"]) == (True, 0)
    assert {"checkpoint_mb_s", "barrier_p99_ms", "shard_distribution"} <= set(metrics)

    assert shell(total, workdir, env) == "3\n"

    (summary,) = json_values(shell(failures, workdir, env))
    assert "w2" in summary
    assert "failed" in summary

    then = json_values(shell(replayed, workdir, env))
    assert sorted(w["id"] for w in then) == list(WORKERS)
    assert all(w["status"] not in ("failed", "left") for w in then), then

    pushed = first_push(stream, workdir, env)
    assert pushed[-2:-1] == ["event: dashboard"], pushed
    assert json.loads(pushed[-1].removeprefix("data:"))["job"] == "resnet"


def test_gateway_api_with_a_token(history: History, workdir: Path, tools: None) -> None:
    script = example("docs/gateway.md", "token.sh")
    script = script.replace("localhost:8080", f"localhost:{history.token_port}")
    env = history_env(history, **{API_TOKEN_ENV: history.token})
    jobs, stream = commands(script)

    assert next(job["job"] for job in json.loads(shell(jobs, workdir, env))["jobs"]) == "resnet"
    pushed = first_push(stream, workdir, env)
    assert pushed[-2:-1] == ["event: dashboard"], pushed
    assert json.loads(pushed[-1].removeprefix("data:"))["job"] == "resnet"
    # The same request without the header is refused: the token is what let it through.
    without = shlex.split(jobs)[-1]
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(f"http://{without}", timeout=5)
    assert refused.value.code == 401


def test_gateway_export_then_replay(history: History, workdir: Path, tools: None) -> None:
    env = history_env(history)
    export = example("docs/gateway.md", "export.sh")
    (command,) = commands(export.replace("nats://10.0.0.5:4222", history.nats_url))
    said = shell(command, workdir, env, stderr=True)
    # What it says has the shape the text shows, numbers aside.
    shape = re.escape(documented_output(export, "exported "))
    shape = re.sub(r"\d+", r"(\\d+)", shape)
    match = re.search(shape, said)
    assert match, said
    assert int(match[3]) > FILLER  # resnet's last events came after the other job's
    assert (workdir / "resnet.jsonl").is_file()

    since, membership, failed, earlier = commands(example("docs/gateway.md", "replay.sh"))
    kinds = {kind for _, kind in timeline(shell(since, workdir, env))}
    assert {"worker.registered", "barrier.released", "checkpoint.committed"} <= kinds
    assert {"worker.failed", "worker.left"} <= kinds

    lines = timeline(shell(membership, workdir, env))
    assert lines
    assert all(seq >= 9000 and kind.startswith("worker.") for seq, kind in lines)
    assert {kind for _, kind in lines} == {"worker.failed", "worker.left"}

    (failed_worker,) = json_values(shell(failed, workdir, env))
    assert (failed_worker["id"], failed_worker["status"]) == ("w2", "failed")

    (state,) = json_values(shell(earlier, workdir, env))
    assert state["seq"] <= 9100
    assert {w["id"]: w["status"] for w in state["workers"]}["w2"] == "failed"


# -- docs/operations.md ---------------------------------------------------------------------------


def test_operations_replay_and_export(history: History, workdir: Path) -> None:
    env = history_env(history)
    since, export, state, earlier = commands(example("docs/operations.md", "replay.sh"))

    assert "worker.failed" in {kind for _, kind in timeline(shell(since, workdir, env))}
    assert "exported" in shell(export, workdir, env, stderr=True)
    (now,) = json_values(shell(state, workdir, env))
    assert {w["id"]: w["status"] for w in now["workers"]} == {
        "w0": "left",
        "w1": "left",
        "w2": "failed",
    }
    (then,) = json_values(shell(earlier, workdir, env))
    assert then["seq"] <= 1200  # before the other job's events: all three still at work
    assert all(w["status"] not in ("failed", "left") for w in then["workers"]), then


# -- docs/deployment.md: the chart ----------------------------------------------------------------


class Objects(list[dict[str, Any]]):
    """What `helm template` rendered."""

    def named(self, kind: str, name: str) -> dict[str, Any]:
        found = [o for o in self if o["kind"] == kind and o["metadata"]["name"] == name]
        assert found, f"no {kind} {name} rendered"
        return found[0]

    def kinds(self) -> set[str]:
        return {o["kind"] for o in self}


def render(helm: Path, name: str) -> Objects:
    """`helm template` of each helm command of example `name`; kubectl commands need a cluster
    and are left out. --install and --reuse-values mean nothing without a release."""
    rendered = Objects()
    for command in commands(example("docs/deployment.md", name)):
        words = shlex.split(command)
        if words[0] == "kubectl":
            continue
        assert words[:2] in (["helm", "install"], ["helm", "upgrade"]), command
        args = [w for w in words[2:] if w not in ("--install", "--reuse-values")]
        done = subprocess.run(
            [str(helm), "template", *args],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=60,
            check=False,
        )
        assert done.returncode == 0, f"{command}\n{done.stderr}"
        rendered += [o for o in yaml.safe_load_all(done.stdout) if o]
    assert rendered, f"{name} has no helm command"
    return rendered


def container(workload: dict[str, Any]) -> dict[str, Any]:
    return dict(workload["spec"]["template"]["spec"]["containers"][0])


def env_of(workload: dict[str, Any]) -> dict[str, Any]:
    return {e["name"]: e.get("value", e.get("valueFrom")) for e in container(workload)["env"]}


def test_deployment_install(helm: Path) -> None:
    objects = render(helm, "install.sh")
    worker = objects.named("Job", "strata-worker")
    assert container(worker)["image"] == "registry.example.com/ml/resnet-train:2026-11-01"
    assert container(worker)["command"] == ["python", "train.py"]
    assert env_of(worker)["STRATA_JOB"] == "resnet"
    registry = objects.named("Deployment", "strata-registry")
    assert container(registry)["image"].startswith("registry.example.com/ml/strata:")


def test_deployment_scale(helm: Path) -> None:
    objects = render(helm, "scale.sh")
    assert objects.named("Deployment", "strata-worker")["spec"]["replicas"] == 32
    assert "Job" not in objects.kinds()


def test_deployment_ingress(helm: Path) -> None:
    ingress = render(helm, "ingress.sh").named("Ingress", "strata-dashboard")["spec"]
    assert ingress["rules"][0]["host"] == "strata.example.com"
    assert ingress["tls"][0]["secretName"] == "strata-tls"
    sub_path = render(helm, "ingress_sub_path.sh").named("Ingress", "strata-dashboard")
    assert sub_path["spec"]["rules"][0]["http"]["paths"][0]["path"] == "/strata(/|$)(.*)"
    annotations = sub_path["metadata"]["annotations"]
    assert annotations["nginx.ingress.kubernetes.io/rewrite-target"] == "/$2"


def test_deployment_monitoring(helm: Path) -> None:
    monitor = render(helm, "monitoring.sh").named("ServiceMonitor", "strata")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"


def test_deployment_autoscaling(helm: Path) -> None:
    objects = render(helm, "autoscaling.sh")
    hpa = objects.named("HorizontalPodAutoscaler", "strata-worker")["spec"]
    assert (hpa["minReplicas"], hpa["maxReplicas"]) == (4, 100)
    assert hpa["metrics"][0]["resource"]["target"]["averageUtilization"] == 80
    assert "replicas" not in objects.named("Deployment", "strata-worker")["spec"]


def test_deployment_s3_with_a_secret(helm: Path) -> None:
    checkpoint = env_of(render(helm, "s3_secret.sh").named("Deployment", "strata-checkpoint"))
    assert (checkpoint["STORAGE_BACKEND"], checkpoint["CHECKPOINT_BUCKET"]) == (
        "s3",
        "my-ml-checkpoints",
    )
    assert checkpoint["AWS_REGION"] == "us-east-1"
    assert checkpoint["AWS_ACCESS_KEY_ID"]["secretKeyRef"]["name"] == "aws-credentials"


def test_deployment_s3_with_irsa(helm: Path) -> None:
    objects = render(helm, "s3_irsa.sh")
    account = objects.named("ServiceAccount", "strata")["metadata"]
    assert account["annotations"]["eks.amazonaws.com/role-arn"] == (
        "arn:aws:iam::123456789012:role/strata"
    )
    assert "AWS_ACCESS_KEY_ID" not in env_of(objects.named("Deployment", "strata-checkpoint"))


def test_deployment_local_volume(helm: Path) -> None:
    objects = render(helm, "pvc.sh")
    (claim,) = [o for o in objects if o["kind"] == "PersistentVolumeClaim"]
    spec = claim["spec"]
    assert (spec["storageClassName"], spec["accessModes"]) == ("fast-nvme", ["ReadWriteMany"])
    assert spec["resources"]["requests"]["storage"] == "500Gi"


def test_deployment_external_nats(helm: Path) -> None:
    objects = render(helm, "external_nats.sh")
    assert "StatefulSet" not in objects.kinds()
    registry = env_of(objects.named("Deployment", "strata-registry"))
    assert registry["STRATA_NATS_URL"] == "nats://nats.messaging.svc:4222"


def test_deployment_upgrade(helm: Path) -> None:
    registry = render(helm, "upgrade.sh").named("Deployment", "strata-registry")
    assert container(registry)["image"].endswith(":0.2.0"), container(registry)["image"]


# -- every block is run, or listed with its reason -------------------------------------------------


def unmarked_code() -> list[Block]:
    return [b for d in DOCUMENTS for b in blocks(d) if b.lang in CODE_LANGS and b.name is None]


def test_every_example_is_run_or_listed() -> None:
    listed: Counter[tuple[str, str]] = Counter()
    unrun = []
    for block in unmarked_code():
        reasons = [
            (d, s) for d, s, _ in UNRUN if d == block.document and block.first_line.startswith(s)
        ]
        if not reasons:
            unrun.append(f"{block.document}:{block.line}: {block.first_line}")
        listed.update(reasons)
    assert not unrun, (
        "code blocks that no test runs: mark each `<!-- example: NAME -->` and run it in "
        "tests/e2e/test_docs_examples.py (or list it in UNRUN, saying why it cannot run):\n"
        + "\n".join(unrun)
    )
    stale = [f"{d}: {s}" for d, s, _ in UNRUN if listed[(d, s)] != 1]
    assert not stale, f"UNRUN entries that match no block, or several: {stale}"


def test_every_marked_example_is_used_by_a_test() -> None:
    # The tests and the helpers they share (tests/livejob.py runs docs/pytorch.md's live example).
    sources = "".join(p.read_text(encoding="utf-8") for p in (ROOT / "tests").rglob("*.py"))
    unused = [
        f"{b.document}: {b.name}"
        for d in DOCUMENTS
        for b in blocks(d)
        if b.name is not None and f'"{b.name}"' not in sources
    ]
    assert not unused, f"examples marked but run by no test: {unused}"


def test_benchmark_command_lines_name_real_options() -> None:
    """The benchmarks take minutes of the whole machine, so only their documented options are
    checked: each must be one the script's --help lists."""
    scripts: dict[str, set[str]] = {}
    for block in unmarked_code():
        for command in commands(block.code):
            words = shlex.split(command, comments=True)
            if words[:2] != [".venv/bin/python", words[1]] or not words[1].startswith("bench/"):
                continue
            scripts.setdefault(words[1], set()).update(w for w in words[2:] if w.startswith("--"))
    assert len(scripts) == 9, scripts
    for script, options in scripts.items():
        done = subprocess.run(
            [sys.executable, script, "--help"],
            cwd=ROOT,
            env=environment(),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        missing = {o for o in options if not re.search(rf"{re.escape(o)}\b", done.stdout)}
        assert not missing, f"{script} has no option {sorted(missing)}"
