"""What a training forward keeps for its backward: the outputs of cheap elementwise steps are recomputed from the
inputs autograd keeps anyway, instead of being kept too.

A decoder layer's backward needs each LoRA-wrapped Linear's input (for its A's gradient), and autograd keeps them
as they were produced. Several of those inputs are one elementwise step away from tensors that are kept regardless:

- SwiGLU (`down_proj(silu(gate) * up)`): `silu(gate)` is kept for the product's backward and the product for
  `down_proj`'s, while `gate` (for silu's backward) and `up` (for the product's) are kept too: 4 of the MLP's
  intermediate-sized tensors per token where 2 hold the same information.
- RMSNorm (`weight * (x * rsqrt(mean(x^2) + eps))`): the normalized output is kept for the q/k/v (or gate/up)
  projections, while `x` and the (tokens, 1) `rsqrt` are kept for the norm's own backward.

`recompute_elementwise()` installs `torch.autograd.graph.saved_tensors_hooks` whose pack step recognizes such a
tensor by the autograd node that produced it (its `grad_fn`) and keeps that node instead; the unpack step, in the
backward, redoes the same operations on the node's saved inputs. Same ops, same inputs, same order: the recomputed
tensor equals the forward's bit for bit (`tests/test_saved_activations.py` checks the gradients against a backward
without the hooks), for a few elementwise passes over the recomputed tensors in the backward. On the SmolLM2
example this is 4,224 of the ~11,300 floats a token keeps per layer (docs/benchmarks.md, "Memory of a run").

Which tensors qualify is decided from the node alone, so it holds for any model that builds these steps from the
same torch ops (a broadcast, a dtype change in between, or a missing saved input leaves the tensor kept as usual).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

_SILU = "SiluBackward0"
_MUL = "MulBackward0"


class _Recompute:
    """A kept recipe: the node whose output to recompute at unpack time."""

    __slots__ = ("node", "kind")

    def __init__(self, node, kind: str):
        self.node = node
        self.kind = kind

    def __call__(self) -> torch.Tensor:
        node = self.node
        if self.kind == "silu":
            return torch.nn.functional.silu(node._saved_self)
        if self.kind == "mul":
            return torch.mul(node._saved_self, node._saved_other)
        # "norm": weight * (x * r), the inner product recomputed from its own node's saved x and r
        inner = node.next_functions[1][0]
        return torch.mul(node._saved_self, torch.mul(inner._saved_self, inner._saved_other))


def _saved(node, name: str) -> torch.Tensor | None:
    try:
        value = getattr(node, name)
    except RuntimeError:  # already freed (never expected during a forward)
        return None
    return value if isinstance(value, torch.Tensor) else None


def _recipe(t: torch.Tensor) -> _Recompute | None:
    """How to recompute `t` from what its producing node keeps anyway, or None (keep `t`)."""
    node = t.grad_fn
    if node is None or t._base is not None or not t.is_contiguous():
        return None
    name = type(node).__name__
    if name == _SILU:  # t = silu(x): the node keeps x
        x = _saved(node, "_saved_self")
        if x is not None and x.shape == t.shape and x.dtype == t.dtype:
            return _Recompute(node, "silu")
        return None
    if name != _MUL:
        return None
    a, b = _saved(node, "_saved_self"), _saved(node, "_saved_other")
    if a is not None and b is not None:  # t = a * b, both kept (each needs the other's gradient): same shapes only
        if a.shape == b.shape == t.shape and a.dtype == b.dtype == t.dtype:
            return _Recompute(node, "mul")
        return None
    # t = weight * y with a frozen weight (so y is not kept), y = x * r whose node keeps x and r: an RMSNorm
    if a is None or b is not None or a.dtype != t.dtype or a.dim() != 1 or a.shape[0] != t.shape[-1]:
        return None
    inner = node.next_functions[1][0] if len(node.next_functions) == 2 else None
    if inner is None or type(inner).__name__ != _MUL:
        return None
    x, r = _saved(inner, "_saved_self"), _saved(inner, "_saved_other")
    if x is None or r is None or x.shape != t.shape or x.dtype != t.dtype or r.dtype != t.dtype:
        return None
    if r.shape != (*t.shape[:-1], 1):
        return None
    return _Recompute(node, "norm")


@contextlib.contextmanager
def recompute_elementwise(observe: Callable[[torch.Tensor], None] | None = None) -> Iterator[None]:
    """Within the block, autograd keeps recipes instead of the outputs of SiLU, same-shape products and RMSNorm's
    weight product (see the module docstring). `observe`: called with every tensor that is kept as it is (what a
    memory probe counts)."""

    def pack(t: torch.Tensor):
        recipe = _recipe(t)
        if recipe is None:
            if observe is not None:
                observe(t)
            return t
        return recipe

    def unpack(packed):
        return packed() if isinstance(packed, _Recompute) else packed

    with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
        yield
