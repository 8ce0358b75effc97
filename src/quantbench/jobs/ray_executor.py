"""Attempts on a Ray cluster (`quantbench sweep NAME --ray [ADDRESS]`): the `RayExecutor` of
executor.py, so the sweep's promises (timeouts, retries, logs, resume, one FINISHED run per job)
hold across machines. docs/ray.md says how to run it.

Each attempt is one small Ray actor (`AttemptActor`), asking the job's resources (num_cpus,
num_gpus, memory) and never restarted by Ray (retries are the runner's, counted and backed off).
On the node Ray places it, the actor starts `python -m quantbench quantize ...` in the driver's
working directory (the same path on every node) in a session of its own, and
- kills that process tree when the attempt's timeout passes, on the node, whatever the driver does;
- hands the attempt's log back in pieces while it runs (the driver writes it under
  outputs/sweeps/NAME/logs/), so a node that dies takes at most the last second of it;
- dies with the driver (Ray ends the actors of an owner that died), and the job's process with it
  (SIGTERM through PR_SET_PDEATHSIG), so a killed sweep leaves nothing running: resume it.
A node lost mid-attempt shows up as the actor's death: the attempt fails with Ray's reason and is
retried where Ray places it next; a job that no node of the cluster can host fails after
`placement_timeout_s` with what it asked for and what the nodes have, instead of waiting forever.

ADDRESS: `host:port` of a cluster's head (the driver on a node of it), `ray://host:10001` (Ray
Client, from outside), `auto` (the cluster running here, else an error); omitted: the cluster
running here, else a local Ray started for the sweep and stopped after it. An address that does
not answer fails at once.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

from quantbench.core.errors import UserError
from quantbench.core.processes import stop_tree
from quantbench.jobs.executor import (
    KILL_GRACE_S,
    Ended,
    Executor,
    Job,
    LocalExecutor,
    die_with_parent,
)
from quantbench.tracking import (
    ENV_TAGS,
    TAG,
    Tracker,
    is_local_store,
    shares_artifacts,
    tracking_uri,
)

log = logging.getLogger(__name__)

INSTALL = "pip install -e '.[ray]'"
CONNECT_TIMEOUT_S = 5.0  # an address that does not accept a connection within this fails at once
POLL_S = 1.0  # how often the driver asks an attempt for its state and its log
CHUNK = 4 * 2**20  # log bytes handed back per poll
PLACEMENTS = 3  # times an attempt is placed when Ray's chosen node dies before the job starts
LOST_S = 120.0  # an actor that does not answer for this long is taken for lost
LOCAL_OBJECT_STORE = 128 * 2**20  # a Ray started for a sweep moves only logs and small results
# Ray SIGKILLs a worker's child processes when the worker exits (its owner died, ray.kill): the
# job could not end its run. Without that, the job gets SIGTERM (PR_SET_PDEATHSIG) and ends its
# run as KILLED, its staging directory removed, like a job whose sweep was interrupted.
ACTOR_ENV = {"env_vars": {"RAY_kill_child_processes_on_worker_exit": "false"}}
ENV_PASSED = ("MLFLOW_TRACKING_URI", "QUANTBENCH_RECIPES")  # the driver's settings a job needs on any node


class AttemptActor:
    """On the node Ray picked: one attempt's process, its timeout, its log. Every method returns
    quickly; the actor runs them one at a time in its main thread, the thread that starts the
    process (PR_SET_PDEATHSIG follows that thread)."""

    def start(self, argv: list[str], env: dict[str, str], cwd: str, timeout_s: float, grace_s: float) -> dict:
        import ray

        node = ray.get_runtime_context().get_node_id()
        if not Path(cwd).is_dir():
            raise RuntimeError(
                f"node {node[:12]} ({socket.gethostname()}) has no directory {cwd}, the sweep's working "
                "directory: every node needs the project at the same path (docs/ray.md)"
            )
        tags = {**json.loads(env.get(ENV_TAGS) or "{}"), TAG + "ray_node": node}
        fd, self.log_path = tempfile.mkstemp(prefix="quantbench-attempt-", suffix=".log")
        with os.fdopen(fd, "wb") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "quantbench", *argv],
                cwd=cwd,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**os.environ, **env, ENV_TAGS: json.dumps(tags)},
                preexec_fn=die_with_parent,
            )
        self.started, self.elapsed, self.reason = time.monotonic(), None, ""
        self.settled = threading.Event()
        threading.Thread(target=self._watch, args=(timeout_s, grace_s), name="timeout", daemon=True).start()
        return {"node": node, "host": socket.gethostname(), "pid": self.proc.pid}

    def _watch(self, timeout_s: float, grace_s: float) -> None:
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.reason = f"timeout after {timeout_s:g} s"
            stop_tree(self.proc, grace_s)
        self.elapsed = time.monotonic() - self.started
        try:  # whatever the job left in its group goes with it
            os.killpg(self.proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            pass
        self.settled.set()

    def poll(self, offset: int) -> dict:
        """The log from `offset` on (up to CHUNK bytes), and the exit status once the process
        has ended and every byte of its log was handed over (then the log file is removed)."""
        settled = self.settled.is_set()
        with open(self.log_path, "rb") as handle:
            handle.seek(offset)
            data = handle.read(CHUNK)
        done = settled and len(data) < CHUNK
        if done:
            os.unlink(self.log_path)
        return {
            "exit": self.proc.returncode if done else None,
            "data": data,
            "reason": self.reason,
            "elapsed": self.elapsed,
        }

    def stop(self, grace_s: float) -> None:
        """Kill the attempt's process tree now (the driver was interrupted)."""
        self.reason = self.reason or "stopped: the driver was interrupted"
        stop_tree(self.proc, grace_s)
        self.settled.wait(grace_s + 5)


