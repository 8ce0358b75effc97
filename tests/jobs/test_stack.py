"""`quantbench stack`: the speedup ledger. Bad stack files refused with every problem at once and
nothing written; a stack on the tiny model measured end to end in-process (a recipe step run first
through the quantize pipeline, its quality read from that run); and through llama.cpp's server
(slow: the real build and llama-server processes)."""

import math
import statistics
from pathlib import Path

import psutil
import pytest

from quantbench.cli import main
from tests.conftest import TINY_PROFILE, TINY_SUITE
from tests.helpers import last_json, ours, runs, tiny_recipe, write_recipe

WORKLOAD = "workload:\n  prompt_tokens: 16\n  output_tokens: 4\n  requests: 2\n  repetitions: 3\n  warmup: 0\n"


def write_stack(workdir: Path, name: str, text: str) -> Path:
    (workdir / "stacks").mkdir(exist_ok=True)
    path = workdir / "stacks" / f"{name}.yaml"
    path.write_text(text)
    return path


def write_tiny_gptq(workdir: Path, model_dir: Path, bench: bool = False) -> None:
    """recipes/tiny-gptq.yaml (GPTQ INT4 on the tiny model, evaluated with the tiny suite; with
    `bench`, a bench section too) and what it names."""
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    sections = "evaluate:\n  suite: tiny\n"
    if bench:
        (workdir / "profiles").mkdir()
        (workdir / "profiles" / "tiny.yaml").write_text(TINY_PROFILE)
        sections += "bench:\n  profile: tiny\n  engine: hf\n"
    write_recipe(workdir, "tiny-gptq", tiny_recipe(model_dir, "method: gptq\ngroup_size: 32\n") + sections)


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
        f"{where}: steps.0 (start, line 9): the first step is the naive start: name its engine",
        f"{where}: steps.1 (again, line 10): concurrency: 1 is what the steps before it already use",
        f"{where}: steps.2.name (line 11): 'again' is also step 1's name",
        f"{where}: steps.3 (empty, line 12): changes nothing; set one of engine, dtype, model, concurrency",
        f"{where}: steps.4 (gguf, line 13): dtype float32: llama.cpp serves a model's own GGUF file",
    ):
        assert expected in err, err
    assert not (workdir / "mlflow.db").exists() or runs() == []


