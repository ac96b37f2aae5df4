"""The chunked token log-prob / entropy path (rl_multilora.token_logprobs) against the plain one: lm_head over the
positions, log_softmax, gather, -sum p log p, with autograd. Values and the hidden states' gradient, in float64
(to 1e-12) and at the float32 the trainer uses; chunks smaller than, equal to and larger than the token count."""

from __future__ import annotations

import pytest
import torch

from rl_multilora.token_logprobs import token_logp_entropy


def plain(hidden, weight, bias, targets, inv_t):
    z = torch.nn.functional.linear(hidden, weight, bias) * inv_t[:, None]
    logp_all = torch.log_softmax(z, dim=-1)
    return logp_all.gather(-1, targets[:, None]).squeeze(-1), -(logp_all.exp() * logp_all).sum(-1)


def case(dtype, n=13, h=24, v=97, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g, dtype=torch.float64) * 2).to(dtype).requires_grad_()
    weight = torch.randn(v, h, generator=g, dtype=torch.float64).to(dtype)
    b = torch.randn(v, generator=g, dtype=torch.float64).to(dtype) if bias else None
    targets = torch.randint(0, v, (n,), generator=g)
    inv_t = 1 / torch.empty(n, dtype=torch.float64).uniform_(0.5, 1.5, generator=g)  # per-token temperatures
    # the loss mixes both outputs, as GRPO's does (surrogate on log-probs, an entropy bonus)
    w_logp = torch.randn(n, generator=g, dtype=torch.float64)
    w_ent = torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight, b, targets, inv_t, w_logp, w_ent


@pytest.mark.parametrize("chunk", [1, 4, 13, 64])
@pytest.mark.parametrize("bias", [True, False])
def test_values_and_hidden_grads_equal_the_plain_path_in_float64(chunk, bias):
    hidden, weight, b, targets, inv_t, w_logp, w_ent = case(torch.float64, bias=bias)
    results = []
    for fn in (plain, lambda *a: token_logp_entropy(*a, chunk=chunk)):
        hidden.grad = None
        logp, ent = fn(hidden, weight, b, targets, inv_t)
        ((logp * w_logp).sum() + (ent * w_ent).sum()).backward()
        results.append((logp.detach(), ent.detach(), hidden.grad.clone()))
    for want, got in zip(results[0], results[1], strict=True):
        torch.testing.assert_close(got, want, atol=1e-12, rtol=1e-10)


def test_only_the_logp_or_only_the_entropy_in_the_loss():
    hidden, weight, b, targets, inv_t, _, _ = case(torch.float64)
    for pick in (0, 1):
        grads = []
        for fn in (plain, lambda *a: token_logp_entropy(*a, chunk=5)):
            hidden.grad = None
            fn(hidden, weight, b, targets, inv_t)[pick].sum().backward()
            grads.append(hidden.grad.clone())
        torch.testing.assert_close(grads[1], grads[0], atol=1e-12, rtol=1e-10)


def test_float32_and_bf16_hidden_track_the_float64_result():
    """A float32 head computes in float32; a bf16 one upcasts its logits (as the trainer always did)."""
    hidden64, weight64, b64, targets, inv_t, w_logp, _ = case(torch.float64, n=32, v=500)
    want_logp, want_ent = plain(hidden64, weight64, b64, targets, inv_t)
    for dtype, tol in ((torch.float32, 1e-4), (torch.bfloat16, 0.15)):
        hidden = hidden64.detach().to(dtype).requires_grad_()
        logp, ent = token_logp_entropy(hidden, weight64.to(dtype), b64.to(dtype), targets, inv_t.float(), chunk=7)
        assert logp.dtype == torch.float32 and ent.dtype == torch.float32
        torch.testing.assert_close(logp.double(), want_logp.detach(), atol=tol, rtol=tol)
        torch.testing.assert_close(ent.double(), want_ent.detach(), atol=tol, rtol=tol)
        (logp * w_logp.float()).sum().backward()
        assert hidden.grad.dtype == dtype and torch.isfinite(hidden.grad).all()


def test_float32_entropy_at_large_logits_is_as_exact_as_the_plain_path():
    """A reviewer's case: logits near 1,200 (a low temperature over large hidden states). The entropy was
    lse - sum p z, whose two terms are each as large as the largest logit: float32 kept a 2e-2 error in it (and in
    the entropy bonus's gradient) where the plain path's was 2e-5. -sum p log p is on par with it."""
    g = torch.Generator().manual_seed(0)
    hidden64 = torch.randn(37, 16, generator=g, dtype=torch.float64) * 30
    weight64 = torch.randn(1000, 16, generator=g, dtype=torch.float64)
    b64 = torch.randn(1000, generator=g, dtype=torch.float64)
    targets = torch.randint(0, 1000, (37,), generator=g)
    inv_t = torch.full((37,), 2.0, dtype=torch.float64)
    _, want = plain(hidden64, weight64, b64, targets, inv_t)
    assert float(torch.nn.functional.linear(hidden64, weight64, b64).abs().max() * 2) > 1000
    hidden = hidden64.float().requires_grad_()
    _, ent = token_logp_entropy(hidden, weight64.float(), b64.float(), targets, inv_t.float(), chunk=5)
    _, ent32 = plain(hidden64.float(), weight64.float(), b64.float(), targets, inv_t.float())
    err, err_plain = (ent.double() - want).abs().max().item(), (ent32.double() - want).abs().max().item()
    assert err < 1e-4 and err < 3 * err_plain, (err, err_plain)
    hidden64.requires_grad_()
    _, want = plain(hidden64, weight64, b64, targets, inv_t)
    want.sum().backward()
    ent.sum().backward()
    assert (hidden.grad.double() - hidden64.grad).abs().max() / hidden64.grad.abs().max() < 1e-4


