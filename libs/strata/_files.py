"""Files that hold secrets, written readable by their owner only from the first byte.

Opening an existing file for writing keeps its mode, and a chmod after writing leaves a moment in
which the secret is readable by others; so a secret is written to a fresh file that `mkstemp`
creates with mode 0600, which then replaces the old one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path

PRIVATE_MODE = 0o600


def write_private(path: Path, text: str) -> None:
    """Write `text` to `path` with mode 0600, whatever the umask or the mode of a file already
    there; readers see the old content or the new, never half of it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(descriptor, "w", encoding="utf-8") as out:
            out.write(text)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temporary)
        raise
