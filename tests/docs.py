"""The code examples of README.md and docs/, as written, for the tests that run them.

An example is the fenced block right after a `<!-- example: NAME -->` line; a test writes it to a
file named NAME and runs it the way the text around it says.
"""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_EXAMPLE = re.compile(
    r"<!-- example: (?P<name>[\w.-]+) -->\n```\w*\n(?P<code>.*?)^```", re.S | re.M
)


def examples(document: str) -> dict[str, str]:
    """Every named example of `document` (a path from the repository root), by name."""
    text = (ROOT / document).read_text(encoding="utf-8")
    return {m["name"]: m["code"] for m in _EXAMPLE.finditer(text)}


def write_example(document: str, name: str, directory: Path) -> Path:
    """Write example `name` of `document` into `directory`; its path."""
    found = examples(document)
    assert name in found, f"{document} has no example named {name!r} (it has {sorted(found)})"
    path = directory / name
    path.write_text(found[name], encoding="utf-8")
    return path
