"""Multi-slot LoRA on transformers' packed MoE expert weights, routed per batch row and per routed expert.

Design choices:

- Targets are packed 3-D expert Parameters of a transformers 5 experts module (the ones decorated with
  `use_experts_implementation`: Qwen2/3-MoE, Qwen3.5-MoE, Mixtral, DeepSeek-V3, ...): `gate_up_proj (E, 2I, H)` /
  `up_proj` and `down_proj (E, H, I)`, named as PEFT's `target_parameters` names them. Per targeted Parameter an
  `ExpertLoRA` holds every slot and expert stacked like `layer.py`: `lora_A (max_loras, E, max_rank, in)` and
  `lora_B (max_loras, E, out, max_rank)`; `in`/`out` are the matmul's (H and 2I for `gate_up_proj`, transposed for
  a `is_transposed` layout such as gpt-oss), as PEFT's `ParamWrapper` takes them.
- The experts module keeps its class's behaviour and its Parameters under their own names (base state-dict keys do
  not change): its class is swapped for a subclass that adds the LoRA forward (as `torch.nn.utils.parametrize` does)
  and the `ExpertLoRA`s are registered as its children `lora_<param>`. Without a routing, or when no row of the
  batch uses an adapter covering this module, the original forward runs as it is (whatever
  `config._experts_implementation` is: eager, grouped_mm, batched_mm, a GPU kernel).
- With LoRA rows the module computes the experts itself, with the math every transformers implementation shares:
  per (token, k) pair `up = x @ W1[e].T (+ b1[e])`, `h = _apply_gate(up)` (the module's own gate, so interleaved
  gate/up layouts work) or `act(up)`, `y = h @ W2[e].T (+ b2[e])`, optional post-expert norm, then `y * w[t, k]`
  (routing weights applied after the down projection, in the base dtype) summed over k (reshape + sum, as the
  grouped_mm and batched_mm implementations do). The base matmuls run per expert over the pairs sorted by expert (a
  loop over the E experts, never over slots). Base rows in such a batch therefore equal the base model to float
  rounding, not bit for bit (the base implementation may order the sums differently).
- LoRA is added to each projection output of the pairs whose row uses an adapter, before the gate and before the
  routing weight, exactly as PEFT's `W + scale * B @ A` fold: `y_p += scale[s] * (x_p @ A[s, e].T) @ B[s, e].T` with
  s the row's slot and e the pair's expert. The pairs are sorted by the flat index `s * E + e` and cut into segments
  of one (slot, expert) each, at most `ceil(pairs / groups)` long (`_Segments`, once per layer); `layer.py`'s
  grouped compute (`_GroupedLoRA`, its hand-written backward) then runs over the segments: one gather of A and B
  per segment and two batched matmuls over all of them. Gathering A and B per pair instead, as a Linear does per
  row, would move `rank x (in + out)` values per token (a pair is one token, a row a whole sequence): measured
  on the tiny MoE preset (`bench/bench_moe.py`), a forward + backward with expert LoRA cost 3.7x the same batch
  with LoRA on the Linears only that way, 1.5-1.6x with segments. The cost does not grow with the number of
  slots; the backward adds
  each segment's gradient into its own (slot, expert) only, so gradients land only in the experts a row's tokens
  were routed to, and a NaN/inf row stays in its own tenant (segments never mix slots).
- Scales, ranks and covered targets come from the shared `SlotRouter` routing (`routing.py`); an expert Parameter is
  a "module" there, named by its full Parameter name. A row whose adapter does not cover a Parameter gets scale 0
  there, and its slot's tensors are zero too.
- LoRA tensors are in the LoRA dtype (float32 by default): the projection output is cast to it, the delta added and
  the sum rounded once to the base dtype, like `LoRALinear`.
- `expert_lora="shared_a"` (ModelOpt's layout): one A per slot and Parameter shared by every expert
  (`lora_A: (max_loras, 1, max_rank, in)`), one B per expert. The grouped compute indexes A by slot and B by
  `s * E + e`; files are PEFT's per-expert layout with that A repeated for every expert, so PEFT and per-expert
  models load them as they are, and a shared-A model loads only files whose experts share one A.
- The engine serves expert LoRA from its `LoRABank` (same stacked layout, `bank.stacked(name)`); without autograd
  the grouped compute is plain ops (no Function bookkeeping in a decode step), as in `layer.py`.
- A plain float32 per-pair loop (`reference=True`) is the test oracle.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from rl_multilora.lora.layer import grouped_lora
from rl_multilora.lora.routing import BASE_SLOT, Routing, SlotRouter

# The projection Parameters transformers' experts implementations read (`integrations/moe.py`).
FIRST_PROJ = ("gate_up_proj", "up_proj")
SECOND_PROJ = "down_proj"
EXPERT_PARAMS = (*FIRST_PROJ, SECOND_PROJ)


def is_packed_experts(module: nn.Module) -> bool:
    """True for a transformers experts module with packed 3-D weights and a switchable implementation."""
    return all(hasattr(module, a) for a in ("has_gate", "is_transposed", "num_experts")) and isinstance(
        getattr(module, SECOND_PROJ, None), nn.Parameter
    )


EXPERT_LORA_MODES = ("per_expert", "shared_a")


class ExpertLoRA(nn.Module):
    """`max_loras` slots of per-expert LoRA for one packed expert Parameter `(E, out, in)` (or `(E, in, out)`).

    `lora_A: (max_loras, E, max_rank, in)`, `lora_B: (max_loras, E, out, max_rank)`, zero-filled. With
    `shared_a` (ModelOpt's layout) one A per slot serves every expert: `lora_A: (max_loras, 1, max_rank, in)`.
    """

    def __init__(
        self,
        name: str,
        param: nn.Parameter,
        transposed: bool,
        max_loras: int,
        max_rank: int,
        dtype,
        shared_a: bool = False,
    ):
        super().__init__()
        self.name = name
        num_experts, d1, d2 = param.shape
        self.num_experts = num_experts
        self.shared_a = shared_a
        self.is_transposed = transposed  # the Parameter is stored (E, in, out)
        self.in_features, self.out_features = (d1, d2) if transposed else (d2, d1)
        device = param.device
        a_experts = 1 if shared_a else num_experts
        self.lora_A = nn.Parameter(
            torch.zeros(max_loras, a_experts, max_rank, self.in_features, dtype=dtype, device=device)
        )
        self.lora_B = nn.Parameter(
            torch.zeros(max_loras, num_experts, self.out_features, max_rank, dtype=dtype, device=device)
        )

    def extra_repr(self) -> str:
        shared = ", shared_a" if self.shared_a else ""
        return f"name={self.name}, experts={self.num_experts}, in={self.in_features}, out={self.out_features}{shared}"

    def stacked(self, routing: Routing | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(A, B) over every slot: the engine bank's copies when the routing has one, else this module's own."""
        if routing is not None and routing.bank is not None:
            return routing.bank.stacked(self.name)
        return self.lora_A, self.lora_B

    def add_delta(self, proj: torch.Tensor, x: torch.Tensor, pairs: _PairRouting) -> torch.Tensor:
        """`proj[p] += scale[s] * (x[p] @ A[s, e].T) @ B[s, e].T` for the LoRA pairs p (slot s, expert e).

        proj: (P, out) base projection of every pair, x: (P, in) its input; returns the sum in proj's dtype.
        The pairs are cut into segments of one (slot, expert) each (`_Segments`): per segment one gather of its A
        and B and two batched matmuls over all segments at once.
        """
        routing = pairs.routing
        scales = routing.scales_for(self.name)  # (n_active,) per active row, or None: no used slot covers it
        if scales is None or pairs.sel.numel() == 0:
            return proj
        lora_a, lora_b = self.stacked(routing)
        out = proj.to(lora_a.dtype)  # (P, out); summed in the LoRA dtype and rounded once, as LoRALinear
        seg = pairs.segments
        x_sorted = x.index_select(0, seg.pair_index).to(lora_a.dtype)  # (n, in): LoRA pairs by (slot, expert)
        # x_pad[k, j] = the j-th pair of segment k (zero past its end)
        x_pad = x_sorted.new_zeros(seg.count * seg.width, self.in_features).index_copy(0, seg.pad_pos, x_sorted)
        seg_scale = scales.new_zeros(seg.count).index_copy(0, seg.seg_of, scales.index_select(0, seg.active_pos))
        flat_a = lora_a.view(-1, *lora_a.shape[2:])  # (S * E, R, in), or (S, R, in) when shared
        flat_b = lora_b.view(-1, *lora_b.shape[2:])  # (S * E, out, R)
        y_pad = out.new_zeros(seg.count, seg.width, self.out_features)
        grad = torch.is_grad_enabled() and (lora_a.requires_grad or x.requires_grad)
        # y_pad[k] += scale[k] * x_pad[k] @ A[s_k, e_k].T @ B[s_k, e_k].T: one gather of A and B per segment
        grouped_lora(
            y_pad, x_pad.view(seg.count, seg.width, -1), flat_a, flat_b, seg.key, seg_scale, routing.max_rank, grad,
            seg.slot if self.shared_a else None,
        )  # fmt: skip
        delta = y_pad.view(-1, self.out_features).index_select(0, seg.pad_pos)  # (n, out), in sorted order
        return out.index_add(0, seg.pair_index, delta).to(proj.dtype)  # out[pair_index[i]] += delta[i]


class _Segments:
    """The LoRA pairs of one layer sorted by (slot, expert) and cut into `count` segments of at most `width` pairs,
    each of one (slot, expert): what `ExpertLoRA.add_delta` runs its batched matmuls over.

    Per-pair gathers of A and B (as `layer.py` does per row) would move `rank x (in + out)` values per token, rank
    times the activations themselves: a row of a Linear is a whole sequence, a pair is one token. Per segment the
    gather is paid once. A large group is cut into several segments of `width` = ceil(pairs / groups), so a skewed
    mix pads at most one partial segment per group: the padded size stays below twice the pairs plus the groups.
    Segments never mix slots, so a NaN/inf pair reaches only its own slot's gradients.
    """

    def __init__(self, pairs: _PairRouting, num_experts: int):
        key = pairs.slot * num_experts + pairs.expert  # (n,) flat (slot, expert) index
        sorted_key, order = torch.sort(key, stable=True)
        groups, counts = torch.unique_consecutive(sorted_key, return_counts=True)  # (U,), (U,)
        n, num_groups = key.numel(), groups.numel()
        self.width = -(-n // num_groups)  # ceil: the mean group size
        chunks = (counts + self.width - 1) // self.width  # (U,) segments per group
        self.count = int(chunks.sum())  # host sync (one per layer, shared by its expert Parameters)
        device = key.device
        group_of = torch.repeat_interleave(torch.arange(num_groups, device=device), counts)  # (n,) sorted pairs
        start = torch.cumsum(counts, 0) - counts  # (U,) first sorted pair of each group
        pos = torch.arange(n, device=device) - start.index_select(0, group_of)  # (n,) position in its group
        first_seg = torch.cumsum(chunks, 0) - chunks  # (U,) first segment of each group
        seg_of = first_seg.index_select(0, group_of) + torch.div(pos, self.width, rounding_mode="floor")
        self.seg_of = seg_of  # (n,) each sorted pair's segment
        self.pad_pos = seg_of * self.width + pos % self.width  # (n,) each sorted pair's row in the padded layout
        self.key = torch.repeat_interleave(groups, chunks)  # (K,) (slot, expert) of each segment
        self.slot = torch.div(self.key, num_experts, rounding_mode="floor")  # (K,)
        self.pair_index = pairs.sel.index_select(0, order)  # (n,) the sorted pairs' positions among all pairs
        self.active_pos = pairs.active_pos.index_select(0, order)  # (n,) into the routing's active rows


def expert_a_per_expert(lora_a: torch.Tensor, num_experts: int) -> torch.Tensor:
    """A slot's A `(E, r, in)` or shared `(1, r, in)` -> `(E, r, in)`: what PEFT's per-expert layout holds."""
    return lora_a if lora_a.shape[0] == num_experts else lora_a.expand(num_experts, *lora_a.shape[1:])


class _PairRouting:
    """Which (token, k) pairs, sorted by expert, use an adapter: their positions, slots, experts, active rows."""

    def __init__(self, routing: Routing, pair_row: torch.Tensor, expert: torch.Tensor, num_experts: int):
        # pair_row, expert: (P,) the batch row and the expert of each sorted pair
        self.routing = routing
        if routing.active is None:  # every row uses an adapter
            active_pos = pair_row
            self.sel = torch.arange(pair_row.numel(), device=pair_row.device)
        else:
            row_pos = torch.full((routing.batch_size,), -1, dtype=torch.long, device=pair_row.device)
            row_pos[routing.active] = torch.arange(routing.active.numel(), device=pair_row.device)
            pos = row_pos[pair_row]  # (P,) position of each pair's row among the active rows; -1 = base row
            self.sel = (pos >= 0).nonzero().squeeze(1)
            active_pos = pos.index_select(0, self.sel)
        self.active_pos = active_pos  # (n,) into routing.row_slots / scales_for(...)
        self.slot = routing.row_slots.index_select(0, active_pos)  # (n,)
        self.expert = expert.index_select(0, self.sel)  # (n,)
        self.num_experts = num_experts
        self._segments: _Segments | None = None

    @property
    def segments(self) -> _Segments:
        """The pairs cut into (slot, expert) segments, computed once per layer for all its expert Parameters."""
        if self._segments is None:
            self._segments = _Segments(self, self.num_experts)
        return self._segments


class LoRAExperts:
    """Mixin put in front of a packed experts class: its forward adds each routed token's slot's expert LoRA.

    The instance keeps its own attributes and Parameters; `lora_<param>` children hold the slots.
    """

    _lora_router: SlotRouter
    _lora_targets: dict[str, str]  # param name in this module -> full Parameter name

    def lora(self, param: str) -> ExpertLoRA | None:
        return getattr(self, f"lora_{param}", None)

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        routing = self._lora_router.current
        if (
            routing is None
            or not routing.groups
            or not any(routing.scales_for(name) is not None for name in self._lora_targets.values())
        ):
            return super().forward(hidden_states, top_k_index, top_k_weights)
        num_tokens = hidden_states.shape[0]
        if num_tokens % routing.batch_size:
            raise RuntimeError(
                f"expert LoRA got {num_tokens} tokens, not a multiple of the batch size {routing.batch_size}; "
                "multi-LoRA routing needs the experts' tokens flattened batch-first (B * L, H)"
            )
        if routing.reference:
            return self._reference_forward(hidden_states, top_k_index, top_k_weights, routing)
        return self._lora_forward(hidden_states, top_k_index, top_k_weights, routing)

    def _first_proj(self) -> str:
        return FIRST_PROJ[0] if self.has_gate else FIRST_PROJ[1]

    def _proj(self, which: str, x_g: torch.Tensor, counts: Sequence[int], expert_g: torch.Tensor) -> torch.Tensor:
        """Base `y[p] = x[p] @ W[e_p].T (+ b[e_p])` for pairs sorted by expert; x_g: (P, in) -> (P, out)."""
        weight = getattr(self, which)
        pieces, start = [], 0
        for e, n in enumerate(counts):  # one matmul per expert with pairs: the loop is over E, never over slots
            if n:
                w = weight[e]  # (out, in), or (in, out) when transposed
                seg = x_g[start : start + n]
                pieces.append(seg @ w if self.is_transposed else F.linear(seg, w))
                start += n
        y = torch.cat(pieces) if pieces else x_g.new_zeros(0, weight.shape[2 if self.is_transposed else 1])
        bias = getattr(self, f"{which}_bias", None) if getattr(self, "has_bias", False) else None
        if bias is not None:
            y = y + bias.index_select(0, expert_g)
        return y

    def _activate(self, up: torch.Tensor) -> torch.Tensor:
        return self._apply_gate(up) if self.has_gate else self.act_fn(up)

    def _lora_forward(self, hidden_states, top_k_index, top_k_weights, routing: Routing) -> torch.Tensor:
        num_tokens, hidden = hidden_states.shape
        top_k = top_k_index.shape[-1]
        seq = num_tokens // routing.batch_size
        expert_ids = top_k_index.reshape(-1)  # (P,), pair p = t * top_k + k
        expert_g, perm = torch.sort(expert_ids, stable=True)  # pairs sorted by expert
        token_g = perm // top_k  # (P,) token of each sorted pair
        counts = torch.bincount(expert_ids, minlength=self.num_experts).tolist()  # one host sync per layer
        pairs = _PairRouting(routing, token_g // seq, expert_g, self.num_experts)
        x_g = hidden_states.index_select(0, token_g)  # (P, H)

        first, second = self._first_proj(), SECOND_PROJ
        up = self._proj(first, x_g, counts, expert_g)  # (P, 2I) or (P, I)
        if (lora := self.lora(first)) is not None:
            up = lora.add_delta(up, x_g, pairs)
        h = self._activate(up)  # (P, I)
        y = self._proj(second, h, counts, expert_g)  # (P, H)
        if (lora := self.lora(second)) is not None:
            y = lora.add_delta(y, h, pairs)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        y = y * top_k_weights.reshape(-1).index_select(0, perm).unsqueeze(-1)  # routing weight after down_proj
        unsorted = torch.empty_like(y).index_copy(0, perm, y)  # back to pair order t * top_k + k
        return unsorted.view(num_tokens, top_k, hidden).sum(dim=1).to(hidden_states.dtype)

    def _reference_forward(self, hidden_states, top_k_index, top_k_weights, routing: Routing) -> torch.Tensor:
        """Plain float32 loop over (token, k) pairs with the full padded tensors: the oracle for `_lora_forward`."""
        meta = {g.slot: g for g in routing.groups}
        seq = hidden_states.shape[0] // routing.batch_size
        first = self._first_proj()

        def proj(which: str, x: torch.Tensor, e: int, slot: int) -> torch.Tensor:
            w = getattr(self, which)[e].float()
            y = x @ w if self.is_transposed else x @ w.T
            if getattr(self, "has_bias", False):
                y = y + getattr(self, f"{which}_bias")[e].float()
            lora = self.lora(which)
            if lora is not None and slot != BASE_SLOT and lora.name in meta[slot].modules:
                lora_a, lora_b = lora.stacked(routing)
                a, b = lora_a[slot, 0 if lora.shared_a else e].float(), lora_b[slot, e].float()
                y = y + meta[slot].scale * ((x @ a.T) @ b.T)  # y += scale[s] * (x @ A[s, e].T) @ B[s, e].T
            return y

        rows = []
        for t in range(hidden_states.shape[0]):
            slot = routing.slots[t // seq]
            x = hidden_states[t].float()
            out = torch.zeros_like(x)
            for k in range(top_k_index.shape[-1]):
                e = int(top_k_index[t, k])
                h = self._activate(proj(first, x, e, slot).unsqueeze(0))[0]
                y = proj(SECOND_PROJ, h, e, slot)
                if getattr(self, "has_post_expert_norm", False):
                    y = self.post_expert_norm(y)
                out = out + top_k_weights[t, k].float() * y
            rows.append(out)
        return torch.stack(rows).to(hidden_states.dtype)


def inject_expert_lora(
    module: nn.Module,
    module_name: str,
    params: Sequence[str],
    router: SlotRouter,
    max_loras: int,
    max_rank: int,
    dtype: torch.dtype,
    shared_a: bool = False,
) -> dict[str, ExpertLoRA]:
    """Give the packed experts `module` (named `module_name`) LoRA slots on `params`; returns full name -> holder.

    Its class becomes a subclass with the LoRA forward; its Parameters and state-dict keys stay as they were.
    """
    if isinstance(module, LoRAExperts):
        raise ValueError(f"{module_name} already has expert LoRA injected")
    cls = type(module)
    module.__class__ = type(f"LoRA{cls.__name__}", (LoRAExperts, cls), {})
    module._lora_router = router
    module._lora_targets = {}
    holders: dict[str, ExpertLoRA] = {}
    for param in params:
        full = f"{module_name}.{param}" if module_name else param
        transposed = bool(module.is_transposed)
        holder = ExpertLoRA(full, getattr(module, param), transposed, max_loras, max_rank, dtype, shared_a)
        module.add_module(f"lora_{param}", holder)
        module._lora_targets[param] = full
        holders[full] = holder
    return holders


def init_expert_a(lora_a: torch.Tensor, rank: int, generator: torch.Generator | None) -> torch.Tensor:
    """PEFT's init of a packed expert A (`kaiming_uniform_(a=sqrt(5))` on its `(E * r, in)` Linear weight, i.e.
    U(-1/sqrt(in), 1/sqrt(in))), drawn as one `(E * r, in)` tensor and returned as `(E, r, in)`."""
    num_experts, _, in_features = lora_a.shape
    init = lora_a.new_empty(num_experts * rank, in_features)
    nn.init.kaiming_uniform_(init, a=math.sqrt(5), generator=generator)
    return init.view(num_experts, rank, in_features)
