"""Shared-prompt packing of a training micro-batch: the rows of one tenant that begin with the same prompt (a GRPO
group's samples) become one packed sequence, the prompt once and then each row's own continuation, so the prompt's
forward and backward run once per group instead of once per sample.

Inside a packed sequence every continuation attends to the shared prompt and causally to itself, never to another
row's continuation, and its position ids continue from the prompt's end: each token sees exactly the keys, values
and positions it would see in its own padded row, so logits, losses and gradients are those of the unpacked batch
up to float rounding (the prompt's gradient is the sum of what each row would have sent it; autograd adds it).
`tests/test_packing.py` holds the unpacked forward as the oracle.

The attention pattern goes to the model as a 4D additive mask `(P, 1, W, W)` (0 = attend, the dtype's minimum =
not), which transformers passes to its eager and SDPA attention as it is; `packable` says when a model takes one.
Padding positions attend to themselves only, so no query row is fully masked (a fully masked softmax row is NaN,
and NaN times a zero gradient would still reach the LoRA weights' gradients).

Packing is not always cheaper. The packed sequence's attention is dense over its whole width W = prompt + every
continuation, W^2 (query, key) pairs, most of them masked, where the rows on their own cost the sum of their lengths
squared. A group with a short prompt and long continuations (a multi-turn episode, a long reasoning trace) saves
little linear work and pays much attention work. So a group is packed only when the estimate (`pair_cost`: a pair's
cost in tokens' worth of a layer's linear work) says it saves; the decision reads the group's own rows only.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from rl_multilora.rows import Row

# Attention implementations that take a custom 4D additive mask as it is (flash-attention kernels take none).
_MASKED_ATTENTION = ("eager", "sdpa")


def packable(config) -> bool:
    """Whether a base model's attention takes the packed 4D mask: eager or SDPA attention, no sliding window (the
    packed mask spans whole sequences) and no per-layer attention types that build masks of their own."""
    impl = getattr(config, "_attn_implementation", None) or "eager"
    if impl not in _MASKED_ATTENTION:
        return False
    if getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True):
        return False
    return not any(t != "full_attention" for t in (getattr(config, "layer_types", None) or ()))


@dataclass
class ForwardInputs:
    """One training forward's inputs. `input_ids` (S, W); `attention_mask` (S, W), or (S, 1, W, W) additive when
    packed; `firsts[s]`: a row of the micro-batch in sequence s (its adapter routes the sequence); `state_row`,
    `state_pos`: (N,) where the hidden state that predicts each loss token sits (the flat token order of
    `TokenIndex`), `first_state` the smallest of `state_pos` (host-side, so slicing the logits needs no device
    sync); `position_ids`: (S, W) when packed (None: 0, 1, ...); `tokens`: real (non-padding) tokens forwarded."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    firsts: list[int]
    state_row: torch.Tensor
    state_pos: torch.Tensor
    first_state: int
    tokens: int
    position_ids: torch.Tensor | None = None


# A (query, key) pair's cost against its multiply-adds' share. Measured packed / unpacked training passes on CPU put the
# break-even between 0.42 and 1.92 at the tiny and SmolLM2-135M shapes (14 shapes of prompt, completion and group;
# docs/benchmarks.md, "Shared-prompt packing: which groups pack"): 1 is the multiply-adds themselves.
ATTENTION_OVERHEAD = 1.0


