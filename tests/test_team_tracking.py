"""The team path for real: an MLflow tracking server on 127.0.0.1 backed by PostgreSQL, with
artifacts in an S3-compatible object store (moto's S3 server), and every command against it:
sweep (quantize + evaluate + bench in child processes), evaluate, bench, compare, gate.

PostgreSQL comes from the environment: QUANTBENCH_TEST_POSTGRES names a server where the tests
may create a database (`.ci/run` installs Debian's PostgreSQL, starts it and sets it). The tests
create their own database, object store and MLflow server, and stop and drop them afterwards."""

import json
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
from quantbench.processes import free_port, stop_group

from tests.conftest import TINY_PROFILE, TINY_SUITE
from tests.helpers import last_json, tiny_recipe, write_recipe

pytestmark = pytest.mark.slow  # PostgreSQL, an S3 server and an MLflow server

POSTGRES = os.environ.get("QUANTBENCH_TEST_POSTGRES")
if not POSTGRES:
    if os.environ.get("CI"):
        raise RuntimeError("CI needs PostgreSQL for the team-tracking test: .ci/run sets QUANTBENCH_TEST_POSTGRES")
    pytest.skip("set QUANTBENCH_TEST_POSTGRES=postgresql://USER:PASS@127.0.0.1:5432/postgres to run the team-tracking "
                "tests (see .ci/run)", allow_module_level=True)

S3_ENV = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{url} did not come up:\n{log.read_text()[-3000:]}")
            time.sleep(0.5)


@pytest.fixture(scope="module")
def team_server(tmp_path_factory):
    import boto3
    import psycopg

    tmp = tmp_path_factory.mktemp("team")
    database = f"qb_test_{uuid.uuid4().hex[:12]}"
    with psycopg.connect(POSTGRES, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{database}"')
    backend = POSTGRES.rsplit("/", 1)[0] + f"/{database}"
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
        yield {"uri": uri, "s3": s3, "database": database, "procs": procs}
    finally:
        for proc in reversed(procs):
            stop_group(proc, 20)
        with psycopg.connect(POSTGRES, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')



def test_every_command_against_postgres_and_s3(team_server, workdir, tiny_model_dir, monkeypatch, capsys):
    from mlflow.tracking import MlflowClient

    monkeypatch.setenv("MLFLOW_TRACKING_URI", team_server["uri"])
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "team")
    for sub, name, body in (("suites", "tiny", TINY_SUITE), ("profiles", "tiny", TINY_PROFILE)):
        (workdir / sub).mkdir()
        (workdir / sub / f"{name}.yaml").write_text(body)
    write_recipe(workdir, "fp8", tiny_recipe(tiny_model_dir, "method: fp8\n") + "evaluate:\n  suite: tiny\nbench:\n  profile: tiny\n  backend: hf\n")
    (workdir / "sweeps").mkdir()
    (workdir / "sweeps" / "team.yaml").write_text(yaml.safe_dump({"recipes": ["fp8"], "retries": 0}))

    assert main(["sweep", "team", "--json"]) == 0  # quantize + evaluate + bench, in a child process
    summary = last_json(capsys.readouterr().out)
    [job] = summary["jobs"]
    run_id = job["run_id"]
    assert job["status"] == "finished" and job["metrics"]["speedup/decode_tok_s"] > 0
    assert main(["evaluate", run_id, "--suite", "tiny"]) == 0  # baseline reused from the server's artifacts
    assert "(reused)" in capsys.readouterr().out
    assert main(["bench", run_id, "--profile", "tiny", "--backend", "hf"]) == 0
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

    with psycopg.connect(POSTGRES.rsplit("/", 1)[0] + f"/{team_server['database']}") as conn:
        statuses = dict(conn.execute("select status, count(*) from runs group by status").fetchall())
    assert statuses.get("RUNNING", 0) == 0 and statuses["FINISHED"] >= 4  # candidate, baseline, sweep parent, compare
