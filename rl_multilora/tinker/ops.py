"""The model work behind the Tinker API: client tenants on one `MultiLoRAModel`, sampled by one `EmbeddedEngine`.

Design choices:

- A client tenant is a slot of the model (`add_adapter`) and an AdamW over that slot's leaf views
  (`adapter_parameters`), as GRPO tenants have. Its LoRA alpha is fixed at 32 (Tinker's convention), so the scale is
  32 / rank.
- `forward_backward` of several tenants runs as ONE right-padded mixed batch routed by `adapter_names`; the loss
  summed over every backward row is backpropagated once. The grouped LoRA backward adds each row's gradient into its
  own slot only, so each tenant's gradient is what it would be alone, and it accumulates in the slot's part of the
  stacked `.grad` until that tenant's own `optim_step`, which steps its AdamW with that call's Adam settings and
  zeroes only its slot's grads.
- Losses are Tinker's: sums over tokens (the client normalizes through `weights` / `advantages`), not means.
  `cross_entropy`: -sum w * logp(target). `importance_sampling`: -sum exp(logp - sampler_logp) * A.
  `ppo`: -sum min(r A, clip(r, clip_low_threshold, clip_high_threshold) A), r = exp(logp - sampler_logp).
- Sampler weights are in-memory versions: `save_weights_for_sampler` copies the slot's true-rank tensors
  (`adapter_state_dict`) and loads them into the engine's bank under a name of their own. When the bank is full the
  least recently used version is unloaded; its tensors stay in memory and are loaded again on its next sample.
- Engine log-probs are those of the raw logits (temperature 1), as the engine documents.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file, save_file

from rl_multilora.lora import MultiLoRAModel
from rl_multilora.tinker.wire import Datum
from rollout.types import GenerateRequest, SamplingParams

LORA_ALPHA = 32.0
LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo")
_LAYER_GROUPS = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}


class UserError(ValueError):
    """A request the client must change (bad loss inputs, unknown model, ...): category "user"."""


@dataclass
class ClientTenant:
    """One model created through the API: its slot's leaf views, their AdamW and counters."""

    model_id: str
    rank: int
    params: list[torch.nn.Parameter]
    optim: torch.optim.AdamW
    steps: int = 0
    sampler_versions: int = 0


@dataclass
class SamplerVersion:
    """Frozen weights a sampling session serves; `tensors` None means the base model."""

    engine_name: str | None
    tensors: dict[str, torch.Tensor] | None = None
    config: dict[str, Any] = field(default_factory=dict)


@dataclass
class FwdBwdItem:
    """One forward_backward request of one tenant inside a mixed batch."""

    model_id: str
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool


