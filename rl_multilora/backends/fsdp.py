"""The multi-LoRA model sharded over trainer ranks with FSDP2: the building block of multi-rank training backends.

Design choices:

- `load_sharded` builds the model on every rank from the folder's config on the meta device (no weights read, no
  memory), wraps it with its pre-allocated LoRA slots (`MultiLoRAModel`), and shards it with FSDP2 `fully_shard`
  per decoder layer and at the root. Slots exist before sharding, so the sharded parameter set never changes as
  tenants come and go. Each rank then holds 1/world of every sharded parameter (dim 0; FSDP2 pads the last
  shard), the base and the stacked LoRA slots alike: a slot's A and B live on the rank that holds its row of
  dim 0.
- Pretrained weights are read once: rank 0 loads the folder (`AutoModelForCausalLM.from_pretrained`) and
  `set_model_state_dict(..., full_state_dict=True, broadcast_from_rank0=True)` sends every rank its shards; the
  others never open the weight files. The LoRA slots are not in that state dict (`strict=False` would leave them
  on meta, uninitialized after `to_empty`), so they are zeroed explicitly, and buffers that are not in a state
  dict (rotary `inv_freq`) are broadcast from rank 0's loaded model. `meta_tensors` lets a test prove nothing is
  left on meta.
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
) -> MultiLoRAModel:
    """The model at `path` with its LoRA slots, sharded over `mesh`; only rank 0 reads the weight files."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict
    from transformers import AutoConfig, AutoModelForCausalLM

    rank = dist.get_rank()
    config = AutoConfig.from_pretrained(str(path))
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model = MultiLoRAModel.from_model(
        skeleton.eval(), max_loras, max_rank, target_modules, target_parameters=target_parameters,
        expert_lora=expert_lora,
    )  # fmt: skip
    model.name_or_path = str(path)
    full: dict[str, torch.Tensor] = {}
    buffers: dict[str, torch.Tensor] = {}
    if rank == 0:
        loaded = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
        full = {f"base_model.{k}": v for k, v in loaded.state_dict().items()}
        buffers = {f"base_model.{k}": v for k, v in loaded.named_buffers()}
    shard(model, mesh)
    model.to_empty(device=mesh.device_type)
    set_model_state_dict(
        model, full, options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=False)
    )
    with torch.no_grad():
        for lora_a, lora_b in model._stacked_pairs():  # not in the state dict: empty until set here
            lora_a.to_local().zero_()
            lora_b.to_local().zero_()
        for name, buf in model.named_buffers():  # non-persistent buffers (rotary inv_freq) are in no state dict
            if rank == 0:
                buf.copy_(buffers[name])
            dist.broadcast(buf, src=0)
    return model


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

    Only the adapter's slot rows travel, each from the rank holding it, at the adapter's true rank."""
    rank = dist.get_rank()
    received = 0

    def read(stacked, slot: int) -> torch.Tensor:
        nonlocal received
        owner, local = _slot_owner(stacked, slot)
        shard_tensor = stacked.to_local()
        if owner == dst and rank == dst:
            return shard_tensor[local]
        if rank == owner:
            dist.send(shard_tensor[local].contiguous(), dst=dst)
        elif rank == dst:
            buf = shard_tensor.new_empty(stacked.shape[1:])
            dist.recv(buf, src=owner)
            received += buf.numel() * buf.element_size()
            return buf
        return shard_tensor.new_empty(stacked.shape[1:])  # not used off `dst`: the slot's shape, unfilled

    state = model.adapter_state_dict(name, read_slot=read)
    return (state if rank == dst else {}), received


def adapter_slot_bytes(model: MultiLoRAModel, name: str) -> int:
    """Bytes of the adapter's slot tensors at max_rank (what `gather_adapter_state_dict` moves at most)."""
    return sum(math.prod(stacked.shape[1:]) * stacked.element_size() for stacked, _ in model._slot_tensors(name))


__all__: list[Any] = ["adapter_slot_bytes", "gather_adapter_state_dict", "load_sharded", "meta_tensors", "shard"]
