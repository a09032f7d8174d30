"""Keeps two libraries the SDK uses from importing optional packages it does not need.

A replacement rank's time to rejoin a training group includes its imports. `structlog` imports
rich (and with it pygments) whenever rich is installed, for its console renderer's tracebacks;
nats-py imports aiohttp whenever it is installed, for its WebSocket transport. Together they
were about half of what `import strata.torch.live` cost after torch. Importing `strata` installs
a finder that, while `structlog` or `nats.aio.transport` is being executed in a thread, answers
"not installed" to that thread's first import of those packages:

- structlog then renders exceptions in its console renderer as plain tracebacks by default;
  `strata.logs.configure_logging` hands its console renderer rich's tracebacks itself, importing
  rich only then. Strata's JSON and library logs never used rich (no locals are shown).
- nats-py's module gets a stand-in for aiohttp (and multidict) that imports the real package on
  its first use, so a `ws://` or `wss://` server URL works as before.

Only the first import of each library in a process is shaped, and only when the optional package
is not imported yet: a program that imported them before `strata` keeps what it had. Other
threads importing the same packages meanwhile see them as usual.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.machinery
import importlib.util
import sys
import threading
import types
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Final, cast

if TYPE_CHECKING:
    # Annotations only: `importlib.abc` imports `importlib.resources` (tempfile, shutil, ...),
    # more than this whole module is worth to `import strata`.
    from importlib.abc import Loader

WITHOUT: Final[dict[str, frozenset[str]]] = {
    "structlog": frozenset({"rich"}),
    "nats.aio.transport": frozenset({"aiohttp", "multidict"}),
}
"""Module -> the optional top-level packages its execution is kept from importing."""

DEFERRED: Final[dict[str, tuple[str, ...]]] = {"nats.aio.transport": ("aiohttp", "multidict")}
"""Module -> its globals that get a stand-in importing the package on first use."""


class Deferred(types.ModuleType):
    """Stands for a package until an attribute is read, then imports it and steps aside."""

    def __init__(self, name: str, owner: types.ModuleType) -> None:
        super().__init__(name)
        self._owner = owner

    def __getattr__(self, attr: str) -> object:
        if attr.startswith("__") and attr.endswith("__"):
            raise AttributeError(attr)
        real = importlib.import_module(self.__name__)
        if getattr(self._owner, self.__name__, None) is self:
            setattr(self._owner, self.__name__, real)
        return getattr(real, attr)


class _Shaping(threading.local):
    held: frozenset[str] = frozenset()


class _Loader:
    """Runs the real loader with the module's optional packages held back in this thread."""

    def __init__(self, real: Loader, name: str, finder: OptionalImports) -> None:
        self._real = real
        self._name = name
        self._finder = finder

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> types.ModuleType | None:
        return self._real.create_module(spec)

    def exec_module(self, module: types.ModuleType) -> None:
        # The module keeps its real loader, for `inspect`, `importlib.reload` and the like.
        module.__loader__ = self._real
        if module.__spec__ is not None:
            module.__spec__.loader = self._real
        held = WITHOUT[self._name] - sys.modules.keys()
        with self._finder.shaping(held):
            self._real.exec_module(module)
        for name in DEFERRED.get(self._name, ()):
            if name in held and getattr(module, name, None) is None and _installed(name):
                setattr(module, name, Deferred(name, module))


class OptionalImports:
    """The finder `install` puts first on `sys.meta_path`; it leaves once both modules ran."""

    def __init__(self) -> None:
        self._shaping = _Shaping()
        self._pending = {name for name in WITHOUT if name not in sys.modules}
        self._running = 0
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def shaping(self, held: frozenset[str]) -> Iterator[None]:
        """Hold `held` back from this thread's imports meanwhile; leave when nothing is left."""
        before = self._shaping.held
        self._shaping.held = before | held
        with self._lock:
            self._running += 1
        try:
            yield
        finally:
            self._shaping.held = before
            with self._lock:
                self._running -= 1
                if not self._pending and not self._running:
                    uninstall()

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None,
        target: types.ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        if fullname in self._shaping.held:
            raise ModuleNotFoundError(f"No module named {fullname!r}", name=fullname)
        if fullname not in self._pending:
            return None
        with self._lock:
            self._pending.discard(fullname)
        spec = _find_elsewhere(self, fullname, path, target)
        if spec is None or spec.loader is None:
            return spec
        spec.loader = cast("Loader", _Loader(spec.loader, fullname, self))
        return spec


def _find_elsewhere(
    finder: OptionalImports,
    fullname: str,
    path: Sequence[str] | None,
    target: types.ModuleType | None,
) -> importlib.machinery.ModuleSpec | None:
    for other in list(sys.meta_path):
        if other is finder or not hasattr(other, "find_spec"):
            continue
        spec: importlib.machinery.ModuleSpec | None = other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _installed(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def install() -> None:
    """Put the finder first on `sys.meta_path`, unless both libraries are imported already."""
    if any(isinstance(finder, OptionalImports) for finder in sys.meta_path):
        return
    if all(name in sys.modules for name in WITHOUT):
        return
    sys.meta_path.insert(0, OptionalImports())


def uninstall() -> None:
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, OptionalImports)]
