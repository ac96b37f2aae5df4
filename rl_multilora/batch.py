"""The trainer's batch builder: samples -> training rows, each adapter's per-token weights, micro-batches, padding and
the flat token index of a micro-batch. Pure functions of the samples (no model, no optimizer).

Design choices:

- Tenant isolation is the first invariant. Every aggregation is expressed as a per-token weight that depends only on
  the token's own adapter (`token_weights`; token-mean: 1 / that adapter's token count in the whole batch;
  seq-mean-*: 1 / that adapter's row count, times 1 / the row's token count for token-mean rows). Each adapter's
  loss is therefore normalized over its own rows only, and its gradient does not depend on who else shares the batch
  or how the batch is cut into micro-batches. The trainer sums the adapters' normalized losses and runs one backward
  per micro-batch; since every adapter's parameters only see their own rows, the sum keeps the gradients separate.
- What costs an adapter rows is decided here, per adapter and before any forward (`build_batch`): failed, aborted or
  empty samples are excluded, samples of an older weight version are stale, uniform groups are dropped (GRPO's
  advantages), a sample whose mask keeps no token is excluded, and a malformed sample (no reward, empty prompt,
  mismatched mask or log-probs: a hook's or a data bug) or a non-finite reward / advantage costs its own adapter the
  whole step (`error` / `skipped_nonfinite`); the other adapters build the rows they would have built alone.
- Rows stay in the caller's order, so adapters stay interleaved across micro-batches.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from rl_multilora.backends.base import AdapterStepStats
from rl_multilora.grpo import adapter_name_of, compute_advantages
from rl_multilora.losses import TenantAlgo
from rollout.types import Sample, SampleStatus

EXCLUDED_STATUSES = (SampleStatus.FAILED, SampleStatus.ABORTED)


@dataclass
class Row:
    """One training row: prompt + response token ids and the loss positions inside it."""

    adapter: str
    input_ids: list[int]
    targets: list[int]  # positions (into input_ids) of the response tokens that carry loss
    advantage: float
    rollout_logprobs: list[float] | None  # aligned with `targets`


@dataclass
class Batch:
    """What `build_batch` made of a step's samples."""

    stats: dict[str, AdapterStepStats]  # every adapter seen in the samples, in first-seen order
    rows: list[Row]  # the rows that train, in the caller's order
    by_adapter: dict[str, list[Row]]  # the same rows per adapter (only adapters with rows)


def make_row(s: Sample) -> Row | None:
    """The training row of a finished sample, or None when no response token carries loss."""
    name = adapter_name_of(s)
    where = f"sample index={s.index} of adapter {name!r}"
    n_resp = len(s.response_ids)
    if not s.prompt_ids:
        raise ValueError(f"{where}: prompt_ids is empty; the first response token needs a prompt to be predicted from")
    mask = s.loss_mask if s.loss_mask else [1] * n_resp
    if len(mask) != n_resp:
        raise ValueError(f"{where}: loss_mask has {len(mask)} entries, response_ids has {n_resp}; they must match")
    if s.rollout_logprobs and len(s.rollout_logprobs) != n_resp:
        raise ValueError(
            f"{where}: rollout_logprobs has {len(s.rollout_logprobs)} entries, response_ids has {n_resp}; "
            "they must match (or be empty)"
        )
    start = len(s.prompt_ids)
    keep = [j for j, m in enumerate(mask) if m]
    if not keep:
        return None
    rollout = [float(s.rollout_logprobs[j]) for j in keep] if s.rollout_logprobs else None
    return Row(
        adapter=name,
        input_ids=list(s.prompt_ids) + list(s.response_ids),
        targets=[start + j for j in keep],
        advantage=float(s.advantage),
        rollout_logprobs=rollout,
    )


