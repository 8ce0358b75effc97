"""Backends `openai` and `transformers` against real `transformers serve` processes on 127.0.0.1,
and their faults: refused connections, a server killed mid-run, a checkpoint the server cannot
load. No test leaves a server behind. (vLLM: tests/engines/test_vllm.py.)"""

import json
import os
import shutil
import signal
import threading
import time
from pathlib import Path

import psutil
import pytest
import transformers

from quantbench.cli import main
from quantbench.core.processes import free_port
from quantbench.engines.server import model_server
from tests.helpers import last_json, ours, runs

pytestmark = pytest.mark.slow  # real server processes

PROFILE = "prompt_tokens: [16]\noutput_tokens: 6\nconcurrency: [1, 2]\nrepetitions: 2\nwarmup: 1\n"
LONG = "prompt_tokens: [16]\noutput_tokens: 24\nconcurrency: [1, 3]\nrepetitions: 200\nwarmup: 0\n"


def servers() -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["cmdline"]):
        cmd = proc.info["cmdline"] or []
        if (any(part.endswith("transformers") for part in cmd) and "serve" in cmd) or \
                "vllm.entrypoints.openai.api_server" in cmd:
            found.append(proc)
    return ours(found)


@pytest.fixture
def profiles(workdir):
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "tiny.yaml").write_text(PROFILE)
    (workdir / "profiles" / "long.yaml").write_text(LONG)
    yield
    assert servers() == [], "a transformers serve process was left behind"



def test_transformers_engine_starts_measures_and_stops_both_servers(workdir, tiny_model_dir, profiles, capsys):
    args = ["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--engine", "transformers", "--profile", "tiny",
            "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    m = last_json(out)["metrics"]
    for key in ("ttft_ms_p50", "decode_tok_s", "itl_ms_p50", "e2e_ms_p95", "c2/throughput_tok_s", "c2/ttft_ms_p99",
                "c2/itl_ms_p50", "peak_mem_mb"):
        assert m["speed/" + key] > 0 and m["base_speed/" + key] > 0, key
    assert m["speed/peak_mem_mb"] > 100  # the server process: python, torch and the model
    assert "measured through: transformers serve" in out
    [run] = runs()
    assert run.info.status == "FINISHED" and run.data.tags["quantbench.bench_backend"] == "serve"
    assert run.data.tags["quantbench.bench_server"] == "transformers"
    assert servers() == []


def test_openai_engine_against_running_servers(workdir, tiny_model_dir, profiles, capsys):
    with model_server(tiny_model_dir, workdir / "a.log") as (url, _, _):
        args = ["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--engine", "openai",
                "--endpoint", url, "--base-endpoint", url, "--profile", "tiny", "--json"]
        assert main(args) == 0
    m = last_json(capsys.readouterr().out)["metrics"]
    assert m["speed/c2/requests_s"] > 0 and m["speedup/decode_tok_s"] > 0
    assert "speed/peak_mem_mb" not in m  # an endpoint's memory is not ours to read


def test_a_refused_connection_fails_at_once_with_the_url(workdir, tiny_model_dir, profiles, capsys):
    url = f"http://127.0.0.1:{free_port()}/v1"
    args = ["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--engine", "openai",
            "--endpoint", url, "--base-endpoint", url, "--profile", "tiny"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert f"--endpoint: cannot reach {url}" in err and "ConnectError" in err
    assert runs() == []


def test_a_server_killed_mid_run_fails_the_run_and_keeps_partial_results(workdir, tiny_model_dir, profiles, capsys):
    with model_server(tiny_model_dir, workdir / "a.log") as (url, _, pid):
        def kill_after_some_requests() -> None:  # a whole repetition of both is measured by then
            deadline = time.monotonic() + 300
            while (workdir / "a.log").read_text().count("POST /v1/completions") < 12 and time.monotonic() < deadline:
                time.sleep(0.1)
            os.killpg(pid, signal.SIGKILL)

        killer = threading.Thread(target=kill_after_some_requests)
        killer.start()
        args = ["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--engine", "openai",
                "--endpoint", url, "--base-endpoint", url, "--profile", "long"]
        code = main(args)
        killer.join()
    assert code == 1
    [run] = runs()
    assert run.info.status == "FAILED" and run.data.tags["quantbench.bench_partial"] == "true"
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    report = json.loads(Path(client.download_artifacts(run.info.run_id, "bench.json", str(workdir))).read_text())
    assert report["partial"] is True and "bench stopped part-way" in report["error"]
    assert report["samples"]["candidate"]["p16/ttft_ms"]["values"]  # what was measured before is kept


def test_a_checkpoint_the_server_cannot_load(workdir, tiny_model_dir, profiles, capsys, tmp_path):
    """A whole, readable weights file whose tensor does not match the config (a truncated file is
    refused before any run): transformers serve fails on it."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    args = ["bench", str(broken), "--base", str(tiny_model_dir), "--engine", "transformers", "--profile", "tiny"]
    assert main(args) == 2  # a torn file is refused before any server or run starts
    assert "is truncated or not safetensors" in capsys.readouterr().err and runs() == []

    tensors = load_file(tiny_model_dir / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :160].clone()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert main(args) == 1
    [run] = runs()
    assert run.info.status == "FAILED"
    assert f"transformers serve ({transformers.__version__}) could not serve {broken}" in run.data.tags["quantbench.error"]
