"""Per-tenant algorithms in one mixed batch: each tenant's own loss, KL, clip, temperature and TIS act on its own
rows only; a tenant ends where it ends trained alone, whatever the others use; TIS weights are reported."""

from __future__ import annotations

import math

import pytest
import torch

from rl_multilora.config import AdapterConfig, GRPOSettings, OptimSettings
from rl_multilora.grpo import tenant_algo
from rl_multilora.losses import LOSSES
from rl_multilora.trainer import MultiLoRATrainer
from tests.test_trainer import RANKS, SEEDS, VOCAB, params_of, random_samples
from tests.tiny_models import PAD_ID, tiny_model

GRPO = GRPOSettings(micro_batch_size=4, drop_uniform_groups=False)


def _adapter(name: str, **own) -> AdapterConfig:
    return AdapterConfig(name=name, dataset={"path": "json"}, reward={"name": "gsm8k"}, max_steps=50, **own)


def _build(tenants: dict[str, dict], grpo: GRPOSettings = GRPO):
    from rl_multilora.lora import MultiLoRAModel

    model = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=4, max_rank=16)
    trainer = MultiLoRATrainer(model, grpo, pad_token_id=PAD_ID, norm_len=8)
    for name, own in tenants.items():
        model.add_adapter(name, rank=RANKS[name], alpha=2 * RANKS[name], seed=SEEDS[name])
        algo = tenant_algo(grpo, _adapter(name, **own), 1.0, 8)
        trainer.add_adapter(name, OptimSettings(), lr=1e-2, max_steps=50, algo=algo)
    return model, trainer


def _rollout_logprobs(samples, shift: float):
    """Engine log-probs about `shift` below, at and above the trainer's (about -ln 128 on the random base), token by
    token: a mismatch for TIS to see, with importance weights both above and below 1."""
    for s in samples:
        s.rollout_logprobs = [-math.log(VOCAB) + shift * ((i % 3) - 1) for i in range(len(s.response_ids))]
    return samples


@pytest.mark.parametrize("loss", LOSSES)
def test_a_tenant_with_its_own_loss_trains_beside_others_as_alone(loss):
    own = {"loss": loss, "kl_coef": 0.05, "sampling": {"temperature": 0.7}}
    if loss == "gspo":
        own.update(eps_clip=3e-4, eps_clip_high=4e-4)
    mixed_model, mixed = _build({"a": own, "b": {}, "c": {"loss": "cispo", "tis": {"mode": "sequence", "cap": 1.5}}})
    alone_model, alone = _build({"a": own})
    a = random_samples("a", 3, 4, seed=1)
    for _ in range(2):
        others = _rollout_logprobs(random_samples("b", 2, 4, seed=2) + random_samples("c", 2, 4, seed=3), 0.3)
        mixed_stats = mixed.train_step(a + others)
        alone_stats = alone.train_step(random_samples("a", 3, 4, seed=1))
        assert mixed_stats["a"].stepped and alone_stats["a"].stepped
        assert mixed_stats["a"].loss == pytest.approx(alone_stats["a"].loss, rel=1e-5, abs=1e-7)
    for x, y in zip(params_of(mixed_model, "a"), params_of(alone_model, "a"), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_each_loss_moves_a_tenant_differently_and_the_default_is_the_runs():
    """The same rows under each loss give different updates (two PPO epochs: in the first the ratio is 1 and some
    surrogates share their gradient); a tenant that sets nothing of its own has no algo: the run's GRPOSettings
    path, exactly as before."""
    results = {}
    # A narrow clip range, so the second epoch clips: PPO's clipped tokens stop, CISPO's keep a clipped weight.
    two_epochs = GRPOSettings(
        micro_batch_size=4, drop_uniform_groups=False, ppo_epochs=2, eps_clip=1e-3, eps_clip_high=1e-3
    )
    for loss in (None, *LOSSES):
        own = {} if loss is None else {"loss": loss}
        model, trainer = _build({"a": own}, two_epochs)
        trainer.train_step(random_samples("a", 3, 4, seed=7))
        results[loss] = torch.cat([p.flatten() for p in params_of(model, "a")])
    assert tenant_algo(GRPO, _adapter("a"), 1.0, 8) is None
    distinct = {k: v for k, v in results.items() if k is not None}
    keys = list(distinct)
    for i, x in enumerate(keys):
        for y in keys[i + 1 :]:
            assert not torch.allclose(distinct[x], distinct[y]), (x, y)


def test_tis_weights_are_reported_and_capped():
    _, trainer = _build({"a": {"tis": {"mode": "token", "cap": 1.2}}, "b": {}})
    samples = _rollout_logprobs(random_samples("a", 2, 4, seed=4), 1.0) + random_samples("b", 2, 4, seed=5)
    stats = trainer.train_step(samples)
    a, b = stats["a"], stats["b"]
    assert a.tis_weight_mean is not None and 0.0 < a.tis_weight_mean <= 1.2
    assert 0.0 < a.tis_capped_frac < 1.0 and a.logprob_gap is not None and a.logprob_gap > 0.3
    assert b.tis_weight_mean is None  # only the tenant that asked for it
    assert math.isfinite(a.loss)
    # and they reach metrics.jsonl (and wandb) as the losses guide says; they did not
    from rl_multilora.metrics import StepRecord

    def row(name, st):
        return StepRecord(1, name, 1, 0.5, 0.1, 4.0, 8, 0.0, 0, 0, 0, 0, 0, 1, train=st).to_row()

    got = row("a", a)
    assert (got["tis_weight_mean"], got["tis_capped_frac"]) == (a.tis_weight_mean, a.tis_capped_frac)
    assert "tis_weight_mean" not in row("b", b)


def test_tis_is_refused_at_a_sampling_temperature_its_log_probs_cannot_correct():
    from rl_multilora.config import ConfigError, parse_run_config

    tenant = {"name": "a", "dataset": {"path": "json"}, "reward": {"name": "gsm8k"}, "max_steps": 2, "tis": {}}
    for cfg in (
        {"adapters": [{**tenant, "sampling": {"temperature": 0.7}}]},
        {"rollout": {"temperature": 0.9}, "adapters": [tenant]},
    ):
        with pytest.raises(ConfigError, match=r"adapters\.a\.tis=.*TIS needs temperature 1"):
            parse_run_config({"model": {"path": "m"}, **cfg})
    assert parse_run_config({"model": {"path": "m"}, "adapters": [tenant]}).adapters[0].tis.cap == 2.0


def test_a_kl_tenant_meets_rows_in_a_later_epoch_whose_first_epoch_micro_batch_had_no_kl():
    """Two PPO epochs, the run without KL, one tenant with its own: when a tenant leaves after the first epoch the
    micro-batches are cut again, so a row whose first-epoch micro-batch needed no reference log-probs can share one
    with the KL tenant's rows later. The reference log-probs are cached for every row of a step that has some KL,
    and the KL tenant still ends where it ends trained alone."""
    two_epochs = GRPOSettings(micro_batch_size=4, drop_uniform_groups=False, ppo_epochs=2)

    def rows():  # c: 2 rows, b: 2 rows, a: 4 rows -> epoch 1 cuts [c c b b] [a a a a], epoch 2 [b b a a] [a a]
        return (
            random_samples("c", 1, 2, seed=3) + random_samples("b", 1, 2, seed=2) + random_samples("a", 1, 4, seed=1)
        )

    mixed_model, mixed = _build({"a": {"kl_coef": 0.05}, "b": {}, "c": {}}, two_epochs)
    alone_model, alone = _build({"a": {"kl_coef": 0.05}}, two_epochs)
    stats = mixed.train_step(rows(), max_steps={"c": 1})
    assert stats["c"].n_steps == 1 and stats["a"].n_steps == 2 and stats["b"].n_steps == 2
    alone_stats = alone.train_step(random_samples("a", 1, 4, seed=1))
    assert stats["a"].kl == pytest.approx(alone_stats["a"].kl, rel=1e-5, abs=1e-9) and stats["a"].kl > 0
    for x, y in zip(params_of(mixed_model, "a"), params_of(alone_model, "a"), strict=True):
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-6)


