"""The multi-LoRA model sharded over trainer ranks with FSDP2: the building block of multi-rank training backends.

Design choices:

- `load_sharded` builds the model on every rank from the folder's config on the meta device (no weights read, no
  memory), wraps it with its pre-allocated LoRA slots (`MultiLoRAModel`), and shards it with FSDP2 `fully_shard`
  per decoder layer and at the root. Slots exist before sharding, so the sharded parameter set never changes as
  tenants come and go. Each rank then holds 1/world of every sharded parameter (dim 0; FSDP2 pads the last
  shard), the base and the stacked LoRA slots alike: a slot's A and B live on the rank that holds its row of
  dim 0.
- Pretrained weights are read once per node, not once per rank and not all through global rank 0 (which would
  push every other node's shards over the network from one process): the first rank of each node loads the folder
  (`AutoModelForCausalLM.from_pretrained`, so transformers' key conversions apply) and scatters each parameter's
  dim-0 chunks to the ranks of its node over a node-local process group; the others never open the weight files
  and receive only their own shard. `node_ranks` says which global ranks share a node (the Ray backend reads it
  off the actors' node ids; default: one node). The LoRA slots are in no pretrained state dict, so they are zeroed
  explicitly, and buffers (rotary `inv_freq`, in no state dict either) come from the node's loaded model.
  `meta_tensors` lets a test prove nothing is left on meta.
- `gather_adapter_state_dict` moves only the adapter's own slot tensors, at its true rank, from the rank that holds
  each to `dst` (point to point; every rank joins), never a full state dict; it returns the bytes received.
- Communication is `torch.distributed` on whatever group is initialized (`gloo` on CPU, `nccl` on CUDA).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from rl_multilora.lora import MultiLoRAModel


def decoder_layers(model: MultiLoRAModel) -> list[nn.Module]:
    """The HF decoder layers (`model.layers`) that FSDP2 shards one by one."""
    inner = getattr(model.base_model, "model", None)
    layers = getattr(inner, "layers", None)
    if layers is None:
        raise ValueError(f"{type(model.base_model).__name__} has no model.layers to shard; allowed: an HF causal LM")
    return list(layers)


def shard(model: MultiLoRAModel, mesh) -> MultiLoRAModel:
    """`fully_shard` every decoder layer, then the root (embeddings, final norm, head). A slot used on one rank and
    not on another must not break the reduce-scatter: unused LoRA Parameters still take part in it. Gradients are
    summed over ranks, not averaged: each tenant's loss is normalized by its token / row counts over all ranks, so
    each rank's loss is already its share of the total."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    for layer in decoder_layers(model):
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    # A layer's post-backward (its reduce-scatter) fires from autograd only if its input requires grad, otherwise
    # from FSDP's final callback, in another order. Which layers' inputs do would depend on the LoRA modules a rank's
    # rows happen to use, so ranks could run the reduce-scatters of same-shaped layers in different orders and swap
    # their grads. The embeddings' output requires grad on every rank: every layer fires from autograd, in order.
    model.base_model.enable_input_require_grads()
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_reduce_scatter_unused_params(True)
            module.set_gradient_divide_factor(1.0)
            module.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM
    return model


def load_sharded(
    path: str | Path,
    mesh,
    max_loras: int,
    max_rank: int,
    target_modules: str | Sequence[str] = "all-linear",
    target_parameters: Sequence[str] | None = None,
    expert_lora: str = "per_expert",
    dtype: torch.dtype = torch.float32,
    node_ranks: Sequence[Sequence[int]] | None = None,
) -> MultiLoRAModel:
    """The model at `path` with its LoRA slots, sharded over `mesh`; on each node only its first rank (of
    `node_ranks`, the global ranks per node; default: all on one node) reads the weight files. Every rank calls it."""
    from transformers import AutoConfig, AutoModelForCausalLM

    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = [sorted(n) for n in (node_ranks or [range(world)])]
    if sorted(r for n in nodes for r in n) != list(range(world)):
        raise ValueError(f"node_ranks={nodes} must list every rank 0..{world - 1} exactly once")
    group, node = _node_group(nodes)
    leader = node[0]
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = MultiLoRAModel.from_model(
        skeleton.eval(), max_loras, max_rank, target_modules, target_parameters=target_parameters,
        expert_lora=expert_lora,
    )  # fmt: skip
    model.name_or_path = str(path)
    loaded: dict[str, torch.Tensor] = {}
    if rank == leader:
        pretrained = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        loaded = {f"base_model.{k}": v for k, v in (*pretrained.state_dict().items(), *pretrained.named_buffers())}
        del pretrained
    shard(model, mesh)
    model.to_empty(device=mesh.device_type)
    slots = {id(t) for pair in model._stacked_pairs() for t in pair}
    with torch.no_grad():
        for lora_a, lora_b in model._stacked_pairs():  # in no pretrained state dict: zero until a tenant sets them
            lora_a.to_local().zero_()
            lora_b.to_local().zero_()
        for name, param in model.named_parameters():
            if id(param) not in slots:
                full = _loaded(loaded, name) if rank == leader else None
                _scatter_node_chunks(param.to_local(), param.shape, full, node, group, world)
        for name, buf in model.named_buffers():  # not sharded: the node's copy, whole
            if rank == leader:
                buf.copy_(_loaded(loaded, name))
            dist.broadcast(buf, src=leader, group=group)
    return model