def test_a_source_must_name_an_earlier_model_step_of_a_recipe_step(workdir, tiny_model_dir, capsys):
    from quantbench.core.errors import UserError
    from quantbench.jobs.stack import schema

    write_stack(workdir, "src", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: start, engine: hf, source: later}\n"             # the first step has nothing before it
                "  - {name: student, model: run:0123456789abcdef0123456789abcdef}\n"
                "  - {name: dir, model: /some/dir, source: student}\n"       # source: only for a recipe
                "  - {name: fwd, model: recipe:tiny-a, source: later}\n"     # not an earlier step
                "  - {name: basic, model: recipe:tiny-b, source: start}\n"   # the base model: say nothing
                "  - {name: later, concurrency: 2}\n")  # fmt: skip
    assert main(["stack", "src"]) == 2
    err = capsys.readouterr().err
    for expected in (
        "steps.0 (start, line 9): source: the first step is the naive start; it names no earlier step's model",
        "steps.2 (dir, line 11): source: names the model a recipe starts from; it needs model: recipe:NAME",
        "steps.3 (fwd, line 12): source: 'later' is not an earlier step. Available: dir, start, student",
        "steps.4 (basic, line 13): source: step 'start' serves the base model, which a recipe starts from anyway",
    ):
        assert expected in err, err
    # the same recipe on the base and on a student are two models; on the same source, one
    write_recipe(workdir, "tiny-gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n"))
    write_stack(workdir, "ok", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: start, engine: hf}\n"
                "  - {name: int4, model: recipe:tiny-gptq}\n"
                "  - {name: student, model: run:0123456789abcdef0123456789abcdef}\n"
                "  - {name: student-int4, model: recipe:tiny-gptq, source: student}\n"
                "  - {name: again, model: recipe:tiny-gptq, source: student}\n")  # fmt: skip
    with pytest.raises(UserError) as refused:
        schema.load("ok")
    assert refused.value.problems == [
        "stacks/ok.yaml: steps.4 (again, line 13): model: recipe:tiny-gptq is what the steps before it already use; "
        "a step must add something"
    ]
    write_stack(workdir, "ok", (workdir / "stacks" / "ok.yaml").read_text().rsplit("  - {name: again", 1)[0])
    _, configs = schema.load("ok")
    assert [c.model_key for c in configs] == [None, "recipe:tiny-gptq", "run:0123456789abcdef0123456789abcdef",
                                              "recipe:tiny-gptq@run:0123456789abcdef0123456789abcdef"]
    assert schema.adds(schema.load("ok")[0].steps[3], 3) == "model recipe:tiny-gptq of student"
    # a draft: an earlier step's name stands for its model; only an engine that drafts takes one
    write_stack(workdir, "drafts", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: start, engine: hf}\n"
                "  - {name: in-process, draft: start}\n"
                f"  - {{name: server, engine: llamacpp, draft: {tiny_model_dir}}}\n"
                f"  - {{name: same, draft: {tiny_model_dir}}}\n"
                "  - {name: back, engine: hf}\n"            # the draft kept, on an engine that takes none
                "  - {name: more, concurrency: 2}\n")  # fmt: skip
    with pytest.raises(UserError) as refused:
        schema.load("drafts")
    assert refused.value.problems == [
        f"stacks/drafts.yaml: steps.3 (same, line 12): draft: {tiny_model_dir} is what the steps before it already "
        "use; a step must add something",
        "stacks/drafts.yaml: steps.1 (in-process, line 10): draft: speculative decoding through in-process transformers "
        "generate: not offered through quantbench for this engine; a draft step needs engine vllm or llamacpp",
        "stacks/drafts.yaml: steps.4 (back, line 13): draft: speculative decoding through in-process transformers "
        "generate: not offered through quantbench for this engine; a draft step needs engine vllm or llamacpp",
    ]  # said where the draft meets such an engine, not again for the step after
    # a KV cache in a smaller type: only on an engine that takes that type
    write_stack(workdir, "kv", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: start, engine: hf}\n"
                "  - {name: kv-here, kv_cache: q8_0}\n"
                "  - {name: server, engine: llamacpp}\n"           # takes q8_0
                "  - {name: kv-odd, kv_cache: q9_0}\n")  # fmt: skip
    with pytest.raises(UserError) as refused:
        schema.load("kv")
    why = "; a kv_cache step needs engine llamacpp (q8_0, q4_0, ...: its quality is scored with llama.cpp's tools)"
    assert refused.value.problems == [
        "stacks/kv.yaml: steps.1 (kv-here, line 10): kv_cache q8_0: in-process transformers generate takes no KV-cache type "
        "through quantbench" + why,
        "stacks/kv.yaml: steps.3 (kv-odd, line 12): kv_cache q9_0: llama.cpp takes f16, bf16, q8_0, q5_1, q5_0, iq4_nl, q4_1, "
        "q4_0" + why,
    ]
    # vLLM takes an FP8 KV cache in bench profiles; a stack could not score its quality
    write_stack(workdir, "kvv", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: start, engine: hf}\n"
                "  - {name: vllm, engine: vllm, kv_cache: fp8}\n")  # fmt: skip
    with pytest.raises(UserError) as refused:
        schema.load("kvv")
    assert refused.value.problems == ["stacks/kvv.yaml: steps.1 (vllm, line 10): kv_cache fp8: vLLM takes fp8, fp8_e4m3, fp8_e5m2" + why]


