"""The only module that talks to MLflow: runs, names, artifacts, searches, the model registry, and
what a process that died left behind.

Default store: MLflow's own default, `sqlite:///mlflow.db` in the working directory (the repo
root under `make`), artifacts in mlruns/ beside it. `MLFLOW_TRACKING_URI` names another store.

A store this process cannot read or write (a SQLite file that is read-only, immutable or damaged, a
path that cannot hold one) is bad input, not a crash: every MLflow call goes through `_Checked`,
which says so in one line, naming the store and what to do (StoreError, exit 2).

Every run records who owns it (`quantbench.owner`: host, pid and the process's start time). A run
still RUNNING whose owner process is gone was killed without a chance to say so (SIGKILL, the OOM
killer, a lost node): every command that opens the store marks such runs of this host FAILED, in
every experiment, with the reason and removes the staging directory they left (`reap`); `quantbench
gc` does it on demand.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import socket
import sqlite3
import time
import traceback
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import psutil
from filelock import FileLock

from quantbench.core.errors import UserError
from quantbench.core.processes import interrupted, interrupts_held, signal_received
from quantbench.core.settings import flatten

log = logging.getLogger(__name__)

DEFAULT_EXPERIMENT = "quantbench"
TAG = "quantbench."  # prefix of every tag of ours (docs/metrics.md lists them all)
# MLflow 3's UI opens an experiment in its GenAI (traces) view unless told it holds model runs.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")
OWNER = TAG + "owner"  # "host pid start-time": the process that holds the run open
STAGING = TAG + "staging"  # a directory the run writes and removes unless it finishes
# Environment a parent process (a sweep, a tune) gives its children, so their runs carry its tags.
ENV_TAGS = "QUANTBENCH_RUN_TAGS"  # JSON object of extra tags for every run the child starts
ENV_PARENT = "QUANTBENCH_PARENT_RUN"  # the parent run id (mlflow.parentRunId)


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def experiment_name(name: str | None = None) -> str:
    return name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def is_local_store(uri: str | None = None) -> bool:
    """A store on this machine's disk (SQLite or a file path), not a tracking server."""
    return not (uri or tracking_uri()).startswith(("http://", "https://", "databricks", "postgresql", "mysql"))


def store_exists(uri: str | None = None) -> bool:
    """Whether there is a store to read: False for a local SQLite store whose file is not there yet.
    Reading such a store answers "nothing" and creates nothing (MLflow creates the database, a lock
    and a Default experiment on first contact); the first run written creates it."""
    uri = uri or tracking_uri()
    if uri.startswith("sqlite:///"):
        return Path(uri.removeprefix("sqlite:///")).exists()
    return True


def shares_artifacts(artifact_uri: str) -> bool:
    """Whether artifacts at `artifact_uri` reach other machines (a tracking server's artifact
    store, S3, ...) rather than being written to the disk of whichever machine logs them."""
    return urlparse(artifact_uri).scheme not in ("", "file")


class StoreError(UserError):
    """The tracking store cannot be read or written: which store, what is wrong, what to do."""


def _store_name(uri: str) -> str:
    return uri.removeprefix("sqlite:///") if uri.startswith("sqlite:///") else uri


def _store_problem(exc: BaseException, uri: str) -> str | None:
    """What is wrong with the store in words, when `exc` (or an error it was raised from) is SQLite
    saying it cannot read or write the file; None for any other error (left as it is)."""
    cause = _sqlite_cause(exc)
    if cause is None:
        return None
    reason, name = str(cause), _store_name(uri)
    elsewhere = "or point MLFLOW_TRACKING_URI at another store"
    if "readonly" in reason:
        return (
            f"the tracking store {name} cannot be written ({reason}): make it writable (`chmod u+w {name}` and "
            f"its directory; `chattr -i {name}` if it was made immutable), {elsewhere}"
        )
    if "not a database" in reason or "malformed" in reason:
        return (
            f"the tracking store {name} is damaged ({reason}): restore it from a backup, {elsewhere} (moved "
            "aside, a new one is made in its place)"
        )
    if "unable to open" in reason:
        return _unopenable(name, reason)
    return None


