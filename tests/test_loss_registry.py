"""The one loss registry: every loss the Tinker SDK names against a float64 reference written token by token from
Tinker's published definitions (values and gradients with respect to the policy log-probs; `stable_reinforce` from
this project's own definition, Tinker's being unpublished), the names both doors accept derived from it, and one code path for both doors: a GRPO tenant and a Tinker client with the same loss and
data get the same gradient (up to the float32 rounding of per-token inputs)."""

from __future__ import annotations

import math
import typing

import numpy as np
import pytest
import torch

from rl_multilora.backends.local import LocalBackend
from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import AdapterConfig, GRPOSettings
from rl_multilora.losses import REGISTRY, SDK_LOSS_NAMES, SDK_LOSSES, TokenBatch, client_algo, sdk_loss
from rl_multilora.tinker import ops as tinker_ops
from rl_multilora.tinker.ops import ClientOps, FwdBwdItem, UserError
from rl_multilora.tinker.wire import Datum, Span
from rl_multilora.trainer import MultiLoRATrainer
from tests.test_trainer import VOCAB, random_samples
from tests.tiny_models import PAD_ID, tiny_model


def _batch():
    """Three rows of 4, 1 and 3 tokens; ratios on both sides of every clip range, advantages of both signs, a mask
    and weights that leave some tokens out."""
    g = torch.Generator().manual_seed(0)
    rows = torch.tensor([0, 0, 0, 0, 1, 2, 2, 2])
    old = -torch.rand(8, generator=g, dtype=torch.float64) * 3
    logp = old + torch.tensor([0.5, -0.4, 0.05, 0.0, 0.3, -0.1, 1.6, -1.5], dtype=torch.float64)
    adv = torch.tensor([1.0, 1.0, 1.0, 1.0, -0.7, 0.4, 0.4, -0.4], dtype=torch.float64)
    weights = torch.tensor([0.0, 1.0, 1.0, 0.5, 1.0, 1.0, 0.0, 1.0], dtype=torch.float64)
    return rows, old, logp, adv, weights


def _reference(name: str, cfg: dict, logp: list, old: list, adv: list, w: list, rows: list):
    """(loss, d loss / d logp) per token, float64, one token at a time, from Tinker's loss documentation."""
    loss, grad = [], []
    lo, hi = cfg.get("clip_low_threshold"), cfg.get("clip_high_threshold")
    for t, r in enumerate(rows):
        a, x = adv[t], math.exp(logp[t] - old[t])
        if name == "cross_entropy":
            loss.append(-w[t] * logp[t])
            grad.append(-w[t])
        elif name == "importance_sampling":
            loss.append(-x * a)
            grad.append(-x * a)
        elif name in ("ppo", "gspo"):
            if name == "gspo":  # the sequence ratio over the row's masked tokens, gradient s * d logp_t
                toks = [u for u, q in enumerate(rows) if q == r]
                x = math.exp(sum(w[u] * (logp[u] - old[u]) for u in toks) / sum(w[u] for u in toks))
            clipped = min(max(x, lo), hi)
            if -x * a >= -clipped * a:
                loss.append(-x * a)
                grad.append(-x * a)
            else:
                loss.append(-clipped * a)
                grad.append(0.0)
        elif name == "cispo":
            c = min(max(x, lo), hi)
            loss.append(-c * a * logp[t])
            grad.append(-c * a)
        elif name == "stable_reinforce":  # w: the sampled-token mask; old: the recorded sampler log-probs
            if w[t] == 0:
                loss.append(0.0)
                grad.append(0.0)
                continue
            c, kl, d = min(x, cfg["tis_cap"]), cfg["kl_coeff"], old[t] - logp[t]
            loss.append(w[t] * (-c * a * logp[t] + kl * (math.exp(d) - d - 1.0)))
            grad.append(w[t] * (-c * a + kl * (1.0 - math.exp(d))))
        elif name == "dro":
            beta = cfg["beta"]
            loss.append(-(logp[t] * a - 0.5 * beta * (logp[t] - old[t]) ** 2))
            grad.append(-(a - beta * (logp[t] - old[t])))
        else:
            raise AssertionError(name)
    return loss, grad


OTHER_CONFIG = {"dro": {"beta": 0.3}, "stable_reinforce": {"kl_coeff": 0.1, "tis_cap": 1.2}}
CONFIGS = [
    (name, cfg)
    for name in SDK_LOSSES
    for cfg in ({}, OTHER_CONFIG.get(name, {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}))
    if not (cfg and not REGISTRY[name].config)
]


