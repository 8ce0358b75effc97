"""The memory plan (jobs/footprint.py): its arithmetic on configs of several architectures, read
without loading a weight, and a job that cannot fit refused before anything is written."""

from types import SimpleNamespace

import pytest

from quantbench.cli import main
from quantbench.jobs import footprint
from quantbench.quantize import ProduceFootprint
from quantbench.sources import ladder
from quantbench.sources.shapes import GiB, MiB, Shape
from tests.helpers import runs, tiny_recipe, write_recipe


def config(kind: str, **values):
    from transformers import AutoConfig

    return AutoConfig.for_model(kind, **values)


def test_a_llama_8b_shape_counted_from_its_config():
    """Llama-3.1-8B's layer shapes with a 49,152-token vocabulary, untied: every count by hand."""
    shape = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.1-8b"].config))
    hidden, layers, inter, vocab, kv = 4096, 32, 14336, 49152, 8 * 128
    attention = hidden * hidden * 2 + hidden * kv * 2  # q, o; k, v
    mlp = 3 * hidden * inter
    per_layer = attention + mlp + 2 * hidden  # and two norms
    assert shape.layer_params == per_layer
    assert shape.params == layers * per_layer + 2 * vocab * hidden + hidden  # embeddings, head, final norm
    assert shape.quantized_params == layers * (attention + mlp)  # Linear layers, not the head
    assert (shape.hidden, shape.intermediate, shape.layers, shape.vocab, shape.kv_dim) == (hidden, inter, 32, vocab, kv)
    assert shape.hessian_bytes == 4 * (4 * hidden**2 + 2 * hidden**2 + inter**2)  # q,k,v,o + gate,up read hidden; down inter
    assert shape.weights("bfloat16") == 2 * shape.params and shape.weights("float32") == 4 * shape.params
    assert shape.params / 1e9 == pytest.approx(7.38, abs=0.01)


def test_tied_embeddings_are_counted_once_and_experts_all():
    tied = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.2-1b"].config))
    untied = Shape.from_config(config("llama", **{**ladder.RUNGS["llama-3.2-1b"].config, "tie_word_embeddings": False}))
    assert untied.params - tied.params == 49152 * 2048
    moe = Shape.from_config(config("qwen3_moe", **ladder.RUNGS["moe-8x"].config))
    one = Shape.from_config(config("qwen3_moe", **{**ladder.RUNGS["moe-8x"].config, "num_experts": 1}))
    assert moe.experts == 8 and one.experts == 1 and moe.intermediate == 6144 and moe.kv_dim == 4 * 128
    hidden, inter, layers = 2048, 768, 8
    assert moe.params - one.params == layers * (7 * 3 * hidden * inter + 7 * hidden)  # 7 more experts; router rows
    # the experts are quantized (transformers keeps them as stacked 3-D tensors), the router is not
    assert moe.quantized_params - one.quantized_params == layers * 7 * 3 * hidden * inter
    assert moe.expert_params == layers * 8 * 3 * hidden * inter and tied.expert_params == 0  # stacked ones only


def test_qwen_and_gemma_shapes():
    """Other families: biases on q/k/v (Qwen2), a head size that is not hidden / heads (Gemma)."""
    qwen = Shape.from_config(config("qwen2", hidden_size=896, num_hidden_layers=2, num_attention_heads=14,
                                    num_key_value_heads=2, intermediate_size=4864, vocab_size=1000,
                                    tie_word_embeddings=True))
    assert qwen.kv_dim == 2 * 64 and qwen.params == sum(
        [1000 * 896, 896, 2 * (896 * 896 * 2 + 896 * 128 * 2 + 896 + 2 * 128 + 3 * 896 * 4864 + 2 * 896)])
    gemma = Shape.from_config(config("gemma2", hidden_size=640, num_hidden_layers=2, num_attention_heads=4,
                                     num_key_value_heads=1, head_dim=256, intermediate_size=2048, vocab_size=1000))
    assert gemma.kv_dim == 256  # head_dim from the config, not 640 / 4


def plan(shape, produce, **kw):
    return footprint.plan(shape, compute=kw.pop("compute", "bfloat16"), saved="bfloat16", produce=produce,
                          check_window=512, estimate_window=None, outputs=kw.pop("outputs"), **kw)


