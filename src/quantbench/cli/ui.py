"""`quantbench ui`: start the MLflow UI on the tracking store."""

from __future__ import annotations

import ipaddress
import signal
import subprocess
import sys

from quantbench.core.errors import UserError
from quantbench.core.processes import interrupt, stop_group
from quantbench.tracking import Tracker, tracking_uri


def add_parser(sub) -> None:
    u = sub.add_parser("ui", help="start the MLflow UI on the tracking store")
    u.add_argument(
        "--host",
        default="127.0.0.1",
        help="bind address (default 127.0.0.1); any other than loopback needs --expose-unauthenticated",
    )
    u.add_argument("--port", type=int, default=5000)
    u.add_argument(
        "--expose-unauthenticated",
        action="store_true",
        help="allow a --host other than loopback: the MLflow UI has no login, so anyone who reaches the port "
        "reads and changes every run and registered model. Put authentication in front of it (docs/gate.md)",
    )


def run(args) -> int:
    """The MLflow UI as a child process group, stopped with this process: on Ctrl-C, and on
    SIGTERM / SIGHUP (a supervisor, a closed terminal), not left listening."""
    exposed = not _loopback(args.host)
    if exposed and not args.expose_unauthenticated:
        raise UserError(
            f"--host {args.host}: not a loopback address, and the MLflow UI has no login of its own: anyone "
            "who reaches the port reads and changes every run and registered model. Put authentication in "
            "front of it instead (docs/gate.md, 'Exposing the UI'): a reverse proxy with auth and TLS (nginx "
            "auth_basic, an OAuth2 proxy) listening publicly and forwarding to 127.0.0.1, or MLflow's "
            "basic-auth app. To bind it unauthenticated anyway, add --expose-unauthenticated"
        )
    uri = tracking_uri()
    print(f"MLflow UI for {uri} on http://{args.host}:{args.port}")
    experiment_id = Tracker().experiment_id(create=False)
    if experiment_id is not None:  # MLflow 3 opens its GenAI view by default; this link opens the runs table
        print(f"runs: http://{args.host}:{args.port}/#/experiments/{experiment_id}/runs?workflowType=machine_learning")
    if exposed:
        print(
            f"warning: serving the MLflow UI without authentication on {args.host} (--expose-unauthenticated)",
            file=sys.stderr,
        )
    sys.stdout.flush()
    cmd = [
        sys.executable,
        "-m",
        "mlflow",
        "ui",
        "--backend-store-uri",
        uri,
        "--host",
        args.host,
        "--port",
        str(args.port),
    ]
    for signum in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, interrupt)
    proc = subprocess.Popen(cmd, start_new_session=True)
    try:
        return proc.wait()
    finally:
        stop_group(proc)  # the server and its workers, whatever ended this process


def _loopback(host: str) -> bool:
    """Whether binding `host` serves this machine only (a name other than localhost may resolve anywhere)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False
