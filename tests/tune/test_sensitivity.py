"""Per-layer sensitivity on the tiny model: units found from the forward pass, the replay from a
unit's block proven against the model's own logits and against a full forward done by hand, the
Fisher proxy's ranking, held-back windows, and the stored run reused."""

import json

import pytest
import torch
from scipy.stats import spearmanr

from quantbench.core.errors import UserError
from quantbench.recipe import CalibrationSpec, schemes
from quantbench.tracking import Tracker
from quantbench.tune import sensitivity as S
from quantbench.tune.measure import fake_quantize_weight
from tests.helpers import runs

SCHEMES = ["W4A16-G64", "W4A16-G32", "W8A8", "BF16"]


@pytest.fixture(scope="module")
def windows(tiny_tokenizer):
    from quantbench.sources.data import python_docs

    ids = tiny_tokenizer(python_docs("calibration")[:40_000])["input_ids"]
    return [ids[i * 64 : (i + 1) * 64] for i in range(3)]


@pytest.fixture(scope="module")
def measured(tiny128_model_dir, windows):
    return S.measure(tiny128_model_dir, windows, SCHEMES, S.Settings(method="kld", windows=3, seq_len=64))


def test_units_are_the_layers_that_share_an_input(measured):
    names = [u.name for u in measured.units]
    assert names == [f"model.layers.{b}.{k}" for b in (0, 1) for k in
                     ("self_attn.q_proj+k_proj+v_proj", "self_attn.o_proj", "mlp.gate_proj+up_proj", "mlp.down_proj")]
    qkv = measured.units[0]
    assert qkv.layers == ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"]
    assert qkv.in_features == 128 and qkv.out_features == [128, 32, 32] and qkv.kind == "self_attn.q_proj+k_proj+v_proj"
    assert measured.units[3].in_features == 256  # down_proj reads the intermediate width


def test_measured_kld_is_exact_and_ordered(measured, tiny128_model_dir, windows):
    from transformers import AutoModelForCausalLM

    assert measured.extra["replay"].startswith("from the unit's block")
    for g64, g32, w8a8, bf16 in measured.kld:
        assert bf16 == 0.0 and 0 < w8a8 < g32 and 0 < g64
    assert sum(r[1] for r in measured.kld) < sum(r[0] for r in measured.kld)  # a finer group moves the output less
    # block 1's down_proj by hand: the whole model, its weight fake-quantized, KLD over every position
    model = AutoModelForCausalLM.from_pretrained(tiny128_model_dir, dtype=torch.float32).eval()
    ids = torch.tensor(windows)
    layer = model.model.layers[1].mlp.down_proj
    with torch.inference_mode():
        base = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
        layer.weight.data = fake_quantize_weight(layer.weight.data, schemes.get("W4A16-G32"))
        cand = torch.log_softmax(model(input_ids=ids).logits.float(), -1)
    by_hand = (base.exp() * (base - cand)).sum(-1)[:, :-1].mean().item()
    assert measured.kld[7][1] == pytest.approx(by_hand, rel=1e-3, abs=1e-7)


def test_the_fisher_proxy_ranks_units_like_the_measurement(measured, tiny128_model_dir, windows):
    proxy = S.measure(tiny128_model_dir, windows, SCHEMES, S.Settings(method="fisher", windows=3, seq_len=64))
    m = [v for row in measured.kld for v in row[:3]]
    p = [v for row in proxy.kld for v in row[:3]]
    assert spearmanr(m, p).statistic > 0.8
    assert all(row[3] == 0.0 for row in proxy.kld)


def test_windows_are_held_back_from_the_recipes_calibration():
    ids = list(range(64 * 20))
    cal = CalibrationSpec(samples=8, seq_len=64, seed=0)
    taken = S._recipe_windows(len(ids), cal)
    chosen = S.held_back_windows(ids, 12, 64, 1, taken)
    assert len(chosen) == 12
    for window in chosen:
        assert not any(start <= window[0] < end for start, end in taken)
    with pytest.raises(UserError, match="holds 12 windows of 64 tokens beside the recipe's own"):
        S.held_back_windows(ids, 13, 64, 1, taken)


