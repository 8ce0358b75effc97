"""`quantbench tune --engine llamacpp`: llama.cpp tensor types chosen per tensor. Bad input refused
before anything runs; the patterns a candidate recipe gives llama-quantize select exactly their
tensors; and (slow: the real llama.cpp) a tune on a tiny GGUF whose candidate file holds, tensor for
tensor, the types the allocation chose, at the size and bits it predicted, each weight rounded as
the sensitivity rounded it."""

import collections
import json
import re
from pathlib import Path

import numpy as np
import pytest
import yaml

from quantbench.cli import main
from quantbench.tune import gguf as gguf_tune
from tests import gguf_files as gg
from tests.conftest import TINY_SUITE
from tests.helpers import last_json, runs, tiny_recipe, write_recipe


@pytest.fixture
def setup(workdir, tmp_path_factory):
    """A tiny llama-architecture GGUF as the base, a gguf template recipe on it, the tiny suite and
    a `loose` policy (quantize and evaluate, any KLD below 1)."""
    tiny = gg.write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny.gguf", gg.gpt2_bpe_vocab(400, add_bos=False),
                              heads=2, kv_heads=1)
    (workdir / "suites").mkdir()
    (workdir / "suites" / "tiny.yaml").write_text(TINY_SUITE)
    recipe = tiny_recipe(tiny, "method: gguf\ntype: Q4_0\n").replace("check:\n", "check:\n  base_ppl_bound: false\n")
    write_recipe(workdir, "tiny-g", recipe + "evaluate:\n  suite: tiny\n")
    (workdir / "policies").mkdir()
    (workdir / "policies" / "loose.yaml").write_text(yaml.safe_dump({
        "stages": ["quantize", "evaluate"], "max": {"quality/kld_mean": 1.0}, "registry": {"model": "tiny-{recipe}"}}))
    return workdir


@pytest.mark.parametrize("args, message", [
    (["--engine", "llamacpp", "--schemes", "Q4_K"], "--schemes: Q4_K cannot be tuned per tensor here"),
    (["--engine", "llamacpp", "--schemes", "Q4_O"], "--schemes: unknown llama.cpp type 'Q4_O' for a tune. Did you mean"),
    (["--engine", "vllm"], "--engine vllm: --from tiny-g is a gguf recipe; a vLLM tune needs a compressed-tensors"),
    (["--engine", "llamacpp", "--from", "tiny-rtn"], "--engine llamacpp: --from tiny-rtn is a rtn recipe"),
    (["--from", "tiny-g", "tiny-rtn"], "--from tiny-rtn: every template must name the same model"),
    (["--schemes", "W4A16-G64"], "--schemes: unknown llama.cpp type 'W4A16-G64'"),
])
def test_bad_input_exits_2_before_anything_runs(args, message, setup, tiny_model_dir, capsys):
    write_recipe(setup, "tiny-rtn", tiny_recipe(tiny_model_dir, "method: rtn\n"))
    argv = ["tune", "--policy", "loose", *args]
    assert main(argv if "--from" in args else [*argv, "--from", "tiny-g"]) == 2
    assert message in capsys.readouterr().err
    assert runs() == [] and not (setup / "outputs").exists()


def test_patterns_select_exactly_their_tensors():
    names = [f"blk.{b}.{k}" for b in range(12) for k in ("attn_q", "attn_k", "attn_output", "ffn_down")]
    chosen = ["blk.1.attn_q", "blk.1.attn_k", "blk.10.attn_q", "blk.10.attn_k", "blk.2.attn_output", "blk.11.ffn_down"]
    found = patterns = gguf_tune.patterns(chosen)
    assert len(patterns) == 3  # q and k taken in the same blocks share one pattern
    # llama-quantize lower-cases a pattern and searches each tensor's full name with it
    found = {n for n in names for p in patterns if re.search(p.lower(), n + ".weight")}
    assert found == set(chosen)  # blk.1 is not blk.10 or blk.11; attn_output is not output
    pinned = [n for n in ("token_embd.weight", "output.weight", "blk.0.attn_output.weight")
              if any(re.search(p, n) for p in gguf_tune.PINNED)]
    assert pinned == ["token_embd.weight", "output.weight"]


