"""`quantbench stack`: the speedup ledger. Bad stack files refused with every problem at once and
nothing written; a stack on the tiny model measured end to end in-process (a recipe step run first
through the quantize pipeline, its quality read from that run); and through llama.cpp's server
(slow: the real build and llama-server processes)."""

import json
import math
import statistics
from pathlib import Path

import psutil
import pytest

from quantbench.cli import main
from tests.conftest import TINY_SUITE
from tests.helpers import last_json, runs, tiny_recipe, write_recipe

WORKLOAD = "workload:\n  prompt_tokens: 16\n  output_tokens: 4\n  requests: 2\n  repetitions: 3\n  warmup: 0\n"


def write_stack(workdir: Path, name: str, text: str) -> Path:
    (workdir / "stacks").mkdir(exist_ok=True)
    path = workdir / "stacks" / f"{name}.yaml"
    path.write_text(text)
    return path


def test_a_bad_stack_is_refused_with_every_problem_and_nothing_written(workdir, tiny_model_dir, capsys):
    write_stack(workdir, "bad", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: start, dtype: float32}\n"          # no engine: the naive start must name one
                "  - {name: again, concurrency: 1}\n"          # what the start already uses
                "  - {name: again, concurrency: 2}\n"          # a name given twice
                "  - {name: empty}\n"                          # changes nothing
                "  - {name: gguf, engine: llamacpp}\n")        # llama.cpp with float32 (kept from the start)  # fmt: skip
    assert main(["stack", "bad"]) == 2
    err = capsys.readouterr().err
    where = "stacks/bad.yaml"
    for expected in (
        f"{where}: steps.0 (start): the first step is the naive start: name its engine",
        f"{where}: steps.1 (again): concurrency: 1 is what the steps before it already use",
        f"{where}: steps.2.name: 'again' is also step 1's name",
        f"{where}: steps.3 (empty): changes nothing; set one of engine, dtype, model, concurrency",
        f"{where}: steps.4 (gguf): dtype float32: llama.cpp serves a model's own GGUF file",
    ):
        assert expected in err, err
    assert not (workdir / "mlflow.db").exists() or runs() == []


def test_every_shipped_stack_loads(monkeypatch):
    from quantbench.jobs import stack

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    shipped = sorted((repo / "stacks").glob("*.yaml"))
    assert shipped
    for path in shipped:
        loaded, configs = stack.load(path.stem)
        assert len(configs) == len(loaded.steps) and configs[0].engine == "hf"


def test_schema_errors_and_unknown_references_name_the_file_and_field(workdir, tiny_model_dir, capsys):
    write_stack(workdir, "schema", f"base: {tiny_model_dir}\nworkload:\n  repetitions: 2\nsteps:\n"
                "  - {name: start, engine: trt}\n  - {name: next, concurrency: 0}\n")  # fmt: skip
    assert main(["stack", "schema"]) == 2
    err = capsys.readouterr().err
    assert "stacks/schema.yaml: workload.repetitions: Input should be greater than or equal to 3" in err
    assert "stacks/schema.yaml: steps.0.engine: Value error, unknown engine 'trt'. Available: hf, transformers" in err
    assert "stacks/schema.yaml: steps.1.concurrency: Input should be greater than 0" in err
    assert main(["stack", "nosuch"]) == 2
    assert "stack: unknown stack 'nosuch'" in capsys.readouterr().err
    write_stack(workdir, "refs", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n  - {{name: start, engine: hf}}\n"
                "  - {name: a, model: run:0123456789abcdef0123456789abcdef}\n  - {name: b, model: recipe:nosuch}\n")  # fmt: skip
    assert main(["stack", "refs"]) == 2
    err = capsys.readouterr().err
    assert "model run:0123456789abcdef0123456789abcdef: MLflow run '0123456789abcdef0123456789abcdef' does not exist" in err
    assert "model recipe:nosuch:" in err and "nosuch" in err
    assert not (workdir / "outputs").exists() and runs() == []


