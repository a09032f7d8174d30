"""`strata.procutil.free_ports`: ports chosen one call after another do not collide.

The kernel offers a port bound and released a moment ago again: of 256 ports chosen one at a
time with a bare `bind(0)`, a few are usually the same. A test stack that chooses its servers'
ports one at a time would then start two servers on one port.
"""

from __future__ import annotations

from strata.procutil import RECENT_PORTS, free_port, free_ports


def test_ports_chosen_one_call_after_another_are_distinct() -> None:
    chosen = [free_port() for _ in range(RECENT_PORTS)]
    assert len(set(chosen)) == len(chosen)


def test_the_ports_of_one_call_are_distinct_and_new() -> None:
    before = free_ports(8)
    after = free_ports(RECENT_PORTS - 8)
    assert len(set(before + after)) == RECENT_PORTS