@dataclass
class RayAttempt:
    actor: Any  # a Ray actor handle
    started_ref: Any  # a Ray ObjectRef
    request: dict[str, float]  # Ray's resource names: CPU, GPU, memory
    log_path: Path
    node: str | None = None
    host: str | None = None
    pid: int | None = None
    offset: int = 0
    poll_ref: Any = None
    polled: float = 0.0  # when the last poll was sent
    placement_checked: float = 0.0
    infeasible_since: float | None = None
    unanswered_since: float | None = None
    # to place it again when its actor's node dies before the job started (it never ran: not a try)
    options: dict = field(default_factory=dict)
    call: tuple = ()
    placements: int = 1


class RayExecutor:
    name = "ray"

    def __init__(self, address: str, *, placement_timeout_s: float = 600.0, grace_s: float = KILL_GRACE_S):
        """`address`: as `--ray` takes it ("" when omitted). Connects, or raises UserError."""
        try:
            import ray
        except ImportError:
            raise UserError(
                f"--ray needs Ray, which is not installed in this environment: {INSTALL} "
                "(the same on every node of the cluster)"
            ) from None
        self.placement_timeout_s, self.grace_s = placement_timeout_s, grace_s
        self.address, self.started_local = _connect(ray, address)
        self.actor_class = ray.remote(max_restarts=0, max_task_retries=0)(AttemptActor)
        self.env = {k: os.environ[k] for k in ENV_PASSED if os.environ.get(k)}
        nodes = _alive_nodes(ray)
        self.has_gpus = any(n["Resources"].get("GPU", 0) > 0 for n in nodes)
        self.foreign = [f"{n['NodeManagerHostname']} ({n['NodeManagerAddress']})" for n in nodes if not _is_here(n)]
        log.info(
            "ray: %s, %d nodes%s",
            "a local Ray started for this sweep" if self.started_local else self.address,
            len(nodes),
            f" ({len(self.foreign)} on other machines)" if self.foreign else "",
        )

    def describe(self) -> dict:
        import ray

        return {
            "name": self.name,
            "address": self.address or "local",
            "started_local": self.started_local,
            "nodes": [
                {
                    "node": n["NodeID"],
                    "host": n["NodeManagerHostname"],
                    "ip": n["NodeManagerAddress"],
                    "resources": {k: v for k, v in n["Resources"].items() if k in ("CPU", "GPU", "memory")},
                }
                for n in _alive_nodes(ray)
            ],
        }

    def check_store(self, tracker: Tracker) -> None:
        """Jobs on other machines must reach the tracking store and its artifacts."""
        if not self.foreign:
            return
        where = ", ".join(self.foreign[:3]) + (" ..." if len(self.foreign) > 3 else "")
        if is_local_store():
            raise UserError(
                f"--ray: the tracking store is on this machine's disk ({tracking_uri()}), but the Ray cluster has nodes on "
                f"other machines ({where}) that cannot write to it. Start a tracking server that every node reaches, e.g. "
                "`mlflow server --backend-store-uri postgresql://USER:PASS@DBHOST/mlflow --artifacts-destination "
                "s3://BUCKET/mlflow --host 0.0.0.0 --port 5000` (credentials on the server only), then "
                "`export MLFLOW_TRACKING_URI=http://SERVER:5000` and run the sweep again (docs/ray.md)"
            )
        location = tracker.artifact_location()
        if location is not None and not shares_artifacts(location):
            raise UserError(
                f"--ray: the experiment '{tracker.experiment}' keeps its artifacts at {location}, a path each machine "
                f"would write on its own disk, and the cluster has nodes on other machines ({where}). Serve artifacts "
                "from the tracking server (`mlflow server --artifacts-destination s3://BUCKET/mlflow`) and use a new "
                "experiment (--experiment) (docs/ray.md)"
            )

    # -- the Executor interface

    def start(self, job: Job, argv: list[str], env: dict[str, str], log_path: Path, timeout_s: float) -> RayAttempt:
        asked = job.resources or {}
        gpus = asked.get("num_gpus")
        options = {
            "num_cpus": asked.get("num_cpus") or 1,
            "num_gpus": (1 if self.has_gpus else 0) if gpus is None else gpus,
        }
        if asked.get("memory_gb"):
            options["memory"] = int(asked["memory_gb"] * 2**30)
        request = {"CPU": options["num_cpus"], "GPU": options["num_gpus"], "memory": options.get("memory", 0)}
        call = (argv, {**self.env, **env}, os.getcwd(), timeout_s, self.grace_s)
        actor: Any = self.actor_class.options(**options, runtime_env=ACTOR_ENV).remote()
        started = actor.start.remote(*call)
        log_path.write_bytes(b"")  # the node's log is appended here as it comes
        return RayAttempt(actor, started, {k: v for k, v in request.items() if v}, log_path, options=options, call=call)

    def poll(self, attempt: RayAttempt) -> Ended | None:
        import ray
        from ray.exceptions import ActorUnavailableError, RayActorError

        now = time.monotonic()
        if attempt.node is None:  # waiting for Ray to place it and the actor to start the job
            if not ray.wait([attempt.started_ref], timeout=0)[0]:
                return self._placement(ray, attempt, now)
            try:
                info = ray.get(attempt.started_ref)
            except RayActorError as exc:
                return self._lost(ray, attempt, exc)
            except ray.exceptions.RayTaskError as exc:
                return self._end(ray, attempt, Ended(None, f"could not start: {_cause(exc)}"))
            attempt.node, attempt.host, attempt.pid = info["node"], info["host"], info["pid"]
        if attempt.poll_ref is None:
            if now - attempt.polled < POLL_S:
                return None
            attempt.poll_ref, attempt.polled = attempt.actor.poll.remote(attempt.offset), now
        if not ray.wait([attempt.poll_ref], timeout=0)[0]:
            if now - attempt.polled > LOST_S:
                return self._lost(ray, attempt, f"its actor did not answer for {LOST_S:g} s")
            return None
        ref, attempt.poll_ref = attempt.poll_ref, None
        try:
            state = ray.get(ref)
        except ActorUnavailableError as exc:  # the node may come back, or be declared dead
            attempt.unanswered_since = attempt.unanswered_since or now
            if now - attempt.unanswered_since > LOST_S:
                return self._lost(ray, attempt, exc)
            return None
        except RayActorError as exc:
            return self._lost(ray, attempt, exc)
        attempt.unanswered_since = None
        self._append(attempt, state["data"])
        if state["exit"] is None:
            if len(state["data"]) == CHUNK:
                attempt.polled = 0.0  # more is waiting: ask again at once
            return None
        return self._end(ray, attempt, Ended(state["exit"], state["reason"], elapsed_s=state["elapsed"]))

    def stop(self, attempt: RayAttempt) -> None:
        import ray

        try:
            if attempt.node is not None:
                ray.get(attempt.actor.stop.remote(self.grace_s), timeout=self.grace_s + 30)
                while True:  # the rest of its log
                    state = ray.get(attempt.actor.poll.remote(attempt.offset), timeout=30)
                    self._append(attempt, state["data"])
                    if state["exit"] is not None or not state["data"]:
                        break
        except ray.exceptions.RayError as exc:
            log.warning("stopping the attempt on node %s: %s", attempt.node, _cause(exc))
        finally:
            _kill(ray, attempt.actor)

    def close(self) -> None:
        import ray

        if ray.is_initialized():
            ray.shutdown()  # a local Ray started for the sweep stops with it

    # -- the ways an attempt ends

    def _append(self, attempt: RayAttempt, data: bytes) -> None:
        if data:
            with open(attempt.log_path, "ab") as out:
                out.write(data)
            attempt.offset += len(data)

    def _end(self, ray, attempt: RayAttempt, ended: Ended) -> Ended:
        if ended.code is None:
            self._append(attempt, f"\n[quantbench] {ended.reason}\n".encode())
        _kill(ray, attempt.actor)
        return ended

    def _lost(self, ray, attempt: RayAttempt, exc) -> Ended | None:
        if attempt.node is None:  # its actor never came up (its node died first, or could not import quantbench)
            if attempt.placements < PLACEMENTS and re.search(r"node (has died|died|was terminated)", _cause(exc)):
                # Ray placed it on a node that was dying (not yet declared dead): the job never
                # started, so this is not a try; place it again on a node alive now
                log.warning("the node Ray chose died before the job started (%s); placing it again", _cause(exc))
                _kill(ray, attempt.actor)
                attempt.actor = self.actor_class.options(**attempt.options, runtime_env=ACTOR_ENV).remote()
                attempt.started_ref = attempt.actor.start.remote(*attempt.call)
                attempt.placements += 1
                attempt.placement_checked, attempt.infeasible_since = 0.0, None
                return None
            return self._end(ray, attempt, Ended(None, f"could not start on a Ray node: {_cause(exc)}"))
        node = f"Ray node {attempt.node[:12]}" + (f" ({attempt.host})" if attempt.host else "")
        return self._end(ray, attempt, Ended(None, f"lost with {node}: {_cause(exc)}"))

    def _placement(self, ray, attempt: RayAttempt, now: float) -> Ended | None:
        """None while some alive node could host the attempt (it waits its turn); once none could
        for placement_timeout_s, the attempt fails (not retried) with what was asked and what is there."""
        if now - attempt.placement_checked < 5:
            return None
        attempt.placement_checked = now
        nodes = _alive_nodes(ray)
        if any(all(n["Resources"].get(k, 0) >= v for k, v in attempt.request.items()) for n in nodes):
            attempt.infeasible_since = None
            return None
        attempt.infeasible_since = attempt.infeasible_since or now
        if now - attempt.infeasible_since < self.placement_timeout_s:
            return None
        have = "; ".join(_resources(n["Resources"]) for n in nodes) or "no alive node"
        return self._end(
            ray,
            attempt,
            Ended(
                None,
                f"Ray cannot place it: it requires {_resources(attempt.request)} for placement, and no node of the "
                f"cluster has that (nodes: {have}); gave up after {self.placement_timeout_s:g} s (placement_timeout_s)",
                retry=False,
            ),
        )


