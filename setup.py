"""Package mapping: `strata` lives in libs/strata, `strata.services` in services/.

The mapping needs a package list computed from two roots, which pyproject.toml alone cannot express.
"""

from setuptools import find_packages, setup

packages = (
    ["strata"]
    + [f"strata.{name}" for name in find_packages("libs/strata")]
    + ["strata.services"]
    + [f"strata.services.{name}" for name in find_packages("services")]
)

setup(
    packages=packages,
    package_dir={"strata": "libs/strata", "strata.services": "services"},
)
