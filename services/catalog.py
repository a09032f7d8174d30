"""Which services exist and how to build one: `strata.services.<name>.service.create()`.

`strata up` starts every available service in `ORDER`; `strata serve <name>` runs one.
"""

from __future__ import annotations

import importlib
import importlib.util
from typing import Final

from strata.errors import ConfigError
from strata.events.rpc import SERVICES
from strata.services.runtime import Service

ORDER: Final = SERVICES  # the gateway last: it reads what the others publish


def _module(name: str) -> str:
    return f"strata.services.{name}.service"


def available() -> list[str]:
    """The services built so far, in start order."""
    found = []
    for name in ORDER:
        try:
            if importlib.util.find_spec(_module(name)) is not None:
                found.append(name)
        except ModuleNotFoundError:
            continue
    return found


def create(name: str) -> Service:
    if name not in available():
        choices = ", ".join(available())
        raise ConfigError(f"unknown service {name!r}: choose one of {choices}")
    service: Service = importlib.import_module(_module(name)).create()
    return service