def test_the_plan_adds_what_each_stage_holds(tmp_path):
    shape = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.1-8b"].config))
    checkpoint = int(shape.params * 1.0)
    produce = ProduceFootprint([("compressed", checkpoint)], checkpoint)
    found = plan(shape, produce, outputs=tmp_path)
    stages = {s.name: s for s in found.stages}
    assert list(stages) == ["prepare", "produce", "check"]
    window = shape.window_activations(512)
    assert stages["prepare"].ram == footprint.RUNTIME + 2 * shape.params + window
    assert stages["produce"].ram == footprint.RUNTIME + 2 * shape.params + checkpoint
    # the stored checkpoint's pages are handed back as they are read: what is read meanwhile stays
    read_once = min(checkpoint, footprint.HANDED_BACK)
    assert stages["check"].ram == footprint.RUNTIME + read_once + 2 * shape.params + window
    assert stages["produce"].disk == checkpoint
    # a data-free method's base, loaded in its stored dtype as views of its files, read once
    once = ProduceFootprint([("compressed", checkpoint)], checkpoint, reads_base_once=True)
    planned_once = plan(shape, once, outputs=tmp_path)
    stages_once = {s.name: s for s in planned_once.stages}
    assert stages_once["produce"].ram == footprint.RUNTIME + footprint.HANDED_BACK + checkpoint
    assert stages_once["produce"].reclaimable == footprint.HANDED_BACK
    wide_once = plan(shape, once, compute="float32", outputs=tmp_path)  # a float32 copy: all of it held
    assert {s.name: s.ram for s in wide_once.stages}["produce"] == footprint.RUNTIME + 4 * shape.params + checkpoint
    assert planned_once.reads_base_once and not wide_once.reads_base_once and not found.reads_base_once
    # a quantizer that reads files holds no loaded model; in float32 the model is twice as big
    files = plan(shape, ProduceFootprint([("llama.cpp", 5)], 10, takes_model=False), outputs=tmp_path)
    assert {s.name: s.ram for s in files.stages}["produce"] == footprint.RUNTIME + 5
    wide = plan(shape, produce, compute="float32", outputs=tmp_path)
    assert {s.name: s.ram for s in wide.stages}["prepare"] == footprint.RUNTIME + 4 * shape.params + window
    assert "compute_dtype=bfloat16" in " ".join(wide.stages[0].fits_with)
    metrics = found.metrics()
    assert metrics["plan/produce/peak_rss_mb"] == stages["produce"].ram / 2**20
    assert metrics["plan/peak_rss_mb"] == max(s.ram for s in found.stages) / 2**20
    # the stored checkpoint's pages, read once while it is de-quantized, do not decide the fit
    assert stages["check"].reclaimable == read_once and stages["produce"].reclaimable == 0
    assert stages["check"].needed == stages["check"].ram - read_once
    found.ram_available = stages["check"].ram - 1
    assert not [p for p in found.problems("r.yaml") if "check stage" in p]
    found.ram_available = stages["check"].needed - 1
    assert any("the check stage needs about" in p for p in found.problems("r.yaml"))
    # the base's reference for the suite: scored in the job, it is held from its baseline to the
    # evaluation; read from the store, it is a mapped file that only the evaluation reads
    suite = SimpleNamespace(window=256, batch_size=1)
    evaluation = SimpleNamespace(token_ids=[0] * 2560, ood_ids=None, suite=SimpleNamespace(suite=suite))
    scored = {s.name: s for s in plan(shape, produce, outputs=tmp_path, evaluation=evaluation,
                                      baseline_cached=False).stages}  # fmt: skip
    stored = {s.name: s for s in plan(shape, produce, outputs=tmp_path, evaluation=evaluation).stages}
    reference = 2560 * shape.hidden * 4 + shape.vocab * shape.hidden * 4
    assert list(scored) == ["prepare", "baseline", "produce", "check", "evaluate"]
    assert list(stored) == ["prepare", "produce", "check", "evaluate"]
    for stage in ("produce", "check"):
        assert scored[stage].ram == stages[stage].ram + reference
        assert stored[stage].ram == stages[stage].ram
    evaluate = footprint.RUNTIME + 2 * shape.params + reference + shape.window_activations(256)
    assert scored["evaluate"].ram == stored["evaluate"].ram == evaluate
    # prepare loads the base for its check's pass or the estimate's calibration window, one after the
    # other; neither when the check is cached and nothing is estimated
    def prepare(base_checked, estimate_window):
        found = footprint.plan(shape, compute="bfloat16", saved="bfloat16", produce=produce, check_window=512,
                               estimate_window=estimate_window, outputs=tmp_path, base_checked=base_checked)
        return {s.name: s.ram for s in found.stages}["prepare"]

    calibration = shape.window_activations(2048)
    assert calibration > window
    assert prepare(True, None) == footprint.RUNTIME
    assert prepare(True, 256) == footprint.RUNTIME + 2 * shape.params + shape.window_activations(256)
    assert prepare(False, 256) == footprint.RUNTIME + 2 * shape.params + window
    assert prepare(False, 2048) == footprint.RUNTIME + 2 * shape.params + calibration