def _sqlite_cause(exc: BaseException) -> sqlite3.Error | None:
    """The SQLite error `exc` is, or was raised from (MLflow wraps SQLAlchemy's, which wraps SQLite's)."""
    seen: set[int] = set()
    cause: BaseException | None = exc
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, sqlite3.Error):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def _unopenable(name: str, reason: str) -> str:
    return (
        f"the tracking store {name} cannot be opened ({reason}): it and its directory must be writable "
        "(`chmod u+w`), or point MLFLOW_TRACKING_URI at another store"
    )


@contextmanager
def _store_errors(uri: str):
    """SQLite's "cannot read or write this file" as a StoreError; every other error as it is."""
    try:
        yield
    except StoreError:
        raise
    except Exception as exc:
        problem = _store_problem(exc, uri)
        if problem is None:
            raise
        raise StoreError(problem) from exc


_TRANSFERS = frozenset({"log_artifact", "log_artifacts", "download_artifacts"})  # files (minutes to S3)


class _Checked:
    """An MlflowClient whose every call says a store it cannot read or write as a StoreError (not
    MLflow's 70 frames of SQLAlchemy) and runs whole, but for file transfers: an interrupt is raised
    after it (raised inside SQLAlchemy, one left a SQLite write open that the run's end waited on)."""

    def __init__(self, client, uri: str):
        self._client, self._uri = client, uri

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._client, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            with nullcontext([]) if name in _TRANSFERS else interrupts_held() as held, _store_errors(self._uri):
                result = attr(*args, **kwargs)
            if held:
                raise KeyboardInterrupt(f"signal {held[0]}")
            return result

        return call


@contextmanager
def _creation_lock(uri: str):
    """Two commands opening a fresh SQLite store at once race in MLflow's schema creation ("table
    experiments already exists"): serialise the first access with a lock file beside the database."""
    if not uri.startswith("sqlite:///"):
        yield
        return
    db = Path(uri.removeprefix("sqlite:///"))
    lock = FileLock(db.with_name(db.name + ".lock"))
    try:
        db.parent.mkdir(parents=True, exist_ok=True)
        lock.acquire()
    except OSError as exc:  # a directory that is a file, or one this user may not write in
        raise StoreError(_unopenable(str(db), f"{exc.strerror}: {exc.filename}")) from exc
    try:
        yield
    finally:
        lock.release()


_ready: set[str] = set()


def _client() -> _Checked:
    for noisy in ("alembic",):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    # MLflow logs every SQLAlchemy error with its traceback before raising it; the error reaches
    # the caller anyway (a store fault said in one line by _Checked, anything else as it is)
    logging.getLogger("mlflow.store.db.utils").setLevel(logging.CRITICAL)
    from mlflow.tracking import MlflowClient

    uri = tracking_uri()
    if uri in _ready:
        return _Checked(MlflowClient(uri), uri)
    # the client creates (or upgrades) the schema: one process at a time
    with _creation_lock(uri), _store_errors(uri):
        client = _Checked(MlflowClient(uri), uri)
        client.search_experiments(max_results=1)
    _ready.add(uri)
    return client


def quote(value: str) -> str:
    """A string value for an MLflow search filter. MLflow takes it between quotes with no escapes,
    so the quote character must not occur in it: a value holding both kinds is refused."""
    value = str(value)
    if "'" not in value:
        return f"'{value}'"
    if '"' not in value:
        return f'"{value}"'
    raise UserError(f"cannot search MLflow for a value holding both quote characters: {value[:80]!r}")


def _filter(tags: dict[str, str], status: str | None = "FINISHED") -> str:
    clauses = [f"tags.`{k}` = {quote(v)}" for k, v in tags.items()]
    if status:
        clauses.append(f"attributes.status = '{status}'")
    return " and ".join(clauses)


def owner_tag() -> str:
    """This process, as a run's owner: host, pid and the process's start time (pids are reused)."""
    return f"{socket.gethostname()} {os.getpid()} {psutil.Process().create_time():.2f}"


