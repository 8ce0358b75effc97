"""`quantbench ui` as a supervisor or a closed terminal stops it: SIGTERM (or SIGHUP) ends the
MLflow server and every worker it started, and nothing is left listening."""

import socket
import subprocess
import sys
import time
import urllib.request

import psutil
import pytest

from quantbench.core.processes import free_port

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("signum", ["SIGTERM", "SIGHUP"])
def test_a_signal_stops_the_ui_and_all_its_workers(workdir, signum):
    import signal

    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "quantbench", "ui", "--port", str(port)], cwd=workdir,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    deadline = time.monotonic() + 120
    while True:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2)
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, "the MLflow UI did not start"
            time.sleep(0.5)
    workers = psutil.Process(proc.pid).children(recursive=True)
    assert len(workers) >= 2  # the server and its workers
    proc.send_signal(getattr(signal, signum))
    assert proc.wait(60) == 130
    gone, alive = psutil.wait_procs(workers, timeout=30)
    assert alive == [], [p.cmdline() for p in alive]
    with socket.socket() as sock:
        assert sock.connect_ex(("127.0.0.1", port)) != 0  # nothing listens on the port any more