def test_a_mixture_of_experts_base_is_planned_with_its_experts_file_pages(tmp_path):
    """transformers 5 stacks a MoE checkpoint's per-expert tensors into a copy as it loads, and the
    files' pages stay mapped beside it (the moe-8x rung: every stage that loads the base was ~1 GiB
    short before). Those pages are counted where the base is loaded, and do not decide the fit; a
    server whose loader stacks them holds the copy too, one that maps or reads the weights does not."""
    from quantbench import engines
    from quantbench.speed.measure import Profile
    from quantbench.speed.stage import Plan

    moe = Shape.from_config(config("qwen3_moe", **ladder.RUNGS["moe-8x"].config))
    dense = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.2-1b"].config))
    pages = moe.expert_params * 2
    checkpoint = moe.params  # one byte a weight
    produce = ProduceFootprint([("compressed", checkpoint)], checkpoint)
    for shape, extra in ((moe, pages), (dense, 0)):
        stages = {s.name: s for s in plan(shape, produce, outputs=tmp_path).stages}
        assert stages["prepare"].ram == footprint.RUNTIME + 2 * shape.params + extra + shape.window_activations(512)
        assert stages["produce"].ram == footprint.RUNTIME + 2 * shape.params + extra + checkpoint
        assert stages["prepare"].reclaimable == stages["produce"].reclaimable == extra
        # the checkpoint is de-quantized as it loads: a copy already, nothing more (its pages handed back)
        read_once = min(checkpoint, footprint.HANDED_BACK)
        assert stages["check"].ram == footprint.RUNTIME + read_once + 2 * shape.params + shape.window_activations(512)
    assert "the experts' file pages, read once as they are stacked 0.56" in "; ".join(
        {s.name: s for s in plan(moe, produce, outputs=tmp_path).stages}["prepare"].held
    )
    # a data-free produce on the base as views of its files: handed prepare's model, it holds what is
    # read meanwhile; loading the base itself (the base check cached, or the baseline let prepare's
    # model go), the experts' pages as it stacks them, handed back before the rest is read
    once = ProduceFootprint([("compressed", checkpoint)], checkpoint, reads_base_once=True)
    suite = SimpleNamespace(window=256, batch_size=1)
    evaluation = SimpleNamespace(token_ids=[0] * 256, ood_ids=None, suite=SimpleNamespace(suite=suite))
    kept = 256 * moe.hidden * 4 + moe.vocab * moe.hidden * 4
    runs = {
        "handed": plan(moe, once, outputs=tmp_path),
        "checked": plan(moe, once, outputs=tmp_path, base_checked=True),
        "scored": plan(moe, once, outputs=tmp_path, evaluation=evaluation, baseline_cached=False),
        "cached": plan(moe, once, outputs=tmp_path, evaluation=evaluation),
        "dense": plan(dense, once, outputs=tmp_path, base_checked=True),
    }
    produced = {name: {s.name: s for s in found.stages}["produce"] for name, found in runs.items()}
    assert produced["handed"].ram == footprint.RUNTIME + pages + footprint.HANDED_BACK + checkpoint
    assert produced["checked"].ram == footprint.RUNTIME + pages + pages + checkpoint
    assert produced["checked"].reclaimable == pages
    assert produced["scored"].ram == produced["checked"].ram + kept
    assert produced["cached"].ram == produced["handed"].ram  # the reference read from the store: mapped, not read
    assert produced["dense"].ram == footprint.RUNTIME + footprint.HANDED_BACK + checkpoint
    # the baseline scored in the job: the base as stored and its experts' pages, a layer at a time in
    # float32, a batch of windows and the reference, beside what the suite's libraries allocate
    [baseline] = [s for s in runs["scored"].stages if s.name == "baseline"]
    assert baseline.ram == (footprint.RUNTIME + footprint.EVALUATED_HELD + 2 * moe.params + pages
                            + 4 * moe.layer_params + moe.window_activations(256) + kept)  # fmt: skip
    assert baseline.reclaimable == pages
    assert [s.name for s in runs["cached"].stages] == ["prepare", "produce", "check", "evaluate"]
    profile = Profile(prompt_tokens=[16], output_tokens=4, concurrency=[1])
    served = {}
    for name in ("transformers", "vllm", "hf"):
        bench = Plan("p", profile, [], engines.get(name))
        served[name] = footprint.bench_stage(moe, bench, checkpoint, "bfloat16", 100 * GiB).ram
    kv = 2 * moe.layers * moe.kv_dim * 2 * (16 + 4 + 64)
    two_servers = footprint.RUNTIME + 2 * (2**30 + kv) + 2 * moe.params + checkpoint
    assert served["transformers"] == two_servers + 2 * pages  # each server stacks its experts
    assert served["vllm"] == footprint.RUNTIME + 2 * (int(2.5 * GiB) + GiB) + 2 * moe.params + checkpoint
    assert served["hf"] == footprint.RUNTIME + 2 * moe.params + pages
    # after an evaluation in the same process: what it left there, its mapped files' pages reclaimable
    bench = Plan("p", profile, [], engines.get("hf"))
    after = footprint.bench_stage(moe, bench, checkpoint, "bfloat16", 100 * GiB, evaluated=True)
    assert after.ram == served["hf"] + footprint.EVALUATED_HELD + footprint.EVALUATED_MAPPED
    assert after.reclaimable == pages + footprint.EVALUATED_MAPPED