def owner_alive(owner: str) -> bool | None:
    """Whether a run's owner process still runs; None when it is another host's (can't tell here)."""
    try:
        host, pid, started = owner.rsplit(" ", 2)
        pid_n, started_f = int(pid), float(started)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    try:
        proc = psutil.Process(pid_n)
        # a zombie has exited: only its parent has not collected it yet (an orphan under an init that reaps late)
        return abs(proc.create_time() - started_f) < 0.05 and proc.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def inherited_tags() -> dict[str, str]:
    """Tags a parent process (sweep, tune) asks the candidate runs of its children to carry."""
    tags = json.loads(os.environ.get(ENV_TAGS) or "{}")
    if os.environ.get(ENV_PARENT):
        tags["mlflow.parentRunId"] = os.environ[ENV_PARENT]
    return {str(k): str(v) for k, v in tags.items()}


class Run:
    """One MLflow run as a context manager: FINISHED on success; FAILED with the error
    recorded when an exception escapes; KILLED on Ctrl-C. Never left RUNNING."""

    def __init__(self, client, run_id: str):
        self.client = client
        self.run_id = run_id

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        with interrupts_held() as held:  # a second Ctrl-C must not leave the run RUNNING
            if exc_type is None and signal_received() is not None:  # its KeyboardInterrupt was lost
                held.append(signal_received())
                self.client.set_tag(self.run_id, TAG + "error", f"KeyboardInterrupt: signal {held[0]}")
                self.client.set_terminated(self.run_id, "KILLED")
            elif exc_type is None:
                self.client.set_terminated(self.run_id, "FINISHED")
            else:
                status = "KILLED" if interrupted(exc) else "FAILED"
                try:
                    message = f"{exc_type.__name__}: {exc}"
                    self.client.set_tag(self.run_id, TAG + "error", message[:5000])
                    self.client.log_text(
                        self.run_id, "".join(traceback.format_exception(exc_type, exc, tb)), "error.txt"
                    )
                finally:
                    self.client.set_terminated(self.run_id, status)
        if held and not (exc_type and issubclass(exc_type, KeyboardInterrupt)):
            raise KeyboardInterrupt(f"signal {held[0]}")  # the run is ended; the command still stops

    def set_tags(self, tags: dict[str, Any]) -> None:
        from mlflow.entities import RunTag

        items = [RunTag(key, str(value)[:8000]) for key, value in tags.items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, tags=items[start : start + 100])

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key, _param_value(value)) for key, value in flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, float(value), now, step or 0) for key, value in metrics.items()]
        for start in range(0, len(items), 1000):
            self.client.log_batch(self.run_id, metrics=items[start : start + 1000])

    def log_dict(self, data: dict, name: str) -> None:
        self.client.log_text(self.run_id, json.dumps(data, indent=2, sort_keys=True, default=str), name)

    def log_text(self, text: str, name: str) -> None:
        self.client.log_text(self.run_id, text, name)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, directory: Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(directory), artifact_path)

    def record(
        self,
        metrics: dict[str, float] | None = None,
        tags: dict[str, Any] | None = None,
        artifacts: dict[str, dict] | None = None,
    ) -> None:
        """A stage's result: its metrics, tags and JSON artifacts (name -> content)."""
        if tags:
            self.set_tags(tags)
        if metrics:
            self.log_metrics(metrics)
        for name, content in (artifacts or {}).items():
            self.log_dict(content, name)

    def has_artifact(self, path: str) -> bool:
        """Whether the run has this artifact (a file or a directory). Its parent is listed: listing
        a file itself answers nothing from a tracking server's artifact store."""
        parent = path.rstrip("/").rpartition("/")[0] or None
        return any(f.path == path.rstrip("/") for f in self.client.list_artifacts(self.run_id, parent))

    @property
    def shares_artifacts(self) -> bool:
        """Its artifacts reach other machines (see shares_artifacts())."""
        return shares_artifacts(self.info.artifact_uri)

    def download(self, artifact: str, dest: Path) -> Path:
        return Path(self.client.download_artifacts(self.run_id, artifact, str(dest)))

    @property
    def data(self):
        """The run's current tags, params and metrics (latest values)."""
        return self.client.get_run(self.run_id).data

    @property
    def info(self):
        return self.client.get_run(self.run_id).info


