"""What a Tinker server holds in memory, by component: `GET /api/v1/memory` (not an SDK route; same token).

Bytes of the tensors each component holds, counted once per storage (a slot's optimizer parameters are views of the
stacked slot tensors, an engine's host copy may be a sampler version's own tensors), next to the process's resident
set size. `other` is RSS minus everything counted: the Python and torch runtime, the allocator's free lists, the
tokenizer, sqlite's cache. Components:

- base: the frozen base model's weights and buffers;
- slots: the trainer's stacked LoRA slot tensors (`max_loras x max_rank` per target module, whatever they hold);
- gradients: the stacked slots' `.grad` and the pending gradients of clients between forward_backward and optim_step;
- optimizer: AdamW moments of the tenants resident in a slot;
- paged_host / paged_disk: the tenant store (adapters and moments of tenants not in a slot, true rank);
- samplers_host / samplers_disk: in-memory sampler versions (true rank) and the ones spilled past the host budget;
- engine: the engine's LoRA bank (`max_loras` slots) and its host copies of adapters it pages, and the prompt
  scoring bank; the KV cache lives only while a decode wave runs and is not held between requests;
- results: the futures' results the server keeps in memory (JSON or protobuf bytes);
- stability_records: the arrays of the sequences recorded for `stable_reinforce` (`stability.py`; a request's
  prompt counted once per sequence, an upper bound).
"""

from __future__ import annotations

import json
from typing import Any

import torch


def _nbytes(tensors: Any, seen: set[int]) -> int:
    """Bytes of the storages behind `tensors` not in `seen` (data pointers), which it extends."""
    total = 0
    for t in tensors:
        if not isinstance(t, torch.Tensor) or t.numel() == 0:
            continue
        storage = t.untyped_storage()
        if storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        total += storage.nbytes()
    return total


def _bank_tensors(bank: Any) -> list[torch.Tensor]:
    return [*getattr(bank, "_a", {}).values(), *getattr(bank, "_b", {}).values()] if bank is not None else []


def rss_bytes() -> int:
    """This process's resident set size (Linux `/proc/self/statm`)."""
    import os

    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def server_memory(ops: Any, results: dict[str, Any]) -> dict[str, Any]:
    """Bytes by component of a `ClientOps` and the server's in-memory `results` (see the module docstring)."""
    seen: set[int] = set()
    out: dict[str, Any] = {}
    backend = ops.backend
    model = backend.shared_model
    trainer_ops = getattr(getattr(backend, "trainer", None), "ops", None)
    if model is not None:
        params = list(model.named_parameters())
        lora = [p for n, p in params if "lora_" in n]
        out["base"] = _nbytes([p for n, p in params if "lora_" not in n], seen) + _nbytes(model.buffers(), seen)
        out["slots"] = _nbytes(lora, seen)
        grads = [p.grad for p in lora if p.grad is not None]
        tenants = trainer_ops.tenants.values() if trainer_ops is not None else []
        grads += [g for t in tenants for g in (t.grads or []) if g is not None]
        out["gradients"] = _nbytes(grads, seen)
        moments = [v for t in tenants for state in t.optim.optimizer.state.values() for v in state.values()]
        out["optimizer"] = _nbytes(moments, seen)
    store = getattr(trainer_ops, "store", None)
    out["paged_host"] = store.host_bytes if store is not None else 0
    with ops._samplers_lock:
        out["samplers_host"] = _nbytes([t for v in ops.samplers.values() for t in (v.tensors or {}).values()], seen)
    engine = [*_bank_tensors(getattr(ops.engine, "_bank", None)), *_bank_tensors(ops._score_bank)]
    engine += [t for tensors, _ in getattr(ops.engine, "_host", {}).values() for t in tensors.values()]
    out["engine"] = _nbytes(engine, seen)
    out["results"] = sum(
        len(r.value) if isinstance(r.value, bytes) else len(json.dumps(r.value, default=str)) for r in results.values()
    )
    records = ops.records.stats()
    out["stability_records"] = records["bytes"]
    rss = rss_bytes()
    out["rss"] = rss
    out["other"] = rss - sum(v for k, v in out.items() if k != "rss")
    out["paged_disk"] = store.disk_bytes if store is not None else 0
    out["samplers_disk"] = ops.sampler_disk_bytes
    out["counts"] = {
        "models": len(ops.tenants),
        "paged": len(store) if store is not None else 0,
        "sampler_versions": len(ops.samplers),
        "sampler_versions_spilled": sum(v.spilled is not None for v in ops.samplers.values()),
        "results": len(results),
        "host_budget_bytes": ops.host_budget_bytes,
        "stability_records": records["records"],
        "stability_tokens": records["tokens"],
    }
    return out