def _node_group(nodes: list[list[int]]):
    """(the process group of this rank's node, its ranks). Every rank creates every node's group, in one order,
    as `new_group` requires; a single node uses the default group."""
    rank = dist.get_rank()
    node = next(n for n in nodes if rank in n)
    if len(nodes) == 1:
        return None, node
    groups = [dist.new_group(n) for n in nodes]
    return groups[nodes.index(node)], node


def _loaded(loaded: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in loaded:
        raise KeyError(f"{name} is not in the pretrained weights; the folder does not match its config")
    return loaded[name]


def _scatter_node_chunks(local, full_shape, full, node: list[int], group, world: int) -> None:
    """Copy this rank's dim-0 chunk of a parameter into `local` (its FSDP2 shard): the node's first rank holds the
    whole tensor (`full`) and sends each rank of its node only that rank's chunk. FSDP2 shards dim 0 in chunks of
    ceil(rows / world); the last ones may be short or empty, so the chunks travel padded to one size."""
    rank = dist.get_rank()
    per_rank = -(-full_shape[0] // world)
    if len(node) == 1:  # this rank read the weights itself
        local.copy_(full[rank * per_rank : rank * per_rank + local.shape[0]])
        return
    buf = local.new_empty((per_rank, *full_shape[1:]))
    chunks = None
    if rank == node[0]:
        whole = full.to(device=local.device, dtype=local.dtype)
        chunks = [buf.new_zeros(buf.shape) for _ in node]
        for chunk, r in zip(chunks, node, strict=True):
            piece = whole[r * per_rank : (r + 1) * per_rank]
            chunk[: piece.shape[0]] = piece
    dist.scatter(buf, chunks, src=node[0], group=group)
    local.copy_(buf[: local.shape[0]])


def meta_tensors(model: nn.Module) -> list[str]:
    """Names of Parameters and buffers (local shards for DTensors) still on the meta device."""
    out = []
    for name, t in (*model.named_parameters(), *model.named_buffers()):
        local = t.to_local() if hasattr(t, "to_local") else t
        if local.is_meta:
            out.append(name)
    return out


def _slot_owner(stacked, slot: int) -> tuple[int, int]:
    """(rank holding row `slot` of a dim-0-sharded stacked tensor, its index in that rank's shard)."""
    world = stacked.device_mesh.size()
    per_rank = -(-stacked.shape[0] // world)  # FSDP2 shards dim 0 in chunks of ceil(S / world)
    return slot // per_rank, slot % per_rank


def gather_adapter_state_dict(model: MultiLoRAModel, name: str, dst: int = 0) -> tuple[dict[str, torch.Tensor], int]:
    """(the adapter's PEFT state dict on `dst`, {} elsewhere; bytes `dst` received). Every rank must call it.

    Only the adapter's slot rows travel, each from the rank holding it, cut to the adapter's true rank."""
    rank = dist.get_rank()
    received = 0

    def read(stacked, slot: int, index: tuple[slice, ...]) -> torch.Tensor:
        nonlocal received
        owner, local = _slot_owner(stacked, slot)
        shard_tensor = stacked.to_local()
        if owner == dst and rank == dst:
            return shard_tensor[local][index]
        shape = torch.empty(stacked.shape[1:], device="meta")[index].shape
        if rank == owner:
            dist.send(shard_tensor[local][index].contiguous(), dst=dst)
        elif rank == dst:
            buf = shard_tensor.new_empty(shape)
            dist.recv(buf, src=owner)
            received += buf.numel() * buf.element_size()
            return buf
        return torch.zeros(shape, dtype=stacked.dtype)  # not used off `dst`: the right shape for the conversion

    state = model.adapter_state_dict(name, read_slot=read)
    return (state if rank == dst else {}), received


def adapter_slot_bytes(model: MultiLoRAModel, name: str) -> int:
    """Bytes of the adapter's slot tensors at its true rank: what `gather_adapter_state_dict` moves from a rank
    that is not `dst` (every stacked tensor has one rank dim, of size max_rank)."""
    r, max_rank = model.adapters[name].rank, model.max_rank
    return sum(
        math.prod(stacked.shape[1:]) // max_rank * r * stacked.element_size()
        for stacked, _ in model._slot_tensors(name)
    )


__all__: list[Any] = ["adapter_slot_bytes", "gather_adapter_state_dict", "load_sharded", "meta_tensors", "shard"]
