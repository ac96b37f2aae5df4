"""The trainer's parts, each alone: the batch builder (per-adapter normalization, exclusions, micro-batches), the
mixed micro-batch loss, one tenant's optimizer (clipping, NaN skip, state) and the rank coordinator (world 1, the
token-balanced split). No model is built here; `tests/test_trainer.py` tests them composed."""

from __future__ import annotations

import math

import pytest
import torch

from rl_multilora.batch import build_batch, micro_batches, token_weights
from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.grpo import TokenSettings, kl_penalty, per_adapter_sum, policy_loss, token_loss
from rl_multilora.losses import TenantAlgo
from rl_multilora.ranks import RankCoordinator
from rl_multilora.rows import Row, TokenIndex, pad
from rl_multilora.tenant_optim import TenantOptimizer, clip_grads_
from rollout.types import SampleStatus
from tests.test_trainer import random_samples, sample

# ----------------------------------------------------------------------------------------------- batch builder


def _rows(name: str, lengths: list[int], advantage: float = 1.0) -> list[Row]:
    """Rows of `name` with 2 prompt tokens and `n` loss tokens each."""
    return [
        Row(
            adapter=name,
            input_ids=[3, 4] + [5] * n,
            targets=list(range(2, 2 + n)),
            advantage=advantage,
            rollout_logprobs=None,
        )
        for n in lengths
    ]


@pytest.mark.parametrize("agg", ["token-mean", "seq-mean-token-mean", "seq-mean-token-sum"])
def test_an_adapters_token_weights_ignore_the_other_adapters_rows(agg):
    a = _rows("a", [1, 4, 2])
    alone = token_weights({"a": a}, agg, {})
    mixed = token_weights({"b": _rows("b", [7, 7]), "a": a, "c": _rows("c", [1] * 5)}, agg, {})
    assert {id(r): mixed[id(r)] for r in a} == alone
    # each adapter's weights sum to its own aggregate over its own tokens
    total = sum(alone[id(r)] * len(r.targets) for r in a)
    expected = {"token-mean": 1.0, "seq-mean-token-mean": 1.0, "seq-mean-token-sum": 7 / 3}[agg]
    assert total == pytest.approx(expected)


def test_a_tenants_own_aggregation_overrides_the_runs():
    algo = TenantAlgo(
        loss="dr_grpo",
        normalize_std=False,
        loss_agg="seq-mean-token-sum-norm",
        kl_coef=0.0,
        eps_low=0.2,
        eps_high=0.2,
        temperature=1.0,
        norm_len=8,
    )
    a, b = _rows("a", [1, 4]), _rows("b", [1, 4])
    weights = token_weights({"a": a, "b": b}, "token-mean", {"a": algo, "b": None})
    assert [weights[id(r)] for r in a] == [1.0 / (2 * 8)] * 2  # Dr. GRPO: rows over the constant budget
    assert [weights[id(r)] for r in b] == [1.0 / 5] * 2  # the run's token-mean


def test_build_batch_counts_exclusions_per_adapter_and_keeps_the_others_rows():
    a = random_samples("a", 2, 4, seed=1)
    b = random_samples("b", 2, 4, seed=2)
    alone = build_batch(random_samples("b", 2, 4, seed=2))

    a[0].status = SampleStatus.FAILED
    a[1].status = SampleStatus.ABORTED
    a[2].response_ids = []
    a[2].loss_mask = []
    a[3].weight_version = 0  # stale: a's current version is 1
    a[4].loss_mask = [0] * len(a[4].response_ids)  # nothing to learn from
    mixed = build_batch(a + b, current_versions={"a": 1})

    st = mixed.stats["a"]
    assert (st.excluded, st.stale, st.error, st.skipped_nonfinite) == (4, 1, None, False)
    assert st.n_rows == 3 and [r.adapter for r in mixed.rows[:3]] == ["a"] * 3
    assert list(mixed.stats) == ["a", "b"]
    # b's rows, counts and advantages are what they are without a's samples
    assert vars(mixed.stats["b"]) == vars(alone.stats["b"])
    assert [vars(r) for r in mixed.by_adapter["b"]] == [vars(r) for r in alone.by_adapter["b"]]


