"""torchrun with `--rdzv-backend=strata`, real agents and ranks on CPU/gloo: docs/pytorch.md's
examples as written. Two torchrun invocations on one host stand for two nodes of two ranks each.

- the two nodes form one world of 4 and each rank's Strata worker has torch's rank;
- a rank killed restarts the group on both nodes, and the job finishes;
- a node killed leaves the other going on alone (`--nnodes=1:2`), and a new node makes the world 4
  again;
- torchrun's restart after a rank's death is, in Strata's events, that rank failing and every rank
  registering again with torch's rank;
- the leader of the rendezvous bucket's stream killed in a 3-node NATS cluster loses nothing: a
  rank killed afterwards restarts the group through the new leader;
- `--max-restarts` bounds the restarts of a group that keeps failing;
- with worker credentials of the job on a secured nats-server the job runs, and a finished run's
  id is used again at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
import signal
import subprocess
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import pytest
from strata.bus import Bus
from strata.bus.server import NatsCluster, NatsServer
from strata.config import Env
from strata.events import AnyEvent, WorkerFailed, WorkerRegistered, subjects
from strata.security import (
    authorization_config,
    by_role,
    generate_credentials,
    job_credential,
    save_credentials,
)

from tests.docs import example, write_example
from tests.rendezvous import (
    Agent,
    descendants,
    entry_point_path,
    env_of,
    kill_tree,
    torchrun_env,
    wait_all,
)
from tests.support import job_events, new_job, running_services, wait_until

pytestmark = pytest.mark.timeout(600)

SUM = re.compile(r"rank (\d+) of (\d+): sum (\d+), Strata worker (\S+) rank (\d+)")
WORLD = re.compile(r"rank (\d+): world (\d+) restart (\d+)")
STOPPED = re.compile(r"rank (\d+): stopped after (\d+) steps in a world of (\d+)")


def host_port(url: str) -> str:
    parsed = urlparse(url)
    return f"{parsed.hostname}:{parsed.port}"


@pytest.fixture
def extra_path(tmp_path: Path) -> str | None:
    return entry_point_path(tmp_path / "entry-point")


@pytest.fixture
def stack(own_nats_server: NatsServer, tmp_path: Path) -> Iterator[str]:
    with running_services(own_nats_server.url, tmp_path / "logs"):
        yield own_nats_server.url


def elastic_script(endpoint: str, run_id: str) -> str:
    """docs/pytorch.md's elastic.sh with the test's server and run id."""
    script = example("docs/pytorch.md", "elastic.sh")
    return script.replace("127.0.0.1:4222", endpoint).replace("elastic-example", run_id)


class ElasticNode:
    """One node of docs/pytorch.md's elastic example: its torchrun command, run in `workdir`."""

    def __init__(
        self, workdir: Path, endpoint: str, run_id: str, env: dict[str, str], name: str
    ) -> None:
        self.log = workdir / f"node-{name}.log"
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen(
                ["bash", "-e", "-c", elastic_script(endpoint, run_id)],
                cwd=workdir,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def worlds(self) -> list[tuple[int, int]]:
        """(world, restart) of every rank that started, in order."""
        return [(int(m[2]), int(m[3])) for m in WORLD.finditer(self.output())]

    def kill(self) -> None:
        """SIGKILL the node: torchrun and every rank it started."""
        kill_tree(self.proc)

    def kill_one_rank(self) -> int:
        """SIGKILL one of the node's ranks; its global rank."""
        ranks = [p for p in descendants(self.proc.pid) if _is_rank(p)]
        assert ranks, self.output()
        rank = int(env_of(ranks[0], "RANK") or -1)
        os.kill(ranks[0], signal.SIGKILL)
        return rank

    def wait(self, timeout: float) -> int | None:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None


def _is_rank(pid: int) -> bool:
    return env_of(pid, "LOCAL_RANK") is not None


def worlds_formed(nodes: list[ElasticNode], world: int) -> int:
    """How many times every rank of a world of `world` started (a node restarted for another
    node's sake keeps its restart count: only its own failures count)."""
    return sum(w == world for n in nodes for w, _ in n.worlds()) // world


@contextlib.contextmanager
def elastic_nodes(
    workdir: Path, endpoint: str, run_id: str, env: dict[str, str], names: str = "ab"
) -> Iterator[list[ElasticNode]]:
    """Nodes of the elastic example, one per name; every node in the list (the test may add
    more) is SIGKILLed on the way out, whatever happened."""
    nodes = [ElasticNode(workdir, endpoint, run_id, env, name) for name in names]
    try:
        yield nodes
    finally:
        for node in nodes:
            node.kill()


def stopped(nodes: list[ElasticNode]) -> list[tuple[int, int]]:
    """(rank, world) of every rank that stopped when asked to, sorted."""
    output = "".join(node.output() for node in nodes)
    return sorted((int(m[1]), int(m[3])) for m in STOPPED.finditer(output))


def run_nodes(
    script: str, cwd: Path, envs: list[dict[str, str]], name: str
) -> tuple[list[int], str]:
    """Run `script` once per environment, as nodes started together; their exit codes, and
    their output together."""
    logs = [cwd / f"{name}-node-{n}.log" for n in range(len(envs))]
    nodes = []
    try:
        for log, env in zip(logs, envs, strict=True):
            with log.open("wb") as out:
                nodes.append(
                    subprocess.Popen(
                        ["bash", "-e", "-c", script],
                        cwd=cwd,
                        env=env,
                        stdin=subprocess.DEVNULL,
                        stdout=out,
                        stderr=subprocess.STDOUT,
                        start_new_session=True,
                    )
                )
        codes = [node.wait(300) for node in nodes]
    finally:
        for node in nodes:
            kill_tree(node)
    return codes, "\n".join(log.read_text(errors="replace") for log in logs)


def stop_and_finish(workdir: Path, nodes: list[ElasticNode]) -> None:
    (workdir / "stop").touch()
    codes = [node.wait(120) for node in nodes]
    assert codes == [0] * len(nodes), "\n\n".join(n.output()[-5000:] for n in nodes)


@pytest.fixture
def elastic_dir(tmp_path: Path) -> Path:
    workdir = tmp_path / "elastic"
    workdir.mkdir()
    write_example("docs/pytorch.md", "elastic_train.py", workdir)
    return workdir


def test_two_nodes_of_two_ranks_form_one_world_with_torchs_ranks_in_strata(
    stack: str, tmp_path: Path, extra_path: str | None
) -> None:
    write_example("docs/pytorch.md", "sum_world.py", tmp_path)
    job = new_job("rdzv")
    script = (
        example("docs/pytorch.md", "rdzv-two-nodes.sh")
        .replace("127.0.0.1:4222", host_port(stack))
        .replace("sum-example", job)
    )
    env = torchrun_env(extra_path)
    for name in (Env.JOB, Env.NATS_URL):
        env.pop(name, None)  # the agent passes on the endpoint and the id
    codes, output = run_nodes(script, tmp_path, [env, env], "two")
    assert codes == [0, 0], output[-6000:]
    results = {int(m[1]): m for m in SUM.finditer(output)}
    assert sorted(results) == [0, 1, 2, 3], output[-6000:]
    for rank, match in results.items():
        assert (int(match[2]), int(match[3])) == (4, 10)
        assert (match[4], int(match[5])) == (f"rank-{rank}", rank)


def test_a_killed_rank_restarts_the_group_on_both_nodes_and_the_job_finishes(
    own_nats_server: NatsServer, elastic_dir: Path, extra_path: str | None
) -> None:
    env = torchrun_env(extra_path)
    endpoint, run_id = host_port(own_nats_server.url), new_job("rdzv")
    with elastic_nodes(elastic_dir, endpoint, run_id, env) as nodes:
        wait_until(lambda: worlds_formed(nodes, 4) >= 1, 180, "a world of 4")
        nodes[1].kill_one_rank()
        wait_until(lambda: worlds_formed(nodes, 4) >= 2, 180, "the group restarted, world 4")
        stop_and_finish(elastic_dir, nodes)
    output = "".join(node.output() for node in nodes)
    assert "exitcode: -9" in output, "torchrun never saw the rank die"
    assert stopped(nodes) == [(r, 4) for r in range(4)], output[-4000:]


def test_a_lost_node_leaves_a_world_of_two_and_a_new_node_makes_it_four_again(
    own_nats_server: NatsServer, elastic_dir: Path, extra_path: str | None
) -> None:
    env = torchrun_env(extra_path)
    endpoint, run_id = host_port(own_nats_server.url), new_job("rdzv")
    with elastic_nodes(elastic_dir, endpoint, run_id, env) as nodes:
        first, lost = nodes
        wait_until(lambda: worlds_formed(nodes, 4) >= 1, 180, "a world of 4")
        lost.kill()
        # Its ranks failed with the other node's: one restart of its own.
        wait_until(lambda: (2, 1) in first.worlds(), 180, "the first node going on alone")
        new = ElasticNode(elastic_dir, endpoint, run_id, env, "c")
        nodes.append(new)
        wait_until(
            lambda: worlds_formed([first, new], 4) >= 1 and (4, 1) in first.worlds(),
            180,
            "a world of 4 with the new node",
        )
        stop_and_finish(elastic_dir, [first, new])
    assert stopped([first, new]) == [(r, 4) for r in range(4)], first.output()[-4000:]


MEMBER = """\
import os, time
import strata
import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank, world = dist.get_rank(), dist.get_world_size()
worker = strata.default_worker()
restart = os.environ["TORCHELASTIC_RESTART_COUNT"]
print(f"rank {rank}: world {world} restart {restart} strata {worker.id} {worker.rank}", flush=True)
while True:
    stop = torch.tensor([float(os.path.exists("stop"))])
    dist.all_reduce(stop, op=dist.ReduceOp.MAX)
    if stop.item():
        break
    time.sleep(0.05)
print(f"rank {rank}: stopped after 0 steps in a world of {world}", flush=True)
dist.destroy_process_group()
"""
MEMBER_LINE = re.compile(r"rank (\d+): world \d+ restart \d+ strata (\S+) (\d+)")


def test_a_torchrun_restart_is_one_failure_and_reregistration_in_strata(
    stack: str, tmp_path: Path, extra_path: str | None
) -> None:
    workdir = tmp_path / "member"
    workdir.mkdir()
    (workdir / "elastic_train.py").write_text(MEMBER)
    env = torchrun_env(extra_path)
    for name in (Env.JOB, Env.NATS_URL):
        env.pop(name, None)  # the agent passes on the endpoint and the id
    job = new_job("rdzv")
    with elastic_nodes(workdir, host_port(stack), job, env) as nodes:
        wait_until(lambda: worlds_formed(nodes, 4) >= 1, 180, "a world of 4")
        killed = nodes[1].kill_one_rank()
        wait_until(lambda: worlds_formed(nodes, 4) >= 2, 180, "the group restarted, world 4")
        stop_and_finish(workdir, nodes)
    output = "".join(node.output() for node in nodes)
    lines = MEMBER_LINE.findall(output)
    assert len(lines) == 8, output[-4000:]
    assert all(
        worker == f"rank-{rank}" and int(rank) == int(strata_rank)
        for rank, worker, strata_rank in lines
    )

    events = asyncio.run(stored_events(stack, job))
    registered = Counter((e.worker_id, e.rank) for e in events if isinstance(e, WorkerRegistered))
    # Every rank registered twice, as itself: once per round of the group.
    assert registered == {(f"rank-{r}", r): 2 for r in range(4)}, registered
    failed = {e.worker_id for e in events if isinstance(e, WorkerFailed)}
    # The killed rank at least (the ranks torchrun stopped too, when their successors superseded
    # them), and nobody else.
    assert f"rank-{killed}" in failed, [type(e).__name__ for e in events]
    assert failed <= {f"rank-{r}" for r in range(4)}


async def stored_events(url: str, job: str) -> list[AnyEvent]:
    async with await Bus.connect(url, deadline=10) as bus:
        return await job_events(bus, job)


def test_the_rendezvous_survives_its_nats_leader_being_killed(
    nats_cluster: NatsCluster, elastic_dir: Path, extra_path: str | None
) -> None:
    env = torchrun_env(extra_path, **{Env.STREAM_REPLICAS: "3"})
    endpoint, run_id = nats_cluster.url, new_job("rdzv")
    with elastic_nodes(elastic_dir, endpoint, run_id, env) as nodes:
        wait_until(lambda: worlds_formed(nodes, 4) >= 1, 180, "a world of 4")
        kv_stream = subjects.rendezvous_stream_name(run_id)
        leader = nats_cluster.wait_for_stream_leader(kv_stream, timeout=30)
        index = next(i for i, n in enumerate(nats_cluster.nodes) if n.name == leader)
        nats_cluster.kill(index)
        wait_until(
            lambda: nats_cluster.stream_leader(kv_stream) not in (None, leader),
            60,
            "a new leader of the rendezvous bucket",
        )
        # A new round of the rendezvous, entirely through the new leader.
        nodes[0].kill_one_rank()
        wait_until(lambda: worlds_formed(nodes, 4) >= 2, 180, "the group restarted, world 4")
        stop_and_finish(elastic_dir, nodes)
    assert stopped(nodes) == [(r, 4) for r in range(4)], nodes[0].output()[-4000:]


def test_torchrun_finds_the_backend_through_its_entry_point(
    own_nats_server: NatsServer, tmp_path: Path, extra_path: str | None
) -> None:
    """One node of one rank, started by `Agent` (which the benchmark uses too)."""
    write_example("docs/pytorch.md", "elastic_train.py", tmp_path)
    (tmp_path / "stop").touch()
    agent = Agent(
        tmp_path / "elastic_train.py",
        backend="strata",
        endpoint=own_nats_server.url,
        run_id=new_job("rdzv"),
        nnodes="1",
        nproc=1,
        log=tmp_path / "agent.log",
        env=torchrun_env(extra_path),
    )
    assert wait_all([agent], 120) == [0], agent.output()[-4000:]
    assert "rank 0: stopped after 0 steps in a world of 1" in agent.output()


def test_max_restarts_bounds_the_restarts_as_with_c10d(
    own_nats_server: NatsServer, tmp_path: Path, extra_path: str | None
) -> None:
    """A rank that always fails: torchrun restarts the group `--max-restarts` times, then fails."""
    script = tmp_path / "fails.py"
    script.write_text(
        "import os, sys\n"
        "print('attempt', os.environ['TORCHELASTIC_RESTART_COUNT'], flush=True)\n"
        "sys.exit(3)\n"
    )
    agent = Agent(
        script,
        backend="strata",
        endpoint=own_nats_server.url,
        run_id=new_job("rdzv"),
        nnodes="1",
        nproc=1,
        log=tmp_path / "agent.log",
        env=torchrun_env(extra_path),
        max_restarts=2,
    )
    code = wait_all([agent], 180)
    assert code not in ([0], [None]), agent.output()[-4000:]
    assert re.findall(r"attempt (\d+)", agent.output()) == ["0", "1", "2"], agent.output()[-4000:]


def test_with_worker_credentials_a_finished_run_id_is_used_again_at_once(
    tmp_path: Path, extra_path: str | None
) -> None:
    """docs/pytorch.md's secured examples on a nats-server with `strata up --secure`'s rules: two
    nodes of one rank, each with its own worker credential of the job, form a world of 2; run
    again with the same --rdzv-id right after the first run ended, as two nodes of two ranks on
    the job's shared credential, they form a world of 4 and finish too."""
    job = new_job("secure")
    credentials = [*generate_credentials(job, ["worker-0", "worker-1"]), job_credential(job)]
    (tmp_path / ".strata").mkdir()
    save_credentials(tmp_path / ".strata" / "credentials.json", credentials)
    write_example("docs/pytorch.md", "sum_world.py", tmp_path)
    with (
        NatsServer(
            store_dir=tmp_path / "nats", extra_config=authorization_config(credentials)
        ) as server,
        running_services(
            server.url,
            tmp_path / "logs",
            # The services make the job's rendezvous bucket: its credentials may not.
            env={**by_role(credentials, "services")[0].env(), Env.RENDEZVOUS_JOBS: job},
        ),
    ):
        scripts = [
            example("docs/pytorch.md", name)
            .replace("127.0.0.1:4222", host_port(server.url))
            .replace("sum-example", job)
            for name in ("rdzv-secure.sh", "rdzv-secure-shared.sh")
        ]
        env = torchrun_env(extra_path)
        for name in (Env.JOB, Env.NATS_URL, Env.NATS_USER, Env.NATS_PASSWORD):
            env.pop(name, None)
        for run, script in enumerate(scripts):
            envs = [{**env, "NODE": str(n)} for n in range(2)]
            codes, output = run_nodes(script, tmp_path, envs, f"run-{run}")
            assert codes == [0, 0], f"run {run}:\n{output[-6000:]}"
            results = {int(m[1]): m for m in SUM.finditer(output)}
            world = 2 * (run + 1)
            assert sorted(results) == list(range(world)), output[-6000:]
            for rank, match in results.items():
                assert (int(match[2]), int(match[3])) == (world, world * (world + 1) // 2)
                # The worker is the one-worker credential's, or rank-N with the shared one; the
                # rank is torch's.
                assert match[4] in (("worker-0", "worker-1") if run == 0 else (f"rank-{rank}",))
                assert int(match[5]) == rank


REVERSE_ORDER = '''
"""A rank builds its own strata.Worker(job=<rendezvous id>) only once every higher rank has
registered, so the registry sees them in reverse rank order."""
import os, sys, time
from pathlib import Path
import strata

rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
here = Path(sys.argv[1])
deadline = time.monotonic() + 120
while rank + 1 < world and not (here / f"registered-{rank + 1}").exists():
    assert time.monotonic() < deadline, f"rank {rank + 1} never registered"
    time.sleep(0.05)
with strata.Worker(job=os.environ["TORCHELASTIC_RUN_ID"]) as worker:
    (here / f"registered-{rank}").touch()
    print(f"torch rank {rank}: strata rank {worker.rank} as {worker.id}", flush=True)
    while not all((here / f"registered-{r}").exists() for r in range(world)):
        assert time.monotonic() < deadline, "not every rank registered"
        time.sleep(0.05)
'''
STRATA_RANK = re.compile(r"torch rank (\d+): strata rank (\d+) as (\S+)")


def test_an_explicit_worker_under_torchrun_takes_torchs_rank(
    stack: str, tmp_path: Path, extra_path: str | None
) -> None:
    """Two agents of two processes each, every process building its own `strata.Worker` as the
    docs show, the higher ranks first: each takes torch's rank, not the lowest free one."""
    script = tmp_path / "reverse_order.py"
    script.write_text(REVERSE_ORDER)
    job = new_job("rdzv")
    env = torchrun_env(extra_path)
    for name in (Env.JOB, Env.NATS_URL, Env.RANK):
        env.pop(name, None)  # the agent passes on the endpoint and the id
    agents = [
        Agent(
            script,
            backend="strata",
            endpoint=host_port(stack),
            run_id=job,
            nnodes="2",
            nproc=2,
            log=tmp_path / f"agent-{n}.log",
            env=env,
            max_restarts=0,
            args=(str(tmp_path),),
        )
        for n in range(2)
    ]
    try:
        codes = wait_all(agents, 240)
    finally:
        for agent in agents:
            agent.kill()
    output = "\n".join(agent.output() for agent in agents)
    assert codes == [0, 0], output[-6000:]
    ranks = {int(m[1]): (int(m[2]), m[3]) for m in STRATA_RANK.finditer(output)}
    assert ranks == {r: (r, f"rank-{r}") for r in range(4)}, output[-6000:]
