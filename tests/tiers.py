"""Test tiers: `make test` runs everything in full, `make check` a fast cut of it for each change.

`make check` sets STRATA_TEST_TIER=check: it runs the unit and the integration tests not marked
`slow`, on two processes, and the property tests with a fifth of their examples (at least ten), so a
change is checked in minutes. `make test`, the full suite that CI runs, leaves the variable unset.
A property test with no count of its own gets `examples` of hypothesis's default through the
"strata" profile (tests/conftest.py). The figures, and what is marked `slow`: README.md, "Test
tiers".
"""

from __future__ import annotations

import os

from strata.config import Env

CHECK = "check"
SHARE = 5
"""`make check` runs a property test's examples divided by this."""
FLOOR = 10


def quick() -> bool:
    """Whether this run is `make check`'s fast tier."""
    return os.environ.get(Env.TEST_TIER, "") == CHECK


def examples(full: int) -> int:
    """A property test's example count: `full` in `make test`, a fifth of it in `make check`."""
    return max(min(full, FLOOR), full // SHARE) if quick() else full
