"""The model work behind the Tinker API: client tenants on one `MultiLoRAModel`, sampled by one `EmbeddedEngine`.

Design choices:

- A client tenant is a slot of the model and an AdamW over that slot's leaf views (`adapter_parameters`), as GRPO
  tenants have. The slot comes from `slots`: the model itself (`ModelSlots`, the standalone server) or the GRPO
  service's `TenantManager` (`add_client` / `release_client`), so both kinds of tenants share one slot pool. Its LoRA alpha is fixed at 32 (Tinker's convention), so the scale is
  32 / rank.
- `forward_backward` of several tenants runs as ONE right-padded mixed batch routed by `adapter_names`; the loss
  summed over every backward row is backpropagated once. The grouped LoRA backward adds each row's gradient into its
  own slot only, so each tenant's gradient is what it would be alone, and it accumulates in the slot's part of the
  stacked `.grad`. Right after the backward each tenant's slot part is added into a buffer of its own and the
  stacked grads are dropped: a GRPO step on the same model (service mode) starts with `zero_lora_grads`, so grads
  left in the stacked tensors would not survive it. The buffer accumulates until that tenant's own `optim_step`,
  which steps its AdamW with that call's Adam settings and empties only that buffer.
- Losses are Tinker's: sums over tokens (the client normalizes through `weights` / `advantages`), not means.
  `cross_entropy`: -sum w * logp(target). `importance_sampling`: -sum exp(logp - sampler_logp) * A.
  `ppo`: -sum min(r A, clip(r, clip_low_threshold, clip_high_threshold) A), r = exp(logp - sampler_logp).
- Model ids are `<session>:train:<n>`, the id the SDK derives on its own for `create_training_client_from_state`.
  They end up in paths (checkpoint folders) and adapter names, so they and checkpoint names are validated against
  a strict pattern (no '/', no '..'); a model's adapter name is its id with ':' -> '.' (`slot_name`).
- Checkpoints are the run's (`rl_multilora.checkpoint.CheckpointManager`, the service's own in `serve`): `save_weights`
  writes the GRPO tenants' layout (PEFT folder, AdamW state, `checkpoint.json`, atomic temp-folder rename) under
  `adapters/<slot_name>/`, labeled with the client's name (`save_labeled`), so `rl-multilora export` and PEFT read
  it as they read any adapter's; `tinker://<model_id>/weights/<name>` is that model's newest checkpoint labeled
  <name>. A replayed save finds the checkpoint its request wrote before the restart.
- Sampler weights are in-memory versions: `save_weights_for_sampler` copies the slot's true-rank tensors
  (`adapter_state_dict`) and loads them into the engine's bank under a name of their own. When the bank is full the
  least recently used version is unloaded from the bank; its tensors stay in memory and are loaded again on its next
  sample. Memory stays bounded: a model keeps at most `max_sampler_versions` versions (publishing or sampling one
  makes it the most recently used); an older one's tensors are freed, and so are all of a model's on `unload`. A
  sample of a freed version is a user error that says why. With an engine shared with GRPO tenants
  (`shared_engine`), client versions hold at most one engine slot per client tenant, so the engine always has room
  for every GRPO tenant's push.
- Engine log-probs are those of the raw logits (temperature 1), as the engine documents.
"""

from __future__ import annotations

import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from rl_multilora.checkpoint import AdapterSnapshot, CheckpointManager, DamagedCheckpoint
from rl_multilora.lora import MultiLoRAModel
from rl_multilora.tenants import TenantError
from rl_multilora.tinker.wire import Datum
from rollout.types import GenerateRequest, SamplingParams

LORA_ALPHA = 32.0
LOSS_FNS = ("cross_entropy", "importance_sampling", "ppo")
PLAIN_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # sessions (fullmatch): no '.', ':' or '/'
MODEL_ID_PATTERN = re.compile(r"([A-Za-z0-9_-]{1,64}):train:([0-9]{1,9})")  # fullmatch
NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")  # checkpoint and sampler names (fullmatch), not '.' or '..'
_LAYER_GROUPS = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}


