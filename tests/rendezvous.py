"""torchrun agents on Strata's rendezvous backend, for the tests and the benchmark that launch them.

torch finds `--rdzv-backend=strata` through the `torchrun.handlers` entry point that pyproject.toml
declares. An environment installed before that entry point existed lacks it, so `entry_point_path`
gives a directory holding just that entry point's metadata, for PYTHONPATH (it is what installing
the distribution writes); where the entry point is installed, nothing is added.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import tomllib
from importlib.metadata import entry_points
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GROUP = "torchrun.handlers"


def declared_entry_point() -> str:
    """`strata = module:function` of the group, as pyproject.toml declares it."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    return project["entry-points"][GROUP]["strata"]


def entry_point_path(directory: Path) -> str | None:
    """A directory to put on PYTHONPATH so that torch finds the `strata` rendezvous backend, or
    None when the installed distribution already declares it."""
    if any(ep.name == "strata" for ep in entry_points(group=GROUP)):
        return None
    info = directory / "strata_rendezvous_entry_point-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: strata-rendezvous-entry-point\nVersion: 0\n"
    )
    (info / "entry_points.txt").write_text(f"[{GROUP}]\nstrata = {declared_entry_point()}\n")
    return str(directory)


def torchrun_env(extra_path: str | None, **env: str) -> dict[str, str]:
    merged = {**os.environ, "OMP_NUM_THREADS": "1", **env}
    # The `torchrun` of this environment first, as an activated virtual environment has it.
    merged["PATH"] = os.pathsep.join((str(Path(sys.executable).parent), merged.get("PATH", "")))
    if extra_path:
        merged["PYTHONPATH"] = os.pathsep.join(
            p for p in (merged.get("PYTHONPATH", ""), extra_path) if p
        )
    return merged


def children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces and parentheses: the fields start after the last ')'.
        if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
            found.append(int(entry.name))
    return found


def env_of(pid: int, name: str) -> str | None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return None
    prefix = f"{name}=".encode()
    return next((item[len(prefix) :].decode() for item in environ if item.startswith(prefix)), None)


def descendants(pid: int) -> list[int]:
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children(parent)]
        found.extend(frontier)
    return found


def kill_tree(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL a process and everything under it. torchrun starts each worker in a session of
    its own, so killing the agent's process group alone would leave its workers running."""
    if proc.poll() is not None:
        return
    for pid in [proc.pid, *descendants(proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    proc.wait()


class Agent:
    """One `torchrun` agent (a node) of a rendezvous, its output kept in a log file."""

    def __init__(
        self,
        script: Path,
        *,
        backend: str,
        endpoint: str,
        run_id: str,
        nnodes: str,
        nproc: int,
        log: Path,
        env: dict[str, str],
        max_restarts: int = 3,
        args: tuple[str, ...] = (),
        rdzv_conf: str = "",
    ) -> None:
        self.log = log
        command = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            f"--nproc-per-node={nproc}",
            f"--rdzv-backend={backend}",
            f"--rdzv-endpoint={endpoint}",
            f"--rdzv-id={run_id}",
            f"--max-restarts={max_restarts}",
            "--monitor-interval=0.2",
        ]
        if rdzv_conf:
            command.append(f"--rdzv-conf={rdzv_conf}")
        with log.open("wb") as out:
            self.proc = subprocess.Popen(
                [*command, str(script), *args],
                cwd=script.parent,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )

    def output(self) -> str:
        return self.log.read_text(encoding="utf-8", errors="replace")

    def worker_pids(self) -> list[int]:
        return children(self.proc.pid)

    def rank_pid(self, local_rank: int) -> int | None:
        return next(
            (p for p in self.worker_pids() if env_of(p, "LOCAL_RANK") == str(local_rank)), None
        )

    def wait(self, timeout: float) -> int | None:
        """The exit status, or None (and the agent killed) past `timeout` seconds."""
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            return None

    def kill(self) -> None:
        """SIGKILL the agent and its workers at once, as losing the node would."""
        kill_tree(self.proc)


def wait_all(agents: list[Agent], timeout: float) -> list[int | None]:
    deadline = time.monotonic() + timeout
    return [agent.wait(max(0.1, deadline - time.monotonic())) for agent in agents]


def rendezvous_state(round_: int) -> bytes:
    """torch's pickle of a fresh rendezvous state at `round_`: what a backend stores and hands
    back (the backend refuses anything that is not a rendezvous state)."""
    import pickle

    from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _RendezvousState

    state = _RendezvousState()
    state.round = round_
    return pickle.dumps(state)
