"""The only module that talks to MLflow: runs, names, artifacts and failures.

Default store: MLflow's own default, `sqlite:///mlflow.db` in the working directory (the repo
root under `make`), artifacts under `./mlruns`. `MLFLOW_TRACKING_URI` switches to a team server.
"""

from __future__ import annotations

import json
import logging
import os
import traceback
from pathlib import Path
from typing import Any

DEFAULT_EXPERIMENT = "quantbench"
TAG = "quantbench."  # prefix of every tag of ours (DESIGN.md, MLflow contract)
# MLflow 3's UI opens an experiment in its GenAI (traces) view unless told it holds model runs.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def tracking_uri() -> str:
    return os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path.cwd() / 'mlflow.db'}"


def experiment_name(name: str | None = None) -> str:
    return name or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_EXPERIMENT


def _client():
    for noisy in ("alembic", "mlflow.store.db.utils"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    from mlflow.tracking import MlflowClient

    return MlflowClient(tracking_uri())


class Run:
    """One MLflow run as a context manager: FINISHED on success; FAILED with the error
    recorded when an exception escapes; KILLED on Ctrl-C. Never left RUNNING."""

    def __init__(self, client, run_id: str):
        self.client = client
        self.run_id = run_id

    def __enter__(self) -> Run:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.client.set_terminated(self.run_id, "FINISHED")
            return
        status = "KILLED" if issubclass(exc_type, KeyboardInterrupt) else "FAILED"
        try:
            message = f"{exc_type.__name__}: {exc}"
            self.client.set_tag(self.run_id, TAG + "error", message[:5000])
            self.client.log_text(self.run_id, "".join(traceback.format_exception(exc_type, exc, tb)), "error.txt")
        finally:
            self.client.set_terminated(self.run_id, status)

    def set_tags(self, tags: dict[str, Any]) -> None:
        for key, value in tags.items():
            self.client.set_tag(self.run_id, key, str(value))

    def log_params(self, params: dict[str, Any]) -> None:
        from mlflow.entities import Param

        items = [Param(key, _param_value(value)) for key, value in flatten(params).items()]
        for start in range(0, len(items), 100):
            self.client.log_batch(self.run_id, params=items[start : start + 100])

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        items = [Metric(key, float(value), now, step or 0) for key, value in metrics.items()]
        self.client.log_batch(self.run_id, metrics=items)

    def log_dict(self, data: dict, name: str) -> None:
        self.client.log_text(self.run_id, json.dumps(data, indent=2, sort_keys=True, default=str), name)

    def log_artifact(self, path: Path, artifact_path: str | None = None) -> None:
        self.client.log_artifact(self.run_id, str(path), artifact_path)

    def log_artifacts(self, directory: Path, artifact_path: str) -> None:
        self.client.log_artifacts(self.run_id, str(directory), artifact_path)

    def has_artifact(self, path: str) -> bool:
        return bool(self.client.list_artifacts(self.run_id, path))

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
    def __init__(self, experiment: str | None = None):
        self.client = _client()
        self.experiment = experiment_name(experiment)

    def experiment_id(self) -> str:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is not None:
            if EXPERIMENT_KIND[0] not in found.tags:
                self.client.set_experiment_tag(found.experiment_id, *EXPERIMENT_KIND)
            return found.experiment_id
        location = None
        if "MLFLOW_TRACKING_URI" not in os.environ:  # the local default: artifacts in ./mlruns
            location = (Path.cwd() / "mlruns").as_uri()
        return self.client.create_experiment(self.experiment, artifact_location=location, tags=dict([EXPERIMENT_KIND]))

    def find_runs(self, tags: dict[str, str]) -> list[str]:
        """FINISHED runs of this experiment carrying all `tags`, newest first."""
        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            return []
        clauses = [f"tags.`{k}` = '{v}'" for k, v in tags.items()] + ["attributes.status = 'FINISHED'"]
        runs = self.client.search_runs([found.experiment_id], " and ".join(clauses), order_by=["attributes.start_time DESC"])
        return [r.info.run_id for r in runs]

    def existing(self, run_id: str) -> Run | None:
        """A handle on a finished run (e.g. to read it), or None if the store has no such run."""
        from mlflow.exceptions import MlflowException

        try:
            self.client.get_run(run_id)
        except MlflowException:
            return None
        return Run(self.client, run_id)

    def resume_run(self, run_id: str) -> Run:
        """Reopen a run to log a later stage into it; it ends FINISHED or FAILED like a new one."""
        self.client.update_run(run_id, status="RUNNING")
        return Run(self.client, run_id)

    def runs(self, tags: dict[str, str], run_ids: list[str] | None = None) -> list:
        """Runs of this experiment (or exactly `run_ids`, any experiment) with these tags, newest first."""
        if run_ids:
            return [self.client.get_run(run_id) for run_id in run_ids]
        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            return []
        clauses = [f"tags.`{k}` = '{v}'" for k, v in tags.items()] + ["attributes.status = 'FINISHED'"]
        return self.client.search_runs([found.experiment_id], " and ".join(clauses), order_by=["attributes.start_time DESC"])

    def runs_with_status(self, tags: dict[str, str], status: str) -> list:
        found = self.client.get_experiment_by_name(self.experiment)
        if found is None:
            return []
        clauses = [f"tags.`{k}` = '{v}'" for k, v in tags.items()] + [f"attributes.status = '{status}'"]
        return self.client.search_runs([found.experiment_id], " and ".join(clauses))

    def fail_run(self, run_id: str, reason: str, status: str = "FAILED") -> None:
        """End a run that nobody will finish (FAILED, or KILLED), with the reason as its error tag."""
        self.client.set_tag(run_id, TAG + "error", reason)
        self.client.set_terminated(run_id, status)

    def start_run(self, run_name: str, tags: dict[str, Any]) -> Run:
        run = self.client.create_run(
            self.experiment_id(), run_name=run_name, tags={k: str(v) for k, v in tags.items()}
        )
        return Run(self.client, run.info.run_id)


def flatten(data: dict[str, Any], prefix: str = "") -> dict[str, Any]:
    """{"quantize": {"group_size": 64}} -> {"quantize.group_size": 64}."""
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _param_value(value: Any) -> str:
    text = json.dumps(value) if isinstance(value, (list, tuple, dict)) else str(value)
    return text[:6000]


class Registry:
    """The MLflow Model Registry: versions of a registered model and the aliases that point at them."""

    def __init__(self):
        self.client = _client()

    def version_for_run(self, name: str, run_id: str):
        """The version already registered from this run, if any (re-gating does not duplicate it)."""
        found = self.client.search_model_versions(f"name = '{name}' and run_id = '{run_id}'")
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
