"""The blocking SDK is a face over `strata.aio`, held by reading both faces.

Every public member of an async class (`strata.aio.Worker`, `CheckpointManager`,
`DatasetRegistry`) has its twin on the blocking face: the same name, the same signature (a
coroutine there, a plain call here; an async class in an annotation stands for its blocking
face) and the same docstring. Both faces take their options as one object, whose keyword form
lists exactly its fields.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import typing
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import strata
import strata.aio
from strata.sharding.plan import ShardRange

ROOT = Path(__file__).resolve().parents[2]
LIBS = ROOT / "libs" / "strata"
BLOCKING_MODULES = ("strata.worker", "strata.checkpoint", "strata.datasets")
TWINS: list[tuple[type, type]] = [
    (strata.aio.Worker, strata.Worker),
    (strata.aio.CheckpointManager, strata.CheckpointManager),
    (strata.aio.DatasetRegistry, strata.DatasetRegistry),
]
BLOCKING_FACE = dict(TWINS)
EXTRA_PARAMETERS = {
    ("Worker", "start"): ("timeout",),
    ("Worker", "stop"): ("timeout",),
}
"""Where the blocking face takes more than its twin: how long the caller's thread may wait."""
OPTIONS: list[tuple[type, type, type]] = [
    (strata.aio.Worker, strata.aio.WorkerOptions, strata.aio.WorkerArgs),
    (strata.aio.CheckpointManager, strata.aio.CheckpointOptions, strata.aio.CheckpointArgs),
    (strata.aio.DatasetRegistry, strata.aio.DatasetOptions, strata.aio.DatasetArgs),
]
HINT_NAMES = {"ShardRange": ShardRange}
"""Names some annotations use that their modules import for type checking only (numpy)."""


def _ids(twin: tuple[type, ...]) -> str:
    return twin[0].__qualname__


def public_members(cls: type) -> dict[str, Any]:
    """The public members of `cls` and of the SDK's layers it is built on."""
    layers = [k for k in reversed(cls.__mro__) if k.__module__.startswith("strata")]
    members = {name: member for k in layers for name, member in vars(k).items()}
    return {name: member for name, member in members.items() if not name.startswith("_")}


def _as_blocking(hint: Any) -> Any:
    """`hint` with every async class in it replaced by its blocking face."""
    if isinstance(hint, type) and hint in BLOCKING_FACE:
        return BLOCKING_FACE[hint]
    args = typing.get_args(hint)
    if not args:
        return hint
    return (typing.get_origin(hint), tuple(_as_blocking(arg) for arg in args))


def _shape(function: Callable[..., Any], leave_out: tuple[str, ...] = ()) -> list[object]:
    """What a caller sees of a function: each parameter's name, kind, default and type, and
    the return type, with async classes written as their blocking faces."""
    hints = typing.get_type_hints(function, localns=HINT_NAMES)
    shape: list[object] = [
        (p.name, p.kind, p.default, _as_blocking(hints.get(p.name)))
        for p in inspect.signature(function).parameters.values()
        if p.name not in leave_out
    ]
    shape.append(("return", _as_blocking(hints.get("return"))))
    return shape


def twin_mismatches(async_cls: type, sync_cls: type) -> Iterator[str]:
    blocking = public_members(sync_cls)
    for name, member in public_members(async_cls).items():
        where = f"{sync_cls.__name__}.{name}"
        twin = blocking.get(name)
        if twin is None:
            yield f"{where} is missing (strata.aio has it)"
            continue
        if isinstance(member, property) != isinstance(twin, property):
            yield f"{where} is a property on one face only"
            continue
        if isinstance(member, property):
            assert member.fget is not None
            assert twin.fget is not None
            member, twin = member.fget, twin.fget
        if inspect.getdoc(member) != inspect.getdoc(twin):
            yield f"{where} has another docstring than its twin's"
        if not callable(member):
            continue
        if inspect.iscoroutinefunction(twin):
            yield f"{where} is a coroutine function; the blocking face returns the result"
        extra = EXTRA_PARAMETERS.get((sync_cls.__name__, name), ())
        if _shape(member) != _shape(twin, leave_out=extra):
            yield (
                f"{where}{inspect.signature(twin)} differs from its twin's "
                f"{inspect.signature(member)}"
            )
        if extra and list(inspect.signature(twin).parameters)[-len(extra) :] != list(extra):
            yield f"{where}: {extra} should come last"


@pytest.mark.parametrize("twin", TWINS, ids=_ids)
def test_every_public_async_member_has_its_blocking_twin(twin: tuple[type, type]) -> None:
    async_cls, sync_cls = twin
    assert len(public_members(async_cls)) > 8
    wrong = list(twin_mismatches(async_cls, sync_cls))
    assert not wrong, "\n".join(wrong)


