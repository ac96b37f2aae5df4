"""min-p sampling in the embedded engine's sampler: tokens below min_p times the top probability are never drawn, the
others keep their relative odds."""

import torch

from rollout.engines.sampling import sample_next_tokens
from rollout.types import SamplingParams


def test_min_p_drops_unlikely_tokens_and_keeps_the_others_odds():
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    logits = torch.log(probs)[None, :]
    draws = [
        int(sample_next_tokens(logits, [SamplingParams(min_p=0.35)], [torch.Generator().manual_seed(s)])[0])
        for s in range(2000)
    ]
    counts = [draws.count(t) for t in range(4)]
    assert counts[2] == counts[3] == 0  # 0.15 and 0.05 are below 0.35 * 0.5
    assert abs(counts[0] / 2000 - 0.5 / 0.8) < 0.04  # renormalized over the two kept tokens
    without = {
        int(sample_next_tokens(logits, [SamplingParams()], [torch.Generator().manual_seed(s)])[0]) for s in range(2000)
    }
    assert without == {0, 1, 2, 3}


def test_an_all_sampled_batch_skips_the_argmax_and_a_mixed_one_keeps_it():
    """Greedy rows take the argmax; when every row samples none is computed (5 ms a decode step at SmolLM2's
    vocabulary), and a row's token is the same whether its neighbours are greedy or not."""
    logits = torch.randn(4, 30, generator=torch.Generator().manual_seed(0))
    sampled = [SamplingParams(temperature=0.8)] * 4
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        alone = sample_next_tokens(logits.clone(), sampled, gens)
    assert "aten::argmax" not in {e.key for e in prof.key_averages()}
    mixed_params = [SamplingParams(temperature=0.0), *sampled[1:]]
    gens = [torch.Generator().manual_seed(i) for i in range(4)]
    mixed = sample_next_tokens(logits.clone(), mixed_params, gens)
    assert mixed[0] == logits[0].argmax() and torch.equal(mixed[1:], alone[1:])
    # every row of the all-sampled batch is its own draw (none is left unwritten): each row sampled alone
    for i in range(4):
        row = sample_next_tokens(logits[i : i + 1].clone(), [sampled[i]], [torch.Generator().manual_seed(i)])
        assert row.item() == alone[i].item(), i
