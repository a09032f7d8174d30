"""Install the dashboard's npm packages only when node_modules does not match the lockfile.

npm records what it installed in node_modules/.package-lock.json. The tree is current when every
package recorded there is the lockfile's, and every package of the lockfile it lacks is an optional
one for another platform; then nothing is done, whatever the files' times say (a fresh checkout
makes the lockfile look new). Otherwise `npm ci` runs, unless node_modules is a link to a tree
shared with another checkout: `npm ci` would empty that tree for every checkout, so this stops and
says so.

Standard library only: `make dashboard-test` runs it before the virtual environment exists.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent.parent / "dashboard"


def _packages(lockfile: Path) -> dict[str, Any]:
    packages: dict[str, Any] = json.loads(lockfile.read_text())["packages"]
    return {path: entry for path, entry in packages.items() if path}  # "" is the project itself


def mismatch(dashboard: Path = DASHBOARD) -> str | None:
    """Why node_modules does not match package-lock.json, or None when it does."""
    installed_record = dashboard / "node_modules" / ".package-lock.json"
    if not installed_record.is_file():
        return "dashboard/node_modules is not installed"
    wanted = _packages(dashboard / "package-lock.json")
    installed = _packages(installed_record)
    for path, entry in installed.items():
        if wanted.get(path) != entry:
            return f"{path} differs from package-lock.json"
    for path, entry in wanted.items():
        if path not in installed and not entry.get("optional", False):
            return f"{path} is in package-lock.json but not installed"
    return None


def main(dashboard: Path = DASHBOARD) -> int:
    reason = mismatch(dashboard)
    if reason is None:
        return 0
    modules = dashboard / "node_modules"
    if modules.is_symlink():
        print(
            f"dashboard/node_modules links to {modules.resolve()}, which does not match "
            f"dashboard/package-lock.json ({reason}). npm ci would empty the linked tree for "
            "every checkout using it: run npm ci in the checkout that owns it, or remove the "
            "link to install here.",
            file=sys.stderr,
        )
        return 1
    print(f"npm ci: {reason}", file=sys.stderr)
    return subprocess.call(["npm", "ci", "--no-audit", "--no-fund"], cwd=dashboard)


if __name__ == "__main__":
    sys.exit(main())