@pytest.mark.slow  # the real llama.cpp (built on first use), a whole tune with a child job
@pytest.mark.llamacpp
def test_a_gguf_tune_writes_the_types_it_chose_at_the_size_it_predicted(setup, capsys):
    from gguf import GGMLQuantizationType, GGUFReader, quants

    from quantbench.engines import llamacpp
    from quantbench.recipe import schemes
    from quantbench.sources import models

    assert main(["tune", "--policy", "loose", "--from", "tiny-g", "--bits", "6", "--budget-runs", "1",
                 "--sensitivity-windows", "2", "--json"]) == 0
    summary = last_json(capsys.readouterr().out)
    [cand] = summary["candidates"]
    assert cand["status"] == "finished" and summary["passed"]
    # a unit per tensor (llama.cpp does not fuse q/k/v): 7 per block, 2 blocks
    [sens] = [r for r in runs() if r.data.tags.get("quantbench.role") == "sensitivity"]
    assert sens.data.metrics["sensitivity/units"] == 14
    assert sum(cand["counts"].values()) == 14 and len(cand["counts"]) > 1  # a mix, not one type
    recipe = yaml.safe_load(Path(cand["recipe"]).read_text())["quantize"]
    assert recipe["method"] == "gguf" and recipe["type"] == max(cand["counts"], key=cand["counts"].get)
    [run] = [r for r in runs() if r.info.run_id == cand["run_id"]]
    checkpoint = next(Path("outputs").glob(f"tiny-g-mixed-*/{run.info.run_id}"))
    reader = GGUFReader(checkpoint / "model.gguf")
    written = {t.name: t for t in reader.tensors}
    blocks = {n: t for n, t in written.items() if n.startswith("blk.") and len(t.shape) == 2}
    # the file holds the allocation: its types, counted tensor by tensor; the embeddings pinned
    assert collections.Counter(t.tensor_type.name for t in blocks.values()) == cand["counts"]
    assert written["token_embd.weight"].tensor_type.name == gguf_tune.EMBEDDINGS
    # at the bits and size the allocation predicted (the file's own bytes)
    m = run.data.metrics
    assert m["model/bits_per_weight"] == pytest.approx(cand["bits_per_weight"], abs=1e-9)
    assert m["model/size_mb"] == pytest.approx(cand["predicted_size_mb"], rel=2e-3)
    # each weight as the sensitivity rounded it: the tune's type, applied to the base's F16 file,
    # equals what llama-quantize wrote, to the last bit
    source = yaml.safe_load((setup / "recipes" / "tiny-g.yaml").read_text())["model"]["source"]
    base = {t.name: t for t in GGUFReader(llamacpp.base_gguf(models.resolve(source).path)).tensors}
    import torch

    for name, tensor in blocks.items():
        kind = tensor.tensor_type
        if kind.name == "F16":
            continue
        stored = quants.dequantize(tensor.data, kind).reshape(base[name].shape[::-1])
        f16 = quants.dequantize(base[name].data, GGMLQuantizationType.F16).reshape(stored.shape)
        ours = schemes.GGUF_TUNE_TYPES[kind.name].fake_quantize(torch.from_numpy(np.ascontiguousarray(f16)))
        assert np.array_equal(ours.numpy(), stored), name

    # the latency objective: a cost table measured once through llama-bench (cached), then the
    # fastest mix the policy's KLD allows is the first candidate; it passes (`loose`), so it is the answer
    assert main(["tune", "--policy", "loose", "--from", "tiny-g", "--objective", "latency", "--budget-runs", "2",
                 "--sensitivity-windows", "2", "--json"]) == 0
    fast = last_json(capsys.readouterr().out)
    assert fast["objective"] == "latency" and fast["tune"] != summary["tune"]
    table = fast["cost_table"]
    assert set(table["ms"]) == {"Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "F16"} and all(v > 0 for v in table["ms"].values())
    [quick] = fast["candidates"]  # the fastest mix passes: nothing between it and itself to search
    assert fast["best_run"] == quick["run_id"]
    # the fastest mix whose predicted KLD the policy allows (`loose`: below 1): the fastest uniform
    # file's time when that file's predicted KLD is below 1, else more (which type is fastest, and
    # how far its KLD goes on this random model, depends on the CPU)
    assert min(table["ms"].values()) - 1e-9 <= quick["predicted_ms"] <= max(table["ms"].values()) + 1e-9
    assert quick["predicted_kld"] <= 1
    [run] = [r for r in runs() if r.info.run_id == quick["run_id"]]
    assert run.data.metrics["tune/predicted_decode_ms"] == pytest.approx(quick["predicted_ms"])
    stored = Path(table["path"])
    measured_at = stored.stat().st_mtime
    # a latency budget below what any mix reaches: exit 2 before any candidate, the table reused
    assert main(["tune", "--policy", "loose", "--from", "tiny-g", "--latency-ms", "0.0001",
                 "--sensitivity-windows", "2"]) == 2
    err = capsys.readouterr().err
    assert "--latency-ms 0.0001: below" in err and "the fastest any mix of" in err
    assert stored.stat().st_mtime == measured_at
    # --remeasure-costs: the table measured again and replaced (the same refusal after it)
    assert main(["tune", "--policy", "loose", "--from", "tiny-g", "--latency-ms", "0.0001", "--remeasure-costs",
                 "--sensitivity-windows", "2"]) == 2
    assert "--latency-ms 0.0001: below" in capsys.readouterr().err
    assert stored.stat().st_mtime > measured_at and json.loads(stored.read_text())["ms"].keys() == table["ms"].keys()
    assert len([r for r in runs() if r.data.tags.get("quantbench.role") == "candidate"]) == 2