@pytest.mark.slow  # a quantize job, then three steps measured in-process over 3 rounds
def test_an_in_process_stack_runs_its_recipe_first_and_logs_the_ledger(workdir, tiny_model_dir, capsys):
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    write_recipe(workdir, "tiny-gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n")
                 + "evaluate:\n  suite: tiny\n")  # fmt: skip
    write_stack(workdir, "tiny", f"description: the tiny model in-process\nbase: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: naive, engine: hf, dtype: float32}\n"
                "  - {name: batched, concurrency: 4}\n"
                "  - {name: int4, model: recipe:tiny-gptq}\n")  # fmt: skip
    (workdir / "policies").mkdir()
    (workdir / "policies" / "loose.yaml").write_text("max:\n  quality/kld_mean: 5\n  quality/flips_pct: 0.001\n"
                                                     "min:\n  speedup/decode_tok_s: 100\n")  # fmt: skip
    assert main(["stack", "tiny", "--json", "--policy", "loose"]) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    summary = last_json(out)
    steps = summary["steps"]
    assert [s["step"] for s in steps] == ["naive", "batched", "int4"]
    assert [s["concurrency"] for s in steps] == [1, 4, 4] and steps[2]["model"] == "recipe:tiny-gptq"
    assert steps[0]["multiplier"] == 1.0 and steps[0]["cumulative"] == pytest.approx(1.0)
    for s in steps:
        assert s["status"] == "measured" and s["throughput_tok_s"] > 0
    for s in steps[1:]:  # each multiplier is the ratio of the medians, with the paired rounds' interval
        low, high = s["multiplier_ci"]
        assert low <= high and low > 0
    for prev, s in zip(steps, steps[1:]):  # the median of the per-round ratios, rounds measured back to back
        assert len(s["throughputs"]) == 3 and s["throughput_tok_s"] == pytest.approx(statistics.median(s["throughputs"]))
        assert s["multiplier"] == pytest.approx(statistics.median(a / b for a, b in zip(s["throughputs"], prev["throughputs"])))
        assert s["cumulative"] == pytest.approx(
            statistics.median(a / b for a, b in zip(s["throughputs"], steps[0]["throughputs"])))
    assert summary["product"] == pytest.approx(math.prod(s["multiplier"] for s in steps))
    assert summary["direct"] == pytest.approx(steps[2]["cumulative"])
    # the recipe ran first, through the pipeline; the step's quality is that run's own evaluation
    [candidate] = [r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]
    assert candidate.data.tags["quantbench.recipe"] == "tiny-gptq" and candidate.info.status == "FINISHED"
    quality = steps[2]["quality"]
    assert quality["metric"] == "quality/kld_mean" and quality["value"] == candidate.data.metrics["quality/kld_mean"]
    assert steps[0]["quality"] is None and summary["policy"] == "loose"
    # the policy's quality limits only (its speed limit is the stack's business, not the model's)
    flips = candidate.data.metrics["quality/flips_pct"]
    assert steps[2]["policy_failed"] == ([] if flips <= 0.001 else ["quality/flips_pct"])
    assert steps[0]["policy_passed"] and steps[1]["policy_passed"]  # the base model itself
    # one parent run, a child run per step
    [parent] = [r for r in runs() if r.data.tags.get("quantbench.role") == "stack"]
    children = {r.data.tags["quantbench.stack_step"]: r for r in runs() if r.data.tags.get("quantbench.role") == "stack_step"}
    assert parent.info.run_id == summary["run_id"] and parent.info.status == "FINISHED"
    assert set(children) == {"0:naive", "1:batched", "2:int4"}
    for i, s in enumerate(steps):
        child = children[f"{i}:{s['step']}"]
        assert child.info.status == "FINISHED" and child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.metrics["speed/throughput_tok_s"] == pytest.approx(s["throughput_tok_s"])
        assert parent.data.metrics[f"stack/{s['step']}/multiplier"] == pytest.approx(s["multiplier"])
    assert children["2:int4"].data.tags["quantbench.stack_model_run"] == candidate.info.run_id
    assert parent.data.metrics["stack/product"] == pytest.approx(summary["product"])
    from mlflow import MlflowClient

    client = MlflowClient()
    names = {f.path for f in client.list_artifacts(parent.info.run_id)}
    assert {"stack.json", "stack.md", "stack_waterfall.png"} <= names
    ledger = Path(client.download_artifacts(parent.info.run_id, "stack.md", str(workdir))).read_text()
    assert "| naive" in ledger and "× cumulative" in ledger and "product of the step multipliers" in ledger
    assert "× step" in out and "int4" in out and "measured on: " in out and summary["device"] in out
    # run again: the recipe's run is reused, not quantized a second time
    assert main(["stack", "tiny", "--json"]) == 0
    assert len([r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]) == 1
    json.loads(capsys.readouterr().out.strip().splitlines()[-1])


@pytest.mark.slow  # the real llama.cpp (built on first use) and llama-server processes
@pytest.mark.llamacpp
def test_a_stack_through_llama_server_stops_every_server(workdir, tmp_path_factory, capsys):
    from tests import gguf_files as gg

    tiny_gguf = gg.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gg.gpt2_bpe_vocab(400, add_bos=False))
    write_recipe(workdir, "tiny-q8", f"model:\n  source: {tiny_gguf}\n  dtype: float32\nquantize:\n  method: gguf\n"
                 "  type: Q8_0\ncheck:\n  base_ppl_bound: false\n  ppl_tokens: 512\n  window: 128\n")  # fmt: skip
    write_stack(workdir, "llama", f"base: {tiny_gguf}\n{WORKLOAD}steps:\n"
                "  - {name: naive, engine: hf, dtype: float32}\n"
                "  - {name: server, engine: llamacpp, dtype: auto}\n"
                "  - {name: q8, model: recipe:tiny-q8}\n"
                "  - {name: batched, concurrency: 2}\n")  # fmt: skip
    assert main(["stack", "llama", "--json"]) == 0, capsys.readouterr().err[-3000:]
    summary = last_json(capsys.readouterr().out)
    steps = {s["step"]: s for s in summary["steps"]}
    assert all(s["status"] == "measured" and s["throughput_tok_s"] > 0 for s in steps.values())
    assert steps["server"]["engine"] == "llamacpp" and steps["q8"]["quality"]["metric"] == "check/ppl_ratio"
    assert 0.9 < steps["q8"]["quality"]["value"] < 1.1  # Q8_0: the reload check's ratio, from its run
    assert [p for p in psutil.process_iter(["name"]) if p.info["name"] == "llama-server"] == []
    [parent] = [r for r in runs() if r.data.tags.get("quantbench.role") == "stack"]
    from mlflow import MlflowClient

    servers = {f.path for f in MlflowClient().list_artifacts(parent.info.run_id, "servers")}
    assert len(servers) == 2  # the base's F16 file and the Q8_0 checkpoint, one server each
