"""Package mapping and the dashboard build step of the strata-ctl distribution.

`strata` lives in libs/strata and `strata.services` in services/: the mapping needs a package list
computed from two roots, which pyproject.toml alone cannot express. A wheel also carries the
built dashboard (dashboard/dist, made by `make dashboard`) as `strata/dashboard/dist`, where the
gateway serves it from; an editable install leaves it in the source tree, where the gateway looks
next.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py

ROOT = Path(__file__).resolve().parent
DASHBOARD_BUILD = ROOT / "dashboard" / "dist"
DASHBOARD_IN_PACKAGE = Path("strata", "dashboard", "dist")

packages = (
    ["strata"]
    + [f"strata.{name}" for name in find_packages("libs/strata")]
    + ["strata.services"]
    + [f"strata.services.{name}" for name in find_packages("services")]
)


class BuildWithDashboard(build_py):
    """build_py, then the built dashboard copied into the package."""

    def run(self) -> None:
        super().run()
        if self.editable_mode:
            return  # the gateway serves dashboard/dist from the source tree itself
        target = Path(self.build_lib) / DASHBOARD_IN_PACKAGE
        # A leftover from an earlier build would ship assets the new index.html no longer uses.
        shutil.rmtree(target, ignore_errors=True)
        if not (DASHBOARD_BUILD / "index.html").is_file():
            print(
                f"WARNING: {DASHBOARD_BUILD} has no index.html: this build carries no dashboard "
                "and the gateway will answer / with how to build it. Run `make dashboard` "
                "(or `cd dashboard && npm ci && npm run build`) first.",
                file=sys.stderr,
            )
            return
        shutil.copytree(DASHBOARD_BUILD, target)


setup(
    packages=packages,
    package_dir={"strata": "libs/strata", "strata.services": "services"},
    cmdclass={"build_py": BuildWithDashboard},
)
