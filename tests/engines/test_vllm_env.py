"""vLLM as a managed engine, without starting a server: which formats it serves on which device,
how `auto` chooses, the command line it is started with, `quantbench doctor`, and bad input
(a format vLLM does not serve, vLLM that cannot be created): one message naming the cause,
exit 2, no run."""

import json
import platform
import shutil
import sys
from pathlib import Path

import pytest

from quantbench.cli import main
from quantbench.core import hardware
from quantbench.engines import choose
from quantbench.engines import vllm_env as vllm_engine
from quantbench.speed.measure import Profile, summarize
from tests.helpers import last_json, runs, tiny_recipe, write_recipe


def config(tiny_model_dir, quant=None, **fields) -> dict:
    c = json.loads((tiny_model_dir / "config.json").read_text())
    return {**c, **fields, **({"quantization_config": quant} if quant else {})}


def group(bits, kind="int", activations=None) -> dict:
    return {"quant_method": "compressed-tensors", "config_groups": {"group_0": {
        "weights": {"num_bits": bits, "type": kind}, "input_activations": activations}}}


AVX2 = hardware.CPU(frozenset({"avx2", "fma", "f16c"}))  # e.g. an AVX2-only EPYC
AVX512 = hardware.CPU(frozenset({"avx2", "fma", "f16c", "avx512f", "avx512_bf16", "avx512_vnni"}))
AMX = hardware.CPU(AVX512.flags | {"amx_tile", "amx_bf16"})


@pytest.mark.parametrize("cpu", [AVX2, AVX512, AMX], ids=lambda c: c.klass)
def test_which_formats_vllm_serves_where(tiny_model_dir, tiny128_model_dir, cpu):
    """What vLLM-CPU serves depends on the CPU's ISA: its 4-bit weight kernel and its FP8 KV cache
    are in its AVX-512 build only. Asked for each CPU class, whatever this machine is."""
    cfg = lambda q=None, **f: config(tiny_model_dir, q, **f)  # noqa: E731  hidden 96, 3 heads: head size 32
    everywhere = [cfg(), group(8, "int", {"num_bits": 8, "type": "int"}), group(8, "float", {"num_bits": 8, "type": "float"})]
    avx512_only = [group(4), {"quant_method": "gptq", "bits": 4}, {"quant_method": "awq", "bits": 4},
                   {**group(4), "kv_cache_scheme": {"num_bits": 8, "type": "float"}},
                   {**group(8, "int", {"num_bits": 8, "type": "int"}), "kv_cache_scheme": {"num_bits": 8, "type": "float"}}]
    for c in everywhere + avx512_only:
        anywhere = any(c is e for e in everywhere)
        c = c if "vocab_size" in c else cfg(c)
        assert vllm_engine.unserved(c, "cuda", cpu) is None, c
        if anywhere or cpu.avx512:
            assert vllm_engine.unserved(c, "cpu", cpu) is None, c
        else:
            assert "needs AVX-512" in vllm_engine.unserved(c, "cpu", cpu) and "AVX2" in vllm_engine.unserved(c, "cpu", cpu)
    assert "runs 4-bit integer weights only; 8-bit weight-only needs a GPU kernel" in vllm_engine.unserved(cfg(group(8)), "cpu", cpu)
    assert "bitsandbytes checkpoints on a GPU only" in vllm_engine.unserved(cfg({"quant_method": "bitsandbytes"}), "cpu", cpu)
    assert "gptq 8-bit" in vllm_engine.unserved(cfg({"quant_method": "gptq", "bits": 8}), "cpu", cpu)
    for c in (group(8), {"quant_method": "bitsandbytes"}, {"quant_method": "gptq", "bits": 8}):
        assert vllm_engine.unserved(cfg(c), "cuda", cpu) is None
    # a quantized mixture of experts: vLLM-CPU 0.32.0 has no MoE kernel for FP8 or 4-bit experts
    # (measured on the size ladder's moe-8x rung); an unquantized one and any on a GPU are served
    moe = {"num_experts": 8, "num_experts_per_tok": 2}
    for c in (group(4), group(8, "float", {"num_bits": 8, "type": "float"})):
        assert "quantized mixture of experts" in vllm_engine.unserved(cfg(c, **moe), "cpu", cpu)
        assert vllm_engine.unserved(cfg(c, **moe), "cuda", cpu) is None
    assert vllm_engine.unserved(cfg(**moe), "cpu", cpu) is None
    # head size 16 passes /health and crashes on the first request: refused before
    assert "this model's is 16" in vllm_engine.unserved(cfg(head_dim=16), "cpu", cpu)
    assert vllm_engine.unserved(cfg(head_dim=16), "cuda", cpu) is None
    # the CPU INT4 kernel needs widths divisible by 32 (hidden 80, 5 heads of 16... here: 160 / 5 = 32, intermediate 200)
    odd = cfg(group(4), hidden_size=160, num_attention_heads=5, intermediate_size=200)
    if cpu.avx512:
        assert vllm_engine.unserved(odd, "cpu", cpu) == ("vLLM's CPU INT4 kernel (CPUWNA16) needs layer widths divisible "
                                                         "by 32: intermediate_size 200")
    assert (vllm_engine.unserved(config(tiny128_model_dir, group(4)), "cpu", cpu) is None) == cpu.avx512


