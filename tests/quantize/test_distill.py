"""Distillation on the tiny model: the loss falls, bad student inits are rejected before anything
is written, an interrupted job resumes from its last checkpoint, and a recipe can name another
recipe's output (lineage)."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from quantbench.cli import main
from tests.helpers import last_json, runs, tiny_recipe, write_recipe


def distill_recipe(model_dir: Path, **fields) -> str:
    settings = {"method": "distill", "steps": 12, "batch_size": 2, "seq_len": 64, "learning_rate": 3e-3,
                "warmup_steps": 0, "save_steps": 4, "log_steps": 2, "bf16": False, **fields}
    body = "".join(f"{k}: {json.dumps(v)}\n" for k, v in settings.items())
    # the teacher is random (peaked on purpose): the base perplexity bound would rightly refuse it
    return tiny_recipe(model_dir, body).replace("check:\n", "check:\n  max_ppl_ratio: 1.05\n  base_ppl_bound: false\n")


@pytest.fixture(scope="module")
def teacher_dir(tmp_path_factory, tiny_tokenizer) -> Path:
    """The tiny Llama with larger random weights: peaked next-token distributions (a default-init
    tiny model is near uniform, nothing to learn), so a pruned student starts far from it."""
    from tests.conftest import build_tiny

    return build_tiny(tmp_path_factory.mktemp("teacher"), tiny_tokenizer, initializer_range=0.2)



def metric_history(run_id: str, key: str) -> list[tuple[int, float]]:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(os.environ["MLFLOW_TRACKING_URI"])
    return sorted((m.step, m.value) for m in client.get_metric_history(run_id, key))


def test_distill_loss_falls_and_the_student_is_saved(workdir, teacher_dir, capsys):
    write_recipe(workdir, "d", distill_recipe(teacher_dir, student={"layers": [1]}, steps=40, log_steps=5,
                                              learning_rate=1e-2))
    assert main(["quantize", "d", "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    ckpt = Path(result["checkpoint"])
    config = json.loads((ckpt / "config.json").read_text())
    assert config["num_hidden_layers"] == 1 and config["dtype"] == "bfloat16"
    from safetensors import safe_open

    with safe_open(ckpt / "model.safetensors", "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}  # noqa: SIM118 (safe_open is not iterable)
    curve = metric_history(result["run_id"], "distill/kd_loss")
    assert [step for step, _ in curve] == list(range(5, 41, 5))
    assert curve[-1][1] < 0.7 * curve[0][1], curve  # the student learns the teacher's distribution
    m = result["metrics"]
    assert m["distill/steps"] == 40 and m["distill/tokens"] == 40 * 2 * 64
    assert m["distill/student_params"] < m["distill/teacher_params"]
    assert m["distill/tokens_per_s"] > 0
    assert m["distill/kld_after"] < 0.7 * m["distill/kld_before"]  # on held-out text, not the training text
    [run] = runs()
    tags = run.data.tags
    assert run.info.status == "FINISHED" and tags["quantbench.method"] == "distill"
    assert tags["quantbench.format"] == "safetensors-bf16"
    card = (ckpt / "README.md").read_text()
    assert "license: mit" in card and "Teacher:" in card and "1 of the teacher's 2 layers" in card
    assert not list((workdir / "outputs" / "d").glob(".distill-*"))  # training checkpoints removed when done


@pytest.mark.parametrize(
    "student, expected",
    [
        ({"layers": [0, 5]}, "quantize.student.layers (line 18): the teacher has 2 layers (0..1); no layer 5"),
        ({"config": {"num_hidden_layerz": 1}}, "has no field num_hidden_layerz"),
        ({"config": {"vocab_size": 256}}, "vocab_size must stay 512"),
        ({"layers": [0], "config": {"num_hidden_layers": 1}}, "give one of layers, config, source (got layers, config)"),
    ],
)
def test_bad_student_init_is_rejected_before_anything_runs(workdir, teacher_dir, capsys, student, expected):
    write_recipe(workdir, "d", distill_recipe(teacher_dir, student=student))
    assert main(["quantize", "d"]) == 2
    assert expected in capsys.readouterr().err
    assert runs() == [] and not (workdir / "outputs").exists()


def test_student_with_another_vocabulary_is_rejected(workdir, teacher_dir, tmp_path, capsys):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                                 vocab_size=512)).save_pretrained(other)
    tok = AutoTokenizer.from_pretrained(teacher_dir)
    tok.add_tokens(["<extra>"])  # same vocab_size in the config, one token id more in the tokenizer
    tok.save_pretrained(other)
    write_recipe(workdir, "d", distill_recipe(teacher_dir, student={"source": str(other)}))
    assert main(["quantize", "d"]) == 2
    err = capsys.readouterr().err
    assert "quantize.student.source" in err and "does not share the teacher's tokenizer" in err
    assert runs() == []


@pytest.mark.slow  # a child process trained, killed and resumed
def test_interrupted_distillation_resumes_from_its_last_checkpoint(workdir, teacher_dir):
    write_recipe(workdir, "d", distill_recipe(teacher_dir, steps=400, save_steps=10, log_steps=10))
    command = [sys.executable, "-m", "quantbench", "quantize", "d", "--json"]
    first = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.monotonic() + 300
    workdirs = workdir / "outputs" / "d"
    while not list(workdirs.glob(".distill-*/checkpoint-*/trainer_state.json")):
        assert first.poll() is None, first.stdout.read()
        assert time.monotonic() < deadline
        time.sleep(0.05)
    first.send_signal(signal.SIGTERM)
    out, _ = first.communicate(timeout=120)
    assert first.returncode != 0, out
    [killed] = runs()
    assert killed.info.status == "KILLED"
    saved = max(int(p.name.split("-")[1]) for p in workdirs.glob(".distill-*/checkpoint-*"))
    assert 10 <= saved < 400

    second = subprocess.run(command, capture_output=True, text=True, timeout=600, check=False)
    assert second.returncode == 0, second.stderr[-3000:]
    result = last_json(second.stdout)
    resumed = next(r for r in runs() if r.info.run_id == result["run_id"])
    start = int(resumed.data.tags["quantbench.resumed_from_step"])
    assert start >= saved  # from the newest checkpoint, not from zero
    assert "resuming from" in second.stderr + second.stdout
    assert result["metrics"]["distill/steps"] == 400
    # the curve before the interruption was replayed into the new run: one point every 10 steps
    steps = [s for s, _ in metric_history(result["run_id"], "distill/loss")]
    assert steps == list(range(10, 401, 10))


def test_recipe_can_quantize_another_recipes_output_and_records_lineage(workdir, teacher_dir, capsys):
    write_recipe(workdir, "student", distill_recipe(teacher_dir, student={"layers": [0]}, steps=4))
    assert main(["quantize", "student", "--json"]) == 0
    student = last_json(capsys.readouterr().out)
    body = tiny_recipe(teacher_dir, "method: gptq\nscheme: W8A16\ngroup_size: null\n").replace(
        "check:\n", "check:\n  base_ppl_bound: false\n")  # the student of a random teacher is random too
    write_recipe(workdir, "q", body.replace(f"source: {teacher_dir}", "source: recipe:student"))
    assert main(["quantize", "q", "--json"]) == 0
    quantized = last_json(capsys.readouterr().out)
    run = next(r for r in runs() if r.info.run_id == quantized["run_id"])
    assert run.data.tags["quantbench.parent_run"] == student["run_id"]
    assert run.data.tags["quantbench.base_model"] == "recipe:student"
    info = json.loads((Path(quantized["checkpoint"]) / "quantbench.json").read_text())
    assert info["parent_run"] == student["run_id"]
    assert info["base_model"]["license"] == "mit"  # inherited through the student's card
    config = json.loads((Path(quantized["checkpoint"]) / "config.json").read_text())
    assert config["num_hidden_layers"] == 1  # the student's shape, not the teacher's
    # a recipe naming an output that does not exist yet: a clear error, nothing written
    write_recipe(workdir, "q2", body.replace(f"source: {teacher_dir}", "source: recipe:nothing-yet"))
    assert main(["quantize", "q2"]) == 2
    assert "no FINISHED run of the recipe 'nothing-yet'" in capsys.readouterr().err


def test_speculative_decoding_with_a_draft(workdir, teacher_dir, capsys):
    """The teacher drafting for itself accepts every proposal; the 1-layer student, fewer."""
    profile = workdir / "profiles"
    profile.mkdir()
    (profile / "spec.yaml").write_text("prompt_tokens: [16]\noutput_tokens: 12\nrepetitions: 2\nwarmup: 0\nbase_dtype: float32\n")
    write_recipe(workdir, "student", distill_recipe(teacher_dir, student={"layers": [0]}, steps=4))
    assert main(["quantize", "student", "--json"]) == 0
    student = last_json(capsys.readouterr().out)

    assert main(["bench", "--draft", str(teacher_dir), str(teacher_dir), "--profile", "spec", "--json"]) == 0
    itself = last_json(capsys.readouterr().out)["metrics"]
    assert itself["speed/spec_acceptance"] > 0.95
    assert itself["speed/spec_tokens_per_target_step"] >= 1.9  # every step: the accepted tokens + one of its own

    assert main(["bench", "--draft", student["run_id"], "--profile", "spec", "--json"]) == 0
    result = last_json(capsys.readouterr().out)
    assert result["run_id"] == student["run_id"] and result["target"] == str(teacher_dir)
    m = result["metrics"]
    assert 0 <= m["speed/spec_acceptance"] < itself["speed/spec_acceptance"]
    assert m["speedup/spec_decode_tok_s"] == pytest.approx(m["speed/spec_decode_tok_s"] / m["base_speed/spec_decode_tok_s"])
    run = next(r for r in runs() if r.info.run_id == student["run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["speed/spec_acceptance"] == m["speed/spec_acceptance"]
    assert run.data.tags["quantbench.spec_target"] == str(teacher_dir)


def test_draft_with_another_vocabulary_is_rejected(workdir, teacher_dir, tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other"
    LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=1,
                                 vocab_size=640)).save_pretrained(other)
    AutoTokenizer.from_pretrained(tiny_model_dir).save_pretrained(other)
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "spec.yaml").write_text("prompt_tokens: [16]\n")
    assert main(["bench", "--draft", str(other), str(teacher_dir), "--profile", "spec"]) == 2
    assert "a draft must share the vocabulary" in capsys.readouterr().err
    assert runs() == []


def test_training_windows_start_with_bos_where_the_tokenizer_adds_one():
    import random

    from quantbench.quantize.distill import training_windows

    ids = list(range(3, 3 + 2000))
    rng = random.Random(7)  # without BOS: the windows of before, offsets and all
    before = [ids[s : s + 64] for s in [rng.randrange(0, len(ids) - 64 + 1) for _ in range(5)]]
    assert [w["input_ids"].tolist() for w in training_windows(ids, 5, 64, 7)] == before
    with_bos = [w["input_ids"].tolist() for w in training_windows(ids, 5, 64, 7, bos=1)]
    assert all(len(w) == 64 and w[0] == 1 and w[1:] == list(range(w[1], w[1] + 63)) for w in with_bos)