def test_rate_and_prefix_cache_steps_need_a_server_and_a_shared_prefix(workdir, tiny_model_dir, capsys):
    from quantbench.core.errors import UserError
    from quantbench.jobs.stack import schema
    from quantbench.jobs.stack.measure import shared_prefix_prompts

    write_stack(workdir, "load", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: start, engine: hf}\n"
                "  - {name: arrivals, rate: 2}\n"                 # open loop in-process: no server
                "  - {name: cached, prefix_cache: true}\n"        # no prefix cache in-process, nor a shared prefix
                "  - {name: server, engine: llamacpp}\n")  # fmt: skip
    with pytest.raises(UserError) as refused:
        schema.load("load")
    assert refused.value.problems == [
        "stacks/load.yaml: steps.1 (arrivals, line 10): rate 2: requests arriving at a rate need a server; in-process "
        "transformers generate runs in-process (one batched generate)",
        "stacks/load.yaml: steps.2 (cached, line 11): prefix_cache: in-process transformers generate does not turn its prefix "
        "cache on and off per request; a prefix_cache step needs engine vllm or llamacpp",
        "stacks/load.yaml: steps.2 (cached, line 11): prefix_cache: the workload's prompts share no prefix, so there is nothing "
        "to reuse; set workload.prefix_tokens (e.g. 96 of 128: a system prompt)",
    ]  # each said once, where it meets the engine (not again for the steps after)
    write_stack(workdir, "long", f"base: {tiny_model_dir}\nworkload:\n  prompt_tokens: 16\n  prefix_tokens: 16\n"
                "steps:\n  - {name: start, engine: hf}\n  - {name: more, concurrency: 2}\n")  # fmt: skip
    assert main(["stack", "long"]) == 2
    assert "stacks/long.yaml: workload (line 2): prefix_tokens 16: the shared prefix is part of each prompt and " \
           "must be shorter than prompt_tokens (16)" in capsys.readouterr().err  # fmt: skip
    # a rate keeps the slots of the concurrency before it; a later concurrency goes back to closed loop
    prefix = WORKLOAD.replace("prompt_tokens: 16", "prompt_tokens: 16\n  prefix_tokens: 12")
    write_stack(workdir, "ok", f"base: {tiny_model_dir}\n{prefix}steps:\n"
                "  - {name: start, engine: hf}\n"
                "  - {name: server, engine: llamacpp, concurrency: 4}\n"
                "  - {name: cached, prefix_cache: true}\n"
                "  - {name: arrivals, rate: 2.5}\n"
                "  - {name: closed, concurrency: 8}\n")  # fmt: skip
    loaded, configs = schema.load("ok")
    assert [(c.concurrency, c.rate, c.prefix_cache, c.level) for c in configs] == [
        (1, None, False, "c1"), (4, None, False, "c4"), (4, None, True, "c4"), (4, 2.5, True, "r2.5"),
        (8, None, True, "c8")]  # fmt: skip
    assert schema.adds(loaded.steps[3], 3) == "rate 2.5/s" and schema.adds(loaded.steps[2], 2) == "prefix cache on"
    # every prompt starts with the same 12 tokens and goes on with 4 of its own
    ids = list(range(1000))
    rows = shared_prefix_prompts(ids, loaded.workload, 6)
    assert all(len(r) == 16 and r[:12] == rows[0][:12] for r in rows)
    assert len({tuple(r[12:]) for r in rows}) == 6
    assert len({tuple(r[:12]) for r in shared_prefix_prompts(ids, schema.Workload(prompt_tokens=16), 6)}) == 6


def test_every_shipped_stack_loads(monkeypatch):
    from quantbench.jobs.stack import schema

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.chdir(repo)
    shipped = sorted((repo / "stacks").glob("*.yaml"))
    assert shipped
    for path in shipped:
        loaded, configs = schema.load(path.stem)
        assert len(configs) == len(loaded.steps) and configs[0].engine == "hf"


