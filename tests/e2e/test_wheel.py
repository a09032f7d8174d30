"""The wheel as people install it: built from the repository, installed into fresh virtual
environments outside it, and used from a directory that is not the repository either.

With `[server,torch,lightning,accelerate]`: `strata up` serves the dashboard the wheel carries (the
page renders in headless Chromium and every asset loads), the API docs render with every request
answered by the gateway (any other host is refused, as air-gapped), a worker script registers and
commits a checkpoint through the SDK, and docs/frameworks.md's Lightning and Accelerate jobs run
under the venv's torchrun, a rank SIGKILLed mid-epoch, every sample once per epoch. With no extra
at all: `import strata` and a `Worker` work, the server side is not installed, and `strata up`
stops with one line naming the extra.

Needs `make dashboard` (dashboard/dist), the `build` package (part of `[dev]`), PyPI or pip's
cache for the dependencies, the torch 2.13.0 CPU wheel pip finds locally, and Chromium at
/usr/bin/chromium for the browser checks.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from strata import procutil
from strata.extras import EXTRA_MODULES

from tests.docs import write_example
from tests.support import new_job, wait_until
from tests.torchrun import Torchrun, committed_steps, verdict

sync_api = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed: pip install -e '.[dev]'"
)

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD_DIST = ROOT / "dashboard" / "dist"
TORCH = "torch==2.13.0"
"""The CPU wheel on disk: any other torch is gigabytes of CUDA packages."""
CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-quic",
]
INSTALL_TIMEOUT_S = 420.0
START_TIMEOUT_S = 90.0
UI_TIMEOUT_MS = 20_000
JOB = "wheel-job"
WORKER = "wheel-worker"
STEP = 7

SDK_SCRIPT = f"""
import sys

import strata
import torch

checkpoint_dir = sys.argv[1]
print("strata from", strata.__file__, flush=True)
with strata.Worker(job={JOB!r}, worker_id={WORKER!r}) as worker:
    print("registered as rank", worker.rank, "of", worker.world_size, flush=True)
    checkpoints = strata.CheckpointManager(worker, checkpoint_dir, keep_count=2)
    checkpoints.save_state({{"weights": torch.arange(4.0)}}, step={STEP}, epoch=0)
    info = checkpoints.wait_committed({STEP}, timeout=60)
    latest = checkpoints.latest()
    assert latest is not None and latest.step == {STEP}, latest
    state = checkpoints.load_state()
    assert torch.equal(state["weights"], torch.arange(4.0)), state
    checkpoints.close()