def test_a_malformed_sample_or_a_nonfinite_reward_costs_only_its_own_adapter():
    a, b, c = (random_samples(n, 2, 3, seed=i) for i, n in enumerate("abc"))
    a[4].prompt_ids = []
    b[0].reward = float("nan")
    batch = build_batch(a + b + c)
    assert "prompt_ids is empty" in batch.stats["a"].error and batch.stats["a"].n_rows == 0
    assert batch.stats["b"].skipped_nonfinite and batch.stats["b"].n_rows == 0
    assert set(batch.by_adapter) == {"c"} and batch.stats["c"].n_rows == 6


def test_uniform_groups_are_dropped_and_counted():
    samples = [sample("a", 0, 1.0) for _ in range(3)] + [sample("a", 1, r) for r in (1.0, 0.0)]
    batch = build_batch(samples)
    assert batch.stats["a"].dropped_groups == 1 and batch.stats["a"].n_rows == 2
    kept = build_batch(samples, drop_uniform_groups=False)
    assert kept.stats["a"].dropped_groups == 0 and kept.stats["a"].n_rows == 5


def test_micro_batches_have_the_same_count_on_every_rank():
    rows = _rows("a", [1] * 7)
    shares = [rows[:5], rows[5:]]
    assert [len(m) for m in micro_batches(shares, 0, 2)] == [2, 2, 1]
    assert [len(m) for m in micro_batches(shares, 1, 2)] == [2, 0, 0]  # empty: zero-weight filler
    assert micro_batches([rows], 0, 3) == [rows[:3], rows[3:6], rows[6:]]


def test_pad_and_token_index_line_up():
    micro = _rows("b", [2]) + _rows("a", [1], advantage=-0.5)
    micro[0].rollout_logprobs = [-1.0, -2.0]
    ids, mask = pad(micro, pad_token_id=0, device="cpu")
    assert ids.tolist() == [[3, 4, 5, 5], [3, 4, 5, 0]] and mask.tolist() == [[1, 1, 1, 1], [1, 1, 1, 0]]
    weights = {id(micro[0]): 0.25, id(micro[1]): 1.0}
    tok = TokenIndex.build(micro, {"a": 0, "b": 1}, weights, "cpu")
    assert tok.row.tolist() == [0, 0, 1] and tok.pos.tolist() == [2, 3, 2] and tok.adapter.tolist() == [1, 1, 0]
    assert tok.weight.tolist() == [0.25, 0.25, 1.0] and tok.advantage.tolist() == [1.0, 1.0, -0.5]
    assert tok.has_rollout.tolist() == [True, True, False] and tok.rollout_logp.tolist() == [-1.0, -2.0, 0.0]
    assert tok.counts == [2, 1] and tok.first_pos == 2


# ----------------------------------------------------------------------------------------------- the loss


def test_per_adapter_sum_against_a_loop():
    values = torch.randn(9, dtype=torch.float64)
    adapter = torch.tensor([2, 0, 0, 1, 2, 2, 0, 1, 1])
    want = [sum(float(v) for v, a in zip(values, adapter.tolist(), strict=True) if a == k) for k in range(4)]
    assert per_adapter_sum(values, adapter, 4).tolist() == pytest.approx(want, abs=1e-12)


def test_token_loss_without_own_algorithms_is_the_runs_formula():
    cfg = GRPOSettings(kl_coef=0.1, kl_type="k3", entropy_coef=0.01)
    micro = _rows("a", [3]) + _rows("b", [2], advantage=-1.0)
    tok = TokenIndex.build(micro, {"a": 0, "b": 1}, {id(r): 1.0 for r in micro}, "cpu")
    gen = torch.Generator().manual_seed(0)
    logp, old, ref, ent = (-torch.rand(5, generator=gen) for _ in range(4))
    settings = TokenSettings.of([None, None], cfg, 1.0, tok.adapter)
    assert settings.need_ref and not settings.custom and settings.temperature is None
    got = token_loss(cfg, settings, tok, logp, old, ref, ent, n_rows=2)
    pg, clipped = policy_loss(logp, old, tok.advantage, cfg.eps_clip, cfg.eps_clip_high)
    torch.testing.assert_close(got.total, pg + 0.1 * kl_penalty(logp, ref, "k3") - 0.01 * ent, rtol=0, atol=0)
    assert torch.equal(got.clipped, clipped) and got.tis is None


