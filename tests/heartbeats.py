"""Reading the registry's heartbeat counters from its metrics endpoint."""

from __future__ import annotations

import re
import urllib.request

_SAMPLE = re.compile(r"^(\w+)\{(.*)\} (\S+)$")


def scrape(port: int) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The process's Prometheus samples, keyed by name and label set."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    samples = {}
    for line in text.splitlines():
        found = _SAMPLE.match(line)
        if found:
            labels = frozenset(re.findall(r'(\w+)="([^"]*)"', found.group(2)))
            samples[(found.group(1), labels)] = float(found.group(3))
    return samples


def rejected_heartbeats(port: int) -> dict[str, float]:
    return {
        dict(labels)["code"]: value
        for (name, labels), value in scrape(port).items()
        if name == "strata_messages_rejected_total"
        and ("consumer", "registry.heartbeats") in labels
    }