class Tracker:
    """The store and one experiment in it. Opening it reaps what dead processes left RUNNING in the
    whole store. A local store that does not exist yet is read as empty and created only by the first
    write (a run), so a command refused as bad input leaves no store behind."""

    def __init__(self, experiment: str | None = None, reap: bool = True):
        self._client = None
        self.experiment = experiment_name(experiment)
        if reap:
            self.reap()

    @property
    def client(self):
        if self._client is None:
            self._client = _client()
        return self._client

    def _readable(self) -> bool:
        return self._client is not None or store_exists()

    def _experiment(self):
        return self.client.get_experiment_by_name(self.experiment) if self._readable() else None

    def experiment_id(self, create: bool = True) -> str | None:
        found = self._experiment()
        if found is not None:
            if EXPERIMENT_KIND[0] not in found.tags:
                self.client.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
            return found.experiment_id
        if not create:
            return None
        uri = tracking_uri()  # a SQLite store's artifacts beside it, not in ./mlruns of whoever creates this
        beside = Path(_store_name(uri).split("?")[0]).resolve().parent / "mlruns"
        location = beside.as_uri() if uri.startswith("sqlite:///") else None
        from mlflow.exceptions import MlflowException

        try:
            return self.client.create_experiment(
                self.experiment, artifact_location=location, tags=dict([EXPERIMENT_KIND])
            )
        except MlflowException:  # another process created it first
            found = self._experiment()
            if found is None:
                raise
            return found.experiment_id

    def artifact_location(self) -> str | None:
        """Where the experiment's runs keep their artifacts; None before it exists."""
        found = self._experiment()
        return None if found is None else found.artifact_location

    def search(self, tags: dict[str, str], status: str | None = "FINISHED", order_newest: bool = True) -> list:
        """Runs of this experiment carrying all `tags` (values compared exactly), in `status`."""
        found = self._experiment()
        if found is None:
            return []
        order = ["attributes.start_time DESC"] if order_newest else None
        return self.client.search_runs([found.experiment_id], _filter(tags, status), order_by=order)

    def find_runs(self, tags: dict[str, str]) -> list[str]:
        """FINISHED runs of this experiment carrying all `tags`, newest first."""
        return [r.info.run_id for r in self.search(tags)]

    def existing(self, run_id: str) -> Run | None:
        """A handle on a run (e.g. to read it), or None if the store has no such run."""
        from mlflow.exceptions import MlflowException

        if not self._readable():
            return None
        try:
            self.client.get_run(run_id)
        except MlflowException:
            return None
        return Run(self.client, run_id)

    def get(self, run_id: str, field: str = "run"):
        """A run's entity (info, data); UserError naming `field` when the store has none."""
        from mlflow.exceptions import MlflowException

        if not self._readable():
            raise UserError(
                f"{field}: run '{run_id}' not found: the tracking store {tracking_uri()} does not exist yet"
            )
        try:
            return self.client.get_run(run_id)
        except MlflowException as exc:
            raise UserError(f"{field}: {exc.message}") from None

    def resume_run(self, run_id: str) -> Run:
        """Reopen a run to log a later stage into it; it ends FINISHED or FAILED like a new one."""
        self.client.update_run(run_id, status="RUNNING")
        self.client.set_tag(run_id, OWNER, owner_tag())
        return Run(self.client, run_id)

    def runs(self, tags: dict[str, str], run_ids: list[str] | None = None) -> list:
        """Runs of this experiment (or exactly `run_ids`, any experiment) with these tags, newest first."""
        if run_ids:
            return [self.get(run_id, "--runs") for run_id in run_ids]
        return self.search(tags)

    def runs_with_status(self, tags: dict[str, str], status: str) -> list:
        return self.search(tags, status, order_newest=False)

    def fail_run(self, run_id: str, reason: str, status: str = "FAILED") -> None:
        """End a run that nobody will finish (FAILED, or KILLED), with the reason as its error tag."""
        self.client.set_tag(run_id, TAG + "error", reason)
        self.client.set_terminated(run_id, status)

    def fail_orphans(self, tags: dict[str, str], what: str) -> list[str]:
        """Runs with these tags left RUNNING by a `what` (sweep, tune) that died, when the caller
        holds the lock that says no `what` owns them any more: a job process still alive is killed
        first, then the run is FAILED with the reason. Their ids."""
        failed = []
        for run in self.runs_with_status(tags, "RUNNING"):
            owner = run.data.tags.get(OWNER, "")
            if owner_alive(owner):
                try:
                    os.killpg(int(owner.split()[1]), signal.SIGKILL)
                except (ProcessLookupError, PermissionError, ValueError):
                    pass
            reason = f"left RUNNING by a {what} that died (job process {owner or '?'}); marked FAILED on resume"
            self.fail_run(run.info.run_id, reason)
            failed.append(run.info.run_id)
        return failed

    def start_run(self, run_name: str, tags: dict[str, Any]) -> Run:
        tags = {OWNER: owner_tag(), **tags}
        experiment_id = self.experiment_id()
        with interrupts_held() as held:  # an interrupt now would leave a RUNNING run nobody ends
            run_id = self.client.create_run(
                experiment_id, run_name=run_name, tags={k: str(v) for k, v in tags.items()}
            ).info.run_id
            if held:
                self.fail_run(run_id, "interrupted while the run was being created", status="KILLED")
        if held:
            raise KeyboardInterrupt(f"signal {held[0]}")
        return Run(self.client, run_id)

    def reap(self, everywhere: bool = True) -> list[dict]:
        """Runs left RUNNING by a process of this host that is gone, in every experiment of the store
        (`everywhere=False`: this experiment only): FAILED with the reason, their staging directory
        removed. Returns what was done."""
        done = []
        if not self._readable():
            return done
        try:
            if everywhere:
                names = {e.experiment_id: e.name for e in self.client.search_experiments()}
            else:
                found = self._experiment()
                names = {found.experiment_id: found.name} if found is not None else {}
            mine = f"attributes.status = 'RUNNING' and tags.`{OWNER}` LIKE {quote(socket.gethostname() + ' %')}"
            running = self.client.search_runs(list(names), mine) if names else []
        except StoreError:  # a store that cannot be read: said now (gc must not call it clean)
            raise
        except Exception as exc:  # a store that cannot be searched now must not stop the command
            log.debug("reap: %s", exc)
            return done
        for run in running:
            owner = run.data.tags.get(OWNER)
            if not owner or owner_alive(owner) is not False:
                continue
            staging = run.data.tags.get(STAGING)
            removed = None
            if staging and Path(staging).name == f".{run.info.run_id}.partial" and Path(staging).is_dir():
                shutil.rmtree(staging, ignore_errors=True)
                removed = staging
            reason = (
                f"its process ({owner}) died without ending it (killed: SIGKILL, out of memory, or a lost "
                "node); marked FAILED by a later command" + (f", staging dir {removed} removed" if removed else "")
            )
            self.fail_run(run.info.run_id, reason)
            experiment = names.get(run.info.experiment_id, run.info.experiment_id)
            log.warning(
                "run %s (%s) in %s was left RUNNING by a dead process; marked FAILED%s",
                run.info.run_id,
                run.info.run_name,
                experiment,
                f", removed {removed}" if removed else "",
            )
            done.append(
                {
                    "run_id": run.info.run_id,
                    "name": run.info.run_name,
                    "owner": owner,
                    "removed": removed,
                    "experiment": experiment,
                }
            )
        return done


