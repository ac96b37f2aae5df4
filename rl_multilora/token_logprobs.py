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
and dz/dh = W / T. The head's weight is frozen, so no gradient is formed for it.

With a LoRA on `lm_head` (`MultiLoRAModel.head_lora`), each token's logits add its own slot's delta,
  z = (h @ W.T + b + scale * (h @ A[s].T) @ B[s].T) / T,
computed per used slot inside each chunk, so the full-vocabulary logits are still never kept. The backward forms the
gradients of that slot's A (R, H) and B (V, R) from the same recomputed chunk: with g = dL/dz * (1/T) and u = scale *
h @ A[s].T, dB[s] += g.T @ u, dA[s] += scale * (g @ B[s]).T @ h, and dh gets scale * (g @ B[s]) @ A[s] on top.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from rl_multilora.lora.model import HeadLoRA

# Tokens per chunk: (chunk, V) float32 is 25 MB at V = 49,152 (196 KB per token). A chunk's forward holds about two
# such tensors at once and its backward about three (each step below works in place where the result is the same).
DEFAULT_CHUNK = 128


def _chunk_logits(h: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, inv_t: torch.Tensor, dtype,
                  lora: _Lora | None = None, span: slice = slice(None)):  # fmt: skip
    """z = (h @ W.T + b + LoRA delta) / T for one chunk (tokens `span`), in `dtype` (float32 at least: half-precision
    logits are upcast)."""
    z = torch.nn.functional.linear(h, weight, bias).to(dtype)  # (c, V), a new tensor: scaled in place below
    if lora is not None:
        for s, idx, scale in lora.groups(span):  # z[idx] += scale * (h[idx] @ A[s].T) @ B[s].T
            u = (h[idx].to(lora.dtype) @ lora.a[s].T) * scale  # (k, r)
            z[idx] += (u @ lora.b[s].T).to(dtype)
    return z.mul_(inv_t[:, None])


class _Lora:
    """The head LoRA of one call, at its rank: per slot A[s] (r, H) and B[s] (V, r), and per token its slot."""

    def __init__(self, head: HeadLoRA):
        self.a = head.lora_a.detach()[:, : head.rank]  # (S, r, H)
        self.b = head.lora_b.detach()[:, :, : head.rank]  # (S, V, r)
        self.dtype = self.a.dtype
        self.head = head
        self.slots = head.slots.tolist()
        self.scales = head.scales.tolist()

    def groups(self, span: slice):
        """(slot, token indices within the span (k,), scale) of each used slot among the span's tokens."""
        by_slot: dict[int, list[int]] = {}
        for i, s in enumerate(self.slots[span]):
            if s >= 0:
                by_slot.setdefault(s, []).append(i)
        device = self.head.slots.device
        for s, idx in sorted(by_slot.items()):
            yield s, torch.tensor(idx, device=device), self.scales[span][idx[0]]


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, inv_t, chunk: int, dtype, lora_a, lora_b, lora: _Lora | None):
        # hidden: (N, H), weight: (V, H), bias: (V,) or None, targets: (N,), inv_t: (N,) 1 / temperature per token;
        # lora_a / lora_b: the head LoRA's stacked Parameters (only for autograd to see them) or None
        n = hidden.shape[0]
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        entropy = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _chunk_logits(hidden[s:e], weight, bias, inv_t[s:e], dtype, lora, slice(s, e))  # (c, V)
            l_se = torch.logsumexp(z, dim=-1)  # (c,)
            logp[s:e] = z.gather(-1, targets[s:e, None]).squeeze(-1) - l_se
            log_p = z.sub_(l_se[:, None])  # (c, V), in place: z is not used after
            # H = -sum p log p. (lse - sum p z is the same value, but both terms are as large as the largest logit:
            # at logits near 1,200 (T = 0.5) float32 kept a 2e-2 error in H and in the entropy gradient.)
            entropy[s:e] = log_p.exp().mul_(log_p).sum(-1).neg_()
            lse[s:e] = l_se
        ctx.save_for_backward(hidden, weight, bias, targets, inv_t, lse, entropy)
        ctx.chunk, ctx.dtype, ctx.lora = chunk, dtype, lora
        return logp, entropy

    @staticmethod
    def backward(ctx, g_logp, g_entropy):
        hidden, weight, bias, targets, inv_t, lse, entropy = ctx.saved_tensors
        lora: _Lora | None = ctx.lora
        want_a, want_b = (ctx.needs_input_grad[7], ctx.needs_input_grad[8]) if lora is not None else (False, False)
        if not (ctx.needs_input_grad[0] or want_a or want_b):
            return (None,) * 10
        n, chunk, dtype = hidden.shape[0], ctx.chunk, ctx.dtype
        g_logp = torch.zeros(n, dtype=dtype, device=hidden.device) if g_logp is None else g_logp.to(dtype)
        g_entropy = torch.zeros(n, dtype=dtype, device=hidden.device) if g_entropy is None else g_entropy.to(dtype)
        grad_hidden = torch.empty_like(hidden)
        grad_a: dict[int, torch.Tensor] = {}  # slot -> dA (r, H), in the LoRA dtype
        grad_b: dict[int, torch.Tensor] = {}  # slot -> dB (V, r)
        for s in range(0, n, chunk):
            e = min(n, s + chunk)
            z = _chunk_logits(hidden[s:e], weight, bias, inv_t[s:e], dtype, lora, slice(s, e))  # (c, V)
            log_p = z.sub_(lse[s:e, None])  # (c, V), in place: z is not used after
            p = log_p.exp()
            # g_z = g_logp * (onehot - p) - g_H * p * (log p + H), in place over log_p, then p; the same values as
            # p * (-g_logp - g_H * (log p + H)): -(g_H * x) - g_logp equals -g_logp - g_H * x exactly
            g_z = p.mul_(log_p.add_(entropy[s:e, None]).mul_(g_entropy[s:e, None]).neg_().sub_(g_logp[s:e, None]))
            del log_p
            g_z.scatter_add_(-1, targets[s:e, None], g_logp[s:e, None])
            g_z.mul_(inv_t[s:e, None])  # through z = logits / T
            g_h = g_z.to(weight.dtype) @ weight  # (c, H)
            if lora is not None:
                g_h = g_h.to(dtype)
                for slot, idx, scale in lora.groups(slice(s, e)):
                    a, b = lora.a[slot], lora.b[slot]  # (r, H), (V, r)
                    h = hidden[s:e][idx].to(lora.dtype)  # (k, H)
                    g = g_z[idx].to(lora.dtype)  # (k, V)
                    g_u = (g @ b) * scale  # d/d(h @ A.T): (k, r)
                    g_h[idx] += (g_u @ a).to(dtype)
                    if want_b:
                        db = g.T @ ((h @ a.T) * scale)  # (V, r)
                        grad_b[slot] = db if slot not in grad_b else grad_b[slot] + db
                    if want_a:
                        da = g_u.T @ h  # (r, H)
                        grad_a[slot] = da if slot not in grad_a else grad_a[slot] + da
            grad_hidden[s:e] = g_h.to(hidden.dtype)
        stacked_a = _stacked_grad(lora, grad_a, 0) if want_a else None
        stacked_b = _stacked_grad(lora, grad_b, 1) if want_b else None
        return grad_hidden, None, None, None, None, None, None, stacked_a, stacked_b, None