def test_stored_once_and_reused(workdir, tiny128_model_dir, tiny_tokenizer):
    from quantbench.sources import models

    base = models.resolve(str(tiny128_model_dir))
    cal = CalibrationSpec(samples=4, seq_len=64)
    settings = S.Settings(method="kld", windows=2, seq_len=64)
    first = S.get(Tracker(), base, tiny_tokenizer, ["W4A16-G32", "BF16"], cal, settings)
    again = S.get(Tracker(), base, tiny_tokenizer, ["W4A16-G32", "BF16"], cal, settings)
    assert not first.reused and again.reused and again.run_id == first.run_id and again.kld == first.kld
    [run] = runs()
    assert run.data.tags["quantbench.role"] == "sensitivity" and run.info.status == "FINISHED"
    client = Tracker().client
    names = {a.path for a in client.list_artifacts(run.info.run_id, "sensitivity")}
    assert names == {"sensitivity/sensitivity.json", "sensitivity/table.csv", "sensitivity/heatmap.png"}
    csv = (workdir / "t.csv")
    csv.write_text(open(client.download_artifacts(run.info.run_id, "sensitivity/table.csv", str(workdir))).read())
    assert csv.read_text().splitlines()[0] == "unit,layers,block,in_features,params,kld[W4A16-G32],kld[BF16]"
    assert len(csv.read_text().splitlines()) == 1 + 8
    other = S.get(Tracker(), base, tiny_tokenizer, ["W4A16-G32", "BF16"], cal, S.Settings(windows=3, seq_len=64))
    assert other.run_id != first.run_id  # other settings: measured anew
    doc = json.loads(open(client.download_artifacts(run.info.run_id, "sensitivity/sensitivity.json", str(workdir))).read())
    assert doc["schemes"] == ["W4A16-G32", "BF16"] and len(doc["units"]) == 8


@pytest.mark.parametrize("bos", [None, 1])
def test_windows_start_like_the_calibration_windows_and_stay_held_back(bos, tiny_tokenizer, tiny_bos_tokenizer):
    """With a tokenizer that asks for BOS every window is <s> + 63 text tokens, as the recipe's own
    calibration windows are, and none of them shares text with those; without, as before."""
    from quantbench.sources import data

    tokenizer = tiny_bos_tokenizer if bos else tiny_tokenizer
    text = data.python_docs("calibration")[:60_000]
    cal = CalibrationSpec(samples=8, seq_len=64, seed=0)
    settings = S.Settings(windows=12, seq_len=64)
    chosen = S.sensitivity_windows(tokenizer, text, cal, settings)
    recipe = data.calibration_windows(data.text_ids(tokenizer, text), cal.samples, cal.seq_len, cal.seed, field="f", bos=bos)
    assert len(chosen) == 12 and all(len(w) == 64 for w in chosen + recipe)
    if bos is None:
        ids = tiny_tokenizer(text)["input_ids"]  # the ids and windows sensitivity had before BOS framing
        taken = S._recipe_windows(len(ids), cal)
        assert chosen == S.held_back_windows(ids, 12, 64, settings.seed, taken)
        assert all(1 not in w for w in chosen)
    else:
        assert all(w[0] == 1 and 1 not in w[1:] for w in chosen + recipe)
    text_of = lambda w: tuple(w[1:] if bos else w)  # noqa: E731
    assert not {text_of(w) for w in chosen} & {text_of(w) for w in recipe}


def test_the_reuse_key_changes_with_bos_and_not_without():
    a = S.key("fp", ["W4A16-G32"], "sha", S.Settings())
    assert S.key("fp", ["W4A16-G32"], "sha", S.Settings(), None) == a  # stored results without BOS stay valid
    assert S.key("fp", ["W4A16-G32"], "sha", S.Settings(), 1) != a