@pytest.mark.parametrize(("name", "config"), CONFIGS)
def test_each_sdk_loss_matches_its_float64_reference(name, config):
    rows, old, logp, adv, weights = _batch()
    d = sdk_loss(name)
    cfg = d.resolve(config)
    x = logp.clone().requires_grad_(True)
    loss, _ = d.fn(TokenBatch(x, old, adv, weights, rows, 3), cfg)
    loss.sum().backward()
    want, want_grad = _reference(name, cfg, logp.tolist(), old.tolist(), adv.tolist(), weights.tolist(), rows.tolist())
    assert loss.detach().tolist() == pytest.approx(want, rel=1e-12, abs=1e-12)
    assert x.grad.tolist() == pytest.approx(want_grad, rel=1e-12, abs=1e-12)


def test_clip_ranges_are_active_somewhere_in_the_reference_batch():
    """The batch exercises both branches of every clipped loss (else the reference could not catch a clip bug)."""
    rows, old, logp, adv, weights = _batch()
    for name in ("ppo", "cispo", "gspo", "stable_reinforce"):
        d = REGISTRY[name]
        _, clipped = d.fn(TokenBatch(logp, old, adv, weights, rows, 3), d.resolve(OTHER_CONFIG.get(name, {})))
        assert 0 < int(clipped.sum()) < len(rows), name


def test_the_documented_defaults_are_the_registrys():
    assert REGISTRY["ppo"].resolve({}) == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    assert REGISTRY["cispo"].resolve({}) == {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}
    assert REGISTRY["stable_reinforce"].resolve({}) == {"kl_coeff": 0.0, "tis_cap": 2.0}


def test_stable_reinforce_reference_by_hand():
    """One token, in float64 by hand: logp -1, sampler -1.5 (ratio e^0.5 = 1.6487 > cap 1.5), A 2, kl_coeff 0.1:
    loss = -1.5 * 2 * (-1) + 0.1 * (e^-0.5 + 0.5 - 1) = 3.0 + 0.1 * 0.1065307, gradient -3 + 0.1 * (1 - e^-0.5);
    a prompt position (mask 0) carries nothing, even with a sampler log-prob far off."""
    x = torch.tensor([-1.0, -0.2], dtype=torch.float64, requires_grad=True)
    batch = TokenBatch(x, torch.tensor([-1.5, -60.0], dtype=torch.float64), torch.tensor([2.0, 0.0], dtype=torch.float64),
                       torch.tensor([1.0, 0.0], dtype=torch.float64), torch.tensor([0, 0]), 1)  # fmt: skip
    loss, capped = REGISTRY["stable_reinforce"].fn(batch, {"kl_coeff": 0.1, "tis_cap": 1.5})
    loss.sum().backward()
    assert loss.tolist() == pytest.approx([3.0 + 0.1 * (math.exp(-0.5) - 0.5), 0.0], rel=1e-15)
    assert x.grad.tolist() == pytest.approx([-3.0 + 0.1 * (1.0 - math.exp(-0.5)), 0.0], rel=1e-15)
    assert capped.tolist() == [True, False]


def test_stable_reinforce_is_not_a_grpo_tenants_loss():
    """The GRPO door does not offer it (its surrogates take the trainer's own old log-probs): the config refuses the
    name, and the registry's GRPO entry point says why."""
    from pydantic import ValidationError

    from rl_multilora.losses import token_losses

    with pytest.raises(ValidationError, match="loss"):
        AdapterConfig(name="g", dataset={"path": "json"}, reward={"name": "gsm8k"}, loss="stable_reinforce")
    z = torch.zeros(2)
    with pytest.raises(ValueError, match=r"loss='stable_reinforce' is not allowed \(a Tinker client's loss: it needs"):
        token_losses("stable_reinforce", z, z, z, torch.zeros(2, dtype=torch.long), 1, 0.2, 0.2)


def test_both_doors_accept_the_names_the_registry_derives():
    from rl_multilora.config import AdapterConfig as Cfg
    from rl_multilora.losses import GRPO_LOSSES

    choices = typing.get_args(typing.get_args(Cfg.model_fields["loss"].annotation)[0])
    assert choices == GRPO_LOSSES
    assert tinker_ops.LOSS_FNS == SDK_LOSSES
    assert SDK_LOSSES == SDK_LOSS_NAMES  # every SDK loss is served (stable_reinforce as this project's own)


