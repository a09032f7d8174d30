"""`make dashboard-test` and `make dashboard` run `npm ci` only when node_modules is not current.

`scripts/dashboard_modules.py` compares the tree npm recorded in node_modules/.package-lock.json
with the lockfile, not file times: a fresh checkout installs nothing when the packages match, and a
node_modules linked to another checkout's tree is never emptied by `npm ci`.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests.scripts import load_script

modules = load_script("dashboard_modules")

REACT = {"version": "19.3.1", "integrity": "sha512-react"}
FSEVENTS = {"version": "2.3.3", "integrity": "sha512-fsevents", "optional": True}


def _lock(packages: dict[str, Any]) -> str:
    return json.dumps({"name": "dashboard", "lockfileVersion": 3, "packages": packages})


def _dashboard(tmp_path: Path, installed: dict[str, Any] | None) -> Path:
    dashboard = tmp_path / "dashboard"
    dashboard.mkdir()
    wanted = {"": {"name": "dashboard"}, "node_modules/react": REACT}
    wanted["node_modules/fsevents"] = FSEVENTS
    (dashboard / "package-lock.json").write_text(_lock(wanted))
    if installed is not None:
        (dashboard / "node_modules").mkdir()
        (dashboard / "node_modules" / ".package-lock.json").write_text(_lock(installed))
    return dashboard


def test_a_tree_matching_the_lockfile_is_current_without_other_platforms_optional_packages(
    tmp_path: Path,
) -> None:
    dashboard = _dashboard(tmp_path, {"node_modules/react": REACT})
    assert modules.mismatch(dashboard) is None
    assert modules.main(dashboard) == 0


@pytest.mark.parametrize(
    ("installed", "reason"),
    [
        (None, "not installed"),
        ({}, "node_modules/react is in package-lock.json but not installed"),
        ({"node_modules/react": {**REACT, "version": "19.2.0"}}, "node_modules/react differs"),
        (
            {"node_modules/react": REACT, "node_modules/left-pad": REACT},
            "node_modules/left-pad differs",
        ),
    ],
)
def test_a_tree_that_differs_from_the_lockfile_is_named(
    tmp_path: Path, installed: dict[str, Any] | None, reason: str
) -> None:
    mismatch = modules.mismatch(_dashboard(tmp_path, installed))
    assert mismatch is not None
    assert reason in mismatch


def test_a_stale_linked_tree_is_left_alone_and_the_link_is_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    shared = _dashboard(tmp_path, {})
    (shared / "node_modules" / "react").mkdir()
    checkout = tmp_path / "checkout"
    checkout.mkdir()
    (checkout / "package-lock.json").write_text((shared / "package-lock.json").read_text())
    (checkout / "node_modules").symlink_to(shared / "node_modules")

    assert modules.main(checkout) == 1

    assert (shared / "node_modules" / "react").is_dir()
    message = capsys.readouterr().err
    assert str(shared / "node_modules") in message
    assert "npm ci" in message
