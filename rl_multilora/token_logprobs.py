"""Token log-probs and entropies straight from the last hidden states, in chunks of tokens: the full-vocabulary
logits are never kept for the backward.

The trainer needs, for each loss token, `log p(target)` and the entropy of the predictive distribution. The plain
way (`lm_head` over every kept position, `log_softmax`, a gather, `exp * logp`) materializes several `(N, V)`
float32 tensors and autograd keeps them until the backward: at SmolLM2's vocabulary (49,152) that is 190 KB per
token per tensor, hundreds of MB per micro-batch. `token_logp_entropy` computes both per chunk of `chunk` tokens and
saves only the hidden states, the targets and one float per token (the log-sum-exp and the entropy); its backward
recomputes each chunk's logits and writes the gradient of the hidden states directly (the same recompute-the-logits
idea as fused linear + cross-entropy kernels such as Liger's, here in plain PyTorch ops so it runs on any device).

Gradients (z = logits / T of one token, p = softmax(z), H = entropy, lse = logsumexp(z)):
  d logp(t) / dz = onehot(t) - p
  d H / dz       = -p * (log p + H) = -p * (z - lse + H)
and dz/dh = W / T. The head's weight is frozen (no LoRA on `lm_head`), so no gradient is formed for it.
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK = 1024  # tokens per chunk: (chunk, V) float32 is 200 MB at V = 49,152; 4 KB per token-vocab row


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_t: torch.Tensor, dtype):
    """z = (h @ W.T + b) / T for one chunk, in `dtype` (float32 at least: half-precision logits are upcast)."""
    z = torch.nn.functional.linear(h, weight, bias).to(dtype)  # (c, V)
    return z * inv_t[:, None]


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, chunk: int, dtype):
        # hidden: (N, H), weight: (V, H), bias: (V,) or None, targets: (N,), inv_t: (N,) 1 / temperature per token
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _chunk_logits(hidden[s:e], weight, bias, inv_t[s:e], dtype)  # (c, V)
            l_se = torch.logsumexp(z, dim=-1)  # (c,)
            logp[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1) - l_se
            p = torch.exp(z - l_se[:, None])  # (c, V)
            entropy[s:e] = l_se - (p * z).sum(-1)  # H = lse - sum p z
            lse[s:e] = l_se
        ctx.save_for_backward(hidden, weight, bias, targets, inv_t, lse, entropy)
        ctx.chunk, ctx.dtype = chunk, dtype
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, targets, inv_t, lse, entropy = ctx.saved_tensors
        if not ctx.needs_input_grad[0]:
            return None, None, None, None, None, None, None
        n, chunk, dtype = hidden.shape[0], ctx.chunk, ctx.dtype
        g_logp = torch.zeros(n, dtype=dtype, device=hidden.device) if g_logp is None else g_logp.to(dtype)
        g_entropy = torch.zeros(n, dtype=dtype, device=hidden.device) if g_entropy is None else g_entropy.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _chunk_logits(hidden[s:e], weight, bias, inv_t[s:e], dtype)  # (c, V)
            log_p = z - lse[s:e, None]
            p = torch.exp(log_p)
            # g_z = g_logp * (onehot - p) - g_H * p * (log p + H)
            g_z = p * (-(g_logp[s:e, None]) - g_entropy[s:e, None] * (log_p + entropy[s:e, None]))
            g_z.scatter_add_(-1, targets[s:e, None], g_logp[s:e, None])
            g_z = g_z * inv_t[s:e, None]  # through z = logits / T
            grad_hidden[s:e] = (g_z.to(weight.dtype) @ weight).to(hidden.dtype)  # (c, H)
        return grad_hidden, None, None, None, None, None, None


def token_logp_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor | float,
    chunk: int = DEFAULT_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: `log softmax((h @ W.T + b) / T)[target]` and the entropy of that distribution, both (N,), computed
    `chunk` tokens at a time in float32 (float64 for a float64 head); differentiable in `hidden` only.

    hidden: (N, H) the last hidden state before each target; weight: (V, H) the output head's (frozen) weight;
    targets: (N,) token ids; inv_temperature: a float or (N,) per-token 1 / T."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk!r} is not allowed; allowed: an integer >= 1")
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    n = hidden.shape[0]
    if not isinstance(inv_temperature, torch.Tensor):
        inv_temperature = torch.full((n,), float(inv_temperature), dtype=dtype, device=hidden.device)
    inv_t = inv_temperature.to(dtype=dtype, device=hidden.device).expand(n).contiguous()
    return _TokenLogProbs.apply(hidden, weight.detach(), None if bias is None else bias.detach(), targets, inv_t,
                                chunk, dtype)  # fmt: skip