def test_a_tenants_own_algorithm_leaves_the_other_tenants_tokens_as_they_were():
    cfg = GRPOSettings(eps_clip=0.1, eps_clip_high=0.1)
    algo = TenantAlgo(
        loss="cispo",
        normalize_std=True,
        loss_agg="token-mean",
        kl_coef=0.5,
        eps_low=0.3,
        eps_high=0.3,
        temperature=0.7,
        norm_len=8,
        tis_mode="token",
        tis_cap=1.5,
    )
    micro = _rows("a", [3]) + _rows("b", [2], advantage=-1.0)
    micro[0].rollout_logprobs = [-1.0, -2.0, -0.5]
    tok = TokenIndex.build(micro, {"a": 0, "b": 1}, {id(r): 1.0 for r in micro}, "cpu")
    gen = torch.Generator().manual_seed(1)
    logp, old, ref, ent = (-torch.rand(5, generator=gen) for _ in range(4))
    settings = TokenSettings.of([algo, None], cfg, 1.0, tok.adapter)
    assert settings.custom and settings.temperature.tolist() == pytest.approx([0.7] * 3 + [1.0] * 2)
    got = token_loss(cfg, settings, tok, logp, old, ref, ent, n_rows=2)
    b = tok.adapter == 1
    pg, clipped = policy_loss(logp[b], old[b], tok.advantage[b], 0.1, 0.1)
    torch.testing.assert_close(got.total[b], pg)  # the run's kl_coef is 0 and b has no TIS
    assert torch.equal(got.clipped[b], clipped)
    weight, applied, _ = got.tis
    assert applied.tolist() == [True, True, True, False, False] and weight[b].tolist() == [1.0, 1.0]


# ----------------------------------------------------------------------------------------------- tenant optimizer


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(4, 3, generator=gen)), torch.nn.Parameter(torch.randn(5, generator=gen))]


def _set_grads(params, seed: int = 1, scale: float = 1.0) -> None:
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = scale * torch.randn(p.shape, generator=gen)


@pytest.mark.parametrize("max_norm", [None, 1e-2, 1e3])
def test_one_process_clips_and_steps_exactly_like_clip_grad_norm_and_adamw(max_norm):
    optim = OptimSettings(weight_decay=0.01, max_grad_norm=max_norm)
    ours, ref = _params(), _params()
    tenant = TenantOptimizer("a", ours, optim, lr=1e-2, max_steps=None)
    adamw = torch.optim.AdamW(ref, lr=1e-2, betas=tuple(optim.betas), eps=optim.eps, weight_decay=0.01)
    world1 = RankCoordinator()
    for step in range(3):
        _set_grads(ours, seed=step)
        _set_grads(ref, seed=step)
        stepped, norm = tenant.step(world1.grad_norm(tenant.grads(), reached=True), skip=False)
        want = (
            torch.nn.utils.get_total_norm([p.grad for p in ref])
            if max_norm is None
            else torch.nn.utils.clip_grad_norm_(ref, max_norm)
        )
        adamw.step()
        adamw.zero_grad(set_to_none=True)
        assert stepped and norm == float(want)
        for x, y in zip(ours, ref, strict=True):
            assert torch.equal(x, y)
    assert tenant.step_count == 3 and all(p.grad is None for p in ours)


def test_a_norm_over_ranks_clips_by_the_same_rule_in_float64():
    grads = [torch.full((3,), 2.0), torch.full((2,), -1.0)]
    norm = math.sqrt(3 * 4.0 + 2 * 1.0)
    clip_grads_(grads, norm, max_norm=0.5)
    coef = 0.5 / (norm + 1e-6)
    assert torch.equal(grads[0], torch.full((3,), 2.0 * coef)) and torch.equal(grads[1], torch.full((2,), -coef))
    unclipped = [torch.ones(2)]
    clip_grads_(unclipped, 1.0, max_norm=10.0)  # under the limit: the coefficient is 1
    assert torch.equal(unclipped[0], torch.ones(2))


@pytest.mark.parametrize("poison", [float("nan"), float("inf")])
def test_a_nonfinite_grad_skips_the_step_and_drops_the_grads(poison):
    params = _params()
    before = [p.detach().clone() for p in params]
    tenant = TenantOptimizer("a", params, OptimSettings(max_grad_norm=1.0, weight_decay=0.1), lr=1e-2, max_steps=None)
    _set_grads(params)
    params[1].grad[2] = poison
    stepped, norm = tenant.step(RankCoordinator().grad_norm(tenant.grads(), reached=True), skip=False)
    assert not stepped and not math.isfinite(norm)
    assert tenant.step_count == 0 and all(p.grad is None for p in params)
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))  # weight decay did not move it