print("committed step", info.step, flush=True)
"""


def _environment(venv: Path | None = None, **extra: str) -> dict[str, str]:
    """This process's environment without anything that would lead a child to the repository
    (PYTHONPATH, an active venv, the test run's STRATA_* settings)."""
    env = {
        key: value
        for key, value in os.environ.items()
        if key not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV", "PYTHONSTARTUP")
        and not key.startswith("STRATA_")
    }
    # Only the venv's own programs: a nats-server elsewhere on PATH must not stand in for its own.
    env["PATH"] = os.pathsep.join([*([str(venv / "bin")] if venv else []), "/usr/bin", "/bin"])
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    env["PYTHONNOUSERSITE"] = "1"
    return {**env, **extra}


def _run(
    command: list[str], *, cwd: Path, timeout: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(
        command,
        cwd=cwd,
        env=env if env is not None else _environment(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if done.returncode != 0:
        pytest.fail(
            f"{' '.join(command)} exited with {done.returncode}:\n"
            f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
        )
    return done


@dataclass(frozen=True)
class Venv:
    root: Path
    outside: Path
    """A directory outside the repository to run things from."""

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def strata(self) -> Path:
        return self.root / "bin" / "strata"

    def env(self, **extra: str) -> dict[str, str]:
        return _environment(self.root, **extra)

    def pip(self, *args: str) -> None:
        _run([str(self.python), "-m", "pip", *args], cwd=self.outside, timeout=INSTALL_TIMEOUT_S)

    def python_says(self, code: str, *args: str, timeout: float = 60, **env: str) -> str:
        command = [str(self.python), "-c", code, *args]
        return _run(command, cwd=self.outside, timeout=timeout, env=self.env(**env)).stdout


def _new_venv(base: Path) -> Venv:
    outside = base / "work"
    outside.mkdir(parents=True)
    assert ROOT not in outside.resolve().parents
    root = base / "venv"
    _run([sys.executable, "-m", "venv", str(root)], cwd=outside, timeout=120)
    return Venv(root, outside)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    if not (DASHBOARD_DIST / "index.html").is_file():
        pytest.fail(f"{DASHBOARD_DIST} has no index.html: run `make dashboard` first")
    out = tmp_path_factory.mktemp("dist")
    # sdist first, then the wheel from the unpacked sdist: what a release build does.
    _run([sys.executable, "-m", "build", "--outdir", str(out), str(ROOT)], cwd=out, timeout=300)
    (built,) = out.glob("strata_ctl-*.whl")
    with zipfile.ZipFile(built) as archive:
        names = set(archive.namelist())
    expected = {
        f"strata/dashboard/dist/{path.relative_to(DASHBOARD_DIST).as_posix()}"
        for path in DASHBOARD_DIST.rglob("*")
        if path.is_file()
    }
    assert "strata/dashboard/dist/index.html" in expected
    assert expected <= names, sorted(expected - names)
    assert not [name for name in names if name.startswith(("tests/", "dashboard/"))]
    return built


@pytest.fixture(scope="module")
def core_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    venv = _new_venv(tmp_path_factory.mktemp("core"))
    venv.pip("install", "--quiet", str(wheel))
    venv.pip("check")
    return venv


@pytest.fixture(scope="module")
def server_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Venv:
    venv = _new_venv(tmp_path_factory.mktemp("server"))
    # torch first and pinned, and held there: anything but 2.13.0 means gigabytes of CUDA.
    venv.pip("install", "--quiet", TORCH)
    constraints = venv.outside / "constraints.txt"
    constraints.write_text(f"{TORCH}\n")
    extras = "server,torch,lightning,accelerate"
    venv.pip("install", "--quiet", "--constraint", str(constraints), f"{wheel}[{extras}]")
    venv.pip("check")
    return venv


def test_the_core_alone_runs_a_worker_and_names_the_extra_the_server_needs(
    core_venv: Venv,
) -> None:
    server_side = [name for extra in EXTRA_MODULES.values() for name in extra]
    said = core_venv.python_says(
        "import importlib.util, sys\n"
        "import strata\n"
        "print(strata.__file__)\n"
        "worker = strata.Worker(job='core-job', nats_url='nats://127.0.0.1:1')\n"
        "print(worker.id)\n"
        "print(','.join(n for n in sys.argv[1:] if importlib.util.find_spec(n)))\n",
        *server_side,
    )
    location, worker_id, installed = said.splitlines()
    assert Path(location).is_relative_to(core_venv.root), location
    assert worker_id.startswith("w-")
    assert installed == "", f"the core install brought in {installed}"

    version = _run(
        [str(core_venv.strata), "--version"],
        cwd=core_venv.outside,
        timeout=60,
        env=core_venv.env(),
    )
    assert version.stdout.startswith("strata ")
    up = subprocess.run(
        [str(core_venv.strata), "up", "--data-dir", str(core_venv.outside / "data")],
        cwd=core_venv.outside,
        env=core_venv.env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert up.returncode == 1, up
    assert up.stdout == ""
    (line,) = up.stderr.strip().splitlines()
    assert "missing_extra" in line
    assert line.endswith("pip install 'strata-ctl[server]'"), line
    assert not (core_venv.outside / "data").exists()


@dataclass
class Stack:
    proc: subprocess.Popen[bytes]
    log: Path
    http_port: int
    nats_port: int

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    def output(self) -> str:
        return self.log.read_text(errors="replace")

    def get(self, path: str) -> tuple[int, str, bytes]:
        try:
            with urllib.request.urlopen(f"{self.base_url}{path}", timeout=5) as answer:
                return answer.status, answer.headers.get("content-type", ""), answer.read()
        except urllib.error.HTTPError as error:
            return error.code, error.headers.get("content-type", ""), error.read()


@contextlib.contextmanager
def strata_up(venv: Venv, name: str) -> Iterator[Stack]:
    """`strata up` from the venv, outside the repository, with a data directory of its own."""
    http_port, nats_port = procutil.free_ports(2)
    log = venv.outside / f"{name}.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [
                str(venv.strata),
                "up",
                "--http-port",
                str(http_port),
                "--nats-port",
                str(nats_port),
                "--data-dir",
                str(venv.outside / f"{name}-data"),
            ],
            cwd=venv.outside,
            env=venv.env(STRATA_LOG_FORMAT="json"),
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    running = Stack(proc, log, http_port, nats_port)

    def summary_printed() -> bool:
        if proc.poll() is not None:
            pytest.fail(f"strata up exited with {proc.returncode}:\n{running.output()}")
        return "Ctrl-C stops everything" in running.output()

    try:
        wait_until(summary_printed, START_TIMEOUT_S, "strata up to report every service ready")
        yield running
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def stack(server_venv: Venv) -> Iterator[Stack]:
    """The stack the dashboard test checks, and stops at its end as people stop it."""
    with strata_up(server_venv, "up") as running:
        yield running


@pytest.fixture(scope="module")
def training_stack(server_venv: Venv) -> Iterator[Stack]:
    """A stack of its own for the training jobs (the dashboard test stops the other)."""
    with strata_up(server_venv, "training") as running:
        yield running


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is missing: apt-get install -y chromium")
    with sync_api.sync_playwright() as playwright:
        launched = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        try:
            yield launched
        finally:
            launched.close()


class Requests:
    """What a page asked for: other hosts are refused (as air-gapped) and remembered, and so is
    every request of the gateway's that failed or was answered with an error."""

    def __init__(self, page: Any, base_url: str) -> None:
        self.origin = urllib.parse.urlsplit(base_url).netloc
        self.elsewhere: list[str] = []
        self.failed: list[str] = []
        page.route("**/*", self._route)
        page.on("requestfailed", lambda r: self.failed.append(f"{r.url}: {r.failure}"))
        page.on("response", self._response)

    def _route(self, route: Any) -> None:
        url = route.request.url
        where = urllib.parse.urlsplit(url)
        if where.scheme in ("data", "blob") or where.netloc == self.origin:
            route.continue_()
        else:
            self.elsewhere.append(url)
            route.abort()

    def _response(self, response: Any) -> None:
        if response.status >= 400:
            self.failed.append(f"{response.url}: {response.status}")


@pytest.mark.nats
@pytest.mark.timeout(900)
def test_the_readme_and_seeds_examples_run_against_the_installed_wheel(
    server_venv: Venv, stack: Stack, tmp_path: Path
) -> None:
    """README's quick start, and the seeds' calls without a worker (`implicit.py`), as written,
    by the venv's interpreter from outside the repository."""
    for name, expected in (("quickstart.py", "committed 5000"), ("implicit.py", "saved by")):
        script = write_example("README.md", name, tmp_path)
        result = subprocess.run(
            [str(server_venv.python), str(script)],
            cwd=tmp_path,
            env=server_venv.env(
                STRATA_NATS_URL=f"nats://127.0.0.1:{stack.nats_port}", STRATA_JOB="seeds"
            ),
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert result.returncode == 0, result.stderr
        assert result.stdout.startswith(expected), result.stdout


def test_the_wheel_with_server_and_torch_runs_the_stack_the_dashboard_and_a_worker(
    server_venv: Venv, stack: Stack, browser: Any
) -> None:
    started = time.monotonic()
    output = stack.output()
    assert "not built" not in output, output
    assert f"http://127.0.0.1:{stack.http_port}/" in output

    # The SDK against it, run from outside the repository by the venv's interpreter.
    said = server_venv.python_says(
        SDK_SCRIPT,
        str(server_venv.outside / "checkpoints"),
        timeout=120,
        STRATA_NATS_URL=f"nats://127.0.0.1:{stack.nats_port}",
    ).splitlines()
    assert Path(said[0].removeprefix("strata from ")).is_relative_to(server_venv.root), said
    assert said[1] == "registered as rank 0 of 1", said
    assert said[-1] == f"committed step {STEP}", said

    # The dashboard the wheel carries, and its assets, over plain HTTP.
    status, kind, body = stack.get("/")
    assert status == 200
    assert kind.startswith("text/html")
    page_html = body.decode()
    assert '<div id="root">' in page_html
    assets = [
        f"/assets/{path.name}"
        for path in (DASHBOARD_DIST / "assets").iterdir()
        if path.suffix in (".js", ".css")
    ]
    assert assets
    for asset in assets:
        assert asset in page_html, asset
        assert stack.get(asset)[0] == 200, asset

    expect = sync_api.expect
    page = browser.new_page()
    requests = Requests(page, stack.base_url)
    errors: list[str] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.goto(f"{stack.base_url}/?job={JOB}")
    expect(page.get_by_test_id("mode")).to_have_attribute(
        "data-mode", "live", timeout=UI_TIMEOUT_MS
    )
    expect(page.get_by_test_id(f"worker-{WORKER}")).to_be_visible(timeout=UI_TIMEOUT_MS)
    expect(page.get_by_test_id(f"checkpoint-{STEP}")).to_be_visible(timeout=UI_TIMEOUT_MS)
    failed, elsewhere = list(requests.failed), list(requests.elsewhere)
    page.close()  # after the snapshot: closing cuts the live stream, which reads as a failure
    assert not errors, errors
    assert not failed, failed
    assert not elsewhere, elsewhere

    # The API docs, with every other host refused.
    status, _, body = stack.get("/docs")
    assert status == 200
    assert b"https://" not in body, body.decode()
    assert b"http://" not in body, body.decode()
    page = browser.new_page()
    requests = Requests(page, stack.base_url)
    page.goto(f"{stack.base_url}/docs")
    expect(page.locator(".swagger-ui .info .title")).to_contain_text(
        "Strata gateway", timeout=UI_TIMEOUT_MS
    )
    expect(page.get_by_text("/api/dashboard").first).to_be_visible(timeout=UI_TIMEOUT_MS)
    failed, elsewhere = list(requests.failed), list(requests.elsewhere)
    page.close()
    assert not failed, failed
    assert not elsewhere, elsewhere

    # Stopped as people stop it: SIGTERM, and every service and NATS goes with it.
    stack.proc.send_signal(signal.SIGTERM)
    assert stack.proc.wait(timeout=30) == 0, stack.output()
    assert "stopped" in stack.output()
    print(f"stack, SDK, dashboard and docs checked in {time.monotonic() - started:.1f}s")


@pytest.mark.nats
@pytest.mark.timeout(900)
@pytest.mark.parametrize("example", ["train_lightning.py", "train_accelerate.py"])
def test_the_framework_jobs_run_exactly_once_from_the_installed_wheel(
    server_venv: Venv, training_stack: Stack, tmp_path: Path, example: str
) -> None:
    """docs/frameworks.md's jobs as a user runs them: the venv's torchrun and interpreter, the
    wheel's `strata.lightning`/`strata.accelerate`, from outside the repository. A rank SIGKILLed
    after the first committed checkpoint; torchrun restarts the group, which resumes from it, and
    every sample goes into the model once per epoch, the same weights on both ranks."""
    script = write_example("docs/frameworks.md", example, tmp_path)
    job = new_job(example.removeprefix("train_").removesuffix(".py"))
    run = Torchrun(
        script,
        f"nats://127.0.0.1:{training_stack.nats_port}",
        job,
        tmp_path,
        procs=2,
        python=server_venv.python,
        environ=server_venv.env(),
    )
    try:
        wait_until(lambda: bool(committed_steps(tmp_path, job)), 240, "a first checkpoint")
        victim = run.rank_pid(1)
        assert victim is not None, run.output()
        os.kill(victim, signal.SIGKILL)
        assert run.wait(400) == 0, run.output()[-6000:]
    finally:
        run.kill_all()
    output = run.output()
    assert "exitcode: -9" in output, "torchrun never saw the rank die"
    assert "resumed from step" in output, output[-6000:]
    verdict(run, ranks=2)