# ---------------------------------------------------------------------------------------------
# Connecting


def _connect(ray, address: str) -> tuple[str | None, bool]:
    """Connect to the cluster `address` names; (the address, whether a local Ray was started)."""
    target, given = address, address
    if address in ("", "auto"):
        target = _running_cluster(ray, address)
        if target is None and address == "auto":
            raise UserError(
                "--ray auto: no Ray cluster is running on this machine (start one with `ray start --head`, "
                "or give its address: --ray HOST:PORT)"
            )
        given = f"{address} (RAY_ADDRESS={target})" if os.environ.get("RAY_ADDRESS") else f"{address} (found {target})"
    if target is not None:
        _check_reachable(target, given.strip())
    kwargs = {"log_to_driver": False, "logging_level": logging.WARNING}
    if target is None:
        kwargs.update(include_dashboard=False, object_store_memory=LOCAL_OBJECT_STORE)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        ray.init(address=target or "local", **kwargs)
    except (ConnectionError, RuntimeError, ValueError) as exc:
        raise UserError(
            f"--ray {address or target or ''}: cannot connect to a Ray cluster at {target}: {exc}"
        ) from None
    if previous is not None and threading.current_thread() is threading.main_thread():
        # ray.init installs a SIGTERM handler that aborts the process; SIGTERM stays what it was
        # (the CLI's: an interrupt, so the attempts are stopped on their nodes and the state saved)
        signal.signal(signal.SIGTERM, previous)
    return target, target is None


