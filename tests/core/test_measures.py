import math

import pytest
import torch

from quantbench.core.measures import (
    Reference,
    compare,
    kl_divergence,
    perplexity,
    reference,
)


@pytest.fixture(scope="module")
def tiny(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_model_dir)


IDS = [(i * 37) % 509 + 3 for i in range(64 * 6)]


def test_perplexity_matches_a_hand_computed_value(tiny):
    ids = list(range(3, 3 + 130))  # two windows of 64, a 2-token tail dropped
    with torch.no_grad():
        logits = tiny(input_ids=torch.tensor([ids[:64], ids[64:128]])).logits
    logp = torch.log_softmax(logits.float(), -1)
    targets = torch.tensor([ids[1:64], ids[65:128]])
    nll = -logp[:, :-1].gather(-1, targets.unsqueeze(-1)).mean().item()
    assert math.isclose(perplexity(tiny, ids, 64, batch_size=1), math.exp(nll), rel_tol=1e-5)
    assert math.isclose(perplexity(tiny, ids, 64, batch_size=2), math.exp(nll), rel_tol=1e-5)
    assert 300 < perplexity(tiny, ids, 64) < 900  # a random model over 512 tokens: near uniform


def test_a_model_against_itself_has_zero_kld_and_full_agreement(tiny):
    ref = reference(tiny, IDS, 64)
    m = compare(tiny, IDS, 64, ref).metrics()
    assert m["quality/kld_mean"] == pytest.approx(0, abs=1e-6) and m["quality/kld_max"] == pytest.approx(0, abs=1e-5)
    assert m["quality/top1_agreement"] == 1.0
    assert m["quality/positions"] == 6 * 63
    assert m["quality/ppl"] == pytest.approx(perplexity(tiny, IDS, 64), rel=1e-5)
    assert math.exp(ref.nll.double().mean().item()) == pytest.approx(m["quality/ppl"], rel=1e-5)


def test_kld_rises_with_the_noise_on_the_weights(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ref = reference(base, IDS, 64)
    klds, agreements = [], []
    for sigma in (0.002, 0.01, 0.03, 0.1):
        noisy = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for p in noisy.parameters():
                p.add_(torch.randn(p.shape, generator=gen) * sigma)
        m = compare(noisy, IDS, 64, ref).metrics()
        klds.append(m["quality/kld_mean"])
        agreements.append(m["quality/top1_agreement"])
    assert klds == sorted(klds) and klds[0] > 0 and klds[-1] > 10 * klds[0], klds
    assert agreements[0] > agreements[-1]


def test_kl_divergence_matches_torch():
    gen = torch.Generator().manual_seed(1)
    base = torch.log_softmax(torch.randn(50, 100, generator=gen) * 2, -1)
    cand = torch.log_softmax(base + torch.randn(50, 100, generator=gen) * 0.5, -1)
    expected = torch.nn.functional.kl_div(cand, base, log_target=True, reduction="none").sum(-1)
    assert torch.allclose(kl_divergence(base, cand), expected, atol=1e-6)
    assert torch.allclose(kl_divergence(base, base), torch.zeros(50), atol=1e-6)


def test_the_cached_reference_rebuilds_the_base_distributions(tiny, tmp_path):
    """Hidden states + output head reproduce the model's own log-probs, also after a save/load."""
    ref = reference(tiny, IDS[:128], 64)
    ref.save(tmp_path / "ref.safetensors")
    loaded = Reference.load(tmp_path / "ref.safetensors")
    with torch.no_grad():
        logits = tiny(input_ids=torch.tensor([IDS[:64], IDS[64:128]])).logits[:, :-1].float()
    direct = torch.log_softmax(logits, -1).reshape(-1, logits.shape[-1])
    assert torch.allclose(loaded.log_probs(0, 126), direct, atol=1e-4)
    assert loaded.hidden.shape == (126, 96) and loaded.head_weight.shape == (512, 96)


def test_compare_refuses_a_reference_from_other_text(tiny):
    ref = reference(tiny, IDS, 64)
    with pytest.raises(ValueError, match="different text"):
        compare(tiny, IDS[: 64 * 3], 64, ref)


def test_windows_that_start_with_bos_score_every_text_token_and_never_the_bos(tiny):
    """framed ids (data.framed): each window of 64 is <s> + 63 text tokens; the 63 predictions scored
    per window are exactly the text's tokens, in order, each seen after the BOS."""
    from quantbench.core.measures import _log_probs
    from quantbench.sources.data import framed

    text = IDS[:200]
    ids = framed(text, 64, 1)
    assert len(ids) == 3 * 64 and ids[::64] == [1, 1, 1]
    targets = torch.cat([t for _, t in _log_probs(tiny, ids, 64, 2, "test")])
    assert targets.tolist() == text[: 3 * 63]  # no BOS among the scored tokens; no text token left out
    with torch.no_grad():
        logits = tiny(input_ids=torch.tensor([[1] + text[k * 63 : (k + 1) * 63] for k in range(3)])).logits
    logp = torch.log_softmax(logits.float(), -1)[:, :-1]
    nll = -logp.gather(-1, torch.tensor([text[k * 63 : (k + 1) * 63] for k in range(3)]).unsqueeze(-1)).mean().item()
    assert math.isclose(perplexity(tiny, ids, 64), math.exp(nll), rel_tol=1e-5)
    m = compare(tiny, ids, 64, reference(tiny, ids, 64)).metrics()
    assert m["quality/positions"] == 3 * 63 and m["quality/ppl"] == pytest.approx(math.exp(nll), rel=1e-5)


def test_position_buckets_slice_every_window_and_stop_at_its_end():
    import torch

    from quantbench.core.measures import Comparison
    from quantbench.quality.suite import Suite

    # 2 windows of 4 scored positions; the KLD grows with position, agreement falls
    c = Comparison(torch.zeros(8), torch.tensor([0.0, 0.0, 1.0, 1.0, 0.0, 0.0, 3.0, 3.0]),
                   torch.tensor([1, 1, 0, 0, 1, 1, 1, 0]).bool(), per_window=4)
    assert c.by_position([0, 2, 100]) == {"quality/kld_mean:pos0-1": 0.0, "quality/top1_agreement:pos0-1": 1.0,
                                          "quality/kld_mean:pos2-3": 2.0, "quality/top1_agreement:pos2-3": 0.25}
    assert list(c.by_position([0, 4, 8], "quality_ood/")) == ["quality_ood/kld_mean:pos0-3",
                                                              "quality_ood/top1_agreement:pos0-3"]
    for edges in ([512, 0], [0], [-1, 4], [0, 4, 4]):
        with pytest.raises(ValueError, match="the buckets' edges"):
            Suite(position_buckets=edges)