@pytest.mark.parametrize(
    ("loss_fn", "config", "needle"),
    [
        ("nope", None, "allowed: cross_entropy, importance_sampling, ppo, cispo, dro, gspo, stable_reinforce"),
        ("stable_reinforce", {"kl_coeff": float("inf")}, "loss_fn_config['kl_coeff']=inf is not allowed"),
        (
            "stable_reinforce",
            {"kl_coeff": -0.1},
            "loss_fn_config['kl_coeff']=-0.1 is not allowed; allowed: a finite number >= 0",
        ),
        (
            "stable_reinforce",
            {"tis_cap": 0},
            "loss_fn_config['tis_cap']=0 is not allowed; allowed: a finite number > 0",
        ),
        ("stable_reinforce", {"beta": 1.0}, "allowed: kl_coeff, tis_cap"),
        ("dro", {"beta": -1.0}, "loss_fn_config['beta']=-1.0 is not allowed; allowed: a finite number >= 0"),
        ("ppo", {"clip_low": 0.5}, "loss_fn_config ['clip_low'] is not allowed for loss_fn 'ppo'"),
        ("ppo", {"clip_low_threshold": float("nan")}, "loss_fn_config['clip_low_threshold']=nan"),
        ("cross_entropy", {"beta": 1.0}, "allowed: none"),
        (
            "ppo",
            {"clip_low_threshold": 1.5, "clip_high_threshold": 0.5},
            "clip_low_threshold=1.5 > clip_high_threshold=0.5 is not allowed for loss_fn 'ppo'",
        ),
        ("gspo", {"clip_low_threshold": 1.3}, "clip_low_threshold=1.3 > clip_high_threshold=1.2"),
        ("cispo", {"clip_low_threshold": -3}, "loss_fn_config['clip_low_threshold']=-3 is not allowed; allowed: a"),
        ("ppo", {"clip_high_threshold": -1}, "loss_fn_config['clip_high_threshold']=-1 is not allowed; allowed: a"),
    ],
)
def test_a_loss_the_registry_cannot_compute_is_refused_with_the_reason(loss_fn, config, needle):
    with pytest.raises(ValueError) as e:
        client_algo(loss_fn, config)
    assert needle in str(e.value)


# ----------------------------------------------------------------------------------- one code path for both doors


def _backend():
    base = tiny_model(seed=0, vocab=VOCAB).to(torch.float64)
    from rl_multilora.lora import MultiLoRAModel

    model = MultiLoRAModel.from_model(
        base, max_loras=4, max_rank=16, target_modules="all-linear", lora_dtype=torch.float64
    )
    grpo = GRPOSettings(micro_batch_size=4, ppo_epochs=1, eps_clip=0.2, eps_clip_high=0.28)
    return LocalBackend(model, MultiLoRATrainer(model, grpo, pad_token_id=PAD_ID))


@pytest.mark.parametrize("loss", ["cispo", "grpo"])
def test_a_grpo_tenant_and_a_client_with_the_same_loss_and_data_get_the_same_gradient(loss, tmp_path):
    """The GRPO tenant trains on samples through `train_step`; the client sends the same sequences as datums with
    the GRPO advantages times the tenant's aggregation weight, the same clip range and its own log-probs as the
    sampler's: the gradients each accumulates before its optim_step are equal (float64, one forward path)."""
    backend = _backend()
    backend.add_adapter(
        AdapterConfig(
            name="g",
            dataset={"path": "json"},
            reward={"name": "gsm8k"},
            rank=8,
            alpha=32,
            seed=5,
            loss=loss,
            lr=1e-3,
            max_steps=5,
        )
    )
    ops = ClientOps(backend, engine=None, pad_id=PAD_ID, ckpt=CheckpointManager(tmp_path))
    ops.create("c", rank=8, seed=5, layers={})
    got: dict[str, list[torch.Tensor]] = {}
    step = backend.trainer.ops.optim_step

    def spy(name, *args, **kwargs):
        got[name] = [g.clone() for g in backend.trainer.ops.tenants[name].grads]
        return step(name, *args, **kwargs)

    backend.trainer.ops.optim_step = spy
    samples = random_samples("g", n_groups=2, group_size=4, seed=7)
    for s in samples:
        s.loss_mask = []  # every response token trains (a client's weights could say the same)
    backend.train_step(samples, {}, {"g": 1})

    n_tok = sum(len(s.response_ids) for s in samples)
    n_rows = len(samples)
    data = []
    for s in samples:
        full = s.prompt_ids + s.response_ids
        p, r = len(s.prompt_ids), len(s.response_ids)
        weight = 1.0 / n_tok if loss == "cispo" else 1.0 / (n_rows * r)  # token-mean / seq-mean-token-mean
        adv = [0.0] * (p - 1) + [s.advantage * weight] * r
        data.append(Datum(np.array(full[:-1]), {"target_tokens": np.array(full[1:]), "advantages": np.array(adv)}))
    # the sampler's log-probs: the client's own before any step (as the GRPO tenant's first epoch uses its own), in
    # float64 straight from the backend (the wire would round them to float32)
    rows = [tinker_ops._datum_row("c", "cross_entropy", d, ops.limits.vocab_size) for d in data]
    fwd = backend.forward_backward(rows, {"c": client_algo("cross_entropy", None)}, backward=False)
    for d, logp in zip(data, fwd.logprobs, strict=True):
        d.inputs["logprobs"] = logp.numpy()
    sdk = "cispo" if loss == "cispo" else "ppo"
    ops.forward_backward([FwdBwdItem("c", sdk, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}, data, False)])
    ops.optim_step("c", {"learning_rate": 1e-3})
    assert len(got["g"]) == len(got["c"]) > 0
    for a, b in zip(got["g"], got["c"], strict=True):
        # per-token inputs cross as float32 (advantages, weights, log-probs): equal up to that rounding
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6 * float(a.abs().max()))
    assert any(float(a.abs().max()) > 0 for a in got["g"])