def _running_cluster(ray, address: str) -> str | None:
    """The address of the cluster RAY_ADDRESS or `ray start` on this machine names; None if none.
    An address file left by a cluster that is gone is not a running cluster."""
    from ray._private import services

    try:
        found = services.get_ray_address_from_environment(address or None, None)
    except ConnectionError:
        return None
    if found in (None, "auto", "local"):
        return None
    if os.environ.get("RAY_ADDRESS"):
        return found  # named by the user: must answer
    try:
        _check_reachable(found, "")
    except UserError:
        log.warning("ray: the cluster last started here (%s) does not answer; starting a local Ray", found)
        return None
    return found


def _check_reachable(address: str, given: str) -> None:
    target = address.removeprefix("ray://")
    host, _, port = target.rpartition(":")
    if not host or not port.isdigit():
        raise UserError(f"--ray {given or address}: '{address}' is not an address (HOST:PORT, ray://HOST:PORT or auto)")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=CONNECT_TIMEOUT_S).close()
    except OSError as exc:
        raise UserError(
            f"--ray {given or address}: no Ray cluster answers at {address} "
            f"({exc.strerror or exc.__class__.__name__}): is its head running (`ray start --head`), "
            "and is the port open from here?"
        ) from None
    # Something listens; Ray's GCS (and Ray Client) speak gRPC. ray.init would retry a port that
    # does not for many minutes.
    import grpc

    channel = grpc.insecure_channel(target)
    try:
        grpc.channel_ready_future(channel).result(timeout=CONNECT_TIMEOUT_S)
    except grpc.FutureTimeoutError:
        raise UserError(
            f"--ray {given or address}: {address} accepts connections but does not speak gRPC as a Ray "
            "head does: is it the GCS port (6379 by default) or the Ray Client port (10001, ray://)?"
        ) from None
    finally:
        channel.close()