def test_schema_errors_and_unknown_references_name_the_file_and_field(workdir, tiny_model_dir, capsys):
    write_stack(workdir, "schema", f"base: {tiny_model_dir}\nworkload:\n  repetitions: 2\nsteps:\n"
                "  - {name: start, engine: trt}\n  - {name: next, concurrency: 0}\n")  # fmt: skip
    assert main(["stack", "schema"]) == 2
    err = capsys.readouterr().err
    assert "stacks/schema.yaml: workload.repetitions (line 3): Input should be greater than or equal to 3" in err
    assert "stacks/schema.yaml: steps.0.engine (line 5): unknown engine 'trt'. Available: vllm, transformers, llamacpp, hf" in err
    assert "stacks/schema.yaml: steps.1.concurrency (line 6): Input should be greater than 0" in err
    assert main(["stack", "nosuch"]) == 2
    assert "stack: unknown stack 'nosuch'" in capsys.readouterr().err
    write_stack(workdir, "refs", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n  - {{name: start, engine: hf}}\n"
                "  - {name: a, model: run:0123456789abcdef0123456789abcdef}\n  - {name: b, model: recipe:nosuch}\n")  # fmt: skip
    assert main(["stack", "refs"]) == 2
    err = capsys.readouterr().err
    # the store and the recipes are asked in the same pass
    assert "steps.1 (a, line 10): model: MLflow run '0123456789abcdef0123456789abcdef' does not exist" in err
    assert "steps.2 (b, line 11): model: unknown recipe 'nosuch'" in err
    assert not (workdir / "outputs").exists() and runs() == []



