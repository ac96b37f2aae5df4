"""GRPO trainer: advantages, tenant isolation, per-tenant optimizer steps, NaN handling, KL, clipping, schedules."""

from __future__ import annotations

import copy
import math
import random
import statistics

import pytest
import torch

from rl_multilora.batch import AdapterStepStats
from rl_multilora.config import ConfigError, GRPOSettings, OptimSettings, parse_run_config
from rl_multilora.grpo import compute_advantages, kl_penalty, lr_multiplier, policy_loss
from rl_multilora.trainer import MultiLoRATrainer
from rollout.types import AdapterRef, Sample, SampleStatus
from tests.tiny_models import PAD_ID, tiny_model

VOCAB = 128
RANKS = {"a": 4, "b": 8, "c": 16}
SEEDS = {"a": 11, "b": 22, "c": 33}


def sample(name: str, group: int, reward: float | None, prompt=(5, 6, 7), response=(8, 9), slot: int = 0, **kw):
    return Sample(
        prompt="",
        prompt_ids=list(prompt),
        response_ids=list(response),
        reward=reward,
        group_index=group,
        adapter=AdapterRef(name, slot),
        status=kw.pop("status", SampleStatus.COMPLETED),
        **kw,
    )


def random_samples(name: str, n_groups: int, group_size: int, seed: int) -> list[Sample]:
    """Groups of random prompts/responses of varied lengths with random 0/1 rewards (never uniform)."""
    rng = random.Random(seed)
    out = []
    for g in range(n_groups):
        prompt = [rng.randrange(3, VOCAB) for _ in range(rng.randint(2, 6))]
        rewards = [1.0, 0.0] + [float(rng.random() < 0.5) for _ in range(group_size - 2)]
        for r in rewards:
            response = [rng.randrange(3, VOCAB) for _ in range(rng.randint(1, 7))]
            mask = [1] * len(response)
            if len(response) > 2:
                mask[1] = 0  # e.g. a tool-output token inside the response
            out.append(sample(name, g, r, prompt=prompt, response=response, loss_mask=mask))
    return out


def optim_of(lr: float = 1e-4, total_steps: int | None = None, **settings) -> tuple[OptimSettings, float, int | None]:
    """An adapter's optimizer as the trainer takes it: (its `optim:` section, its lr, its max_steps)."""
    return OptimSettings(**settings), lr, total_steps


def build(names, cfg: GRPOSettings | None = None, optim: tuple | None = None, dtype=torch.float32):
    from rl_multilora.lora import MultiLoRAModel

    base = tiny_model(seed=0, vocab=VOCAB).to(dtype)
    model = MultiLoRAModel.from_model(base, max_loras=4, max_rank=16, target_modules="all-linear", lora_dtype=dtype)
    trainer = MultiLoRATrainer(model, cfg or GRPOSettings(micro_batch_size=3), pad_token_id=PAD_ID)
    for n in names:
        model.add_adapter(n, rank=RANKS[n], alpha=2 * RANKS[n], seed=SEEDS[n])
        settings, lr, max_steps = optim or optim_of(lr=1e-2)
        trainer.add_adapter(n, settings, lr=lr, max_steps=max_steps)
    return model, trainer


def params_of(model, name) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.adapter_parameters(name)]


def other_params(model, names) -> dict[str, torch.Tensor]:
    """Every parameter (base and all slots) except those of `names`, by name."""
    skip = {model.slot_of(n) for n in names}
    out = {}
    for k, p in model.named_parameters():
        if k.endswith(("lora_A", "lora_B")):  # stacked slots: every slot but those of `names`
            out.update({f"{k}[{s}]": p[s].detach().clone() for s in range(p.shape[0]) if s not in skip})
        else:
            out[k] = p.detach().clone()
    return out


def assert_same(xs, ys, atol=0.0):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        torch.testing.assert_close(x, y, rtol=0.0 if atol == 0.0 else 1e-5, atol=atol)


# ----- advantages -----