def _stacked_grad(lora: _Lora, per_slot: dict[int, torch.Tensor], which: int) -> torch.Tensor | None:
    """The gradient of the stacked A (which=0) or B (1) from each used slot's true-rank gradient: handed to the
    sink as a compact (U, ...) tensor (None to autograd), or a zero-filled (S, ...) one, zero beyond the rank."""
    stacked = lora.head.lora_a if which == 0 else lora.head.lora_b
    used = sorted(per_slot)
    r = lora.head.rank
    compact = stacked.new_zeros(len(used), *stacked.shape[1:])  # (U, R, H) or (U, V, R)
    for i, s in enumerate(used):
        (compact[i, :r] if which == 0 else compact[i, :, :r]).copy_(per_slot[s])
    ids = torch.tensor(used, dtype=torch.long, device=stacked.device)
    if lora.head.sink is not None:
        lora.head.sink.add(stacked, ids, compact)
        return None
    return stacked.new_zeros(stacked.shape).index_copy_(0, ids, compact)


def token_logp_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    inv_temperature: torch.Tensor | float,
    chunk: int = DEFAULT_CHUNK,
    lora: HeadLoRA | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token: `log softmax((h @ W.T + b) / T)[target]` and the entropy of that distribution, both (N,), computed
    `chunk` tokens at a time in float32 (float64 for a float64 head); differentiable in `hidden` and, with `lora`,
    in the head LoRA's slots (their gradients go to the Parameters' `.grad` or to `lora.sink`).

    hidden: (N, H) the last hidden state before each target; weight: (V, H) the output head's (frozen) weight;
    targets: (N,) token ids; inv_temperature: a float or (N,) per-token 1 / T; lora: each token's LoRA delta on the
    head (`MultiLoRAModel.head_lora`), None for none."""
    if chunk < 1:
        raise ValueError(f"chunk={chunk!r} is not allowed; allowed: an integer >= 1")
    dtype = torch.float64 if weight.dtype == torch.float64 else torch.float32
    n = hidden.shape[0]
    if not isinstance(inv_temperature, torch.Tensor):
        inv_temperature = torch.full((n,), float(inv_temperature), dtype=dtype, device=hidden.device)
    inv_t = inv_temperature.to(dtype=dtype, device=hidden.device).expand(n).contiguous()
    head = _Lora(lora) if lora is not None else None
    # the stacked LoRA Parameters are passed (not used) so that autograd calls the backward for their gradients
    lora_a, lora_b = (lora.lora_a, lora.lora_b) if lora is not None else (None, None)
    return _TokenLogProbs.apply(hidden, weight.detach(), None if bias is None else bias.detach(), targets, inv_t,
                                chunk, dtype, lora_a, lora_b, head)  # fmt: skip