def test_what_vllm_serves_is_asked_of_this_cpu(tiny128_model_dir):
    """Without a CPU named, the answer is this machine's: the same as asking its class."""
    here = hardware.cpu()
    w4 = {**config(tiny128_model_dir), "quantization_config": group(4)}
    assert vllm_engine.unserved(w4, "cpu") == vllm_engine.unserved(w4, "cpu", here)
    assert (vllm_engine.unserved(w4, "cpu") is None) == ("avx512f" in here.flags)
    assert vllm_engine.unserved(tiny128_model_dir, "cpu") is None  # from the directory


def test_auto_chooses_vllm_where_it_serves_else_transformers(tiny_model_dir):
    chosen = choose("auto", "auto", tiny_model_dir, tiny_model_dir)
    assert (chosen.engine.name, chosen.why) == ("vllm", "auto: vLLM serves this format on this CPU (vllm-cpu)")
    w8 = config(tiny_model_dir, group(8))
    chosen = choose("auto", "auto", w8, tiny_model_dir)
    assert chosen.engine.name == "transformers" and chosen.engine.kind == "server"
    assert chosen.why.startswith("auto: vLLM does not serve the checkpoint on this CPU (vllm-cpu): compressed-tensors int "
                                 "8-bit weight-only") and chosen.why.endswith("; transformers serve instead")
    assert choose("hf", "auto", w8, tiny_model_dir).engine.kind == "in-process"
    assert choose("transformers", "auto", tiny_model_dir, tiny_model_dir).engine.name == "transformers"
    assert choose("serve", "auto", w8, tiny_model_dir).engine.name == "transformers"  # servers only
    assert choose("serve", "transformers", tiny_model_dir, tiny_model_dir).engine.name == "transformers"


def test_engine_vllm_refuses_a_format_it_does_not_serve(workdir, tiny_model_dir, capsys):
    """--engine vllm (and a recipe's bench.engine: vllm) on W8A16: exit 2, the cause named, the
    run untouched and no new one."""
    write_recipe(workdir, "w8", tiny_recipe(tiny_model_dir, "method: gptq\nscheme: W8A16\ngroup_size: 32\n"))
    assert main(["quantize", "w8", "--json"]) == 0
    run_id = last_json(capsys.readouterr().out)["run_id"]
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "cpu-smoke.yaml").write_text("prompt_tokens: [16]\n")
    assert main(["bench", run_id, "--engine", "vllm"]) == 2
    err = capsys.readouterr().err
    assert ("--engine vllm: vLLM does not serve the checkpoint on this CPU (vllm-cpu): compressed-tensors int 8-bit "
            "weight-only (config group group_0): vLLM's CPU kernel (CPUWNA16) runs 4-bit integer weights only") in err
    # nor does transformers serve load pack-quantized weights: the engine that does is named
    assert "`--engine hf` measures it through in-process transformers generate" in err
    [run] = runs()
    assert run.info.status == "FINISHED" and "quantbench.bench_server" not in run.data.tags
    # the same in a recipe: refused before the job, from the format the recipe would write
    write_recipe(workdir, "w8b", tiny_recipe(tiny_model_dir, "method: gptq\nscheme: W8A16\ngroup_size: 32\n")
                 + "bench:\n  engine: vllm\n")
    assert main(["quantize", "w8b"]) == 2
    assert "error: recipes/w8b.yaml: bench.engine vllm: vLLM does not serve the checkpoint" in capsys.readouterr().err
    assert len(runs()) == 1


