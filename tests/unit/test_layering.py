"""The layers, held by reading the imports: the SDK and shared code never depend on the services.

`strata` (libs/strata) is what a training worker installs and imports; the services
(`strata.services`, services/) build on it. Only the command line reaches up, and only inside the
functions that start or read with the services (`strata up`, `serve`, `replay`), so `import
strata.cli.main` stays as light as the SDK. The services never import the command line.
"""

from __future__ import annotations

import ast
import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / "libs" / "strata"
SERVICES = ROOT / "services"
CLI = LIBS / "cli"


@dataclass(frozen=True)
class Import:
    path: Path
    line: int
    module: str
    in_function: bool
    type_checking_only: bool

    def __str__(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line} imports {self.module}"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(node: ast.Import | ast.ImportFrom) -> Iterator[str]:
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
    elif node.level == 0 and node.module is not None:
        yield node.module
        # `from strata import services` names the package as well as `from strata.services ...`.
        yield from (f"{node.module}.{alias.name}" for alias in node.names)


@functools.cache
def _module(path: Path) -> ast.Module:
    """A file's syntax tree, parsed once for every test that reads it."""
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def imports(path: Path) -> Iterator[Import]:
    """Every absolute import in `path`, with where it sits: in a function, under TYPE_CHECKING."""

    def walk(nodes: Iterable[ast.AST], in_function: bool, checking: bool) -> Iterator[Import]:
        for node in nodes:
            if isinstance(node, ast.Import | ast.ImportFrom):
                for module in _imported(node):
                    yield Import(path, node.lineno, module, in_function, checking)
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda):
                yield from walk(ast.iter_child_nodes(node), True, checking)
            elif isinstance(node, ast.If) and _is_type_checking(node.test):
                yield from walk(node.body, in_function, True)
                yield from walk(node.orelse, in_function, checking)
            elif isinstance(node, ast.expr):
                continue  # an import is a statement: no expression holds one
            else:
                yield from walk(ast.iter_child_nodes(node), in_function, checking)

    yield from walk(_module(path).body, False, False)


def _is(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def test_the_walk_sees_imports_where_they_are(tmp_path: Path) -> None:
    source = tmp_path / "sample.py"
    source.write_text(
        "import json\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from strata.services.readmodel import JobState\n"
        "def main() -> None:\n"
        "    from strata import services\n"
    )
    found = {(i.module, i.in_function, i.type_checking_only) for i in imports(source)}
    assert ("json", False, False) in found
    assert ("strata.services.readmodel", False, True) in found
    assert ("strata.services", True, False) in found


def test_the_libraries_never_import_the_services() -> None:
    modules = [path for path in LIBS.rglob("*.py") if CLI not in path.parents]
    assert len(modules) > 30
    wrong = [
        str(found)
        for path in modules
        for found in imports(path)
        if _is(found.module, "strata.services")
    ]
    assert not wrong, "strata (libs) must not depend on strata.services:\n" + "\n".join(wrong)


def test_the_command_line_imports_the_services_only_inside_functions() -> None:
    wrong = [
        str(found)
        for path in CLI.rglob("*.py")
        for found in imports(path)
        if _is(found.module, "strata.services")
        and not (found.in_function or found.type_checking_only)
    ]
    assert not wrong, "import strata.services inside the command's functions:\n" + "\n".join(wrong)


def test_the_services_never_import_the_command_line() -> None:
    modules = list(SERVICES.rglob("*.py"))
    assert len(modules) > 10
    wrong = [
        str(found) for path in modules for found in imports(path) if _is(found.module, "strata.cli")
    ]
    assert not wrong, "\n".join(wrong)


def test_the_tests_never_import_the_benchmarks() -> None:
    """Shared test helpers live in tests/ (benchmarks may import them), never in bench/."""
    modules = list((ROOT / "tests").rglob("*.py"))
    assert len(modules) > 50
    wrong = [
        str(found) for path in modules for found in imports(path) if _is(found.module, "bench")
    ]
    assert not wrong, "move what these use into tests/:\n" + "\n".join(wrong)


def _is_a_test_module(module: str) -> bool:
    return module.startswith("tests.") and module.rsplit(".", 1)[-1].startswith("test_")


def test_the_tests_never_import_a_test_module() -> None:
    """What several test modules share lives in a module of tests/ not named test_*.

    A test module is read by pytest, not imported by its neighbours: sharing its constants and
    builders ties one file's tests to another's edits and hides where the shared cases live.
    """
    modules = list((ROOT / "tests").rglob("*.py"))
    assert len(modules) > 50
    assert _is_a_test_module("tests.unit.test_replay")
    assert not _is_a_test_module("tests.histories")
    assert not _is_a_test_module("tests.unit.test_replay.JOB")
    wrong = sorted(
        {
            str(found)
            for path in modules
            for found in imports(path)
            if _is_a_test_module(found.module)
        }
    )
    assert not wrong, "move what these use into a module of tests/ not named test_*:\n" + "\n".join(
        wrong
    )