def build_batch(
    samples: Sequence[Sample],
    current_versions: Mapping[str, int] | None = None,
    normalize_std: bool = True,
    drop_uniform_groups: bool = True,
    normalize_std_of: Mapping[str, bool] | None = None,
) -> Batch:
    """The rows of `samples` that train, with per-adapter counts of what left and why (see the module docstring).

    Writes each live sample's GRPO advantage (`compute_advantages`, same arguments). `current_versions` maps adapter
    name to its current weight version; samples with an older `weight_version` are stale. Fills each adapter's
    `excluded`, `stale`, `error`, `dropped_groups`, `skipped_nonfinite`, `n_rows`, `n_tokens`.
    """
    stats: dict[str, AdapterStepStats] = {}
    live: list[Sample] = []
    for s in samples:
        name = adapter_name_of(s)
        st = stats.setdefault(name, AdapterStepStats())
        current = (current_versions or {}).get(name)
        if s.status in EXCLUDED_STATUSES or not s.response_ids:
            st.excluded += 1
        elif current is not None and s.weight_version is not None and s.weight_version < current:
            st.stale += 1
        else:
            live.append(s)

    # A malformed sample costs its own adapter this step, with the reason in `error`.
    made: dict[int, Row | None] = {}  # id(sample) -> its row (built once; the advantage is set below)
    for s in live:
        st = stats[adapter_name_of(s)]
        if st.error is None:
            try:
                if s.reward is None:
                    raise ValueError(
                        f"sample index={s.index} (group_index={s.group_index}) has reward=None: score every "
                        "sample before training"
                    )
                made[id(s)] = make_row(s)
            except ValueError as e:
                st.error = str(e)
    live = [s for s in live if stats[adapter_name_of(s)].error is None]

    adv = compute_advantages(live, normalize_std, drop_uniform_groups, normalize_std_of=normalize_std_of)
    for name, n in adv.dropped_groups.items():
        stats[name].dropped_groups = n

    rows: list[Row] = []
    for s, kept in zip(live, adv.kept, strict=True):
        if not kept:
            continue
        row = made[id(s)]
        if row is None:
            stats[adapter_name_of(s)].excluded += 1  # all-zero loss mask: nothing to learn from
        else:
            row.advantage = float(s.advantage)
            rows.append(row)

    # Non-finite rewards/advantages: the tenant's step is skipped before its rows can reach the forward.
    for name in {r.adapter for r in rows if not math.isfinite(r.advantage)}:
        stats[name].skipped_nonfinite = True
    rows = [r for r in rows if not stats[r.adapter].skipped_nonfinite]
    by_adapter: dict[str, list[Row]] = defaultdict(list)
    for r in rows:
        by_adapter[r.adapter].append(r)
    for name, own in by_adapter.items():
        stats[name].n_rows = len(own)
        stats[name].n_tokens = sum(len(r.targets) for r in own)
    return Batch(stats=stats, rows=rows, by_adapter=dict(by_adapter))


def token_weights(
    by_adapter: Mapping[str, Sequence[Row]], loss_agg: str, algos: Mapping[str, TenantAlgo | None]
) -> dict[int, float]:
    """id(row) -> the weight of each of its tokens, so that sum(weight * token_loss) over an adapter's tokens is that
    adapter's own aggregate of its own rows. `loss_agg`: the run's aggregation; a tenant in `algos` with an algo
    uses its own (`TenantAlgo.loss_agg`, and its `norm_len` for seq-mean-token-sum-norm)."""
    weights: dict[int, float] = {}
    for name, rows in by_adapter.items():
        algo = algos.get(name)
        agg = loss_agg if algo is None else algo.loss_agg
        n_rows = len(rows)
        n_tokens = sum(len(r.targets) for r in rows)
        for r in rows:
            if agg == "token-mean":
                weights[id(r)] = 1.0 / n_tokens
            elif agg == "seq-mean-token-mean":
                weights[id(r)] = 1.0 / (n_rows * len(r.targets))
            elif agg == "seq-mean-token-sum-norm":  # Dr. GRPO: token sums over a constant (the budget)
                weights[id(r)] = 1.0 / (n_rows * algo.norm_len)
            else:  # seq-mean-token-sum
                weights[id(r)] = 1.0 / n_rows
    return weights


def micro_batches(shares: Sequence[Sequence[Row]], rank: int, size: int) -> list[list[Row]]:
    """Rank `rank`'s micro-batches of at most `size` rows from its share (`shares[rank]`), as many on every rank (the
    longest share's count): an empty one where this rank has run out of rows, which it runs as zero-weight filler
    so that every rank joins the same collectives."""
    n_micro = max(-(-len(share) // size) for share in shares)
    mine = shares[rank]
    return [list(mine[i * size : (i + 1) * size]) for i in range(n_micro)]


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
    weight: torch.Tensor  # aggregation weight (`token_weights`)
    rollout_logp: torch.Tensor
    has_rollout: torch.Tensor  # bool
    counts: list[int]  # tokens per row
    first_pos: int  # smallest target position (host-side, so slicing the logits needs no device sync)

    @staticmethod
    def build(micro: Sequence[Row], slot_of: Mapping[str, int], weights: Mapping[int, float], device) -> TokenIndex:
        """`slot_of`: adapter name -> its index in the micro-batch; `weights`: `token_weights` (id(row) -> weight)."""
        row, pos, target, adapter, advantage, weight, rollout, has_rollout, counts = ([] for _ in range(9))
        for b, r in enumerate(micro):
            n = len(r.targets)
            counts.append(n)
            row += [b] * n
            pos += r.targets
            target += [r.input_ids[t] for t in r.targets]
            adapter += [slot_of[r.adapter]] * n
            advantage += [r.advantage] * n
            weight += [weights[id(r)]] * n
            rollout += r.rollout_logprobs if r.rollout_logprobs is not None else [0.0] * n
            has_rollout += [r.rollout_logprobs is not None] * n

        def long(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.long, device=device)

        def flt(x: list) -> torch.Tensor:
            return torch.tensor(x, dtype=torch.float32, device=device)

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
        )