def test_a_stack_file_is_checked_like_a_recipe_every_problem_with_its_line(workdir, tiny_model_dir, capsys):
    """Schema errors do not hide the steps' checks; every problem has its line; the models and drafts
    the steps name are resolved in the same pass (an unknown recipe, a draft that is no earlier step
    nor a model, each with its close match); nothing is written."""
    write_recipe(workdir, "tiny-gptq", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n"))
    write_stack(workdir, "all", f"base: {tiny_model_dir}\n"
                "workload:\n  repetitions: 2\n"                      # line 3: schema
                "steps:\n"
                "  - {name: start, engine: hf}\n"
                "  - {name: fast, concurrency: 0}\n"                 # line 6: schema (its step checks left out)
                "  - {name: int4, model: recipe:tiny-gtpq}\n"        # line 7: no such recipe
                "  - {name: spec, engine: llamacpp, draft: strat}\n"  # line 8: no such step or model
                "  - {name: odd, model: ghost-dir}\n"                # line 9: no such directory
                "  - name: empty\n"                                  # line 10: changes nothing
                "    bogus: 1\n")  # fmt: skip
    assert main(["stack", "all"]) == 2
    err = capsys.readouterr().err
    where = "error: stacks/all.yaml"
    for expected in (
        f"{where}: workload.repetitions (line 3): Input should be greater than or equal to 3 (got 2)",
        f"{where}: steps.1.concurrency (line 6): Input should be greater than 0 (got 0)",
        f"{where}: steps.5.bogus (line 11): unknown key 'bogus'. Available: concurrency, draft, dtype, engine, kv_cache, "
        "model, name, prefix_cache, rate, source",
        f"{where}: steps.2 (int4, line 7): model: unknown recipe 'tiny-gtpq' (no recipes/tiny-gtpq.yaml). Did you "
        "mean 'tiny-gptq'? Available: tiny-gptq",
        f"{where}: steps.3 (spec, line 8): draft: 'strat' is neither an earlier step's name, run:ID, recipe:NAME nor "
        "a checkpoint directory. Did you mean 'start'? Available: fast, int4, start",
        f"{where}: steps.4 (odd, line 9): model: 'ghost-dir' is neither run:ID, recipe:NAME nor a checkpoint "
        "directory (no such path)",
    ):
        assert expected + "\n" in err, err
    assert "steps.1 (fast" not in err  # a step with a schema problem is not also said to change nothing
    assert "steps.5 (empty" not in err  # nor one whose key is unknown
    assert not (workdir / "outputs").exists() and runs() == []

@pytest.mark.slow  # a quantize job, then three steps measured in-process over 3 rounds
def test_an_in_process_stack_runs_its_recipe_first_and_logs_the_ledger(workdir, tiny_model_dir, tiny128_model_dir,
                                                                      capsys):
    write_tiny_gptq(workdir, tiny_model_dir, bench=True)
    write_stack(workdir, "tiny", f"description: the tiny model in-process\nbase: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: naive, engine: hf, dtype: float32}\n"
                "  - {name: batched, concurrency: 4}\n"
                "  - {name: int4, model: recipe:tiny-gptq}\n"
                f"  - {{name: student, model: {tiny128_model_dir}}}\n"     # another model (same tokenizer)
                "  - {name: student-int4, model: recipe:tiny-gptq, source: student}\n")  # fmt: skip
    (workdir / "policies").mkdir()
    (workdir / "policies" / "loose.yaml").write_text("max:\n  quality/kld_mean: 5\n  quality/flips_pct: 0.001\n"
                                                     "min:\n  speedup/decode_tok_s: 100\n")  # fmt: skip
    assert main(["stack", "tiny", "--json", "--policy", "loose"]) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    summary = last_json(out)
    steps = summary["steps"]
    assert [s["step"] for s in steps] == ["naive", "batched", "int4", "student", "student-int4"]
    assert [s["concurrency"] for s in steps] == [1, 4, 4, 4, 4] and steps[2]["model"] == "recipe:tiny-gptq"
    assert steps[4]["model"] == f"recipe:tiny-gptq of {tiny128_model_dir}"
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
    assert summary["direct"] == pytest.approx(steps[-1]["cumulative"])
    # the recipe ran first, through the pipeline, once from the base and once from the student (in
    # that order); the step's quality is that run's own evaluation
    made = {r.data.tags["quantbench.base_model"]: r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"}
    assert set(made) == {str(tiny_model_dir), str(tiny128_model_dir)}
    candidate, of_student = made[str(tiny_model_dir)], made[str(tiny128_model_dir)]
    assert candidate.data.tags["quantbench.recipe"] == "tiny-gptq" and candidate.info.status == "FINISHED"
    assert of_student.data.tags["quantbench.recipe"] == "tiny-gptq" and of_student.info.status == "FINISHED"
    for run in made.values():  # the stack measures speed itself: the recipe's bench stage is left out
        assert not any(k.startswith(("speed/", "speedup/")) for k in run.data.metrics)
    # its run measured the student quantized against the student; the stack scores it against the
    # base (an evaluation in transformers with the suite its run used), with intervals, as its run would
    chained = steps[4]["quality"]
    assert chained["metric"] == "quality/kld_mean" and chained["ci"][0] <= chained["value"] <= chained["ci"][1]
    assert chained["value"] > of_student.data.metrics["quality/kld_mean"]  # the student is another model
    assert set(steps[4]["policy_failed"]) <= {"quality/kld_mean", "quality/flips_pct"}
    assert steps[3]["quality"] is None and steps[3]["policy_failed"] == ["no quantbench run: quality unknown"]
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
    assert set(children) == {"0:naive", "1:batched", "2:int4", "3:student", "4:student-int4"}
    for i, s in enumerate(steps):
        child = children[f"{i}:{s['step']}"]
        assert child.info.status == "FINISHED" and child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.data.metrics["speed/throughput_tok_s"] == pytest.approx(s["throughput_tok_s"])
        assert parent.data.metrics[f"stack/{s['step']}/multiplier"] == pytest.approx(s["multiplier"])
    assert children["2:int4"].data.tags["quantbench.stack_model_run"] == candidate.info.run_id
    assert children["4:student-int4"].data.tags["quantbench.stack_model_run"] == of_student.info.run_id
    assert parent.data.metrics["stack/product"] == pytest.approx(summary["product"])
    from mlflow import MlflowClient

    client = MlflowClient()
    names = {f.path for f in client.list_artifacts(parent.info.run_id)}
    assert {"stack.json", "stack.md", "stack_waterfall.png"} <= names
    ledger = Path(client.download_artifacts(parent.info.run_id, "stack.md", str(workdir))).read_text()
    assert "| naive" in ledger and "× cumulative" in ledger and "product of the step multipliers" in ledger
    assert "× step" in out and "int4" in out and "measured on: " in out and summary["device"] in out
    # run again: the recipe's runs are reused, not quantized a second time
    assert main(["stack", "tiny", "--json"]) == 0
    assert len([r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]) == 2
    again = last_json(capsys.readouterr().out)
    # compare the two stack runs: their ledgers side by side, step by step, in a summary run
    assert main(["compare", "--runs", summary["run_id"], again["run_id"], "--json"]) == 0
    out = capsys.readouterr().out
    compared = last_json(out)
    assert [st["run_id"] for st in compared["stacks"]] == [summary["run_id"], again["run_id"]]
    for st, ledger_of in zip(compared["stacks"], (summary, again)):
        assert [s["multiplier"] for s in st["steps"]] == pytest.approx([s["multiplier"] for s in ledger_of["steps"]])
    table = out.split("\n{")[0]
    row = next(line for line in table.splitlines() if line.startswith("| int4"))
    for ledger_of in (summary, again):  # each stack's own multipliers in the int4 row
        assert f"{ledger_of['steps'][2]['cumulative']:.2f}×" in row
    assert f"tiny ({summary['run_id'][:8]}): last step over the first, measured directly {summary['direct']:.2f}×" in table
    [summary_run] = [r for r in runs() if r.data.tags.get("quantbench.role") == "summary"]
    assert summary_run.data.tags["quantbench.compared_runs"] == f"{summary['run_id']},{again['run_id']}"
    assert (workdir / "outputs" / "compare" / summary_run.info.run_id / "stacks.md").read_text().count("| student ") == 1
    # a stack beside a candidate, or with candidate axes: refused, nothing written
    assert main(["compare", "--runs", summary["run_id"], candidate.info.run_id]) == 2
    assert f"--runs: '{candidate.info.run_id}' is a candidate run; stacks are compared with stacks" in capsys.readouterr().err
    assert main(["compare", "--runs", summary["run_id"], "--speed", "speed/decode_tok_s"]) == 2
    assert "stacks are compared step by step" in capsys.readouterr().err
    assert len([r for r in runs() if r.data.tags.get("quantbench.role") == "summary"]) == 1


@pytest.mark.slow  # a quantize job, then three steps and the best subset measured in-process
def test_best_finds_the_fastest_passing_subset_and_measures_it(workdir, tiny_model_dir, capsys):
    write_tiny_gptq(workdir, tiny_model_dir)
    write_stack(workdir, "best", f"base: {tiny_model_dir}\n{WORKLOAD}steps:\n"
                "  - {name: naive, engine: hf, dtype: float32}\n"
                "  - {name: int4, model: recipe:tiny-gptq}\n"
                "  - {name: batched, concurrency: 4}\n")  # fmt: skip
    (workdir / "policies").mkdir()
    (workdir / "policies" / "exact.yaml").write_text("max:\n  quality/kld_mean: 0.0\n")  # only the base passes
    assert main(["stack", "best", "--best"]) == 2
    assert "--best: the fastest stack that passes what? Name the policy too" in capsys.readouterr().err
    assert main(["stack", "best", "--policy", "exact", "--best", "--json"]) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    summary = last_json(out)
    steps = {s["step"]: s for s in summary["steps"]}
    assert steps["int4"]["policy_failed"] == ["quality/kld_mean"] and steps["batched"]["policy_passed"] is False
    # the INT4 model fails: the fastest passing stack is the start with batching alone, a configuration
    # no step measured (batching was measured on the INT4 model), so it is measured now
    best = summary["best"]
    assert best["steps"] == ["naive", "batched"] and best["measured_as"] == "measured now"
    assert best["predicted_cumulative"] == pytest.approx(steps["batched"]["multiplier"])
    assert best["cumulative"] > 0 and best["cumulative_ci"][0] <= best["cumulative"] <= best["cumulative_ci"][1]
    assert "fastest stack passing exact: naive → batched" in out
    [parent] = [r for r in runs() if r.data.tags.get("quantbench.role") == "stack"]
    assert parent.data.metrics["stack/best_cumulative"] == pytest.approx(best["cumulative"])
    # a lax policy: every model passes, and the best subset is one of the stack's own steps
    (workdir / "policies" / "lax.yaml").write_text("max:\n  quality/kld_mean: 100\n")
    assert main(["stack", "best", "--policy", "lax", "--best", "--json"]) == 0
    summary = last_json(capsys.readouterr().out)
    rows = {s["step"]: s for s in summary["steps"]}
    options = {("naive",): 1.0, ("naive", "int4"): rows["int4"]["multiplier"],
               ("naive", "batched"): rows["batched"]["multiplier"],
               ("naive", "int4", "batched"): rows["int4"]["multiplier"] * rows["batched"]["multiplier"]}  # fmt: skip
    winner = max(options, key=options.get)
    assert tuple(summary["best"]["steps"]) == winner
    assert summary["best"]["predicted_cumulative"] == pytest.approx(options[winner])
    if winner in (("naive", "int4"), ("naive", "int4", "batched")):
        assert summary["best"]["measured_as"] == winner[-1]
        assert summary["best"]["cumulative"] == pytest.approx(rows[winner[-1]]["cumulative"])


@pytest.mark.slow  # the real llama.cpp (built on first use) and llama-server processes
@pytest.mark.llamacpp
def test_a_stack_through_llama_server_stops_every_server(workdir, tmp_path_factory, capsys):
    from quantbench.sources import models
    from tests import gguf_files as gg

    vocab = gg.gpt2_bpe_vocab(400, add_bos=False)
    # attention heads of 32 (2 of the hidden 64): whole blocks of an 8-bit KV cache
    tiny_gguf = gg.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", vocab, heads=2, kv_heads=1)
    # a "student": one layer, other weights, the same vocabulary (as an HF directory)
    student = models.resolve(str(gg.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "student.gguf", vocab,
                                                    layers=1, seed=1, std=0.2, heads=2, kv_heads=1))).path  # fmt: skip
    write_recipe(workdir, "tiny-q8", f"model:\n  source: {tiny_gguf}\n  dtype: float32\nquantize:\n  method: gguf\n"
                 "  type: Q8_0\ncheck:\n  base_ppl_bound: false\n  ppl_tokens: 512\n  window: 128\n")  # fmt: skip
    write_stack(workdir, "llama", f"base: {tiny_gguf}\n{WORKLOAD}steps:\n"
                "  - {name: naive, engine: hf, dtype: float32}\n"
                "  - {name: server, engine: llamacpp, dtype: auto}\n"
                "  - {name: self-draft, draft: server}\n"       # the base model drafting for itself
                "  - {name: q8, model: recipe:tiny-q8}\n"
                "  - {name: kv8, kv_cache: q8_0}\n"
                "  - {name: batched, concurrency: 2}\n"
                f"  - {{name: student, model: {student}}}\n"
                "  - {name: student-q8, model: recipe:tiny-q8, source: student}\n")  # fmt: skip
    assert main(["stack", "llama", "--json"]) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    summary = last_json(out)
    steps = {s["step"]: s for s in summary["steps"]}
    assert all(s["status"] == "measured" and s["throughput_tok_s"] > 0 for s in steps.values())
    assert steps["server"]["engine"] == "llamacpp" and steps["q8"]["quality"]["metric"] == "check/ppl_ratio"
    # speculative decoding through llama-server: llama.cpp's own counts of drafted and accepted tokens;
    # a model drafting for itself (greedy) has most of its drafts accepted, and every later step keeps the draft
    assert steps["server"]["draft"] is None
    assert steps["self-draft"]["draft"] == "base" and 0.5 < steps["self-draft"]["spec_acceptance"] <= 1
    assert all(steps[n]["draft"] == "base" and 0 <= steps[n]["spec_acceptance"] <= 1
               for n in ("q8", "kv8", "batched", "student", "student-q8"))  # fmt: skip
    # the Q8_0 model served with an 8-bit KV cache: its quality against the base through llama.cpp
    # with that cache (a KL divergence, small: 8-bit weights and cache); every later step keeps the cache
    kv8 = steps["kv8"]["quality"]
    assert kv8["metric"] == "quality_engine/kld_mean" and kv8["label"] == "KLD (llama.cpp, q8_0 KV cache)"
    assert 0 <= kv8["value"] < 0.05 and all(steps[n]["kv_cache"] == "q8_0" for n in ("kv8", "batched", "student"))
    assert "· KV q8_0" in out
    assert "· draft base (accepted" in out
    assert 0.9 < steps["q8"]["quality"]["value"] < 1.1  # Q8_0: the reload check's ratio, from its run
    # the student quantized: its run measured it against the student; the stack scores it against
    # the base through llama-perplexity (another model: a KL divergence well above Q8_0's rounding)
    chained = steps["student-q8"]["quality"]
    assert chained["metric"] == "quality_engine/kld_mean" and chained["value"] > 0.01
    assert chained["ci"][0] < chained["value"] < chained["ci"][1]
    [of_student] = [r for r in runs() if r.data.tags.get("quantbench.base_model") == str(student)]
    assert of_student.data.tags["quantbench.recipe"] == "tiny-q8"
    assert of_student.data.metrics["check/ppl_ratio"] == pytest.approx(1, abs=0.1)  # against the student
    assert ours(p for p in psutil.process_iter(["name"]) if p.info["name"] == "llama-server") == []
    [parent] = [r for r in runs() if r.data.tags.get("quantbench.role") == "stack"]
    from mlflow import MlflowClient

    servers = {f.path for f in MlflowClient().list_artifacts(parent.info.run_id, "servers")}
    # one server each: the base's F16 file, then with the base as draft: itself, the Q8_0 checkpoint
    # (with its 16-bit, then its 8-bit KV cache), the student, its Q8_0
    assert len(servers) == 6
    drafted = MlflowClient().download_artifacts(parent.info.run_id, "servers/1-llamacpp.log", str(workdir))
    assert "--model-draft" in Path(drafted).read_text()


@pytest.mark.slow  # the real llama.cpp (built on first use) and llama-server processes
@pytest.mark.llamacpp
def test_a_prefix_cache_step_reuses_the_shared_prefix_and_a_rate_step_arrives_open_loop(workdir, tmp_path_factory,
                                                                                          capsys):  # fmt: skip
    from tests import gguf_files as gg

    tiny_gguf = gg.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gg.gpt2_bpe_vocab(400, add_bos=False))
    workload = ("workload:\n  prompt_tokens: 64\n  prefix_tokens: 48\n  output_tokens: 4\n  requests: 4\n"
                "  repetitions: 3\n  warmup: 1\n")  # fmt: skip
    write_stack(workdir, "cache", f"base: {tiny_gguf}\n{workload}steps:\n"
                "  - {name: naive, engine: hf, dtype: float32}\n"
                "  - {name: server, engine: llamacpp, dtype: auto, concurrency: 2}\n"
                "  - {name: cached, prefix_cache: true}\n"
                "  - {name: arrivals, rate: 4}\n")  # fmt: skip
    assert main(["stack", "cache", "--json"]) == 0, capsys.readouterr().err[-3000:]
    out = capsys.readouterr().out
    steps = {s["step"]: s for s in last_json(out)["steps"]}
    assert all(s["status"] == "measured" and s["throughput_tok_s"] > 0 for s in steps.values())
    # llama-server's own counts: with the cache off every prompt token is computed; with it on, a slot
    # holding an earlier prompt computes only what follows the shared 48 of 64 tokens
    assert steps["server"]["level_prompt_cached_share"] == 0
    assert 0.5 < steps["cached"]["level_prompt_cached_share"] <= 48 / 64 + 0.05
    assert steps["cached"]["prefix_cache"] and steps["arrivals"]["prefix_cache"]
    assert "· prefix cache (reused" in out
    # open loop: 4 requests/s on the 2 slots the concurrency step gave the server (its level r4)
    arrivals = steps["arrivals"]
    assert arrivals["rate"] == 4 and arrivals["concurrency"] == 2 and arrivals["adds"] == "rate 4/s"
    assert "4/s (≤ 2 at once)" in out
    # the arrivals are paced: each round's 4 requests cannot finish before the last one is sent, so
    # the level's requests/s stays under 4 / the span of the round's (seeded) Poisson draws, far below
    # the closed loop's on the same server
    import random

    spans = [sum(random.Random(f"{rnd}-rate-4.0").expovariate(4) for _ in range(3)) for rnd in (1, 2, 3)]
    assert arrivals["level_requests_s"] <= 4 / min(spans) * 1.01
    assert arrivals["level_requests_s"] < steps["server"]["level_requests_s"]
    assert ours(p for p in psutil.process_iter(["name"]) if p.info["name"] == "llama-server") == []