def test_two_servers_run_together_only_with_memory_to_spare():
    """A server's weights are mapped files, its working set: two servers that fit only just would have
    the kernel drop and re-read them mid-measurement (the 8B rung's two llama-servers planned at 22.18
    GiB of 22.3). Together with SERVERS_HEADROOM to spare, else one at a time, the larger alone."""
    from quantbench import engines
    from quantbench.speed.measure import Profile
    from quantbench.speed.stage import Plan

    dense = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.2-1b"].config))
    profile = Profile(prompt_tokens=[16], output_tokens=4, concurrency=[1, 2])
    checkpoint = dense.params // 2

    def planned(available):
        bench = Plan("p", profile, [], engines.get("llamacpp"))
        return footprint.bench_stage(dense, bench, checkpoint, "bfloat16", available), bench.one_at_a_time

    together, apart = planned(100 * GiB)
    assert not apart and "candidate's llama.cpp server" in "; ".join(together.held)
    roomy = int(together.ram / (1 - footprint.SERVERS_HEADROOM)) + MiB
    assert planned(roomy)[0].ram == together.ram and not planned(roomy)[1]
    alone, apart = planned(together.ram + MiB)  # fits, but with nothing to spare
    assert apart and "one llama.cpp server at a time (the base's)" in "; ".join(alone.held)
    assert together.ram - alone.ram == pytest.approx(engines.get("llamacpp").server_memory(
        checkpoint, 2 * dense.layers * dense.kv_dim * 2, 16 + 4 + 64, 2, 0, bits=4.0), abs=1)  # fmt: skip