def test_advantages_group_normalization_with_and_without_std():
    rewards = [1.0, 0.0, 0.0, 0.5]
    mean, std = statistics.fmean(rewards), statistics.stdev(rewards)
    for normalize in (True, False):
        batch = [sample("a", 0, r) for r in rewards]
        stats = compute_advantages(batch, normalize_std=normalize)
        expected = [(r - mean) / (std + 1e-6) if normalize else r - mean for r in rewards]
        assert [s.advantage for s in batch] == pytest.approx(expected, abs=1e-9)
        assert stats.kept == [True] * 4 and stats.groups == {"a": 1} and stats.dropped_groups == {}


def test_uniform_groups_dropped_and_counted_per_adapter():
    batch = (
        [sample("a", 0, 1.0) for _ in range(3)]
        + [sample("a", 1, r) for r in (1.0, 0.0)]
        + [sample("b", 0, 0.0) for _ in range(2)]
    )
    stats = compute_advantages(batch)
    assert stats.dropped_groups == {"a": 1, "b": 1}
    assert stats.groups == {"a": 2, "b": 1}
    assert stats.kept == [False, False, False, True, True, False, False]
    assert all(s.advantage == 0.0 for s, k in zip(batch, stats.kept, strict=True) if not k)

    kept_all = compute_advantages(batch, drop_uniform_groups=False)
    assert kept_all.kept == [True] * 7 and kept_all.dropped_groups == {}
    assert [s.advantage for s in batch[:3]] == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("drop", [True, False])
def test_a_group_of_infinite_rewards_is_non_finite_not_uniform(drop):
    """All +inf compare equal: such a group (or a one-sample group scored inf) was taken as uniform, dropped or
    trained at advantage 0, and never counted as the non-finite reward it is; its advantages stay non-finite now,
    which skips that tenant's step (`test_nonfinite_reward_skips_only_that_adapter`)."""
    for rewards in ([math.inf] * 3, [math.inf], [-math.inf] * 2):
        batch = [sample("a", 0, r) for r in rewards] + [sample("b", 0, r) for r in (1.0, 0.0)]
        stats = compute_advantages(batch, drop_uniform_groups=drop)
        assert stats.dropped_groups == {} and stats.kept == [True] * len(batch)
        assert all(not math.isfinite(s.advantage) for s in batch[: len(rewards)])
        assert [s.advantage for s in batch[len(rewards) :]] == pytest.approx([0.7071, -0.7071], abs=1e-3)


def test_groups_of_different_adapters_stay_separate_with_equal_group_index():
    batch = [sample("a", 0, r) for r in (1.0, 0.0)] + [sample("b", 0, r) for r in (5.0, 5.0, 8.0)]
    compute_advantages(batch, normalize_std=False)
    assert [s.advantage for s in batch] == pytest.approx([0.5, -0.5, -1.0, -1.0, 2.0])


def test_advantages_reject_unscored_or_unowned_samples():
    with pytest.raises(ValueError, match="reward=None"):
        compute_advantages([sample("a", 0, None)])
    orphan = sample("a", 0, 1.0)
    orphan.adapter = None
    with pytest.raises(ValueError, match="adapter=None"):
        compute_advantages([orphan])


# ----- pure loss pieces -----


def test_policy_loss_clipping_against_direct_formula():
    ratios = [0.5, 0.75, 0.9, 1.0, 1.2, 1.3, 1.6, 0.5, 1.6]
    advs = [1.0, 1.0, 1.0, 1.0, 1.0, 1.0, 1.0, -2.0, -2.0]
    old = torch.tensor([-1.0 - 0.1 * i for i in range(len(ratios))])
    logp = old + torch.log(torch.tensor(ratios))
    loss, clipped = policy_loss(logp, old, torch.tensor(advs), eps_clip=0.2, eps_clip_high=0.28)

    expected, expected_clip = [], []
    for r, a in zip(ratios, advs, strict=True):
        clipped_r = min(max(r, 0.8), 1.28)
        expected.append(max(-r * a, -clipped_r * a))
        expected_clip.append(-clipped_r * a > -r * a)
    torch.testing.assert_close(loss, torch.tensor(expected), rtol=1e-6, atol=1e-6)
    assert clipped.tolist() == expected_clip
    # A > 0 is clipped only above 1 + eps_high (1.3, 1.6); A < 0 only below 1 - eps (0.5).
    assert expected_clip == [False, False, False, False, False, True, True, True, False]
    assert clipped.float().mean().item() == pytest.approx(3 / 9)


