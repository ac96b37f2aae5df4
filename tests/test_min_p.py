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
