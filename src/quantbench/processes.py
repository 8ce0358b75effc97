"""Child processes that must not outlive their owner: a free loopback port, and stopping a
process group (SIGTERM, a grace period, then SIGKILL; the group killed even if its leader left)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def stop_group(proc: subprocess.Popen, grace_s: float = 10.0) -> None:
    """Stop the process group led by `proc` (started with start_new_session=True); reaped either way."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=grace_s)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            pass
    try:  # whatever is left of the group: the leader after its grace, or children it left behind
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