def test_kl_penalty_k1_k3_against_direct_computation():
    logp = torch.tensor([-1.0, -2.0, -0.5, -3.0])
    ref = torch.tensor([-1.0, -1.5, -0.7, -0.1])
    k1 = kl_penalty(logp, ref, "k1")
    k3 = kl_penalty(logp, ref, "k3")
    for i in range(4):
        lp, rf = logp[i].item(), ref[i].item()
        assert k1[i].item() == pytest.approx(lp - rf, abs=1e-6)
        assert k3[i].item() == pytest.approx(math.exp(rf - lp) - (rf - lp) - 1.0, abs=1e-5)
    assert k3[0].item() == 0.0 and bool((k3 >= 0).all())
    torch.testing.assert_close(kl_penalty(logp, ref, "low_var_kl"), k3.clamp(-10, 10))


def test_low_var_kl_has_a_finite_gradient_past_an_exp_overflow():
    """A reviewer's case: a base-minus-policy gap of 95 nats overflowed exp in float32; the [-10, 10] clamp's zero
    gradient times inf made a NaN gradient (the tenant's whole step skipped). verl clamps the gap to [-20, 20] first:
    such a token gets a zero gradient, the others theirs."""
    logp = torch.tensor([-1.0, -96.0], requires_grad=True)
    ref = torch.tensor([-1.5, -1.0])
    kl = kl_penalty(logp, ref, "low_var_kl")
    kl.sum().backward()
    assert torch.isfinite(kl).all() and kl[1].item() == 10.0
    assert torch.isfinite(logp.grad).all() and logp.grad[1].item() == 0.0
    assert logp.grad[0].item() == pytest.approx(1.0 - math.exp(-0.5), abs=1e-6)  # d/dlogp of k3: 1 - exp(ref - logp)


def test_lr_schedule_warmup_and_cosine_values():
    cfg = OptimSettings(schedule="cosine", warmup_steps=4, min_lr_ratio=0.1)
    for k, want in [(0, 0.25), (1, 0.5), (3, 1.0), (4, 1.0), (9, 0.55), (14, 0.1), (20, 0.1)]:
        assert lr_multiplier(k, cfg, 14) == pytest.approx(want, abs=1e-12), k
    k = 6
    assert lr_multiplier(k, cfg, 14) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.2)))
    constant = OptimSettings(warmup_steps=2)
    assert [lr_multiplier(k, constant, None) for k in range(4)] == [0.5, 1.0, 1.0, 1.0]


def test_config_errors_name_field_value_and_allowed():
    # The trainer takes the validated config sections; their errors come from config validation.
    def parse(grpo=None, **adapter):
        adapter = {"name": "a", "dataset": {"path": "json"}, "reward": {"name": "gsm8k"}, "max_steps": 4, **adapter}
        return parse_run_config({"model": {"path": "m"}, "grpo": grpo or {}, "adapters": [adapter]})

    with pytest.raises(ValueError, match=r"loss_agg='mean'.*token-mean"):
        parse(grpo={"loss_agg": "mean"})
    with pytest.raises(ValueError) as err:
        parse(grpo={"kl_type": "k2", "micro_batch_size": 0})
    assert "kl_type='k2'" in str(err.value) and "micro_batch_size=0" in str(err.value)
    with pytest.raises(ConfigError, match=r"max_steps=None.*cosine"):
        parse(optim={"schedule": "cosine"}, max_steps=None, epochs=1.0)
    with pytest.raises(ValueError, match=r"lr=-1"):
        parse(lr=-1)
    # The trainer refuses the same cosine schedule without a budget at admission, not mid-run.
    _, trainer = build([])
    trainer.model.add_adapter("a", rank=4, alpha=8)
    with pytest.raises(ValueError, match=r"max_steps=None.*cosine"):
        trainer.add_adapter("a", OptimSettings(schedule="cosine"), lr=1e-3, max_steps=None)