def test_a_tenant_without_kl_gets_no_kl_term_beside_one_with_it():
    """Tenant a has no KL; b, in the same micro-batch, has one, so the base's log-probs are computed for every token.
    a's token whose log-prob fell 94 nats under the base's made k3 overflow, and a's 0 * inf was NaN: its loss and
    step were lost because of its neighbour. Its loss and gradient now equal those it has alone."""
    from rl_multilora.grpo import TokenSettings, per_adapter_sum, token_loss
    from rl_multilora.losses import TenantAlgo
    from rl_multilora.rows import Row, TokenIndex

    cfg = GRPOSettings()

    def algo(kl):
        return TenantAlgo("grpo", True, "token-mean", kl, 0.2, 0.28, 1.0, 8)

    def loss_and_grad(names, algos):
        rows = [Row(n, [1, 2, 3], [1, 2], 1.0, None) for n in names]
        slot_of = {n: i for i, n in enumerate(sorted(set(names)))}
        tok = TokenIndex.build(rows, slot_of, None, "cpu")
        settings = TokenSettings.of([algos[n] for n in sorted(slot_of)], cfg, 1.0, tok.adapter)
        logp = torch.tensor([-2.0, -95.0] + [-2.0, -2.0] * (len(rows) - 1), requires_grad=True)  # (N,)
        ref = torch.tensor([-2.0, -1.0] + [-2.1, -1.9] * (len(rows) - 1))  # (N,) the base's
        entropy = torch.zeros(len(logp))
        out = token_loss(
            cfg, settings, tok, logp, logp.detach(), ref if settings.need_ref else None, entropy, len(rows)
        )
        per = per_adapter_sum(out.total, tok.adapter, len(slot_of))  # (n_adapters,)
        per[slot_of["a"]].backward()
        return per[slot_of["a"]].item(), logp.grad[:2], settings.need_ref

    alone, alone_grad, needed = loss_and_grad(["a"], {"a": algo(0.0)})
    beside, beside_grad, needed_beside = loss_and_grad(["a", "b"], {"a": algo(0.0), "b": algo(0.1)})
    assert not needed and needed_beside  # b made the base's log-probs part of the micro-batch
    assert math.isfinite(beside) and beside == alone
    assert torch.equal(beside_grad, alone_grad)
