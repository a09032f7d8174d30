"""What `import strata.torch.live` brings into a process, held to a list instead of a stopwatch.

A replacement rank's time to rejoin includes its imports (docs/pytorch.md, "Where a replacement's
time goes"; `bench/imports.py` measures them). Each module named here cost a rank's start tens of
milliseconds and is not needed to train: these tests fail when one of them is imported again.
They run in a fresh interpreter, as a rank starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

HEAVY = ("rich", "pygments", "aiohttp", "multidict", "yarl")
"""Top-level packages a training rank does not need: structlog's console tracebacks (rich and
pygments), nats-py's WebSocket transport (aiohttp, which imports multidict and yarl)."""


def _run(code: str) -> dict[str, object]:
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout.splitlines()[-1])
    return result


def test_the_live_group_imports_none_of_the_heavy_packages() -> None:
    found = _run(
        f"""
        import json, sys
        import torch
        import strata.torch.live
        print(json.dumps({{"heavy": sorted(
            m for m in sys.modules if m.partition(".")[0] in {set(HEAVY)!r}
        )}}))
        """
    )
    assert found["heavy"] == []


def test_import_strata_alone_imports_no_library_of_the_sdk() -> None:
    found = _run(
        """
        import json, sys
        import strata
        libraries = ("nats", "structlog", "pydantic", "msgpack", "numpy", "torch")
        print(json.dumps({"loaded": sorted(
            m for m in sys.modules if m.partition(".")[0] in libraries
        )}))
        """
    )
    assert found["loaded"] == []


def test_a_program_that_imported_rich_first_keeps_structlogs_rich_tracebacks() -> None:
    found = _run(
        """
        import json
        import rich
        import strata
        import structlog.dev
        print(json.dumps({"rich": structlog.dev.rich is not None,
                          "default": structlog.dev.default_exception_formatter
                          is structlog.dev.rich_traceback}))
        """
    )
    assert found == {"rich": True, "default": True}


def test_nats_reaches_aiohttp_on_first_use_and_steps_aside() -> None:
    found = _run(
        """
        import json, sys
        import strata.bus
        import aiohttp as real_aiohttp  # a later import of its own gets the real package
        import nats.aio.transport as transport
        before = type(transport.aiohttp).__name__
        message_type = transport.aiohttp.WSMsgType.BINARY
        print(json.dumps({
            "before": before,
            "same": message_type is real_aiohttp.WSMsgType.BINARY,
            "after": transport.aiohttp is real_aiohttp,
            "multidict": transport.multidict.CIMultiDict is sys.modules["multidict"].CIMultiDict,
        }))
        """
    )
    assert found == {"before": "Deferred", "same": True, "after": True, "multidict": True}