def test_a_nonfinite_loss_skips_a_step_with_finite_grads():
    params = _params()
    before = [p.detach().clone() for p in params]
    tenant = TenantOptimizer("a", params, OptimSettings(), lr=1e-2, max_steps=None)
    _set_grads(params)
    stepped, norm = tenant.step(RankCoordinator().grad_norm(tenant.grads(), reached=True), skip=True)
    assert not stepped and math.isfinite(norm) and tenant.step_count == 0
    assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))


def test_tenant_optimizer_state_round_trip_and_a_rank_without_the_slot():
    optim = OptimSettings(schedule="cosine", warmup_steps=1)
    params = _params()
    tenant = TenantOptimizer("a", params, optim, lr=1e-2, max_steps=4)
    for step in range(2):
        _set_grads(params, seed=step)
        tenant.step(RankCoordinator().grad_norm(tenant.grads(), reached=True), skip=False)
    state = tenant.state_dict()

    restored = TenantOptimizer("a", _params(), optim, lr=1e-2, max_steps=4)
    restored.load_state_dict(state, "a")
    assert (restored.step_count, restored.lr) == (2, tenant.lr) and restored.holds
    assert torch.equal(
        restored.optimizer.state_dict()["state"][0]["exp_avg"], state["optimizer"]["state"][0]["exp_avg"]
    )

    placeholder = TenantOptimizer("a", [], optim, lr=1e-2, max_steps=4)  # another rank holds the slot
    placeholder.load_state_dict(state, "a")
    assert not placeholder.holds and (placeholder.step_count, placeholder.lr) == (2, tenant.lr)
    with pytest.raises(ValueError, match="keys including"):
        restored.load_state_dict({"optimizer": {}}, "a")


def test_tenant_optimizer_refuses_bad_settings_naming_the_field():
    with pytest.raises(ValueError, match=r"a\.lr"):
        TenantOptimizer("a", _params(), OptimSettings(), lr=0.0, max_steps=None)
    with pytest.raises(ValueError, match=r"a\.max_steps"):
        TenantOptimizer("a", _params(), OptimSettings(schedule="cosine", warmup_steps=3), lr=1e-2, max_steps=3)
    with pytest.raises(TypeError, match=r"a\.optim"):
        TenantOptimizer("a", _params(), {"lr": 1.0}, lr=1e-2, max_steps=None)


# ----------------------------------------------------------------------------------------------- rank coordinator


def test_world_one_is_a_no_op():
    ranks = RankCoordinator()
    rows = _rows("a", [3, 1, 2])
    assert ranks.split(rows) == [rows]
    assert ranks.agree(["a", "b"], {"a"}, {"b"}) == ({"a"}, {"b"})
    assert ranks.sum_floats([1.5, 2.0]) == [1.5, 2.0]
    grads = [torch.tensor([3.0, 0.0]), torch.tensor([4.0])]
    norm = ranks.grad_norm(grads, reached=True)
    assert isinstance(norm, torch.Tensor) and torch.equal(norm, torch.nn.utils.get_total_norm(grads))
    assert ranks.grad_norm([], reached=True) is None


def test_split_balances_tokens_and_keeps_each_share_in_order():
    rows = [r for n in (9, 1, 1, 1, 4, 2, 2) for r in _rows("a", [n])]
    shares = RankCoordinator(world=2, rank=1).split(rows)
    assert shares == RankCoordinator(world=2, rank=0).split(rows)  # the same deal on every rank
    tokens = [[len(r.input_ids) for r in share] for share in shares]
    # each row goes to the rank with the fewest tokens so far, ties to the lower rank
    assert tokens == [[11, 4, 4], [3, 3, 3, 6]]
    order = {id(r): i for i, r in enumerate(rows)}
    assert all([order[id(r)] for r in s] == sorted(order[id(r)] for r in s) for s in shares)
    assert sorted(id(r) for s in shares for r in s) == sorted(order)


def test_no_backward_anywhere_gives_no_norm_without_a_collective():
    # No process group exists here: a collective would raise.
    assert RankCoordinator(world=2, rank=0).grad_norm([torch.ones(2)], reached=False) is None
