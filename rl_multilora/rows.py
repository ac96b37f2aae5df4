"""What the backend's operations consume: training rows (one sequence of one tenant and its loss tokens), their
padding, and the flat token index of a micro-batch. Pure data, no model, no optimizer.

A GRPO sample becomes a `Row` whose targets are its response tokens (`rl_multilora.batch.make_row`); a Tinker
`Datum` becomes one whose targets are every position of its `model_input`, with the client's `target_tokens`,
advantages, sampler log-probs and weights per token (`rl_multilora.tinker.ops`). The loss of either is the
registry's (`rl_multilora.losses`), so both doors run the same forward, loss and backward.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch


@dataclass
class Row:
    """One training row: token ids and the loss positions inside it.

    `targets[k]` is a position whose token is predicted from the logits one position earlier; its target id is
    `input_ids[targets[k]]`, or `target_ids[k]` when given (a Tinker datum, whose targets may be any tokens and
    whose last target lies one past its input). Per-token inputs, each aligned with `targets`, default to what a
    GRPO row needs: one advantage for every token, the trainer's own old log-probs, weight 1."""

    adapter: str
    input_ids: list[int]
    targets: list[int]
    advantage: float
    rollout_logprobs: list[float] | None  # the engine's log-probs of the target tokens (compared, TIS)
    target_ids: list[int] | None = None
    advantages: list[float] | None = None  # per token (overrides `advantage`)
    old_logprobs: torch.Tensor | list[float] | None = None  # the sampling policy's; None: the trainer's own forward
    ref_logprobs: torch.Tensor | None = None  # the base model's (KL), once a forward computed them
    loss_weights: list[float] | None = None  # the loss's own per-token weights (cross_entropy, gspo's mask)
    prompt_len: int | None = None  # leading tokens that are its sample's prompt: rows of one tenant with the same
    # prompt (a GRPO group) train it once (`rl_multilora.packing`); None: never shared


def pad(rows: Sequence[Row], pad_token_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad rows into (B, T) input ids and a (B, T) attention mask."""
    width = max(len(r.input_ids) for r in rows)
    ids = torch.full((len(rows), width), pad_token_id, dtype=torch.long, device=device)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long, device=device)  # (B, T)
    for b, r in enumerate(rows):
        ids[b, : len(r.input_ids)] = torch.tensor(r.input_ids, dtype=torch.long, device=device)
        mask[b, : len(r.input_ids)] = 1
    return ids, mask


@dataclass
class TokenIndex:
    """Flat per-loss-token tensors of one micro-batch, all (N,), tokens ordered row by row."""

    row: torch.Tensor  # row in the micro-batch
    pos: torch.Tensor  # position of the target token in the row
    target: torch.Tensor  # target token id
    adapter: torch.Tensor  # index into the micro-batch's sorted adapter names
    advantage: torch.Tensor
    weight: torch.Tensor  # aggregation weight (GRPO: `rl_multilora.batch.token_weights`; 1 for token sums)
    rollout_logp: torch.Tensor
    has_rollout: torch.Tensor  # bool
    counts: list[int]  # tokens per row
    first_pos: int  # smallest target position (host-side, so slicing the logits needs no device sync)
    loss_weight: torch.Tensor | None = None  # the loss's own per-token weights; None: ones
    given_old: torch.Tensor | None = None  # the rows' own old log-probs (zeros for rows without), when some have
    has_old: torch.Tensor | None = None  # bool, which tokens' rows have them; None when every row does

    @staticmethod
    def build(
        micro: Sequence[Row], slot_of: Mapping[str, int], weights: Mapping[int, float] | None, device
    ) -> TokenIndex:
        """`slot_of`: adapter name -> its index in the micro-batch; `weights`: id(row) -> aggregation weight of each
        of its tokens (None: 1 for every token)."""
        row, pos, target, adapter, advantage, weight, rollout, has_rollout, counts = ([] for _ in range(9))
        for b, r in enumerate(micro):
            n = len(r.targets)
            counts.append(n)
            row += [b] * n
            pos += r.targets
            target += list(r.target_ids) if r.target_ids is not None else [r.input_ids[t] for t in r.targets]
            adapter += [slot_of[r.adapter]] * n
            advantage += list(r.advantages) if r.advantages is not None else [r.advantage] * n
            weight += [1.0 if weights is None else weights[id(r)]] * n
            rollout += r.rollout_logprobs if r.rollout_logprobs is not None else [0.0] * n
            has_rollout += [r.rollout_logprobs is not None] * n

        def long(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        def flt(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.float32, device=device)

        loss_weight = None
        if any(r.loss_weights is not None for r in micro):
            loss_weight = flt([w for r in micro for w in (r.loss_weights or [1.0] * len(r.targets))])
        given_old, has_old = None, None
        if any(r.old_logprobs is not None for r in micro):
            # cached tensors keep their dtype (a float64 model's stay float64); a client's lists are float32
            parts = [
                r.old_logprobs
                if isinstance(r.old_logprobs, torch.Tensor)
                else flt(list(r.old_logprobs) if r.old_logprobs is not None else [0.0] * len(r.targets))
                for r in micro
            ]
            given_old = (
                torch.cat(parts) if len({p.dtype for p in parts}) == 1 else torch.cat([p.float() for p in parts])
            )
            if not all(r.old_logprobs is not None for r in micro):
                has_old = torch.tensor(
                    [r.old_logprobs is not None for r in micro for _ in r.targets], dtype=torch.bool, device=device
                )
        return TokenIndex(
            row=long(row),
            pos=long(pos),
            target=long(target),
            adapter=long(adapter),
            advantage=flt(advantage),
            weight=flt(weight),
            rollout_logp=flt(rollout),
            has_rollout=torch.tensor(has_rollout, dtype=torch.bool, device=device),
            counts=counts,
            first_pos=min(pos),
            loss_weight=loss_weight,
            given_old=given_old,
            has_old=has_old,
        )