class ClientOps:
    """Everything the server does to the model and the engine. Training calls come from one worker thread;
    sampling calls may come from any thread (the engine has its own worker and bank)."""

    def __init__(self, model: MultiLoRAModel, engine: Any, pad_id: int, checkpoint_dir: Path) -> None:
        self.model = model
        self.engine = engine
        self.pad_id = pad_id
        self.checkpoint_dir = checkpoint_dir
        self.tenants: dict[str, ClientTenant] = {}
        self.samplers: dict[str, SamplerVersion] = {}
        self._loaded: OrderedDict[str, None] = OrderedDict()  # engine names in the bank, least recently used first
        self._engine_lock = threading.Lock()
        self.device = next(model.parameters()).device
        self.batch_sizes: list[int] = []  # requests per mixed forward_backward batch, in order (tests, bench)

    # -- tenants ---------------------------------------------------------------------------------------------------
    def create(self, model_id: str, rank: int, seed: int | None, layers: dict[str, bool]) -> ClientTenant:
        if model_id in self.tenants:
            return self.tenants[model_id]
        wanted = {leaf for key, leaves in _LAYER_GROUPS.items() if layers.get(key, True) for leaf in leaves}
        targets = [m for m in self.model.lora_modules if m.rsplit(".", 1)[-1] in wanted]
        if not targets:
            raise UserError(f"lora_config {layers} selects none of the model's LoRA modules")
        if not 1 <= rank <= self.model.max_rank:
            raise UserError(f"lora_config.rank={rank} is not allowed; allowed: 1 to {self.model.max_rank}")
        if not self.model.free_slots:
            raise UserError(f"no free LoRA slot: all {self.model.max_loras} are in use; unload a model first")
        self.model.add_adapter(model_id, rank, LORA_ALPHA, seed=seed, target_modules=targets)
        params = self.model.adapter_parameters(model_id)
        optim = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        tenant = ClientTenant(model_id, rank, params, optim)
        self.tenants[model_id] = tenant
        return tenant

    def tenant(self, model_id: str) -> ClientTenant:
        if model_id not in self.tenants:
            raise UserError(f"unknown model_id {model_id!r}")
        return self.tenants[model_id]

    # -- training --------------------------------------------------------------------------------------------------
    def forward_backward(self, items: list[FwdBwdItem]) -> list[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
        """One mixed forward over every datum of `items`, one backward over the rows of non-forward-only items."""
        self.batch_sizes.append(len(items))
        rows: list[tuple[int, Datum]] = [(i, d) for i, item in enumerate(items) for d in item.data]
        for item in items:
            self.tenant(item.model_id)
            if item.loss_fn not in LOSS_FNS:
                raise UserError(f"loss_fn={item.loss_fn!r} is not supported; allowed: {', '.join(LOSS_FNS)}")
        if not rows:
            return [([], {"loss:sum": 0.0}) for _ in items]
        width = max(len(d.tokens) for _, d in rows)
        ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for r, (_, d) in enumerate(rows):
            ids[r, : len(d.tokens)] = torch.from_numpy(d.tokens)
            mask[r, : len(d.tokens)] = 1
        names = [items[i].model_id for i, _ in rows]
        need_grad = any(not item.forward_only for item in items)
        with torch.set_grad_enabled(need_grad):
            # logits: (R, T, V); right padding leaves every real position's logits as they are alone.
            logits = self.model(ids.to(self.device), attention_mask=mask.to(self.device), adapter_names=names).logits
            logp_all = torch.log_softmax(logits.float(), dim=-1)
            losses: list[torch.Tensor] = []
            outputs: list[dict[str, np.ndarray]] = []
            for r, (i, d) in enumerate(rows):
                loss, logp = _row_loss(items[i], d, logp_all[r, : len(d.tokens)])
                losses.append(loss)
                outputs.append({"logprobs": logp.detach().cpu().numpy(), "loss": np.array([loss.item()], np.float32)})
            train = [loss for (i, _), loss in zip(rows, losses, strict=True) if not items[i].forward_only]
            if train:
                torch.stack(train).sum().backward()
        results = []
        start = 0
        for item in items:
            n = len(item.data)
            mine = outputs[start : start + n]
            total = float(sum(o.pop("loss")[0] for o in mine))
            results.append((mine, {"loss:sum": total}))
            start += n
        return results

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        t = self.tenant(model_id)
        self.model.attach_slot_grads(model_id, t.params)
        grads = [p.grad for p in t.params if p.grad is not None]
        norm = float(torch.linalg.vector_norm(torch.stack([g.norm() for g in grads]))) if grads else 0.0
        clip = float(adam.get("grad_clip_norm", 0.0))
        if clip > 0 and grads:
            torch.nn.utils.clip_grad_norm_(t.params, clip)
        for group in t.optim.param_groups:
            group["lr"] = float(adam.get("learning_rate", 1e-4))
            group["betas"] = (float(adam.get("beta1", 0.9)), float(adam.get("beta2", 0.95)))
            group["eps"] = float(adam.get("eps", 1e-12))
            group["weight_decay"] = float(adam.get("weight_decay", 0.0))
        t.optim.step()
        for p in t.params:  # zero only this slot's part of the stacked grads; other tenants keep accumulating
            if p.grad is not None:
                p.grad.zero_()
            p.grad = None
        t.steps += 1
        return {"grad_norm": norm}

    # -- weights ---------------------------------------------------------------------------------------------------
    def save(self, model_id: str, name: str) -> str:
        """Adapter (PEFT safetensors) + optimizer state under checkpoint_dir/<model_id>/<name>/."""
        t = self.tenant(model_id)
        out = self.checkpoint_dir / model_id / name
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.contiguous() for k, v in self.model.adapter_state_dict(model_id).items()},
            out / "adapter.safetensors",
        )
        (out / "adapter_config.json").write_text(json.dumps(self.model.peft_config(model_id)))
        torch.save({"optim": t.optim.state_dict(), "steps": t.steps, "rank": t.rank}, out / "optim.pt")
        return f"tinker://{model_id}/weights/{name}"

    def load(self, model_id: str, path: str, with_optimizer: bool) -> None:
        folder = self._checkpoint_folder(path)
        tensors = load_file(folder / "adapter.safetensors")
        config = json.loads((folder / "adapter_config.json").read_text())
        saved = torch.load(folder / "optim.pt", weights_only=False)
        if model_id not in self.tenants:
            self.create(model_id, int(saved["rank"]), None, {})
        t = self.tenants[model_id]
        self.model.load_adapter_state_dict(model_id, tensors, config)
        if with_optimizer:
            t.optim.load_state_dict(saved["optim"])
            t.steps = int(saved["steps"])

    def _checkpoint_folder(self, path: str) -> Path:
        parts = path.removeprefix("tinker://").split("/")
        if len(parts) != 3 or parts[1] != "weights":
            raise UserError(f"path={path!r} is not a training checkpoint; allowed: tinker://<model_id>/weights/<name>")
        folder = self.checkpoint_dir / parts[0] / parts[2]
        if not (folder / "optim.pt").is_file():
            raise UserError(f"checkpoint {path!r} does not exist")
        return folder

    def publish_sampler(self, model_id: str, name: str | None) -> tuple[str, str]:
        """A new in-memory sampler version of the tenant: (its tinker:// path, its engine name)."""
        t = self.tenant(model_id)
        t.sampler_versions += 1
        engine_name = f"{model_id}.s{t.sampler_versions}"
        path = f"tinker://{model_id}/sampler_weights/{name or f's{t.sampler_versions}'}"
        version = SamplerVersion(
            engine_name, self.model.adapter_state_dict(model_id), self.model.peft_config(model_id)
        )
        self.samplers[path] = version
        self._ensure_loaded(version)
        return path, engine_name

    def sampler(self, path: str | None) -> SamplerVersion:
        if path is None:
            return SamplerVersion(None)
        if path not in self.samplers:
            raise UserError(f"model_path={path!r} names no sampler weights; save_weights_for_sampler first")
        return self.samplers[path]

    def _ensure_loaded(self, v: SamplerVersion) -> None:
        if v.engine_name is None:
            return
        with self._engine_lock:
            if v.engine_name in self._loaded:
                self._loaded.move_to_end(v.engine_name)
                return
            while len(self._loaded) >= self.model.max_loras:
                old, _ = self._loaded.popitem(last=False)
                self.engine.unload_adapter(old)
            self.engine.load_adapter(v.engine_name, v.tensors, v.config)
            self._loaded[v.engine_name] = None

    async def sample(
        self, v: SamplerVersion, prompt: list[int], n: int, params: dict[str, Any], seed: int
    ) -> list[tuple[list[int], list[float], str]]:
        stop = params.get("stop") or []
        stop = [stop] if isinstance(stop, str) else list(stop)
        base = params.get("seed")
        requests = [
            GenerateRequest(
                input_ids=list(prompt),
                adapter=v.engine_name,
                sampling=SamplingParams(
                    temperature=float(params.get("temperature", 1.0)),
                    top_p=float(params.get("top_p", 1.0)),
                    top_k=int(params.get("top_k", -1)),
                    max_new_tokens=int(params.get("max_tokens") or 64),
                    stop=[s for s in stop if isinstance(s, str)],
                    stop_token_ids=[s for s in stop if isinstance(s, int)],
                    seed=(int(base) if base is not None else seed) + i,
                ),
            )
            for i in range(n)
        ]
        for _ in range(4):  # an LRU eviction by a concurrent sampler aborts rows: load again and resubmit
            self._ensure_loaded(v)
            results = await self.engine.agenerate(requests)
            if all(r.finish_reason in ("stop", "length") for r in results):
                return [(r.output_ids, r.output_logprobs, r.finish_reason) for r in results]
            errors = [r.error for r in results if r.finish_reason == "error"]
            if errors and not any("loaded in the engine" in (e or "") for e in errors):
                raise UserError(errors[0])
        raise RuntimeError("sampling was aborted four times in a row")


