"""Small helpers for the child processes Strata starts (nats-server, services, workers in tests).

They start a service process (`spawn_service`), make sure a child never outlives the process that
started it, stop children in two steps (SIGTERM, then SIGKILL) and find free TCP ports to hand to
them.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import threading
from collections import deque
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Final

_PR_SET_PDEATHSIG = 1

# The pid of the process about to fork, recorded in the parent just before every fork (subprocess
# runs these hooks when a preexec_fn is given), so the child can tell whether that parent is gone.
# `os.getppid() == 1` would not do: the parent may itself be PID 1, e.g. in a container.
_forking_pid = os.getpid()


def _record_forking_pid() -> None:
    global _forking_pid
    _forking_pid = os.getpid()


if sys.platform.startswith("linux"):
    os.register_at_fork(before=_record_forking_pid)


def child_preexec() -> None:
    """`preexec_fn` for `subprocess.Popen`: the child is SIGKILLed when its parent dies.

    Linux only (a no-op elsewhere). The child stays in the parent's process group, so a Ctrl-C
    in a terminal reaches it exactly as the parent decides. Linux fires the signal when the
    *thread* that forked the child exits, so start children from a long-lived thread (the main
    thread), never from a short-lived worker thread.
    """
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"prctl(PR_SET_PDEATHSIG) failed: {os.strerror(errno)}")
    # The parent may have died between fork and prctl; then no signal will ever come and we
    # were adopted by another process, so leave now instead of running as an orphan.
    if os.getppid() != _forking_pid:
        os._exit(1)


def service_command(name: str, python_args: Sequence[str] = ()) -> list[str]:
    """The command line of one Strata service: `python -m strata.services.<name>`, with this
    interpreter (`python_args` go before `-m`, e.g. a profiler's)."""
    return [sys.executable, *python_args, "-m", f"strata.services.{name}"]


def spawn_service(
    name: str,
    env: Mapping[str, str],
    log_path: Path | None = None,
    *,
    python_args: Sequence[str] = (),
    own_process_group: bool = False,
) -> subprocess.Popen[bytes]:
    """Start the service `name` (`registry`, `gateway`, ...) as a child of this process.

    Its stdout and stderr are appended to `log_path` (discarded when None); it reads nothing,
    and dies with the thread that started it (`child_preexec`). `own_process_group` puts it in a
    process group of its own, so a terminal's Ctrl-C reaches only this process, which then stops
    its children in the order it chooses.
    """
    if log_path is None:
        return subprocess.Popen(
            service_command(name, python_args),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            preexec_fn=child_preexec,
            process_group=0 if own_process_group else None,
        )
    with log_path.open("ab") as log:
        return subprocess.Popen(
            service_command(name, python_args),
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            preexec_fn=child_preexec,
            process_group=0 if own_process_group else None,
        )


def terminate(proc: subprocess.Popen[bytes], timeout: float) -> int | None:
    """Stop `proc` with SIGTERM, then SIGKILL after `timeout` seconds; return its exit code.

    Safe on a process that has already exited. Returns None only if the process survives even
    SIGKILL for another `timeout` seconds (stuck in the kernel), which callers should report.
    """
    if proc.poll() is not None:
        return proc.returncode
    with contextlib.suppress(ProcessLookupError):
        proc.terminate()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    try:
        return proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


RECENT_PORTS: Final = 256
"""How many of the ports `free_ports` handed out last it does not hand out again."""
_handed_out: deque[int] = deque(maxlen=RECENT_PORTS)
_handing_out = threading.Lock()


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """`count` distinct TCP ports that were free on `host` a moment ago.

    All sockets stay bound until every port is chosen, so the kernel cannot hand out the same
    port twice in one call; nor is a port this process was handed recently (and may not have
    bound yet) handed out again, so calls one after another do not collide either. Another
    process may still take one before it is used; callers that start a server on it see a bind
    error in that rare case.
    """
    sockets: list[socket.socket] = []
    chosen: list[int] = []
    try:
        with _handing_out:
            while len(chosen) < count:
                sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                sockets.append(sock)  # held bound: the kernel does not offer it again
                sock.bind((host, 0))
                port = int(sock.getsockname()[1])
                if port not in _handed_out:
                    chosen.append(port)
            _handed_out.extend(chosen)
        return chosen
    finally:
        for sock in sockets:
            sock.close()


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port that was free on `host` a moment ago."""
    return free_ports(1, host)[0]
