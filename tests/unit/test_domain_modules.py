"""The checkpoint and sharding domains, split by concern, stay pure and small.

Every module of those domains but the adapter (`service.py`) and the entry point is read for its
imports (with `ast`): none may import what does I/O or reads a clock (the bus, the storage
backends, asyncio, the file system, logging), and none may grow past 600 lines, the size at which
a module mixing concerns is split (issue 28).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOMAINS = ("checkpoint", "sharding")
ADAPTER = {"service.py", "__main__.py", "config.py"}
MAX_LINES = 600
DOES_IO = (
    "asyncio",
    "aioboto3",
    "botocore",
    "logging",
    "nats",
    "os",
    "pathlib",
    "shutil",
    "socket",
    "structlog",
    "subprocess",
    "time",
    "strata.bus",
    "strata.storage.local",
    "strata.storage.s3",
    "strata.services.projection",
)


def domain_modules() -> list[Path]:
    found = [
        path
        for name in DOMAINS
        for path in sorted((ROOT / "services" / name).glob("*.py"))
        if path.name not in ADAPTER
    ]
    assert len(found) >= 12, found  # domain.py and its parts, in both services
    return found


def imported(path: Path) -> list[str]:
    modules = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            modules += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module is not None:
            modules.append(node.module)
            modules += [f"{node.module}.{alias.name}" for alias in node.names]
    return modules


@pytest.mark.parametrize("path", domain_modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_domain_module_does_no_io(path: Path) -> None:
    bad = [
        module
        for module in imported(path)
        if any(module == io or module.startswith(f"{io}.") for io in DOES_IO)
    ]
    assert bad == [], f"{path.relative_to(ROOT)} imports {bad}: a domain does no I/O"


@pytest.mark.parametrize("path", domain_modules(), ids=lambda p: f"{p.parent.name}/{p.name}")
def test_a_domain_module_stays_under_600_lines(path: Path) -> None:
    lines = len(path.read_text().splitlines())
    assert lines <= MAX_LINES, f"{path.relative_to(ROOT)} has {lines} lines"
