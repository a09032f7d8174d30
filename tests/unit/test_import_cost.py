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


UNUSED = ("strata.aio._checkpoint", "strata.storage", "strata.checkpoint")
"""Strata's own modules a rank that trains without checkpoints never uses."""


def test_the_live_group_imports_none_of_the_heavy_packages() -> None:
    found = _run(
        f"""
        import json, sys
        import torch
        import strata.torch.live
        from strata.events.models import EVENT_MODELS
        from strata.events import requests
        from pydantic import BaseModel
        request_models = [
            value for value in vars(requests).values()
            if isinstance(value, type) and issubclass(value, BaseModel)
        ]
        print(json.dumps({{
            "heavy": sorted(m for m in sys.modules if m.partition(".")[0] in {set(HEAVY)!r}),
            "unused": sorted(m for m in {UNUSED!r} if m in sys.modules),
            "models": len(EVENT_MODELS) + len(request_models),
            "built": sorted(
                model.__name__ for model in [*EVENT_MODELS, *request_models]
                if model.__pydantic_complete__
            ),
        }}))
        """
    )
    assert found["heavy"] == []
    assert found["unused"] == []
    # Validators are built on a model's first use (`defer_build`), not for all of them at import.
    assert isinstance(found["models"], int)
    assert found["models"] > 50
    assert found["built"] == []


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
