"""`rl_multilora.saved_activations`: the backward recomputes SwiGLU's and RMSNorm's cheap outputs instead of keeping
them, and its gradients equal those of a backward that kept them, bit for bit."""

from __future__ import annotations

import pytest
import torch

from rl_multilora.lora import MultiLoRAModel
from rl_multilora.saved_activations import recompute_elementwise
from tests.tiny_models import tiny_model


def _model(family: str) -> MultiLoRAModel:
    m = MultiLoRAModel.from_model(tiny_model(family, layers=2), max_loras=2, max_rank=8, target_modules="all-linear")
    m.add_adapter("a", rank=4, alpha=8, seed=0)
    m.add_adapter("b", rank=8, alpha=8, seed=1)
    with torch.no_grad():  # non-zero B: every LoRA branch contributes and has an A gradient
        for name, p in m.named_parameters():
            if "lora_b" in name.lower():
                p.normal_(generator=torch.Generator().manual_seed(hash(name) % 2**31))
    return m.eval()


def _grads(m: MultiLoRAModel, recompute: bool, kept: dict[int, int] | None = None) -> list[torch.Tensor]:
    """The LoRA gradients of one forward + backward; `kept`: filled with the storages kept as they are (data_ptr ->
    elements), activations only."""
    m.zero_grad(set_to_none=True)
    ids = torch.randint(0, 100, (3, 9), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[2, :3] = 0  # some left padding

    def count(t: torch.Tensor) -> None:
        if kept is not None and t.grad_fn is not None:
            kept[t.untyped_storage().data_ptr()] = t.numel()

    ctx = (
        recompute_elementwise(count)
        if recompute
        else torch.autograd.graph.saved_tensors_hooks(lambda t: count(t) or t, lambda t: t)
    )
    with ctx:
        hidden = m.forward_hidden(ids, attention_mask=mask, adapter_names=["a", "b", "a"])
    (hidden.square().mean() + hidden[:, -1].sum()).backward()
    return [p.grad.clone() for p in m.parameters() if p.grad is not None]


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_gradients_equal_those_of_a_backward_that_kept_every_tensor(family):
    m = _model(family)
    kept_plain: dict[int, int] = {}
    kept_recomputed: dict[int, int] = {}
    plain = _grads(m, recompute=False, kept=kept_plain)
    recomputed = _grads(m, recompute=True, kept=kept_recomputed)
    assert len(plain) == len(recomputed) > 0
    for a, b in zip(plain, recomputed, strict=True):
        assert torch.equal(a, b)
    # per layer and token: silu's output and the SwiGLU product are recomputed, not kept, and so are the RMSNorm
    # outputs that need a gradient (all but the first layer's input norm, over the embeddings)
    intermediate = m.base_model.config.intermediate_size
    hidden = m.base_model.config.hidden_size
    saved = sum(kept_plain.values()) - sum(kept_recomputed.values())
    assert saved >= (2 * 2 * intermediate + 3 * hidden) * 3 * 9


def test_a_tensor_modified_in_place_after_it_was_kept_is_not_replaced_by_a_stale_recipe():
    x = torch.randn(4, 6, requires_grad=True)
    with recompute_elementwise():
        a = torch.nn.functional.silu(x)
        y = (a * a.detach()).sum()  # keeps a.detach()'s storage: a view of a, not a recipe
    y.backward()
    expected = torch.autograd.grad((torch.nn.functional.silu(x) * torch.nn.functional.silu(x).detach()).sum(), x)[0]
    assert torch.equal(x.grad, expected)