@pytest.mark.slow  # pip's failing install attempts: ~20 s (the fast tier stays under 3 minutes on 2 cores)
def test_vllm_that_cannot_be_created(workdir, tiny_model_dir, monkeypatch, capsys):
    """No package index (as offline): creating vLLM's environment fails at its first pip step; the
    command names the cause and the log, exits 2, leaves no run and no half environment."""
    env = workdir / "venv-vllm"
    monkeypatch.delenv(vllm_engine.PYTHON_VAR, raising=False)
    monkeypatch.setenv(vllm_engine.ENV_VAR, str(env))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(workdir / "no-wheels"))
    (workdir / "no-wheels").mkdir()
    for sub, text in (("suites", "tokens: 640\nwindow: 64\ntask_limit: 2\n"), ("profiles", "prompt_tokens: [16]\n")):
        (workdir / sub).mkdir()
        (workdir / sub / "tiny.yaml").write_text(text)
    for args in (["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--engine", "vllm", "--profile", "tiny"],
                 ["evaluate", str(tiny_model_dir), "--base", str(tiny_model_dir), "--suite", "tiny", "--engine", "vllm"]):
        assert main(args) == 2
        err = capsys.readouterr().err
        assert "error: vLLM cannot be created: pip install torch==2.13.0+cpu failed (exit code 1):" in err, err
        assert "ERROR: Cannot install torch==2.13.0+cpu" in err and f"(full log: {env}.install.log)" in err
        assert "Is PyPI reachable?" in err
        assert not env.exists()
    assert runs() == []