def _param_value(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
    return text[:6000]


class Registry:
    """The MLflow Model Registry: versions of a registered model and the aliases that point at them."""

    def __init__(self):
        self.client = _client()

    def version_for_run(self, name: str, run_id: str):
        """The version already registered from this run, if any (re-gating does not duplicate it)."""
        found = self.client.search_model_versions(f"name = {quote(name)} and run_id = {quote(run_id)}")
        return found[0] if found else None

    def register(self, name: str, run: Run, artifact_path: str, description: str, tags: dict[str, str]):
        """A new version of `name` whose source is the run's artifact (created if missing)."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_registered_model(name)
        except MlflowException:
            self.client.create_registered_model(name, description="Checkpoints promoted by quantbench gate.")
        return self.client.create_model_version(
            name, f"runs:/{run.run_id}/{artifact_path}", run_id=run.run_id, tags=tags, description=description
        )

    def alias_version(self, name: str, alias: str) -> str | None:
        from mlflow.exceptions import MlflowException

        try:
            return self.client.get_model_version_by_alias(name, alias).version
        except MlflowException:
            return None

    def set_alias(self, name: str, alias: str, version: str) -> None:
        self.client.set_registered_model_alias(name, alias, version)

    def set_version_tags(self, name: str, version: str, tags: dict[str, str]) -> None:
        for key, value in tags.items():
            self.client.set_model_version_tag(name, version, key, str(value))