def test_a_datum_missing_an_input_its_loss_needs_is_a_user_error(tmp_path):
    backend = _backend()
    ops = ClientOps(backend, engine=None, pad_id=PAD_ID, ckpt=CheckpointManager(tmp_path))
    ops.create("c", rank=4, seed=1, layers={})
    d = Datum(np.array([5, 6, 7]), {"target_tokens": np.array([6, 7, 8]), "advantages": np.zeros(3)})
    with pytest.raises(UserError, match=r"loss_fn 'ppo' needs loss_fn_inputs\['logprobs'\]"):
        ops.forward_backward([FwdBwdItem("c", "ppo", {}, [d], False)])


@pytest.mark.parametrize(("name", "config"), CONFIGS)
def test_each_sdk_loss_through_the_tinker_door_matches_its_reference(name, config, tmp_path):
    """A client's forward_backward with each loss and config, sampler log-probs shifted so every clip range bites:
    the `loss:sum` it reports and the gradient it accumulates are the float64 reference's on the same log-probs
    (the loss's config reaches the registry; the datum's inputs reach the right places)."""
    backend = _backend()
    ops = ClientOps(backend, engine=None, pad_id=PAD_ID, ckpt=CheckpointManager(tmp_path))
    ops.create("c", rank=8, seed=2, layers={})
    g = np.random.default_rng(0)
    data = []
    for n in (6, 9):
        full = g.integers(3, VOCAB, n + 1)
        data.append(Datum(full[:-1], {"target_tokens": full[1:]}))
    provenance = REGISTRY[name].provenance
    fwd = ops.forward_backward([FwdBwdItem("c", "cross_entropy", {}, data, forward_only=True)])[0][0]
    inputs = []
    for d, out in zip(data, fwd, strict=True):
        n = len(d.tokens)
        d.inputs["logprobs"] = out["logprobs"].astype(np.float64) + g.normal(0, 0.6, n)  # ratios across the clips
        d.inputs["advantages"] = g.normal(0, 1, n)
        d.inputs["weights" if name == "cross_entropy" else "sequence_ratio_mask"] = (g.random(n) < 0.7).astype(float)
        inputs.append(d.inputs)
    if name != "gspo":
        for d in data:
            d.inputs.pop("sequence_ratio_mask", None)
    for i, d in enumerate(data if provenance else []):
        # rl_loop's layout: the first 3 tokens a prompt, the rest sampled, the sampler's log-probs recorded (the
        # client's `logprobs` input becomes what the server recorded); no loss on the prompt
        p, n = 3, len(d.tokens)
        seq = (np.append(d.tokens[p:], d.inputs["target_tokens"][-1]).tolist(), d.inputs["logprobs"][p - 1 :].tolist())
        ops.records.record("c", [f"q{i}"], d.tokens[:p].tolist(), [(*seq, "stop")])
        d.input_spans = [Span("prompt", f"q{i}", 0, p), Span("sampled", f"q{i}", 0, n - p)]
        d.target_spans = [Span("prompt", f"q{i}", 1, p - 1), Span("sampled", f"q{i}", 0, n - p + 1)]
        d.inputs["advantages"][: p - 1] = 0.0
        d.inputs["weights"] = np.array([0.0] * (p - 1) + [1.0] * (n - p + 1))  # the mask the server derives
        d.inputs["logprobs"] = d.inputs["logprobs"].astype(np.float32).astype(np.float64)  # as recorded
        d.inputs["logprobs"][: p - 1] = 0.0
    [(_, metrics)] = ops.forward_backward([FwdBwdItem("c", name, config, data, False)])
    d = sdk_loss(name)
    cfg = d.resolve(config)
    want = 0.0
    for i, (datum, out) in enumerate(zip(data, fwd, strict=True)):
        logp = out["logprobs"].astype(np.float64).tolist()
        n = len(logp)
        w = datum.inputs.get("weights", datum.inputs.get("sequence_ratio_mask", np.ones(n))).tolist()
        loss, _ = _reference(
            name, cfg, logp, datum.inputs["logprobs"].tolist(), datum.inputs["advantages"].tolist(), w, [i] * n
        )
        want += sum(loss)
    assert metrics["loss:sum"] == pytest.approx(want, rel=1e-5, abs=1e-6)
    assert backend.trainer.ops.tenants["c"].grads is not None