# ----- training -----


@pytest.mark.parametrize(
    "cfg",
    [
        GRPOSettings(micro_batch_size=3, kl_coef=0.1, entropy_coef=0.01),
        GRPOSettings(micro_batch_size=4, loss_agg="seq-mean-token-mean"),
        GRPOSettings(micro_batch_size=5, loss_agg="seq-mean-token-sum", ppo_epochs=2),
    ],
    ids=["token-mean+kl+entropy", "seq-mean-token-mean", "seq-mean-token-sum-2epochs"],
)
def test_isolation_mixed_batch_equals_training_alone(cfg):
    # float64: Adam divides by sqrt(v), which blows float32 summation-order noise on near-zero grads up to ~1e-5;
    # in float64 any real coupling between tenants would still show, far above the 1e-9 tolerance.
    mixed_model, mixed = build(["a", "b", "c"], cfg, dtype=torch.float64)
    alone_model, alone = build(["a"], cfg, dtype=torch.float64)
    b_before = params_of(mixed_model, "b")
    for step in range(3):
        a_rows = random_samples("a", 2, 3, seed=100 + step)  # 6 rows
        b_rows = random_samples("b", 2, 4, seed=200 + step)  # 8 rows
        c_rows = random_samples("c", 1, 2, seed=300 + step)  # 2 rows
        batch = [b_rows[0], *a_rows[:3], *c_rows, *b_rows[1:], *a_rows[3:]]  # interleaved across micro-batches
        stats_mixed = mixed.train_step(copy.deepcopy(batch))
        stats_alone = alone.train_step(copy.deepcopy(a_rows))
        sa, sm = stats_alone["a"], stats_mixed["a"]
        assert sm.stepped and sa.stepped and sm.n_rows == sa.n_rows == 6 and sm.n_tokens == sa.n_tokens
        for key in ("loss", "pg_loss", "kl", "entropy", "grad_norm", "clip_frac"):
            assert getattr(sm, key) == pytest.approx(getattr(sa, key), rel=1e-9, abs=1e-12), key
    assert_same(params_of(mixed_model, "a"), params_of(alone_model, "a"), atol=1e-9)
    assert mixed.adapter_step("a") == alone.adapter_step("a") == 3 * cfg.ppo_epochs
    assert any(not torch.equal(x, y) for x, y in zip(b_before, params_of(mixed_model, "b"), strict=True))


def test_only_present_adapters_step_and_base_is_frozen():
    model, trainer = build(["a", "b"], optim=optim_of(lr=1e-2, weight_decay=0.1))
    a_before = params_of(model, "a")
    others_before = other_params(model, ["a"])
    b_opt_before = copy.deepcopy(trainer.optimizer_state_dict("b"))

    stats = trainer.train_step(random_samples("a", 2, 4, seed=1))
    assert set(stats) == {"a"} and stats["a"].stepped and stats["a"].n_steps == 1
    assert trainer.adapter_step("a") == 1 and trainer.adapter_step("b") == 0
    assert any(not torch.equal(x, y) for x, y in zip(a_before, params_of(model, "a"), strict=True))
    for k, v in other_params(model, ["a"]).items():
        assert torch.equal(v, others_before[k]), k  # base weights and b's slot are bit-identical
    b_opt_after = trainer.optimizer_state_dict("b")
    assert b_opt_after["optimizer"]["state"] == {} == b_opt_before["optimizer"]["state"]
    assert b_opt_after["scheduler"] == b_opt_before["scheduler"] and trainer.adapter_step("b") == 0


def test_uniform_batch_is_no_step():
    model, trainer = build(["a"])
    before = params_of(model, "a")
    stats = trainer.train_step([sample("a", 0, 1.0) for _ in range(4)])
    assert stats["a"] == AdapterStepStats(lr=1e-2, dropped_groups=1)
    assert trainer.adapter_step("a") == 0
    assert_same(before, params_of(model, "a"))