def test_a_scalar_temperature_and_a_bad_chunk():
    hidden, weight, b, targets, _, _, _ = case(torch.float64)
    logp, ent = token_logp_entropy(hidden, weight, b, targets, 1 / 0.7, chunk=3)
    want = plain(hidden, weight, b, targets, torch.full((hidden.shape[0],), 1 / 0.7, dtype=torch.float64))
    torch.testing.assert_close(logp, want[0], atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(ent, want[1], atol=1e-12, rtol=1e-10)
    with pytest.raises(ValueError, match="chunk=0"):
        token_logp_entropy(hidden, weight, b, targets, 1.0, chunk=0)


@pytest.mark.parametrize("multiplier", [0.25, 1.0])
def test_a_head_that_scales_its_logits_sends_the_trainer_to_the_models_logits(multiplier):
    """Falcon-H1 multiplies its logits by `lm_head_multiplier`, a key `output_head` did not know: the trainer's
    chunked log-probs (`hidden @ W.T`) left the factor out (0.19 nats off at 0.25). Such a head is now None (the
    model's own logits are used); a multiplier of 1 keeps the fast path, and its log-probs are the model's."""
    from transformers import FalconH1Config, FalconH1ForCausalLM

    from rl_multilora.lora import MultiLoRAModel
    from rl_multilora.token_logprobs import token_logp_entropy

    cfg = FalconH1Config(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, mamba_d_ssm=32, mamba_n_heads=4, mamba_d_head=8, mamba_n_groups=1, mamba_d_state=8,
        mamba_chunk_size=8, lm_head_multiplier=multiplier, tie_word_embeddings=False,
    )  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = MultiLoRAModel.from_model(FalconH1ForCausalLM(cfg).eval(), max_loras=1, max_rank=4)
    head = m.output_head()
    assert (head is None) == (multiplier != 1.0)
    if head is not None:
        ids = torch.randint(0, 64, (1, 10), generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            hidden = m.forward_hidden(ids, adapter_names=[None])[0, :-1]  # (T-1, H)
            got, _ = token_logp_entropy(hidden, head.weight, head.bias, ids[0, 1:], 1.0)
            logits = m(ids, adapter_names=[None]).logits[0, :-1].float()
        want = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_a_forward_that_scales_in_code_sends_the_trainer_to_the_models_logits():
    """MiniCPM divides its hidden states by `hidden_size / dim_model_base` before the head, in code: no config key
    says so (`output_head` read keys only), and the chunked log-probs left the factor out. A one-time probe compares
    the model's logits with `head(last hidden state)`; a plain Llama keeps the fast path."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rl_multilora.lora import MultiLoRAModel

    class ScaledLlama(LlamaForCausalLM):
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            out.logits = out.logits / 2.25  # what MiniCPM's hidden-state scaling amounts to
            return out

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
                      num_key_value_heads=2)  # fmt: skip
    for cls, plain in ((ScaledLlama, False), (LlamaForCausalLM, True)):
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            base = cls(cfg)
        m = MultiLoRAModel.from_model(base, max_loras=1, max_rank=4)
        m.train()
        assert (m.output_head() is not None) == plain, cls.__name__
        assert m.training and m.base_model.training  # the probe ran in eval mode and put the mode back


def test_the_head_probe_leaves_activation_checkpointing_on():
    """`output_head`'s probe runs the base in eval mode and put it back with `train(mode)`, which reset the decoder
    layers' `training = True` that routed checkpointing keeps in eval mode (the trainer's forwards run in eval mode):
    the training forward that ran the probe kept all its activations (the SmolLM2 example's first micro-batch 338
    MiB instead of 31, the run's peak). The forward after the probe keeps what the one before it kept, and the
    layers still recompute."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from rl_multilora.lora import MultiLoRAModel

    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2)  # fmt: skip
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        m = MultiLoRAModel.from_model(LlamaForCausalLM(cfg), max_loras=2, max_rank=4)
    m.add_adapter("a", rank=4, alpha=8, seed=0)
    m.gradient_checkpointing_enable()
    m.eval()  # as the trainer runs its forwards
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}
    ids = torch.randint(0, 64, (2, 12), generator=torch.Generator().manual_seed(1))

    def saved_bytes() -> int:
        held: dict[int, int] = {}

        def pack(t):
            if (ptr := t.untyped_storage().data_ptr()) not in params:
                held[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m.forward_hidden(ids, adapter_names=["a", "a"]).sum().backward()
        return sum(held.values())

    before = saved_bytes()
    assert m._head_is_plain is None and m.output_head() is not None  # the probe ran here
    after = saved_bytes()
    layers = m.base_model.get_decoder().layers
    assert all(layer.gradient_checkpointing and layer.training for layer in layers)
    assert not m.training and not m.base_model.training
    assert after == before
    m.gradient_checkpointing_disable()
    assert saved_bytes() > 2 * before  # what the forward keeps without the recompute: the check can fail