def test_a_missing_or_different_twin_is_named() -> None:
    class Async:
        async def call(self, n: int) -> strata.aio.Worker:
            """Does it."""
            raise NotImplementedError

        @property
        def size(self) -> int:
            """How big."""
            return 0

    class Blocking:
        def call(self, n: int, extra: int = 0) -> strata.Worker:
            """Does it, blocking."""
            raise NotImplementedError

    Async.__module__ = Blocking.__module__ = "strata.example"
    found = list(twin_mismatches(Async, Blocking))
    assert "Blocking.size is missing (strata.aio has it)" in found
    assert "Blocking.call has another docstring than its twin's" in found
    assert any(line.startswith("Blocking.call(") and "differs" in line for line in found)
    # An async class in an annotation stands for its blocking face: no other difference.
    assert len(found) == 3


@pytest.mark.parametrize("owner", OPTIONS, ids=_ids)
def test_both_faces_take_one_options_object_and_its_fields_as_keywords(
    owner: tuple[type, type, type],
) -> None:
    async_cls, options, keywords = owner
    fields = typing.get_type_hints(options)
    assert dataclasses.fields(options)
    assert options.__dataclass_params__.frozen  # type: ignore[attr-defined]
    assert typing.get_type_hints(keywords) == {
        f.name: fields[f.name] for f in dataclasses.fields(options)
    }
    for face in (async_cls, BLOCKING_FACE[async_cls]):
        hints = typing.get_type_hints(face.__init__, localns=HINT_NAMES)
        parameters = inspect.signature(face.__init__).parameters
        assert hints["options"] == options | None, face
        (overrides,) = [p for p in parameters.values() if p.kind is inspect.Parameter.VAR_KEYWORD]
        assert hints[overrides.name] == typing.Unpack[keywords], face


def test_keywords_and_an_options_object_make_the_same_worker() -> None:
    url = "nats://127.0.0.1:1"  # never dialled: nothing here starts a worker
    by_keywords = strata.Worker(job="twins", nats_url=url, gpus=2, rank=3, saves_timeout=9)
    options = strata.WorkerOptions(gpus=2, rank=3, saves_timeout=9)
    by_object = strata.Worker(job="twins", nats_url=url, options=options)
    assert by_keywords.options == by_object.options == options
    assert by_keywords.requested_rank == by_object.requested_rank == 3
    # Keywords replace the fields they name of a given object.
    assert strata.Worker(job="twins", nats_url=url, options=options, rank=1).requested_rank == 1
    assert strata.Worker(job="twins", nats_url=url, options=options, rank=1).options.gpus == 2


@pytest.mark.parametrize(
    ("make", "field"),
    [
        (lambda: strata.WorkerOptions(saves_timeout=-1), "saves_timeout"),
        (lambda: strata.CheckpointOptions(keep_count=0), "keep_count"),
        (lambda: strata.CheckpointOptions(max_pending_bytes=0), "max_pending_bytes"),
        (lambda: strata.DatasetOptions(retry_for=-1), "retry_for"),
    ],
)
def test_options_are_checked_when_made(make: Callable[[], object], field: str) -> None:
    with pytest.raises(strata.ValidationError, match=field):
        make()


def test_a_blocking_face_checks_its_options_before_it_needs_a_worker(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # No implicit worker can be made here (no job): a bad option must be what is reported.
    monkeypatch.delenv("STRATA_JOB", raising=False)
    with pytest.raises(strata.ValidationError, match="keep_count"):
        strata.CheckpointManager(path="/nonexistent", keep_count=0)
    with pytest.raises(strata.ValidationError, match="timeout"):
        strata.DatasetRegistry(timeout=0)


def _imported_modules(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Every module an import anywhere in `tree` names (under TYPE_CHECKING, in functions)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module is not None:
            yield node.lineno, node.module
            yield from ((node.lineno, f"{node.module}.{alias.name}") for alias in node.names)


def _parsed(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), str(path))


def test_strata_aio_never_imports_its_blocking_faces() -> None:
    modules = sorted((LIBS / "aio").glob("*.py"))
    assert len(modules) >= 9
    wrong = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in modules
        for line, module in _imported_modules(_parsed(path))
        if module in BLOCKING_MODULES
    ]
    assert not wrong, "the async core must not depend on its blocking faces:\n" + "\n".join(wrong)


def test_the_sdk_imports_at_the_top_of_its_modules() -> None:
    """No module-level import below a class or a function, where it would hold an import
    circle together."""
    modules = [
        *sorted((LIBS / "aio").glob("*.py")),
        *(LIBS / f"{m[7:]}.py" for m in BLOCKING_MODULES),
    ]
    wrong = []
    for path in modules:
        defined = False
        for node in _parsed(path).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                defined = True
                continue
            if defined and any(isinstance(n, ast.Import | ast.ImportFrom) for n in ast.walk(node)):
                wrong.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not wrong, "imports after a definition:\n" + "\n".join(wrong)