def test_nonfinite_reward_skips_only_that_adapter():
    model, trainer = build(["a", "b"])
    _, alone = build(["a"])
    a_rows = random_samples("a", 2, 3, seed=5)
    b_rows = random_samples("b", 2, 3, seed=6)
    b_rows[0].reward = float("nan")
    b_before = params_of(model, "b")

    stats = trainer.train_step(copy.deepcopy(a_rows + b_rows))
    alone.train_step(copy.deepcopy(a_rows))
    assert stats["b"].skipped_nonfinite and not stats["b"].stepped and trainer.adapter_step("b") == 0
    assert stats["a"].stepped and not stats["a"].skipped_nonfinite and trainer.adapter_step("a") == 1
    assert_same(b_before, params_of(model, "b"))
    assert_same(params_of(model, "a"), params_of(alone.model, "a"), atol=1e-6)


def test_nonfinite_weights_skip_only_that_adapter():
    model, trainer = build(["a", "b"])
    with torch.no_grad():
        model.adapter_parameters("b")[0].view(-1)[0] = float("inf")  # a diverged tenant
    b_before = params_of(model, "b")
    stats = trainer.train_step(random_samples("a", 2, 3, seed=5) + random_samples("b", 2, 3, seed=6))
    assert stats["b"].skipped_nonfinite and not stats["b"].stepped and trainer.adapter_step("b") == 0
    assert stats["a"].stepped and math.isfinite(stats["a"].loss) and math.isfinite(stats["a"].grad_norm)
    assert all(bool(torch.isfinite(p).all()) for p in model.adapter_parameters("a"))
    for x, y in zip(b_before, params_of(model, "b"), strict=True):
        assert torch.equal(x.nan_to_num(), y.nan_to_num())


def _direct_logprobs(model, rows: list[Sample], adapter: str | None) -> list[torch.Tensor]:
    """Per-sample log-probs of the response tokens, one unpadded forward per sample."""
    out = []
    with torch.no_grad():
        for s in rows:
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(ids, attention_mask=torch.ones_like(ids), adapter_names=[adapter]).logits[0]  # (T, V)
            logp = torch.log_softmax(logits.float(), -1)  # (T, V)
            start = len(s.prompt_ids)
            targets = torch.tensor(s.response_ids)
            out.append(logp[start - 1 : start - 1 + len(targets)].gather(-1, targets[:, None]).squeeze(-1))
    return out


@pytest.mark.parametrize("kl_type", ["k1", "k3"])
def test_kl_zero_for_fresh_adapter_then_matches_direct_formula(kl_type):
    model, trainer = build(["a"], GRPOSettings(micro_batch_size=4, kl_coef=0.5, kl_type=kl_type))
    first = trainer.train_step(random_samples("a", 2, 3, seed=1))["a"]
    assert abs(first.kl) < 1e-6  # lora_B = 0: the adapter is the base model

    rows = random_samples("a", 2, 3, seed=2)
    pol, ref = _direct_logprobs(model, rows, "a"), _direct_logprobs(model, rows, None)
    vals = []
    for s, lp, rf in zip(rows, pol, ref, strict=True):
        keep = torch.tensor(s.loss_mask, dtype=torch.bool)
        vals.append(kl_penalty(lp[keep], rf[keep], kl_type))
    expected = torch.cat(vals).mean().item()  # token-mean over the adapter's loss tokens
    second = trainer.train_step(rows)["a"]
    if kl_type == "k3":
        assert second.kl > 1e-8
    else:
        assert abs(second.kl) > 1e-8
    assert second.kl == pytest.approx(expected, rel=1e-3, abs=1e-7)
    assert second.loss == pytest.approx(second.pg_loss + 0.5 * second.kl, rel=1e-5, abs=1e-7)


