"""bench/results_table.py: docs/results.md's first table made from runs in a real MLflow store
(SQLite): the newest finished run per (device class, shipped recipe), its figures with intervals,
what is not measured on each class named, and the history below the markers left as it was."""

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # a new MLflow store and two processes: ~30 s
REPO = Path(__file__).resolve().parents[2]


def log_run(client, experiment, recipe, device, kld, *, status="FINISHED", suite="default", speed=None):
    run = client.create_run(experiment, tags={
        "quantbench.role": "candidate", "quantbench.recipe": recipe, "quantbench.suite": suite,
        "quantbench.base_model": "builtin:smollm2-135m-instruct", "quantbench.device": device,
        "quantbench.format": "compressed-tensors", **({"quantbench.bench_server": "vllm"} if speed else {}),
    })  # fmt: skip
    metrics = {"quality/kld_mean": kld, "quality/kld_mean.ci_low": kld * 0.9, "quality/kld_mean.ci_high": kld * 1.1,
               "model/size_mb": 108.7, "model/bits_per_weight": 4.31, "quality/top1_agreement": 0.8,
               "quality/flips_pct": 12.0}  # fmt: skip
    if speed:
        metrics |= {"speedup/decode_tok_s": speed, "speedup/decode_tok_s.ci_low": speed - 0.2,
                    "speedup/decode_tok_s.ci_high": speed + 0.2}  # fmt: skip
    for key, value in metrics.items():
        client.log_metric(run.info.run_id, key, value)
    client.set_terminated(run.info.run_id, status)
    time.sleep(0.01)  # start times order the runs
    return run.info.run_id


def test_the_table_takes_the_newest_finished_run_per_class_and_recipe(tmp_path):
    from mlflow.tracking import MlflowClient

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    client = MlflowClient(uri)
    experiment = client.create_experiment("results")
    log_run(client, experiment, "awq-int4", "CPU AVX2, 2 cores", 0.2)
    newer = log_run(client, experiment, "awq-int4", "CPU AVX2, 2 cores", 0.155, speed=1.77)
    log_run(client, experiment, "awq-int4", "CPU AVX2, 2 cores", 0.01, status="FAILED")  # never a failed run
    log_run(client, experiment, "fp8-dynamic", "CPU AMX, 2 cores", 0.03)
    log_run(client, experiment, "fp8-dynamic", "CPU AMX, 2 cores", 0.5, suite="cpu-smoke")  # another suite
    log_run(client, experiment, "not-shipped", "CPU AMX, 2 cores", 0.1)

    # a copy of the repository's script and docs, so --write touches the copy
    root = tmp_path / "repo"
    for sub in ("bench", "docs", "recipes"):
        (root / sub).mkdir(parents=True)
    shutil.copy(REPO / "bench" / "results_table.py", root / "bench")
    for name in ("awq-int4", "fp8-dynamic", "gptq-w4a16"):
        shutil.copy(REPO / "recipes" / f"{name}.yaml", root / "recipes")
    (root / "docs" / "results.md").write_text("# Measured results\n\nintro\n\n## 2026-12-01 a dated entry\n\nhistory\n")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO / "src")}
    for _ in range(2):  # the second time replaces the table between its markers
        done = subprocess.run([sys.executable, str(root / "bench" / "results_table.py"), "--store", uri, "--write"],
                              env=env, capture_output=True, text=True)  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    assert (summary["classes"], summary["rows"]) == (2, 2)

    text = (root / "docs" / "results.md").read_text()
    assert text.count("<!-- current-results:begin -->") == 1
    assert text.startswith("# Measured results\n\nintro\n\n<!-- current-results:begin -->")
    assert text.rstrip().endswith("## 2026-12-01 a dated entry\n\nhistory")
    amx, avx2 = text.split("### CPU AMX, 2 cores")[1].split("### CPU AVX2, 2 cores")
    assert "| awq-int4 | compressed-tensors | 108.7 | 4.31 | 0.155 [0.14, 0.171] | 0.800 | 12.0 | 1.77× [1.57, 1.97] (vllm) |" in avx2
    assert newer[:8] in avx2 and "0.01" not in avx2 and "| 0.2 [" not in avx2
    assert "| fp8-dynamic |" in amx and "| 0.03 [0.027, 0.033] |" in amx and "| 0.5 [" not in amx
    assert "not-shipped" not in text
    assert "Not measured on this class yet: awq-int4, gptq-w4a16." in amx
    assert "Not measured on this class yet: fp8-dynamic, gptq-w4a16." in avx2