def _row_loss(item: FwdBwdItem, d: Datum, logp_all: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(the row's summed loss, its per-token log-probs of target_tokens); logp_all: (N, V) of this row."""
    n = len(d.tokens)

    def vec(name: str, dtype: torch.dtype) -> torch.Tensor:
        if name not in d.inputs:
            raise UserError(f"loss_fn {item.loss_fn!r} needs loss_fn_inputs[{name!r}]; got {sorted(d.inputs)}")
        t = torch.from_numpy(np.array(d.inputs[name])).to(dtype).to(logp_all.device).reshape(-1)
        if t.shape[0] != n:
            raise UserError(f"loss_fn_inputs[{name!r}] has {t.shape[0]} values for {n} model_input tokens")
        return t

    targets = vec("target_tokens", torch.long)
    logp = logp_all.gather(-1, targets[:, None])[:, 0]  # (N,)
    if item.loss_fn == "cross_entropy":
        weights = vec("weights", torch.float32) if "weights" in d.inputs else torch.ones_like(logp)
        return -(weights * logp).sum(), logp
    advantages = vec("advantages", torch.float32)
    ratio = torch.exp(logp - vec("logprobs", torch.float32))
    if item.loss_fn == "importance_sampling":
        return -(ratio * advantages).sum(), logp
    low = float(item.config.get("clip_low_threshold", 0.8))
    high = float(item.config.get("clip_high_threshold", 1.2))
    return -torch.minimum(ratio * advantages, ratio.clamp(low, high) * advantages).sum(), logp