class UserError(ValueError):
    """A request the client must change (bad loss inputs, unknown model, ...): category "user"."""


def model_id_of(session_id: Any, model_seq_id: Any) -> str:
    """The id of a session's n-th model, as the SDK derives it itself when it creates a model by loading weights.

    >>> model_id_of("s0a1", 2)
    's0a1:train:2'
    """
    model_id = f"{session_id}:train:{model_seq_id}"
    if not MODEL_ID_PATTERN.fullmatch(model_id):
        raise _bad_model_id(model_id)
    return model_id


def slot_name(model_id: Any) -> str:
    """The model's adapter name (in the model, the engine and under checkpoint_dir): its id with ':' -> '.'.
    A plain name of the session's characters (no '.' or ':', so no API id maps onto it) names itself: the server
    only makes `<session>:train:<n>` ids, direct `ClientOps` users (bench/bench_tinker.py) may pick their own.

    >>> slot_name("s0a1:train:2"), slot_name("c0")
    ('s0a1.train.2', 'c0')
    >>> slot_name("../x:train:0")  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rl_multilora.tinker.ops.UserError: model_id='../x:train:0' is not allowed; allowed: <session>:train:<n>, ...
    """
    if isinstance(model_id, str) and PLAIN_NAME_PATTERN.fullmatch(model_id):
        return model_id
    if not isinstance(model_id, str) or not MODEL_ID_PATTERN.fullmatch(model_id):
        raise _bad_model_id(model_id)
    return model_id.replace(":", ".")


def _bad_model_id(model_id: Any) -> UserError:
    return UserError(
        f"model_id={model_id!r} is not allowed; allowed: <session>:train:<n>, the session 1 to 64 letters, "
        "digits, '_' or '-'"
    )


def checkpoint_name(field_name: str, name: Any) -> str:
    """`name` if it is a safe path component, else a UserError naming `field_name`.

    >>> checkpoint_name("path", "step-10")
    'step-10'
    """
    if not isinstance(name, str) or not NAME_PATTERN.fullmatch(name) or name in (".", ".."):
        raise UserError(
            f"{field_name}={name!r} is not allowed; allowed: 1 to 128 letters, digits, '.', '_' or '-', "
            "other than '.' and '..'"
        )
    return name


def checkpoint_ref(path: Any) -> tuple[str, str]:
    """(adapter name, label) of a training checkpoint's path, each checked: they become path components.

    >>> checkpoint_ref("tinker://s0a1:train:2/weights/step-10")
    ('s0a1.train.2', 'step-10')
    """
    parts = path.removeprefix("tinker://").split("/") if isinstance(path, str) and path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] != "weights":
        raise UserError(f"path={path!r} is not a training checkpoint; allowed: tinker://<model_id>/weights/<name>")
    return slot_name(parts[0]), checkpoint_name("path name", parts[2])


@dataclass
class ClientTenant:
    """One model created through the API: its slot's leaf views, their AdamW and counters."""

    model_id: str
    name: str  # slot_name(model_id)
    rank: int
    lora_config: dict[str, Any]
    seed: int | None
    params: list[torch.nn.Parameter]
    optim: torch.optim.AdamW
    steps: int = 0
    grads: list[torch.Tensor | None] | None = None  # accumulated since the last optim_step, `params` order
    sampler_versions: int = 0
    sampler_paths: OrderedDict[str, None] = field(default_factory=OrderedDict)  # live versions, least recent first


@dataclass
class SamplerVersion:
    """Frozen weights a sampling session serves; `engine_name` None means the base model. A freed version has
    `tensors` None and its `path` is in `ClientOps.freed`."""

    engine_name: str | None
    tensors: dict[str, torch.Tensor] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    path: str | None = None


@dataclass
class FwdBwdItem:
    """One forward_backward request of one tenant inside a mixed batch."""

    model_id: str
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool


class ModelSlots:
    """Slots straight from the model: the standalone server, where client tenants are the only tenants. The GRPO
    service passes its `TenantManager` instead, which has the same three methods."""

    def __init__(self, model: MultiLoRAModel) -> None:
        self.model = model

    def add_client(self, name: str, rank: int, alpha: float, seed: int | None, target_modules: list[str]) -> int:
        if not self.model.free_slots:
            raise TenantError(f"no free LoRA slot: all {self.model.max_loras} are in use; unload a model first")
        return self.model.add_adapter(name, rank, alpha, seed=seed, target_modules=target_modules)

    def record_client_step(self, name: str, adapter_step: int) -> None:
        """Nothing else keeps client step counts here."""

    def release_client(self, name: str) -> None:
        self.model.remove_adapter(name)

    def end_client_reservations(self) -> None:
        """Nothing is reserved here: no other kind of tenant competes for these slots."""


class ClientOps:
    """Everything the server does to the model and the engine. Training calls come from one worker thread;
    sampling calls may come from any thread (the engine has its own worker and bank)."""

    def __init__(
        self,
        model: MultiLoRAModel,
        engine: Any,
        pad_id: int,
        ckpt: CheckpointManager,
        max_sampler_versions: int = 4,
        slots: Any = None,
        shared_engine: bool = False,
    ) -> None:
        if type(max_sampler_versions) is not int or max_sampler_versions < 1:  # bool is refused too
            raise ValueError(
                f"max_sampler_versions={max_sampler_versions!r} is not allowed; allowed: an int >= 1 "
                "(in-memory sampler versions kept per model)"
            )
        self.model = model
        self.slots = slots if slots is not None else ModelSlots(model)
        self.shared_engine = shared_engine  # GRPO tenants use the engine too: one engine slot per client tenant
        self.engine = engine
        self.pad_id = pad_id
        self.ckpt = ckpt  # the run's checkpoints: client tenants' are GRPO tenants' (see the module docstring)
        self.max_sampler_versions = max_sampler_versions
        self.tenants: dict[str, ClientTenant] = {}
        self.samplers: dict[str, SamplerVersion] = {}  # live versions by tinker:// path
        self.freed: dict[str, str] = {}  # path of a freed version -> why (the error its samples get)
        self._samplers_lock = threading.RLock()  # samplers, freed, sampler_paths: publish (worker) vs sample (loop)
        self._loaded: OrderedDict[str, None] = OrderedDict()  # engine names in the bank, least recently used first
        self._engine_lock = threading.Lock()
        self.device = next(model.parameters()).device
        self.batch_sizes: list[int] = []  # requests per mixed forward_backward batch, in order (tests, bench)

    # -- tenants ---------------------------------------------------------------------------------------------------
    def create(self, model_id: str, rank: int, seed: int | None, layers: dict[str, Any]) -> ClientTenant:
        if model_id in self.tenants:
            return self.tenants[model_id]
        name = slot_name(model_id)
        wanted = {leaf for key, leaves in _LAYER_GROUPS.items() if layers.get(key, True) for leaf in leaves}
        targets = [m for m in self.model.lora_modules if m.rsplit(".", 1)[-1] in wanted]
        if not targets:
            raise UserError(f"lora_config {layers} selects none of the model's LoRA modules")
        if not 1 <= rank <= self.model.max_rank:
            raise UserError(f"lora_config.rank={rank} is not allowed; allowed: 1 to {self.model.max_rank}")
        try:
            self.slots.add_client(name, rank, LORA_ALPHA, seed, targets)
        except TenantError as e:
            raise UserError(str(e)) from None
        params = self.model.adapter_parameters(name)
        optim = torch.optim.AdamW(params, lr=1e-4, betas=(0.9, 0.95), eps=1e-12, weight_decay=0.0)
        lora_config = {key: bool(layers.get(key, True)) for key in _LAYER_GROUPS}
        tenant = ClientTenant(model_id, name, rank, lora_config, seed, params, optim)
        self.tenants[model_id] = tenant
        return tenant

    def tenant(self, model_id: str) -> ClientTenant:
        if model_id not in self.tenants:
            raise UserError(f"unknown model_id {model_id!r}")
        return self.tenants[model_id]

    def unload(self, model_id: str) -> None:
        """Free the model: its slot, optimizer and every sampler version's tensors (engine copies included)."""
        t = self.tenant(model_id)
        for path in list(t.sampler_paths):
            self._free_sampler(t, path, f"sampler weights {path!r} were freed: model {model_id!r} was unloaded")
        if self.shared_engine:  # one engine slot fewer for client versions once this tenant's slot is free
            self._trim_engine(len(self.tenants) - 1)
        self.slots.release_client(t.name)
        del self.tenants[model_id]

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
        names = [self.tenants[items[i].model_id].name for i, _ in rows]
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
                self._take_grads({items[i].model_id for i, _ in rows if not items[i].forward_only})
        results = []
        start = 0
        for item in items:
            n = len(item.data)
            mine = outputs[start : start + n]
            total = float(sum(o.pop("loss")[0] for o in mine))
            results.append((mine, {"loss:sum": total}))
            start += n
        return results

    def _take_grads(self, model_ids: set[str]) -> None:
        """Add each tenant's slot part of the stacked grads into its own buffer, then drop the stacked grads."""
        for model_id in sorted(model_ids):
            t = self.tenants[model_id]
            fresh = self.model.adapter_grads(t.name)
            if t.grads is None:
                t.grads = [None if g is None else g.clone() for g in fresh]
            else:
                t.grads = [
                    old if g is None else (g.clone() if old is None else old.add_(g))
                    for old, g in zip(t.grads, fresh, strict=True)
                ]
        self.model.zero_lora_grads()

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        t = self.tenant(model_id)
        for p, g in zip(t.params, t.grads or [None] * len(t.params), strict=True):
            p.grad = g
        t.grads = None
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
        for p in t.params:  # this tenant's buffer is spent; other tenants keep accumulating in theirs
            p.grad = None
        t.steps += 1
        self.slots.record_client_step(t.name, t.steps)
        return {"grad_norm": norm}

    # -- weights ---------------------------------------------------------------------------------------------------
    def save(self, model_id: str, name: str, key: str | None = None) -> str:
        """A checkpoint of the model labeled `name` (`CheckpointManager.save_labeled`): PEFT folder, AdamW state and
        step count. `key`: the request's id, so its replay after a restart finds this checkpoint."""
        t = self.tenant(model_id)
        label = checkpoint_name("path", name)
        snap = AdapterSnapshot(
            tensors=self.model.adapter_state_dict(t.name),
            peft_config=self.model.peft_config(t.name),
            optimizer=t.optim.state_dict(),
            data_state={},  # no data source: the client holds its own data
            meta={
                "adapter_step": t.steps,
                "state": "RUNNING",
                "tinker": {"model_id": model_id, "rank": t.rank, "lora_config": t.lora_config, "seed": t.seed},
            },
        )
        self.ckpt.save_labeled(t.name, snap, label, key)
        return f"tinker://{model_id}/weights/{label}"

    def load(self, model_id: str, path: str, with_optimizer: bool) -> None:
        """Weights (and, `with_optimizer`, AdamW state and step count) of a checkpoint into the model, which is
        created like the checkpoint's (rank, layers) when it does not exist: the SDK's create-from-state."""
        snap = self._checkpoint(path)
        info = snap.meta["tinker"]
        if model_id not in self.tenants:
            self.create(model_id, int(info["rank"]), None, info.get("lora_config", {}))
        t = self.tenants[model_id]
        if t.rank != int(info["rank"]):
            raise UserError(f"checkpoint {path!r} has rank {info['rank']}; model {model_id!r} has rank {t.rank}")
        self.model.load_adapter_state_dict(t.name, snap.tensors, snap.peft_config)
        if with_optimizer:
            t.optim.load_state_dict(snap.optimizer)
            t.steps = snap.adapter_step
            self.slots.record_client_step(t.name, t.steps)

    def _checkpoint(self, path: str) -> AdapterSnapshot:
        """The checkpoint `tinker://<model_id>/weights/<name>` names: that model's newest labeled <name>."""
        found = self.ckpt.find_labeled(*checkpoint_ref(path))
        if found is None or "tinker" not in found[1]:
            raise UserError(f"checkpoint {path!r} does not exist")
        try:
            return self.ckpt.read_snapshot(*found)
        except DamagedCheckpoint as e:
            raise UserError(f"checkpoint {path!r} cannot be read: {e}") from None

    def publish_sampler(self, model_id: str, name: str | None) -> tuple[str, str]:
        """A new in-memory sampler version of the tenant: (its tinker:// path, its engine name). The model's least
        recently used version beyond `max_sampler_versions` is freed."""
        t = self.tenant(model_id)
        n = t.sampler_versions + 1
        path = f"tinker://{model_id}/sampler_weights/{checkpoint_name('path', name or f's{n}')}"
        t.sampler_versions = n
        engine_name = f"{t.name}.s{n}"
        version = SamplerVersion(
            engine_name, self.model.adapter_state_dict(t.name), self.model.peft_config(t.name), path
        )
        with self._samplers_lock:
            if path in t.sampler_paths:  # the same name again: the new weights replace the old version
                self._free_sampler(t, path, f"sampler weights {path!r} were replaced")
            self.samplers[path] = version
            self.freed.pop(path, None)
            t.sampler_paths[path] = None
            while len(t.sampler_paths) > self.max_sampler_versions:
                old = next(iter(t.sampler_paths))
                self._free_sampler(
                    t,
                    old,
                    f"sampler weights {old!r} were evicted from memory: the server keeps at most "
                    f"{self.max_sampler_versions} sampler versions per model (--max-sampler-versions), least recently "
                    "used first; call save_weights_for_sampler again",
                )
        self._ensure_loaded(version)
        return path, engine_name

    def _free_sampler(self, t: ClientTenant, path: str, why: str) -> None:
        """Drop a version's tensors and its engine copy; its samples from now on fail with `why`."""
        with self._samplers_lock:
            v = self.samplers.pop(path)
            del t.sampler_paths[path]
            self.freed[path] = why
            v.tensors = None
        with self._engine_lock:
            if v.engine_name in self._loaded:
                del self._loaded[v.engine_name]
                self.engine.unload_adapter(v.engine_name)

    def sampler(self, path: str | None) -> SamplerVersion:
        """The version at `path` (None: the base), now the most recently used of its model."""
        if path is None:
            return SamplerVersion(None)
        with self._samplers_lock:
            if path in self.freed:
                raise UserError(self.freed[path])
            if path not in self.samplers:
                raise UserError(f"model_path={path!r} names no sampler weights; save_weights_for_sampler first")
            model_id = path.removeprefix("tinker://").split("/")[0]
            self.tenants[model_id].sampler_paths.move_to_end(path)
            return self.samplers[path]

    def _ensure_loaded(self, v: SamplerVersion) -> None:
        if v.engine_name is None:
            return
        with self._engine_lock:
            if v.tensors is None:  # freed while a sample of it was on its way
                raise UserError(self.freed.get(v.path or "", f"sampler weights {v.path!r} were freed"))
            if v.engine_name in self._loaded:
                self._loaded.move_to_end(v.engine_name)
                return
            room = len(self.tenants) if self.shared_engine else self.model.max_loras
            if room < 1:
                raise UserError(f"sampler weights {v.path!r} cannot be served: its model was unloaded")
            while len(self._loaded) >= room:
                old, _ = self._loaded.popitem(last=False)
                self.engine.unload_adapter(old)
            self.engine.load_adapter(v.engine_name, v.tensors, v.config)
            self._loaded[v.engine_name] = None

    def _trim_engine(self, room: int) -> None:
        """Unload the least recently used client versions until at most `room` are in the engine."""
        with self._engine_lock:
            while len(self._loaded) > max(room, 0):
                old, _ = self._loaded.popitem(last=False)
                self.engine.unload_adapter(old)

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