def test_a_profile_of_request_rates_only_is_planned_with_a_slot_per_request():
    """A profile with no closed levels (concurrency: [], open-loop rates only) has its servers
    started, and planned, with a slot for each request a level sends: Poisson arrivals do not wait
    for the requests before them. It used to stop the plan on max() of an empty list."""
    from quantbench import engines
    from quantbench.speed.measure import Profile
    from quantbench.speed.stage import Plan

    dense = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.2-1b"].config))
    rates = Profile(prompt_tokens=[16], output_tokens=4, concurrency=[], request_rates=[2.0])
    closed = Profile(prompt_tokens=[16], output_tokens=4, concurrency=[1, 3], request_rates=[2.0])
    assert (rates.slots, closed.slots) == (8, 3)
    assert Profile(concurrency=[], request_rates=[2.0], requests_per_level=5).slots == 5

    def planned(profile):
        bench = Plan("p", profile, [], engines.get("llamacpp"))
        return footprint.bench_stage(dense, bench, dense.params // 2, "bfloat16", 100 * GiB).ram

    kv_per_slot = 2 * dense.layers * dense.kv_dim * 2 * (16 + 4 + 64)
    assert planned(rates) - planned(closed) == 2 * (8 - 3) * kv_per_slot  # both servers, 5 slots more


def test_a_gguf_file_type_is_sized_from_the_shape():
    """llama-quantize's MXFP4_MOE gives the experts' 3-D tensors MXFP4 (4.25 bits) and the rest Q8_0
    (8.5): a mixture of experts' file from its expert share, a dense model's all Q8_0."""
    from types import SimpleNamespace

    from quantbench.quantize import gguf
    from quantbench.recipe.methods import GGUFSpec

    moe = Shape.from_config(config("qwen3_moe", **ladder.RUNGS["moe-8x"].config))
    dense = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.2-1b"].config))
    rest = moe.params - moe.expert_params
    assert gguf.file_bytes("MXFP4_MOE", moe) == int(moe.expert_params * 4.25 / 8 + rest * 8.5 / 8)
    assert gguf.file_bytes("mxfp4_moe", dense) == gguf.file_bytes("Q8_0", dense) == int(dense.params * 8.5 / 8)
    assert gguf.file_bytes("F16", dense) == dense.params * 2
    # llama-quantize rounds a tensor at a time; llama-imatrix, before it, maps the whole F16 file
    loaded = SimpleNamespace(recipe=SimpleNamespace(calibration=SimpleNamespace(seq_len=256)))
    q8 = gguf.GGUFQuantizer(GGUFSpec(method="gguf", type="Q8_0")).footprint(dense, loaded, "bfloat16")
    embeddings = dense.vocab * dense.hidden  # the largest tensor
    assert sum(n for _, n in q8.held) == int(embeddings * (2 + 4 + 8.5 / 8)) + int(0.15 * GiB)
    assert q8.checkpoint == gguf.file_bytes("Q8_0", dense) and not q8.takes_model
    imatrix = gguf.GGUFQuantizer(GGUFSpec(method="gguf", type="Q4_K_M", imatrix=True)).footprint(dense, loaded, "bfloat16")
    assert sum(n for _, n in imatrix.held) == 2 * dense.params + int(0.15 * GiB) + dense.window_activations(256)



def test_a_gguf_mixture_of_experts_reload_is_planned_with_its_gathered_experts(tmp_path):
    """transformers' GGUF reader de-quantizes every tensor to float32 and gathers a mixture of experts'
    stacked experts whole before the model takes them (the moe-8x rung's GGUF checks held ~0.66 GiB
    beyond the runtime and the model): the check counts the experts in 16 bits once more, in either
    compute dtype; a dense model has none."""
    from quantbench.quantize import gguf
    from quantbench.recipe.methods import GGUFSpec

    moe = Shape.from_config(config("qwen3_moe", **ladder.RUNGS["moe-8x"].config))
    dense = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.2-1b"].config))
    quantizer = gguf.GGUFQuantizer(GGUFSpec(method="gguf", type="Q8_0"))
    checks = {}
    for name, shape, compute in (("moe", moe, "bfloat16"), ("moe32", moe, "float32"), ("dense", dense, "bfloat16")):
        produce = quantizer.footprint(shape, None, compute)
        check = {s.name: s for s in plan(shape, produce, compute=compute, outputs=tmp_path).stages}["check"]
        checks[name] = check.ram - (
            footprint.RUNTIME + min(produce.checkpoint, footprint.HANDED_BACK) + shape.weights(compute)
            + shape.window_activations(512)
        )
    assert checks == {"moe": moe.expert_params * 2, "moe32": moe.expert_params * 2, "dense": 0}
    assert 0.5 * GiB < moe.expert_params * 2 < 0.6 * GiB  # 0.3 B expert weights


def test_memory_cap_and_its_bad_values(monkeypatch):
    monkeypatch.setenv(footprint.MEMORY_VAR, "1.5")
    assert footprint.available_ram() == int(1.5 * GiB)
    for bad in ("lots", "0", "-2", "nan", "inf"):
        monkeypatch.setenv(footprint.MEMORY_VAR, bad)
        with pytest.raises(Exception, match="QUANTBENCH_MEMORY_GIB"):
            footprint.available_ram()


def test_a_job_that_cannot_fit_is_refused_before_anything_is_written(workdir, tiny_model_dir, capsys, monkeypatch):
    """The plan says which stage, what it holds, what the machine has, and what would make it fit;
    exit 2, no run, no output directory. Here the job may use 0.2 GiB (QUANTBENCH_MEMORY_GIB)."""
    monkeypatch.setenv(footprint.MEMORY_VAR, "0.2")
    write_recipe(workdir, "big", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n"))
    assert main(["quantize", "big"]) == 2
    err = capsys.readouterr().err
    assert "error: recipes/big.yaml: the prepare stage needs about" in err
    assert "and this machine has 0.2 GiB available: the job would be killed part-way." in err
    assert "the produce stage needs about" in err and "fewer calibration windows (--set calibration.samples=N)" in err
    assert runs() == [] and not (workdir / "outputs").exists()
    monkeypatch.setenv(footprint.MEMORY_VAR, "8")
    assert main(["quantize", "big"]) == 0
    (log,) = (workdir / "outputs" / "big").glob("*.log")  # the plan, stage by stage, in the run's log
    text = log.read_text()
    assert "memory plan (peak resident" in text
    assert all(f"  {stage} " in text for stage in ("prepare", "produce", "check"))


def test_the_plan_alone_loads_nothing_and_writes_nothing(workdir, tiny_model_dir, capsys, monkeypatch):
    """`quantize --plan`: each stage's line on the terminal and the plan as JSON, exit 0 where it fits;
    the same refusal as the job where it does not; no run, no output directory either way."""
    import json

    write_recipe(workdir, "big", tiny_recipe(tiny_model_dir, "method: gptq\ngroup_size: 32\n"))
    monkeypatch.setenv(footprint.MEMORY_VAR, "1.5")  # (a machine with less available plans for that)
    assert main(["quantize", "big", "--plan", "--json"]) == 0
    out, err = capsys.readouterr()
    summary = json.loads(out.strip().splitlines()[-1])
    assert summary["fits"] is True and summary["plan"]["plan/ram_available_mb"] <= 1.5 * 1024
    stages = [s for s in ("prepare", "produce", "check") if f"plan/{s}/peak_rss_mb" in summary["plan"]]
    assert stages == ["prepare", "produce", "check"]
    assert summary["plan"]["plan/peak_rss_mb"] == max(
        v for k, v in summary["plan"].items() if k.endswith("/peak_rss_mb") and k != "plan/peak_rss_mb"
    )
    for stage in ("prepare", "produce", "check"):  # each stage's line, with what it holds
        assert any(line.split()[1:3] == [stage, f"{summary['plan'][f'plan/{stage}/peak_rss_mb'] / 1024:.2f}"]
                   for line in err.splitlines()), err  # fmt: skip
    assert "runtime 0.75" in err
    assert runs() == [] and not (workdir / "outputs").exists()
    monkeypatch.setenv(footprint.MEMORY_VAR, "0.2")
    assert main(["quantize", "big", "--plan"]) == 2
    assert "the produce stage needs about" in capsys.readouterr().err
    assert runs() == [] and not (workdir / "outputs").exists()


def test_a_gguf_job_plans_the_conversion_only_where_it_is_not_cached(workdir, tiny_model_dir, capsys, monkeypatch,
                                                                     tmp_path):
    """llama.cpp's converter makes the base's F16 GGUF once; a job whose base has one in the cache
    plans no conversion in its prepare stage (the MoE rung's second GGUF job: +108 % before)."""
    import json

    from quantbench.engines import llamacpp

    monkeypatch.setenv("QUANTBENCH_CACHE", str(tmp_path / "cache"))  # an F16 file of its own, not the shared one
    write_recipe(workdir, "q8", tiny_recipe(tiny_model_dir, "method: gguf\ntype: Q8_0\n"))
    plans = []
    for converted in (False, True):
        if converted:
            f16 = llamacpp.base_gguf_path(tiny_model_dir)
            f16.parent.mkdir(parents=True)
            f16.write_bytes(b"")
        assert main(["quantize", "q8", "--plan", "--json"]) == 0
        out, err = capsys.readouterr()
        plans.append((json.loads(out.strip().splitlines()[-1])["plan"], err))
    (before, said), (after, said_after) = plans
    assert "llama.cpp's converter" in said and "llama.cpp's converter" not in said_after
    assert after["plan/prepare/disk_mb"] == 0 < before["plan/prepare/disk_mb"]
    assert after["plan/prepare/peak_rss_mb"] < before["plan/prepare/peak_rss_mb"]
    assert runs() == [] and not (workdir / "outputs").exists()


def test_a_llama_server_is_planned_with_its_repacked_weights():
    """llama-server maps its file (its working set); its CPU backend repacks a quantized file's
    tensors into a copy of its own at load. The 8B rung (AVX512-BF16): the F16 base's server alone,
    with the bench's process, 14.44 GiB; both servers (the Q4_K_M candidate repacked 3,204 MiB of
    4,227) after an evaluation in the same process, 22.35. The plans come within 5 % of both; a Q8_0
    file is not repacked there."""
    from quantbench import engines
    from quantbench.engines import llamacpp

    server = engines.get("llamacpp")
    assert server.server_memory(10 * GiB, 0, 0, 1) == 10 * GiB + server.runtime_bytes
    assert server.server_memory(10 * GiB, 0, 0, 1, bits=4.8) == int(
        10 * GiB * (1 + llamacpp.REPACKED_SHARE)) + server.runtime_bytes  # fmt: skip
    assert server.server_memory(10 * GiB, 0, 0, 1, bits=8.5) == 10 * GiB + server.runtime_bytes  # Q8_0
    shape = Shape.from_config(config("llama", **ladder.RUNGS["llama-3.1-8b"].config))
    kv = 2 * shape.layers * shape.kv_dim * 2
    base = server.server_memory(shape.params * 2, kv, 32 + 16 + 64, 1)
    candidate = server.server_memory(int(4.17 * GiB), kv, 32 + 16 + 64, 1, bits=8 * 4.17 * GiB / shape.params)
    assert abs(footprint.RUNTIME + base - 14.44 * GiB) < 0.05 * 14.44 * GiB
    evaluated = footprint.EVALUATED_HELD + footprint.EVALUATED_MAPPED
    assert abs(footprint.RUNTIME + evaluated + base + candidate - 22.35 * GiB) < 0.05 * 22.35 * GiB


def test_a_bench_on_a_gpu_is_planned_in_the_share_of_it_each_vllm_server_may_take(tmp_path):
    """On a GPU each vLLM server may take a share of its memory (--gpu-memory-utilization): 0.4 with
    both servers up, 0.9 alone. An 8B base's weights (15 GiB in bfloat16) do not fit 0.4 of a 24 GiB
    GPU: the servers run one at a time. On a 16 GiB GPU not even alone: the job is refused before it
    starts, not failed at its bench after every other stage. llama.cpp computes on the CPU here."""
    from quantbench import engines
    from quantbench.speed.measure import Profile
    from quantbench.speed.stage import Plan

    shape = Shape.from_config(config("llama", **{**ladder.RUNGS["llama-3.1-8b"].config, "vocab_size": 128256}))
    profile = Profile(prompt_tokens=[512], output_tokens=64, concurrency=[1, 4])
    checkpoint = shape.params // 2  # 4 bits a weight
    least = 2 * shape.params + 2 * shape.layers * shape.kv_dim * 2 * (512 + 64 + 64)  # one request's KV cache

    def planned(gpu_gib, engine="vllm"):
        bench = Plan("p", profile, [], engines.get(engine))
        stage = footprint.bench_stage(shape, bench, checkpoint, "bfloat16", 1000 * GiB, gpu_total=gpu_gib * GiB)
        return stage, bench.one_at_a_time, footprint.Footprint([stage], 1000 * GiB, 1000 * GiB, tmp_path).problems("r")

    roomy, apart, problems = planned(80)
    assert not apart and not problems and (roomy.gpu, roomy.gpu_limit) == (least, int(0.4 * 80 * GiB))
    assert "on the GPU at least 15.0 GiB for one server, which may take 32.0 GiB of this GPU" in "\n".join(
        footprint.Footprint([roomy], 1000 * GiB, 1000 * GiB, tmp_path).lines()
    )
    shared, apart, problems = planned(24)
    assert apart and not problems and shared.gpu_limit == int(0.9 * 24 * GiB)
    _, apart, problems = planned(16)
    [problem] = problems
    assert "the bench stage needs on the GPU at least 15.0 GiB for one server, which may take 14.4 GiB" in problem
    assert "--set bench=null" in problem
    # no GPU, or an engine that computes on the CPU: nothing planned on one
    cpu = footprint.bench_stage(shape, Plan("p", profile, [], engines.get("vllm")), checkpoint, "bfloat16", 1000 * GiB)
    assert cpu.gpu == cpu.gpu_limit == 0
    on_cpu, apart, problems = planned(16, "llamacpp")
    assert on_cpu.gpu == 0 and not apart and not problems
