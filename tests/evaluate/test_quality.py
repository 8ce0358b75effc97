import math

import torch

from quantbench.evaluate.quality import perplexity


def test_perplexity_matches_a_hand_computed_value(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = list(range(3, 3 + 130))  # two windows of 64, a 2-token tail dropped
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([ids[:64], ids[64:128]])).logits
    logp = torch.log_softmax(logits.float(), -1)
    targets = torch.tensor([ids[1:64], ids[65:128]])
    nll = -logp[:, :-1].gather(-1, targets.unsqueeze(-1)).mean().item()
    assert math.isclose(perplexity(model, ids, 64, batch_size=1), math.exp(nll), rel_tol=1e-5)
    # a random model over 512 tokens is close to uniform
    assert 300 < perplexity(model, ids, 64) < 900
