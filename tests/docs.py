"""The code examples of README.md and docs/, as written, for the tests that run them.

An example is the fenced block right after a `<!-- example: NAME -->` line; a test writes it to a
file named NAME and runs it the way the text around it says. `blocks` lists every fenced block
of a document, marked or not, so a test can refuse code that no test runs.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = ("README.md", *sorted(f"docs/{p.name}" for p in (ROOT / "docs").glob("*.md")))
_EXAMPLE = re.compile(
    r"<!-- example: (?P<name>[\w.-]+) -->\n```\w*\n(?P<code>.*?)^```", re.S | re.M
)
_FENCE = re.compile(
    r"(?:^<!-- example: (?P<name>[\w.-]+) -->\n)?"
    r"^(?P<indent>[ \t]*)```(?P<lang>\w*)\n(?P<code>.*?)^(?P=indent)```[ \t]*$",
    re.S | re.M,
)


@dataclass(frozen=True)
class Block:
    """One fenced block of a document: its language tag, its example name if marked, its text."""

    document: str
    line: int
    lang: str
    name: str | None
    code: str

    @property
    def first_line(self) -> str:
        return next((line.strip() for line in self.code.splitlines() if line.strip()), "")


def examples(document: str) -> dict[str, str]:
    """Every named example of `document` (a path from the repository root), by name."""
    text = (ROOT / document).read_text(encoding="utf-8")
    return {m["name"]: m["code"] for m in _EXAMPLE.finditer(text)}


def example(document: str, name: str) -> str:
    found = examples(document)
    assert name in found, f"{document} has no example named {name!r} (it has {sorted(found)})"
    return found[name]


def write_example(document: str, name: str, directory: Path) -> Path:
    """Write example `name` of `document` into `directory`; its path."""
    path = directory / name
    path.write_text(example(document, name), encoding="utf-8")
    return path


def blocks(document: str) -> list[Block]:
    """Every fenced block of `document`, in order, indented ones (inside list items) included."""
    text = (ROOT / document).read_text(encoding="utf-8")
    return [
        Block(
            document=document,
            line=text.count("\n", 0, m.start("indent")) + 1,
            lang=m["lang"],
            name=m["name"],
            code=m["code"],
        )
        for m in _FENCE.finditer(text)
    ]


def commands(script: str) -> list[str]:
    """The commands of a shell example, one per entry: continued lines (`\\` at the end) joined,
    blank and comment-only lines left out."""
    found: list[str] = []
    pending = ""
    for line in script.splitlines():
        if not pending and (not line.strip() or line.lstrip().startswith("#")):
            continue
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        found.append((pending + line).strip())
        pending = ""
    assert not pending, f"the last command continues past the end of the block: {pending!r}"
    return found
