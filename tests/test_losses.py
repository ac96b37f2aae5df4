"""Each per-tenant loss and the TIS weights against a float64 reference written token by token from the papers'
formulas, on hand-built batches: values and gradients with respect to the policy log-probs."""

from __future__ import annotations

import math

import pytest
import torch

from rl_multilora.losses import LOSSES, tis_weights, token_losses

EL, EH = 0.2, 0.28


def _batch():
    """Three rows of 4, 1 and 3 tokens; ratios on both sides of the clip range, advantages of both signs."""
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2])
    old = -torch.rand(8, generator=g, dtype=torch.float64) * 3
    logp = old + torch.tensor([0.5, -0.4, 0.05, 0.0, 0.3, -0.1, 0.25, -0.3], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -0.7, 0.4, 0.4, 0.4], dtype=torch.float64)
    rollout = old + torch.tensor([0.01, -0.2, 0.0, 0.7, 0.0, 0.05, -0.05, 0.3], dtype=torch.float64)
    return rows, old, logp, adv, rollout


def _reference(kind: str, logp: list[float], old: list[float], adv: list[float], rows: list[int]):
    """(loss, d loss / d logp) per token, float64, one token at a time."""
    loss, grad = [], []
    by_row: dict[int, list[int]] = {}
    for t, r in enumerate(rows):
        by_row.setdefault(r, []).append(t)
    for t, r in enumerate(rows):
        a = adv[t]
        if kind in ("grpo", "dapo", "dr_grpo", "gspo"):
            if kind == "gspo":
                toks = by_row[r]
                x = math.exp(sum(logp[u] - old[u] for u in toks) / len(toks))  # the sequence ratio s_i
            else:
                x = math.exp(logp[t] - old[t])
            clipped = min(max(x, 1 - EL), 1 + EH)
            if -x * a >= -clipped * a:  # the unclipped branch is active: gradient of -x * a w.r.t. logp_t
                loss.append(-x * a)
                grad.append(-x * a)  # d x / d logp_t = x (GSPO-token: sg(s) * d exp(logp - sg(logp)) = s)
            else:
                loss.append(-clipped * a)
                grad.append(0.0)
        else:  # cispo: the IS weight capped from above only (MiniMax-M1; TRL's clamp(coef_1, max=epsilon_high))
            w = min(math.exp(logp[t] - old[t]), 1 + EH)
            loss.append(-w * a * logp[t])
            grad.append(-w * a)
    return loss, grad


@pytest.mark.parametrize("kind", LOSSES)
def test_each_loss_matches_its_float64_reference(kind):
    rows, old, logp, adv, _ = _batch()
    x = logp.clone().requires_grad_(True)
    loss, _ = token_losses(kind, x, old, adv, rows, 3, EL, EH)
    loss.sum().backward()
    want_loss, want_grad = _reference(kind, logp.tolist(), old.tolist(), adv.tolist(), rows.tolist())
    assert loss.tolist() == pytest.approx(want_loss, rel=1e-12, abs=1e-12)
    assert x.grad.tolist() == pytest.approx(want_grad, rel=1e-12, abs=1e-12)


def test_the_batch_exercises_both_clip_branches():
    rows, old, logp, adv, _ = _batch()
    for kind in ("grpo", "cispo"):
        _, clipped = token_losses(kind, logp, old, adv, rows, 3, EL, EH)
        assert 0 < int(clipped.sum()) < len(clipped), kind


def test_tis_weights_match_their_formula():
    rows, old, _, _, rollout = _batch()
    cap = 1.5
    token = tis_weights(old, rollout, rows, 3, "token", cap)
    assert token.tolist() == pytest.approx(
        [min(math.exp(o - r), cap) for o, r in zip(old.tolist(), rollout.tolist(), strict=True)], rel=1e-12
    )
    seq = tis_weights(old, rollout, rows, 3, "sequence", cap)
    per_row = {}
    for o, r, i in zip(old.tolist(), rollout.tolist(), rows.tolist(), strict=True):
        per_row[i] = per_row.get(i, 0.0) + (o - r)
    assert seq.tolist() == pytest.approx([min(math.exp(per_row[i]), cap) for i in rows.tolist()], rel=1e-12)
    assert not token.requires_grad and max(token.tolist() + seq.tolist()) <= cap


def test_unknown_names_are_refused():
    rows, old, logp, adv, rollout = _batch()
    with pytest.raises(ValueError, match="loss='ppo2' is not allowed"):
        token_losses("ppo2", logp, old, adv, rows, 3, EL, EH)
    with pytest.raises(ValueError, match="tis.mode='all' is not allowed"):
        tis_weights(old, rollout, rows, 3, "all", 2.0)