def test_logprob_gap_measures_rollout_vs_trainer_mismatch():
    model, trainer = build(["a"])
    rows = random_samples("a", 1, 4, seed=3)
    for s, lp in zip(rows, _direct_logprobs(model, rows, "a"), strict=True):
        s.rollout_logprobs = (lp + 0.25).tolist()
    stats = trainer.train_step(rows)["a"]
    assert stats.logprob_gap == pytest.approx(0.25, abs=1e-4)
    assert trainer.train_step(random_samples("a", 1, 4, seed=4))["a"].logprob_gap is None


def test_clip_frac_reported_on_second_ppo_epoch():
    cfg = GRPOSettings(micro_batch_size=8, ppo_epochs=2, eps_clip=0.0, eps_clip_high=0.0)
    _, trainer = build(["a"], cfg, optim_of(lr=5e-2, max_grad_norm=None))
    stats = trainer.train_step(random_samples("a", 2, 4, seed=9))["a"]
    # Epoch 1 has ratio 1 (nothing clipped); after one step nearly every ratio leaves the zero-width clip range.
    assert stats.n_steps == 2 and trainer.adapter_step("a") == 2
    assert 0.0 < stats.clip_frac <= 0.5


def test_stale_failed_and_empty_samples_are_excluded_and_counted():
    model, trainer = build(["a", "b"])
    a_rows = random_samples("a", 1, 4, seed=7)
    for s in a_rows:
        s.weight_version = 3
    stale = random_samples("b", 1, 4, seed=8)
    for s in stale:
        s.weight_version = 1
    failed = sample("a", 0, 1.0, status=SampleStatus.FAILED)
    empty = sample("a", 0, 0.0, response=())
    b_before = params_of(model, "b")
    stats = trainer.train_step(a_rows + stale + [failed, empty], current_versions={"a": 3, "b": 2})
    assert stats["b"].stale == 4 and not stats["b"].stepped and trainer.adapter_step("b") == 0
    assert stats["a"].excluded == 2 and stats["a"].n_rows == 4 and stats["a"].stepped
    assert_same(b_before, params_of(model, "b"))


def test_lr_follows_schedule_and_optimizer_state_round_trips():
    optim = optim_of(lr=1e-2, schedule="cosine", warmup_steps=2, total_steps=6, weight_decay=0.01)
    model, trainer = build(["a"], optim=optim)
    batches = [random_samples("a", 2, 3, seed=40 + k) for k in range(4)]
    lrs = [trainer.train_step(copy.deepcopy(b))["a"].lr for b in batches[:3]]
    assert lrs == pytest.approx([1e-2 * lr_multiplier(k, optim[0], optim[2]) for k in range(3)])

    saved_params = params_of(model, "a")
    saved_state = copy.deepcopy(trainer.optimizer_state_dict("a"))
    last = trainer.train_step(copy.deepcopy(batches[3]))["a"]

    model2, trainer2 = build(["a"], optim=optim)
    with torch.no_grad():
        for p, v in zip(model2.adapter_parameters("a"), saved_params, strict=True):
            p.copy_(v)
    trainer2.load_optimizer_state_dict("a", saved_state)
    assert trainer2.adapter_step("a") == 3 and trainer2.adapter_lr("a") == pytest.approx(last.lr)
    last2 = trainer2.train_step(copy.deepcopy(batches[3]))["a"]
    assert last2.lr == last.lr and last2.loss == pytest.approx(last.loss, abs=1e-7)
    assert_same(params_of(model2, "a"), params_of(model, "a"))
    assert trainer2.adapter_step("a") == trainer.adapter_step("a") == 4


def test_trainer_rejects_unknown_adapter_and_duplicate_registration():
    _, trainer = build(["a"])
    with pytest.raises(KeyError, match="'zzz'"):
        trainer.train_step([sample("zzz", 0, 1.0)])
    with pytest.raises(ValueError, match="already has an optimizer"):
        trainer.add_adapter("a", OptimSettings(), lr=1e-4)
    trainer.model.remove_adapter("a")
    with pytest.raises(RuntimeError, match="no longer in the model"):
        trainer.train_step([sample("a", 0, 1.0)])
    trainer.remove_adapter("a")
    with pytest.raises(KeyError):
        trainer.adapter_step("a")
