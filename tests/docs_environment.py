"""The environment the examples of README.md and docs/ run in."""

from __future__ import annotations

import os
import sys
from pathlib import Path

BIN = Path(sys.executable).parent  # the `strata` and `torchrun` of this environment


def environment(**extra: str) -> dict[str, str]:
    return {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", **extra}