# ---------------------------------------------------------------------------------------------
# Nodes


def _kill(ray, actor) -> None:
    """End an attempt's actor (its process has ended, or its node is gone)."""
    try:
        ray.kill(actor, no_restart=True)
    except Exception as exc:  # the cluster itself may be gone: nothing is left to end
        log.debug("ray.kill: %s", exc)


def _alive_nodes(ray) -> list[dict]:
    return [n for n in ray.nodes() if n.get("Alive")]


def _local_addresses() -> set[str]:
    found = {a.address.split("%")[0] for addrs in psutil.net_if_addrs().values() for a in addrs}
    try:
        found |= {info[4][0] for info in socket.getaddrinfo(socket.gethostname(), None)}
    except OSError:
        pass
    return found


def _is_here(node: dict) -> bool:
    """Whether a Ray node runs on this machine (its address is one of ours)."""
    ip = node.get("NodeManagerAddress", "")
    try:
        if ipaddress.ip_address(ip).is_loopback:
            return True
    except ValueError:
        pass
    return ip in _local_addresses()


def _resources(resources: dict) -> str:
    """{CPU: 2, GPU: 1, memory: 8.0 GiB}, as Ray writes a request."""
    parts = []
    for key in ("CPU", "GPU", "memory"):
        value = resources.get(key, 0)
        if value:
            parts.append(f"{key}: {value / 2**30:.1f} GiB" if key == "memory" else f"{key}: {value:g}")
    return "{" + ", ".join(parts) + "}"


def _cause(exc) -> str:
    """The lines of a Ray error that say why (not its ids and tracebacks)."""
    text = str(exc)
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    why = [
        ln
        for ln in lines
        if any(w in ln for w in ("because", "unexpectedly:", "node", "Error:", "died"))
        and not ln.startswith(("class_name", "actor_id", "pid:", "namespace", "ip:", "File "))
    ]
    return "; ".join(why[-3:] or lines[-1:])[:600]


def make(ray: str | None, placement_timeout_s: float = 600.0) -> Executor:
    """Where attempts run (here in ray_executor, the one module that knows both): here (`ray` None), or on a Ray cluster (an address; "" for the cluster
    running here, else a local Ray). Connects at once: a bad address is a UserError before
    anything is written."""
    if ray is None:
        return LocalExecutor()
    return RayExecutor(ray, placement_timeout_s=placement_timeout_s)