def pair_cost(config) -> float:
    """One (query, key) pair of dense attention in one layer, in tokens' worth of that layer's linear work: the
    attention's multiply-adds per pair (Q.K and the value sum, 2 x heads x head_dim) over the layer's linear
    weights per token (the experts a token is routed to, for an MoE), times `ATTENTION_OVERHEAD`. An estimate for
    choosing a layout, never a matter of the numbers: both layouts give the same results up to float rounding."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    h, heads = config.hidden_size, config.num_attention_heads
    d = getattr(config, "head_dim", None) or h // heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    attention = 2 * h * heads * d + 2 * h * kv * d  # q and o, k and v
    inter = getattr(config, "intermediate_size", None) or 4 * h
    routed = getattr(config, "num_experts_per_tok", None)
    if routed:
        inter = (getattr(config, "moe_intermediate_size", None) or inter) * routed
    return ATTENTION_OVERHEAD * 2 * heads * d / (attention + 3 * h * inter)


def layout_costs(lengths: Sequence[int], prompt: int, pair: float) -> tuple[float, float]:
    """The estimated cost of rows of `lengths` tokens sharing their first `prompt`, (packed, unpacked): tokens plus
    `pair` x attention pairs, one width squared packed, each length squared unpacked."""
    width = prompt + sum(n - prompt for n in lengths)
    return width + pair * width * width, sum(lengths) + pair * sum(n * n for n in lengths)


def worth_packing(lengths: Sequence[int], prompt: int, pair: float) -> bool:
    """Whether rows of `lengths` tokens sharing their first `prompt` train cheaper as one packed sequence than each on
    its own (`layout_costs`). `pair` 0: whenever two rows share the prompt."""
    if len(lengths) < 2:
        return False
    packed, unpacked = layout_costs(lengths, prompt, pair)
    return packed < unpacked


def groups(rows: Sequence[Row]) -> list[list[int]]:
    """Indices of `rows` grouped by (adapter, shared prompt), in first-seen order; a row without `prompt_len` is a
    group of its own."""
    out: dict[object, list[int]] = {}
    for i, r in enumerate(rows):
        key = (r.adapter, tuple(r.input_ids[: r.prompt_len])) if r.prompt_len else ("row", i)
        out.setdefault(key, []).append(i)
    return list(out.values())


def pack(
    rows: Sequence[Row],
    tok_row: torch.Tensor,
    tok_pos: torch.Tensor,
    pad_token_id: int,
    dtype: torch.dtype,
    device,
    pair: float = 0.0,
) -> ForwardInputs | None:
    """Pack `rows` by (adapter, shared prompt); None when no two rows share one (nothing to save). `tok_row`,
    `tok_pos`: each loss token's row and position (`TokenIndex.row` / `.pos`); the state predicting it is at
    `pos - 1` of its row. `dtype`: the mask's (the model's compute dtype). `pair`: `pair_cost` of the model; a
    group that `worth_packing` refuses is laid out as one sequence per row (0: every group of two or more packs).

    Whether a group packs depends on that group alone. Where nothing in the micro-batch packs, the rows take the
    plain padded batch (None), whose causal attention skips the masked half; beside a packed group, a refused
    group's rows are one sequence each here. The two agree to float rounding, as rows that share no prompt always
    did."""
    parts = []
    for members in groups(rows):
        lengths = [len(rows[i].input_ids) for i in members]
        if worth_packing(lengths, rows[members[0]].prompt_len or 0, pair):
            parts.append(members)
        else:
            parts += [[i] for i in members]
    if len(parts) == len(rows):
        return None
    # Per row: its packed sequence, the length of the prompt it shares and where its own tokens start there.
    seq_of, shared_len, start_of = [0] * len(rows), [0] * len(rows), [0] * len(rows)
    layouts: list[tuple[list[int], list[int], list[int]]] = []  # per packed sequence: ids, positions, segment ids
    for p, members in enumerate(parts):
        first = rows[members[0]]
        shared = first.prompt_len if len(members) > 1 else len(first.input_ids)
        ids = list(first.input_ids[:shared])
        positions = list(range(shared))
        segment = [0] * shared
        for k, i in enumerate(members):
            own = rows[i].input_ids[shared:]
            seq_of[i], shared_len[i], start_of[i] = p, shared, len(ids)
            ids += own
            positions += range(shared, shared + len(own))
            segment += [k + 1] * len(own)
        layouts.append((ids, positions, segment))
    width = max(len(ids) for ids, _, _ in layouts)
    n = len(layouts)
    input_ids = torch.full((n, width), pad_token_id, dtype=torch.long)
    position_ids = torch.zeros((n, width), dtype=torch.long)
    segment_ids = torch.empty((n, width), dtype=torch.long)
    for p, (ids, positions, segment) in enumerate(layouts):
        m = len(ids)
        input_ids[p, :m] = torch.tensor(ids)
        position_ids[p, :m] = torch.tensor(positions)
        segment_ids[p, :m] = torch.tensor(segment)
        segment_ids[p, m:] = -1 - torch.arange(width - m)  # padding: a segment of its own per position
    q = torch.arange(width)
    causal = q[None, :] <= q[:, None]  # (W, W) key <= query
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # (P, W, W)
    prompt_key = (segment_ids == 0)[:, None, :]  # (P, 1, W)
    allowed = causal[None] & (same | prompt_key)  # (P, W, W)
    mask = torch.zeros((n, 1, width, width), dtype=dtype)
    mask.masked_fill_(~allowed[:, None], torch.finfo(dtype).min)

    state = tok_pos.cpu() - 1  # (N,) the predicting state's position in its own row
    rows_t = tok_row.cpu()
    shared_t = torch.tensor(shared_len)[rows_t]
    start_t = torch.tensor(start_of)[rows_t]
    packed_pos = torch.where(state < shared_t, state, start_t + state - shared_t)
    return ForwardInputs(
        input_ids=input_ids.to(device),
        position_ids=position_ids.to(device),
        attention_mask=mask.to(device),
        firsts=[members[0] for members in parts],
        state_row=torch.tensor(seq_of)[rows_t].to(device),
        state_pos=packed_pos.to(device),
        first_state=int(packed_pos.min()),
        tokens=sum(len(ids) for ids, _, _ in layouts),
    )