def test_the_vllm_command_line(tmp_path, tiny_model_dir):
    """What quantbench asks of vLLM: loopback only, the model named as the client names it, its
    own generation defaults off, eager or compiled, the dtype, FP8 KV cache when the checkpoint has
    calibrated scales."""
    engine = vllm_engine.Engine("/opt/vllm/bin/python", "vllm-cpu", "0.32.0", "/opt/vllm")
    cmd = vllm_engine.server_command(engine, tiny_model_dir, 8123, 512, compiled=False, dtype="float32")
    assert cmd[:3] == ["/opt/vllm/bin/python", "-m", "vllm.entrypoints.openai.api_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2]))
    assert flags["--host"] == "127.0.0.1" and flags["--port"] == "8123" and flags["--max-model-len"] == "512"
    assert flags["--model"] == flags["--served-model-name"] == str(tiny_model_dir)
    assert flags["--dtype"] == "float32" and flags["--generation-config"] == "vllm"
    assert "--enforce-eager" in cmd and "--kv-cache-dtype" not in cmd
    assert "--enforce-eager" not in vllm_engine.server_command(engine, tiny_model_dir, 8123, 512, compiled=True)
    kv = tmp_path / "kv"
    shutil.copytree(tiny_model_dir, kv)
    c = json.loads((kv / "config.json").read_text())
    c["quantization_config"] = {"quant_method": "compressed-tensors", "kv_cache_scheme": {"num_bits": 8, "type": "float"}}
    (kv / "config.json").write_text(json.dumps(c))
    cmd = vllm_engine.server_command(engine, kv, 8123, 512, compiled=True)
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8"
    # a profile's kv_cache is asked for by name; usage then counts the prompt tokens the prefix cache served
    cmd = vllm_engine.server_command(engine, tiny_model_dir, 8123, 512, compiled=True, kv_cache="fp8_e5m2")
    assert cmd[cmd.index("--kv-cache-dtype") + 1] == "fp8_e5m2" and "--enable-prompt-tokens-details" in cmd
    # a draft model: speculative decoding, 3 tokens drafted a step
    cmd = vllm_engine.server_command(engine, tiny_model_dir, 8123, 512, compiled=False, draft=tmp_path / "draft")
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {"method": "draft_model", "model": str(tmp_path / "draft"), "num_speculative_tokens": 3}
    assert "--block-size" not in cmd
    assert ("--gpu-memory-utilization" in cmd) == (hardware.device() == "cuda")  # a GPU's share, on one
    cmd = vllm_engine.server_command(engine, tiny_model_dir, 8123, 512, compiled=False, block_size=32)
    assert cmd[cmd.index("--block-size") + 1] == "32"
    assert "--max-num-batched-tokens" not in cmd and "--max-num-seqs" not in cmd  # in flight: not known
    # on a CPU, a token budget of the requests in flight at their longest where that is under vLLM's
    # own (2,048): its warm-up computes one pass over the whole budget
    cmd = vllm_engine.server_command(engine, tiny_model_dir, 8123, 112, compiled=True, in_flight=2)
    if hardware.device() == "cuda":
        assert "--max-num-batched-tokens" not in cmd
    else:
        assert cmd[cmd.index("--max-num-batched-tokens") + 1] == "224" and cmd[cmd.index("--max-num-seqs") + 1] == "2"
    cmd = vllm_engine.server_command(engine, tiny_model_dir, 8123, 512, compiled=True, in_flight=4)
    assert "--max-num-batched-tokens" not in cmd and "--max-num-seqs" not in cmd  # 2,048: vLLM's own budget
    env = vllm_engine.server_env(tmp_path, AVX512)
    assert env["TMPDIR"] == str(tmp_path) and env["VLLM_CACHE_ROOT"] and "PYTHONPATH" not in env
    # with AMX every vLLM process asks Linux for the tile state first: its own sitecustomize, alone on its path
    env = vllm_engine.server_env(tmp_path, AMX)
    if sys.platform == "linux" and platform.machine() == "x86_64":
        site = Path(env["PYTHONPATH"])
        assert [p.name for p in site.iterdir()] == ["sitecustomize.py"] and site.parent == tmp_path
        compile((site / "sitecustomize.py").read_text(), "sitecustomize.py", "exec")
        assert "syscall(158, 0x1023, 18)" in (site / "sitecustomize.py").read_text()


def test_a_vllm_server_on_a_gpu_takes_its_share_of_the_gpu(monkeypatch, tiny_model_dir):
    """On a GPU the candidate's and the base's servers share it (0.4 of its memory each); measured one
    at a time (the memory plan's bench.one_at_a_time), one takes vLLM's own default, 0.9."""
    from quantbench.engines import GPU_SHARE_ALONE

    monkeypatch.setattr(vllm_engine.hardware, "device", lambda: "cuda")
    engine = vllm_engine.Engine("/opt/vllm/bin/python", "vllm", "0.32.0", "/opt/vllm")
    cmd = vllm_engine.server_command(engine, tiny_model_dir, 8123, 512, compiled=True)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.4"
    cmd = vllm_engine.server_command(engine, tiny_model_dir, 8123, 512, compiled=True, gpu_share=GPU_SHARE_ALONE)
    assert cmd[cmd.index("--gpu-memory-utilization") + 1] == "0.9"


def test_draft_tokens_are_counted_from_vllm_s_prometheus_counters():
    """(drafted, accepted) summed over engines; the per-position counters and the creation
    timestamps are other series; a server without a draft counts none."""
    text = (
        "# HELP vllm:spec_decode_num_draft_tokens_total Number of draft tokens.\n"
        "# TYPE vllm:spec_decode_num_draft_tokens_total counter\n"
        'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="/m"} 96.0\n'
        'vllm:spec_decode_num_draft_tokens_created{engine="0",model_name="/m"} 1.7648e+09\n'
        'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="/m"} 90.0\n'
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{engine="0",model_name="/m",position="0"} 32.0\n'
        'vllm:spec_decode_num_draft_tokens_total{engine="1",model_name="/m"} 4.0\n'
    )
    assert vllm_engine.spec_decode_counts(text) == (100, 90)
    assert vllm_engine.spec_decode_counts('vllm:num_requests_running{engine="0"} 0.0\n') is None


@pytest.mark.parametrize("cpu", [AVX2, AVX512, AMX], ids=lambda c: c.klass)
def test_the_fp8_kv_cache_a_profile_asks_of_vllm_needs_avx512_and_heads_of_32(tiny_model_dir, cpu):
    unfit = vllm_engine.fp8_kv_cache_unfit(cpu, config(tiny_model_dir))  # head size 32
    assert (unfit is None) if cpu.avx512 else ("needs AVX-512 or AMX" in unfit and "AVX2" in unfit)
    if cpu.avx512:
        assert "head size divisible by 32; this model's is 48" in vllm_engine.fp8_kv_cache_unfit(
            cpu, config(tiny_model_dir, head_dim=48))


def test_vllm_turns_its_prefix_cache_off_per_request_and_says_how_big_its_kv_cache_is(tmp_path):
    from quantbench import engines

    vllm = engines.get("vllm")
    body = vllm.request_body("m", "text", 4)
    assert vllm.with_prefix_cache(body, True) == body  # on by default
    # it reuses whole KV-cache blocks only; vLLM-CPU's are 128 tokens: a shared prefix that is not a
    # whole number of them gets blocks of 32 (what its CPU attention takes), a GPU's 16 do as they are
    on_cpu = hardware.device() != "cuda"
    assert [vllm_engine.block_size(n) for n in (0, 96, 256, 1000)] == [None, 32 if on_cpu else None, None,
                                                                       32 if on_cpu else None]  # fmt: skip
    off = [vllm.with_prefix_cache(body, False) for _ in range(2)]
    assert off[0]["cache_salt"] != off[1]["cache_salt"] and {**off[0], "cache_salt": None} == {**body, "cache_salt": None}
    log = tmp_path / "server.log"  # the lines vllm-cpu 0.32 writes (its worker, then its engine core)
    log.write_text("(EngineCore pid=7) INFO 12-03 13:40:01 [cpu_worker.py:260] Explicitly set (1.0/23.4) GiB for KV "
                   "cache on node 0.\n(EngineCore pid=7) INFO 12-03 13:40:01 [kv_cache_utils.py:2328] CPU KV cache "
                   "size: 43,648 tokens, Maximum concurrency for 464 tokens per request: 94.07x\n")
    assert vllm.kv_cache_mb(log) == pytest.approx(1024 / 94.07)  # one whole context's share of the pool
    log.write_text("no such lines\n")
    assert vllm.kv_cache_mb(log) is None
    # a worker a signal killed (seen: AMX tile state not asked for) says so, not only "cancelled"
    log.write_text("(EngineCore pid=7) ERROR 12-03 14:04:15 [multiproc_executor.py:315] Worker proc VllmWorker-0 died "
                   "unexpectedly (exit code: None), shutting down executor.\n(EngineCore pid=7) ERROR 12-03 14:04:15 "
                   "[core.py:1512] RuntimeError: cancelled\n")
    assert vllm.explain(log) == ("vLLM's worker process (VllmWorker-0) died without a Python error, so a signal ended "
                                 "it (out of memory, an illegal instruction, a crash in a kernel) | RuntimeError: cancelled")


def test_doctor(capsys, monkeypatch, tmp_path):
    monkeypatch.delenv(vllm_engine.PYTHON_VAR, raising=False)
    monkeypatch.setenv(vllm_engine.ENV_VAR, str(tmp_path / "none"))
    assert main(["doctor", "--json"]) == 0
    out = capsys.readouterr().out
    facts = {f["name"]: f for f in last_json(out)["engines"]}
    assert {"torch", "NVIDIA GPU", "transformers", "transformers serve", "vLLM", "bitsandbytes", "GPTQModel",
            "lm-eval"} <= set(facts)
    assert facts["transformers"]["available"] and facts["transformers"]["version"]
    assert not facts["vLLM"]["available"] and f"not created yet ({tmp_path / 'none'})" in facts["vLLM"]["detail"]
    assert "would be vllm-cpu 0.32.0 with torch 2.13.0 CPU build" in facts["vLLM"]["detail"]
    # the CPU class, what it computes natively, and what follows for vLLM-CPU: this machine's, whichever it is
    cpu = hardware.cpu()
    assert cpu.klass in facts["CPU"]["detail"] and ("native bfloat16" in facts["CPU"]["detail"]) == cpu.native("bfloat16")
    computes = "bfloat16" if cpu.native("bfloat16") else "float32"
    assert f"a bfloat16 recipe computes in {computes}" in facts["compute dtype"]["detail"]
    assert ("its CPUWNA16 kernel needs AVX-512" in facts["vLLM"]["detail"]) is not cpu.avx512
    assert ("no FP8 KV cache (needs AVX-512)" in facts["vLLM"]["detail"]) is not cpu.avx512
    lines = out.strip().splitlines()[:-1]
    assert len(lines) == len(facts) and any(line.startswith("vLLM") and " no " in line for line in lines)


def test_load_levels_summarised_per_repetition():
    samples = {"p16/ttft_ms": [10.0, 30.0], "p16/e2e_ms": [1.0, 2.0], "p16/prefill_tok_s": [5.0, 7.0],
               "c2/throughput_tok_s": [9.0, 11.0], "c2/ttft_ms_p99": [40.0, 60.0], "r0.5/itl_ms_p50": [3.0, 5.0]}
    out = summarize(samples, Profile(concurrency=[2], request_rates=[0.5]))
    assert out["c2/throughput_tok_s"] == 10.0 and out["c2/ttft_ms_p99"] == 50.0 and out["r0.5/itl_ms_p50"] == 4.0
    p = Profile(concurrency=[1, 4], request_rates=[2.0])
    assert [p.level_requests(1), p.level_requests(4), p.level_requests(None)] == [2, 8, 8] and p.max_requests == 8
    assert Profile(requests_per_level=3).level_requests(4) == 3
    assert Profile(concurrency=[], request_rates=[4.0]).max_requests == 8  # a stack's rate step: no closed level


def test_request_rates_need_a_server(workdir, tiny_model_dir, capsys):
    (workdir / "profiles").mkdir()
    (workdir / "profiles" / "r.yaml").write_text("prompt_tokens: [16]\nrequest_rates: [2]\n")
    assert main(["bench", str(tiny_model_dir), "--base", str(tiny_model_dir), "--engine", "hf", "--profile", "r"]) == 2
    assert "request_rates need a server" in capsys.readouterr().err
    assert runs() == []


def test_transformers_serve_is_passed_over_for_packed_weights(tiny_model_dir):
    """transformers serve 5.17 answers /health, then fails to load compressed-tensors
    pack-quantized weights (W4A16, W8A16) on the first request: auto never gives it them."""
    from quantbench import engines

    packed = config(tiny_model_dir, {**group(8), "format": "pack-quantized"})
    assert "its loader refuses compressed-tensors pack-quantized weights" in engines.get("transformers").unserved(packed)
    assert engines.get("transformers").unserved(config(tiny_model_dir, {**group(8, "int", {"num_bits": 8}),
                                                                         "format": "int-quantized"})) is None
    # FP8 weights it de-compresses into 16-bit ones on a CPU: not their speed (tests/quantize/test_formats.py)
    fp8 = engines.get("transformers").unserved(config(tiny_model_dir, {**group(8, "float", {"num_bits": 8}),
                                                                        "format": "float-quantized"}))
    assert (fp8 is None) == (hardware.device() == "cuda")
    chosen = choose("auto", "auto", packed, tiny_model_dir)
    assert chosen.engine.name == "hf" and "transformers serve does not serve the checkpoint" in chosen.why


def test_the_managed_environment_lives_in_the_checkout(monkeypatch):
    """In a checkout, vLLM's environment is .venv-vllm beside pyproject.toml (what `make vllm`
    creates and .ci/run removes), not the user cache's fallback for an installed package."""
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    monkeypatch.delenv(vllm_engine.ENV_VAR, raising=False)
    assert vllm_engine.project_root() == repo and vllm_engine.env_dir() == repo / ".venv-vllm"


def test_the_build_key_follows_what_is_installed_not_where_the_checkout_is(monkeypatch, tmp_path):
    here = vllm_engine.build().key
    moved = tmp_path / vllm_engine.CPU_CONSTRAINTS.name
    moved.write_text(vllm_engine.CPU_CONSTRAINTS.read_text())
    monkeypatch.setattr(vllm_engine, "CPU_CONSTRAINTS", moved)
    assert vllm_engine.build().key == here  # the same constraints elsewhere: the same environment
    moved.write_text(moved.read_text() + "\nnumpy==0.0.0\n")
    assert vllm_engine.build().key != here  # other constraints: another environment
