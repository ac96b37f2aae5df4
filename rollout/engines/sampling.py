"""Engine-side sampling: one next token per row from its logits, and the log-prob the engine reports for it.

Design choices:

- Sampling is per row: temperature (0 = greedy argmax), top-k (-1 = off), top-p, then inverse-CDF sampling with one
  uniform drawn from the row's own `torch.Generator` (the engine seeds it from the request's `seed`, else from its
  own seed sequence). A row's random stream therefore does not depend on which other rows share the batch.
- Rows with top-k/top-p sample in sorted order, rows without in vocabulary order (no sort), decided per row so that
  a neighbour's settings never change which path a row takes. top-p keeps the smallest prefix whose mass reaches
  top_p (SGLang's rule); the most likely token always survives both filters.
- Reported log-probs (`token_logprobs`) are the log-softmax of the RAW logits (temperature 1, before top-k/top-p)
  at the chosen token, in float32, whatever the row's sampling settings. What that does and does not match:
  - The trainer scores tokens with log_softmax(logits / T), T = the rollout temperature (1 for greedy rollouts).
    At temperature 1 the two agree on the same tokens (up to float rounding of differently batched forwards);
    at any other temperature > 0 they do not: the engine reports the T=1 policy's log-probs, not those of
    softmax(logits / T) that it sampled from, and the train/rollout log-prob gap then shows the temperature.
  - Greedy rows (temperature 0) are drawn from no distribution; their value is the T=1 log-prob of the argmax,
    which is what the trainer computes for greedy rollouts (it scores them at T=1).
  - With top-k/top-p the value is that of the unfiltered distribution, not of the renormalized one the token was
    drawn from (as in SGLang's reports and the trainer's log-probs).
  - SGLang's sampler reports log(softmax(logits / T)) before top-k/top-p for sampled rows (log_softmax(logits) for
    greedy ones, and for all rows with SGLANG_RETURN_ORIGINAL_LOGPROB set), so behind SGLang the trainer's
    log-probs match at every temperature > 0.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rollout.types import SamplingParams


def sample_next_tokens(
    logits: torch.Tensor, params: Sequence[SamplingParams], generators: Sequence[torch.Generator | None]
) -> torch.Tensor:
    """One next token per row: greedy at temperature 0, else temperature + top-k + top-p + min-p sampling.

    logits: (B, V) float32; `generators[i]` (CPU) drives row i and is only read for sampled rows.
    A row's token depends only on its own logits, settings and generator: rows with top-k/top-p
    sample in sorted order, rows without in vocabulary order (no sort), decided per row so that a
    neighbour's settings never change which path a row takes. Returns (B,) token ids.
    """
    plain, filtered = [], []
    for i, p in enumerate(params):
        if p.temperature > 0:
            (filtered if p.top_k > 0 or p.top_p < 1 or p.min_p > 0 else plain).append(i)
    if len(plain) + len(filtered) < len(params):
        tokens = logits.argmax(dim=-1)  # (B,) greedy choice, kept for temperature-0 rows
    else:  # every row is sampled below (an argmax over (B, V) cost 5 ms a decode step for 96 rows of a 49k vocabulary)
        tokens = torch.empty(len(params), dtype=torch.long, device=logits.device)
    for group, use_filters in ((plain, False), (filtered, True)):
        if group:
            index = torch.tensor(group, device=logits.device)
            picked = _inverse_cdf_sample(  # logits[index]: a copy, which the sampler works in
                logits[index], [params[i] for i in group], [generators[i] for i in group], use_filters
            )
            tokens[index] = picked
    return tokens


def _inverse_cdf_sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    generators: list[torch.Generator | None],
    use_filters: bool,
) -> torch.Tensor:
    """Inverse-CDF sampling of one token per row; logits: (S, V) float32 -> (S,) token ids."""
    device, vocab = logits.device, logits.shape[-1]
    # A temperature below float32's smallest normal number (a client's 1e-300 passes `> 0`) would be 0 in the tensor
    # and give 0 / 0 = NaN at each row's maximum: clamped, it still gives the argmax (0 there, -inf elsewhere).
    temperature = torch.tensor([p.temperature for p in params], device=device, dtype=logits.dtype)
    temperature.clamp_(min=torch.finfo(logits.dtype).tiny)
    # Shift each row's maximum to 0 before dividing: finite logits over a vanishing temperature then give 0 and -inf
    # (the argmax, as the limit T -> 0 is), never inf - inf = NaN, which drew an out-of-vocabulary index.
    # In place on `logits` (the caller's copy of its rows; the same values as out of place): a decode step's (S, V)
    # temporaries are a large part of what a rollout allocates per step.
    scaled = logits.sub_(logits.max(dim=-1, keepdim=True).values).div_(temperature[:, None])  # (S, V), max 0 per row
    order = None
    if use_filters:
        top_p = torch.tensor([p.top_p for p in params], device=device)
        # A top-k at or above the vocabulary keeps everything (and a huge one would not fit in an int64 tensor).
        top_k = torch.tensor([p.top_k if 0 < p.top_k < vocab else vocab for p in params], device=device)
        min_p = torch.tensor([p.min_p for p in params], device=device)
        scaled, order = scaled.sort(dim=-1, descending=True)  # (S, V) most likely first
        probs = torch.softmax(scaled, dim=-1)  # (S, V)
        rank = torch.arange(vocab, device=device)[None, :]  # (1, V)
        # Keep the top-k, the smallest prefix whose mass reaches top_p (SGLang's rule), and the tokens at least min_p
        # times as likely as the top one (min-p sampling); the first token always survives every filter.
        keep = (rank < top_k[:, None]) & ((probs.cumsum(-1) - probs) <= top_p[:, None])  # (S, V)
        keep &= probs >= min_p[:, None] * probs[:, :1]
        probs = probs * keep
    else:
        probs = torch.softmax(scaled, dim=-1)  # (S, V)
    del scaled
    cdf = probs.cumsum(-1)  # (S, V) unnormalized CDF (filtered mass removed)
    del probs
    total = cdf[:, -1:]  # (S, 1)
    # One uniform per row from the row's own generator: independent of the batch's make-up.
    u = torch.stack([torch.rand((), generator=g) for g in generators]).to(device)  # (S,)
    # Strictly below the total, so the first index whose CDF exceeds it always has mass > 0.
    target = torch.minimum(u[:, None] * total, torch.nextafter(total, torch.zeros_like(total)))  # (S, 1)
    pick = torch.searchsorted(cdf, target, right=True)  # (S, 1) position in `order` (or the vocab)
    return (pick if order is None else order.gather(-1, pick)).squeeze(-1)


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor) -> torch.Tensor:
    """The log-prob reported for each row's token: log-softmax of the raw logits, before any temperature or filter.

    logits: (B, V) float32, tokens: (B,) -> (B,). See the module docstring for what this matches (the trainer's
    log-probs at temperature 1) and what it does not (the tempered distribution a token was sampled from).

    >>> logits = torch.tensor([[0.0, 0.0], [2.0, 0.0]])
    >>> [round(v, 4) for v in token_logprobs(logits, torch.tensor([1, 0])).tolist()]
    [-0.6931, -0.1269]
    """
    logprobs = torch.log_softmax(logits, dim=-1)  # (B, V) the policy's own log-probs, before any filter
    return logprobs.gather(-1, tokens[:, None]).squeeze(-1)  # (B,)
