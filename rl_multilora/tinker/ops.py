"""The model work behind the Tinker API: client tenants on one `MultiLoRAModel`, sampled by one `EmbeddedEngine`.

Design choices:

- One trainer behind both doors: a client tenant is a tenant of the training backend like a GRPO tenant (a slot, an
  optimizer with its step count, a gradient buffer: `rl_multilora.train_ops.TenantTrainState`), and this module
  only translates the API onto the backend's primitives. The slot comes from `slots`: the backend itself
  (`BackendSlots`, the standalone server) or the GRPO service's `TenantManager` (`add_client` / `release_client`),
  so both kinds of tenants share one slot pool. Its LoRA alpha is fixed at 32 (Tinker's convention), so the scale
  is 32 / rank.
- `forward_backward` of several tenants is ONE call of the backend's `forward_backward`: one mixed batch, each
  tenant's tokens under its own `loss_fn` from the one loss registry (`rl_multilora.losses`, every SDK loss;
  `stable_reinforce` is this project's own objective, Tinker's being unpublished), each tenant's gradient
  accumulating in its own buffer until its own `optim_step`, which applies that call's Adam settings. A datum is a
  `Row` whose targets are every position of its `model_input` (position i predicts `target_tokens[i]`).
- A loss that reads provenance (`stable_reinforce`) gets its sampler log-probs from the server's own records of what
  it sampled (`records`, `rl_multilora.tinker.stability`), never from the client's `logprobs`: `sample` callers
  record, `forward_backward` resolves each datum's spans against them (the session of the model must own them).
- Losses are Tinker's: sums over tokens (the client normalizes through `weights` / `advantages`), not means.
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
  sample of a freed version is a user error that says why. Versions count against the host budget
  (`host_budget_bytes`, the `--host-budget-gb` paged tenants use): while the tenant store's host bytes plus the live
  versions' host tensors exceed it, the least recently used versions' tensors are written to `spill_dir` and read
  back on their next use (a sample, a prompt score, a journal snapshot), so a server's host memory does not grow with
  its client count past the budget. With an engine shared with GRPO tenants
  (`shared_engine`), client versions hold at most one engine slot per client tenant, so the engine always has room
  for every GRPO tenant's push.
- Engine log-probs are those of the raw logits (temperature 1), as the engine documents.
- Prompt log-probs (`compute_logprobs`, `include_prompt_logprobs`, `topk_prompt_logprobs`) come from one forward of
  the backend's in-process model through a one-slot LoRA bank of this server's own, holding the sampler version's
  frozen tensors (the training slot may have moved on since it was published); raw logits, like the engine's. A
  backend whose model lives in other processes (trainer ranks) has none: such requests are refused, saying so.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rl_multilora.backends.base import TrainingBackend
from rl_multilora.checkpoint import AdapterSnapshot, CheckpointManager, DamagedCheckpoint
from rl_multilora.losses import REGISTRY, SDK_LOSSES, TenantAlgo, client_algo
from rl_multilora.rows import Row
from rl_multilora.tenant_optim import AdamSettings
from rl_multilora.tenants import TenantError
from rl_multilora.tinker.stability import StabilityRecords, session_of
from rl_multilora.tinker.wire import Datum
from rollout.types import GenerateRequest, SamplingParams

LORA_ALPHA = 32.0
LOSS_FNS = SDK_LOSSES  # derived from the loss registry
PLAIN_NAME_PATTERN = re.compile(r"[A-Za-z0-9_-]{1,64}")  # sessions (fullmatch): no '.', ':' or '/'
MODEL_ID_PATTERN = re.compile(r"([A-Za-z0-9_-]{1,64}):train:([0-9]{1,9})")  # fullmatch
SNAPSHOT_LABEL = "_journal-snapshot"  # the label of the checkpoints journal snapshots write (not a client's)
NAME_PATTERN = re.compile(r"[A-Za-z0-9._-]{1,128}")  # checkpoint and sampler names (fullmatch), not '.' or '..'
_LAYER_GROUPS = {
    "train_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "train_mlp": ("gate_proj", "up_proj", "down_proj"),
    "train_unembed": ("lm_head",),
}


class UserError(ValueError):
    """A request the client must change (bad loss inputs, unknown model, ...): category "user"."""


class PartialBatch(Exception):  # noqa: N818 - not an error of its own: it carries the finished part of a batch
    """A mixed batch that failed after some of its items' backend calls had run (their gradients are accumulated):
    `done` maps those items' indices to their results; the other items did not run at all. `__cause__` is the
    failure. A caller that retries the batch runs only the others (running a finished item again would add its
    gradient twice)."""

    def __init__(self, done: dict[int, tuple[list[dict[str, np.ndarray]], dict[str, float]]]) -> None:
        super().__init__(f"{len(done)} items of the batch finished before it failed")
        self.done = done


def model_id_of(session_id: Any, model_seq_id: Any) -> str:
    """The id of a session's n-th model, as the SDK derives it itself when it creates a model by loading weights.

    >>> model_id_of("s0a1", 2)
    's0a1:train:2'
    """
    model_id = f"{session_id}:train:{model_seq_id}"
    if not MODEL_ID_PATTERN.fullmatch(model_id):
        raise bad_model_id(model_id)
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
        raise bad_model_id(model_id)
    return model_id.replace(":", ".")


def bad_model_id(model_id: Any) -> UserError:
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
    """One model created through the API as the server knows it: its id, adapter name and LoRA settings, and its
    sampler versions. Its weights, optimizer and step count are the training backend's tenant `name`."""

    model_id: str
    name: str  # slot_name(model_id)
    rank: int
    lora_config: dict[str, Any]
    seed: int | None
    sampler_versions: int = 0
    sampler_paths: OrderedDict[str, None] = field(default_factory=OrderedDict)  # live versions, least recent first


@dataclass
class SamplerVersion:
    """Frozen weights a sampling session serves; `engine_name` None means the base model. A spilled version has
    `tensors` None and its file at `spilled`; a freed one has neither, `live` False and its `path` in
    `ClientOps.freed`."""

    engine_name: str | None
    tensors: dict[str, torch.Tensor] | None = None
    config: dict[str, Any] = field(default_factory=dict)
    path: str | None = None
    spilled: Path | None = None
    live: bool = True

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.tensors or {}).values())


ALL_LOSS_INPUTS = frozenset(
    ["target_tokens", *(k for d in REGISTRY.values() for k in (*d.inputs, *d.optional_inputs))]
)  # the loss_fn_inputs keys some loss reads (`_datum_row`)
INFLIGHT_NAME = "_inflight"  # the sampler path name of a model's inflight target (`publish_sampler`)


def is_inflight(path: str | None) -> bool:
    """Whether sampler `path` is a model's inflight target (replaced in place by each inflight save)."""
    return path is not None and path.endswith(f"/sampler_weights/{INFLIGHT_NAME}")


def _replaced(v: SamplerVersion) -> bool:
    """Whether `v` is an inflight target that an inflight save replaced (its path holds a newer version)."""
    return not v.live and is_inflight(v.path)


MAX_FREED_PATHS = 100_000  # freed versions whose samples get "freed: <why>"; older ones get "names no sampler weights"


@dataclass(frozen=True)
class ModelLimits:
    """What a request may ask of the served model: token ids below `vocab_size` (the model config's, the rows of
    its embedding), a prompt plus its new tokens within `context_length`, at most `max_tokens_cap` new tokens (the
    server's `--max-tokens-cap`; None: the context length)."""

    vocab_size: int
    context_length: int
    max_tokens_cap: int | None = None

    @classmethod
    def of_config(cls, config: Any, max_tokens_cap: int | None = None) -> ModelLimits:
        """From a HF model config (a multimodal one's `text_config`); 2048 tokens of context when it names none."""
        c = getattr(config, "text_config", None) or config
        context = getattr(c, "max_position_embeddings", None) or getattr(c, "n_positions", None) or 2048
        if max_tokens_cap is not None and (type(max_tokens_cap) is not int or max_tokens_cap < 1):
            raise ValueError(f"max_tokens_cap={max_tokens_cap!r} is not allowed; allowed: an int >= 1 or None")
        return cls(int(c.vocab_size), int(context), max_tokens_cap)

    @classmethod
    def of_path(cls, model_path: str, max_tokens_cap: int | None = None) -> ModelLimits:
        from transformers import AutoConfig

        return cls.of_config(AutoConfig.from_pretrained(model_path), max_tokens_cap)

    def new_tokens(self, prompt_len: int, max_tokens: Any) -> int:
        """How many tokens a sample of a `prompt_len`-token prompt may generate for the client's `max_tokens` (None:
        as many as the cap and the context allow; 0: none), else a UserError naming the limit.

        >>> ModelLimits(100, 32, 16).new_tokens(10, None), ModelLimits(100, 32).new_tokens(10, None)
        (16, 22)
        >>> ModelLimits(100, 32).new_tokens(10, 10**9)  # doctest: +ELLIPSIS
        Traceback (most recent call last):
        ...
        rl_multilora.tinker.ops.UserError: sampling_params.max_tokens=1000000000 is not allowed; allowed: ...
        """
        cap = self.max_tokens_cap if self.max_tokens_cap is not None else self.context_length
        room = self.context_length - prompt_len
        if prompt_len < 1 or room < 1:
            raise UserError(
                f"prompt has {prompt_len} tokens; allowed: 1 to {self.context_length - 1} (the model's context is "
                f"{self.context_length} tokens)"
            )
        if max_tokens is None:
            return min(cap, room)
        if type(max_tokens) is not int or max_tokens < 0 or max_tokens > min(cap, room):
            limit = "the server's --max-tokens-cap" if cap < room else "the model's context minus the prompt"
            raise UserError(
                f"sampling_params.max_tokens={max_tokens!r} is not allowed; allowed: an int in [0, {min(cap, room)}] "
                f"({limit}: context {self.context_length}, prompt {prompt_len} tokens, cap {cap})"
            )
        return max_tokens


@dataclass
class FwdBwdItem:
    """One forward_backward request of one tenant inside a mixed batch."""

    model_id: str
    loss_fn: str
    config: dict[str, float | str]
    data: list[Datum]
    forward_only: bool


class BackendSlots:
    """Slots straight from the training backend: the standalone server, where client tenants are the only tenants.
    The GRPO service passes its `TenantManager` instead, which has the same methods."""

    def __init__(self, backend: TrainingBackend) -> None:
        self.backend = backend

    def add_client(self, name: str, rank: int, alpha: float, seed: int | None, target_modules: list[str]) -> int:
        if not self.backend.free_slots():  # with paging, free places (model.max_tenants), not resident slots
            raise TenantError(
                f"no free LoRA slot: all {self.backend.max_tenants} places are in use (max_tenants; max_loras "
                f"{self.backend.max_loras}); unload a model first"
            )
        return self.backend.add_client(name, rank, alpha, seed, target_modules)

    def record_client_step(self, name: str, adapter_step: int) -> None:
        """Nothing else keeps client step counts here."""

    def release_client(self, name: str) -> None:
        self.backend.remove_adapter(name)

    def end_client_reservations(self) -> None:
        """Nothing is reserved here: no other kind of tenant competes for these slots."""


MASK_LOGPROB = -99999.0  # an empty cell of the SDK's top-k matrices (tinker.types.topk_logprobs)


@dataclass
class PromptScores:
    """A prompt's log-probs under one sampler version: `logprobs` (N,) float32, NaN where not scored (position 0,
    positions before `prompt_logprobs_last_n`); `topk_ids` / `topk_logprobs` (N, k) int32 / float32, the k most
    likely tokens at each scored position (0 / MASK_LOGPROB elsewhere), None without top-k."""

    logprobs: np.ndarray
    topk_ids: np.ndarray | None = None
    topk_logprobs: np.ndarray | None = None


class ClientOps:
    """Everything the server does to the model and the engine. Training calls come from one worker thread;
    sampling calls may come from any thread (the engine has its own worker and bank)."""

    def __init__(
        self,
        backend: TrainingBackend,
        engine: Any,
        pad_id: int,
        ckpt: CheckpointManager,
        max_sampler_versions: int = 4,
        slots: Any = None,
        shared_engine: bool = False,
        limits: ModelLimits | None = None,
        host_budget_bytes: int | None = None,
        spill_dir: str | Path | None = None,
        records: StabilityRecords | None = None,
    ) -> None:
        """`limits`: what requests may ask of the model (default: the backend's in-process model's config).
        `host_budget_bytes`: host bytes for paged tenants and sampler versions together (None: no limit); the
        versions past it are spilled to `spill_dir` (a temporary folder when None). `records`: the sampled
        sequences `stable_reinforce` datums may name (default: one day unused, `stability.MAX_TOKENS`)."""
        if host_budget_bytes is not None and (type(host_budget_bytes) is not int or host_budget_bytes < 0):
            raise ValueError(
                f"host_budget_bytes={host_budget_bytes!r} is not allowed; allowed: an int >= 0 or None (host bytes "
                "of paged tenants and sampler versions)"
            )
        if type(max_sampler_versions) is not int or max_sampler_versions < 1:  # bool is refused too
            raise ValueError(
                f"max_sampler_versions={max_sampler_versions!r} is not allowed; allowed: an int >= 1 "
                "(in-memory sampler versions kept per model)"
            )
        self.backend = backend
        if limits is None:
            if backend.shared_model is None:
                raise ValueError("limits=None needs a backend with an in-process model; pass ModelLimits.of_path(...)")
            limits = ModelLimits.of_config(backend.shared_model.config)
        self.limits = limits
        self.slots = slots if slots is not None else BackendSlots(backend)
        self.shared_engine = shared_engine  # GRPO tenants use the engine too: one engine slot per client tenant
        self.engine = engine
        self.pad_id = pad_id
        self.ckpt = ckpt  # the run's checkpoints: client tenants' are GRPO tenants' (see the module docstring)
        self.max_sampler_versions = max_sampler_versions
        self.tenants: dict[str, ClientTenant] = {}
        self.samplers: dict[str, SamplerVersion] = {}  # live versions by tinker:// path
        self.freed: OrderedDict[str, str] = OrderedDict()  # path of a freed version -> why (its samples' error)
        self.host_budget_bytes = host_budget_bytes
        self._spill_dir = Path(spill_dir) if spill_dir is not None else None
        self._in_host: OrderedDict[str, None] = OrderedDict()  # versions with host tensors, least recently used first
        self.sampler_host_bytes = 0  # tensors of live versions in host memory
        self.sampler_disk_bytes = 0  # spill files of live versions
        self.sampler_spills = 0
        self.sampler_loads = 0
        self._samplers_lock = threading.RLock()  # samplers, freed, sampler_paths: publish (worker) vs sample (loop)
        self._loaded: OrderedDict[str, None] = OrderedDict()  # engine names in the bank, least recently used first
        self._engine_lock = threading.Lock()
        self._score_bank: Any = None  # a one-slot LoRABank for prompt log-probs, made on first use
        self._score_lock = threading.Lock()
        self.batch_sizes: list[int] = []  # requests per mixed forward_backward batch, in order (tests, bench)
        self.records = records if records is not None else StabilityRecords()

    # -- tenants ---------------------------------------------------------------------------------------------------
    def create(self, model_id: str, rank: int, seed: int | None, layers: dict[str, Any]) -> ClientTenant:
        if model_id in self.tenants:
            return self.tenants[model_id]
        name = slot_name(model_id)
        wanted = {leaf for key, leaves in _LAYER_GROUPS.items() if layers.get(key) is not False for leaf in leaves}
        targets = [m for m in self.backend.lora_modules if m.rsplit(".", 1)[-1] in wanted]
        if not targets:
            served = [key for key, leaves in _LAYER_GROUPS.items()
                      if any(m.rsplit(".", 1)[-1] in leaves for m in self.backend.lora_modules)]  # fmt: skip
            why = (
                ""
                if "train_unembed" in served
                else " (this server has no LoRA on lm_head: train_unembed alone selects nothing)"
            )
            raise UserError(
                f"lora_config {layers} selects none of the model's LoRA modules; allowed: one of {served} true{why}"
            )
        if not 1 <= rank <= self.backend.max_rank:
            raise UserError(f"lora_config.rank={rank} is not allowed; allowed: 1 to {self.backend.max_rank}")
        try:
            self.slots.add_client(name, rank, LORA_ALPHA, seed, targets)
        except TenantError as e:
            raise UserError(str(e)) from None
        # what is trained, not what was asked: train_unembed (the SDK's default True) is true only when lm_head is
        # among the model's LoRA modules (tinker-serve's default; a GRPO service's when its target_modules name it)
        leaves = {m.rsplit(".", 1)[-1] for m in targets}
        lora_config = {key: any(leaf in leaves for leaf in group) for key, group in _LAYER_GROUPS.items()}
        tenant = ClientTenant(model_id, name, rank, lora_config, seed)
        self.tenants[model_id] = tenant
        self.spill_over_budget()  # the create may have paged a tenant out into the store
        return tenant

    def steps(self, model_id: str) -> int:
        """Optimizer steps the model has taken (the backend's count for its tenant)."""
        return self.backend.adapter_step(self.tenant(model_id).name)

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

    def score_prompt(self, v: SamplerVersion, prompt: list[int], last_n: int | None, topk: int) -> PromptScores:
        """Log-probs of `prompt`'s tokens under version `v` (the last `last_n` of them; None: all but the first) and,
        `topk` > 0, the top-k tokens at each scored position: one forward through the scoring bank."""
        from rl_multilora.lora.bank import LoRABank

        model = self.backend.shared_model
        if model is None:
            raise UserError(
                "prompt log-probs are not supported with this trainer placement (its model lives in trainer ranks); "
                "sample without include_prompt_logprobs / topk_prompt_logprobs"
            )
        n = len(prompt)
        first = 1 if last_n is None else n - last_n  # the first scored position
        with self._score_lock, torch.no_grad():
            if v.engine_name is not None and self._score_bank is None:
                device = next(model.parameters()).device
                self._score_bank = LoRABank(model.layer_shapes, 1, model.max_rank, model.lora_dtype, device,
                                            expert_shapes=getattr(model, "_expert_shapes", None))  # fmt: skip
            if v.engine_name is not None:
                self._score_bank.set_adapter(0, self._current_tensors(v), v.config)
            device = next(model.parameters()).device
            ids = torch.tensor([prompt], device=device)  # (1, N)
            slots = torch.tensor([0 if v.engine_name is not None else -1], device=device)
            model.eval()  # as the trainer leaves it (see rl_multilora.train_ops)
            out = model(ids, adapter_slots=slots, lora_bank=self._score_bank, logits_to_keep=n - first + 1)
            # positions first-1 .. N-2 predict tokens first .. N-1 (a model that ignores logits_to_keep gives all N)
            logits = out.logits[0, -(n - first + 1) : -1].float()  # (N - first, V)
            logp_all = torch.log_softmax(logits, dim=-1)  # (N - first, V)
            target = torch.tensor(prompt[first:], device=device)  # (N - first,)
            scored = logp_all.gather(-1, target[:, None]).squeeze(-1)  # (N - first,)
            logprobs = np.full(n, np.nan, dtype=np.float32)
            logprobs[first:] = scored.cpu().numpy()
            if not topk:
                return PromptScores(logprobs)
            k = min(topk, logp_all.shape[-1])
            values, index = logp_all.topk(k, dim=-1)  # (N - first, k) each
            top_ids = np.zeros((n, k), dtype=np.int32)
            top_lp = np.full((n, k), MASK_LOGPROB, dtype=np.float32)
            top_ids[first:], top_lp[first:] = index.cpu().numpy(), values.cpu().numpy()
            return PromptScores(logprobs, top_ids, top_lp)

    def check_sample(self, prompt: list[int], params: Any) -> int:
        """The new tokens a sample of `prompt` with sampling `params` may generate; a UserError for a token id out
        of the vocabulary, a prompt or `max_tokens` beyond the context or the cap, or a sampling setting out of its
        range (`sampling_settings`)."""
        sampling_settings(params)
        check_tokens("prompt", prompt, self.limits.vocab_size)
        if not prompt:
            raise UserError("prompt has 0 tokens; allowed: 1 or more (the model needs a token to continue)")
        return self.limits.new_tokens(len(prompt), params.get("max_tokens"))

    # -- training --------------------------------------------------------------------------------------------------
    def forward_backward(self, items: list[FwdBwdItem]) -> list[tuple[list[dict[str, np.ndarray]], dict[str, float]]]:
        """The items' datums as one mixed batch of the backend's `forward_backward` (forward-only items in a forward
        of their own); each item's tenant under its own loss. Returns per item its datums' outputs and metrics."""
        self.batch_sizes.append(len(items))
        losses: list[TenantAlgo] = []
        rows: list[list[Row]] = []
        for item in items:
            t = self.tenant(item.model_id)
            try:
                algo = client_algo(item.loss_fn, item.config)
            except ValueError as e:
                raise UserError(str(e)) from None
            losses.append(algo)
            rows.append([self._row(t.name, item, j, d) for j, d in enumerate(item.data)])
        outputs: list[list[dict[str, np.ndarray]]] = [[] for _ in items]
        totals = [0.0] * len(items)
        finished: list[int] = [i for i in range(len(items)) if not rows[i]]  # items whose calls have run
        # One call per (forward only?, wave, at most max_loras tenants): a call holds each tenant once, with its own
        # loss, and no more tenants than the backend runs in one pass, so that a call is all or nothing (a backend
        # that pages splits a bigger call into passes itself, and a failure in a later pass would leave the earlier
        # passes' gradients accumulated).
        pending = [i for i in range(len(items)) if rows[i]]
        try:
            while pending:
                wave: dict[tuple[bool, str], int] = {}
                for i in pending:
                    wave.setdefault((items[i].forward_only, self.tenants[items[i].model_id].name), i)
                pending = [i for i in pending if i not in wave.values()]
                for forward_only in (False, True):
                    chosen = [i for (fo, _), i in wave.items() if fo == forward_only]
                    for k in range(0, len(chosen), self.backend.max_loras):
                        call = chosen[k : k + self.backend.max_loras]
                        self._call(call, rows, losses, forward_only, outputs, totals)
                        finished += call
        except Exception as e:
            if finished:
                done = {i: (outputs[i], {"loss:sum": totals[i]}) for i in finished}
                raise PartialBatch(done) from e
            raise
        self.spill_over_budget()  # paging the batch's tenants in may have paged others out
        return [(outputs[i], {"loss:sum": totals[i]}) for i in range(len(items))]

    def _call(self, call, rows, losses, forward_only, outputs, totals) -> None:
        """One backend call over items `call` (one tenant each); their outputs and loss sums into `outputs` and
        `totals`."""
        batch = [r for i in call for r in rows[i]]
        algos = {rows[i][0].adapter: losses[i] for i in call}
        out = self.backend.forward_backward(batch, algos, backward=not forward_only)
        start = 0
        for i in call:
            n = len(rows[i])
            outputs[i] = [{"logprobs": logp.float().cpu().numpy()} for logp in out.logprobs[start : start + n]]
            totals[i] = float(sum(out.row_loss[start : start + n]))
            start += n

    def _row(self, name: str, item: FwdBwdItem, j: int, d: Datum) -> Row:
        """Datum `j` of `item` as a training row; for a loss that reads provenance, with the recorded sampler
        log-probs as its old log-probs and its sampled-token mask as its loss weights."""
        row = _datum_row(name, item.loss_fn, d, self.limits.vocab_size, self.limits.context_length)
        if REGISTRY[item.loss_fn].provenance:
            try:
                got = self.records.resolve(session_of(item.model_id), d, f"data[{j}]")
            except ValueError as e:
                raise UserError(str(e)) from None
            row.old_logprobs, row.loss_weights = got.sampler_logprobs, got.sampled
        row.prompt_len = _prompt_len(row)
        return row

    def optim_step(self, model_id: str, adam: dict[str, float]) -> dict[str, float]:
        t = self.tenant(model_id)
        settings = _adam_settings(adam)
        stepped, norm = self.backend.optim_step(t.name, settings)
        self.slots.record_client_step(t.name, self.backend.adapter_step(t.name))
        out = {"grad_norm": norm if norm is not None and np.isfinite(norm) else 0.0}
        if not stepped:
            out["skipped_nonfinite"] = 1.0
        self.spill_over_budget()
        return out

    # -- weights ---------------------------------------------------------------------------------------------------
    def save(self, model_id: str, name: str, key: str | None = None) -> str:
        """A checkpoint of the model labeled `name` (`CheckpointManager.save_labeled`): PEFT folder, AdamW state and
        step count. `key`: the request's id, so its replay after a restart finds this checkpoint."""
        label = checkpoint_name("path", name)
        self._save(model_id, label, key)
        return f"tinker://{model_id}/weights/{label}"

    def save_external(self, model_id: str, name: Any) -> tuple[str, int]:
        """The model's adapter as a plain PEFT folder (`adapter_config.json` + `adapter_model.safetensors`, what
        `PeftModel.from_pretrained` loads; no optimizer state) at `<run dir>/external/<adapter name>/<name>`: the
        SDK's `save_weights_external` ("HuggingFace format"). Written beside and renamed into place, replacing one of
        the same name. Returns its tinker path and its size in bytes."""
        import shutil
        import tempfile

        from rl_multilora.lora import write_peft_folder

        label = checkpoint_name("path", name)
        t = self.tenant(model_id)
        folder = self.ckpt.run_dir / "external" / t.name
        folder.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=folder))
        try:
            write_peft_folder(tmp, self.backend.adapter_state_dict(t.name), self.backend.peft_config(t.name))
            final = folder / label
            if final.exists():  # the same name again (or this request replayed after a restart): replaced
                old = Path(tempfile.mkdtemp(prefix=".old-", dir=folder))
                final.rename(old / label)
                tmp.rename(final)
                shutil.rmtree(old)
            else:
                tmp.rename(final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
        size = sum(f.stat().st_size for f in final.iterdir())
        return f"tinker://{model_id}/external/{label}", size

    def _save(self, model_id: str, label: str, key: str | None) -> Path:
        t = self.tenant(model_id)
        snap = AdapterSnapshot(
            tensors=self.backend.adapter_state_dict(t.name),
            peft_config=self.backend.peft_config(t.name),
            optimizer=self.backend.optimizer_state_dict(t.name),
            data_state={},  # no data source: the client holds its own data
            meta={
                "adapter_step": self.backend.adapter_step(t.name),
                "state": "RUNNING",
                "tinker": {"model_id": model_id, "rank": t.rank, "lora_config": t.lora_config, "seed": t.seed},
            },
        )
        return self.ckpt.save_labeled(t.name, snap, label, key)

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
        saved = info.get("lora_config")
        if saved and saved != t.lora_config:  # other modules: the optimizer's parameters would not be the adapter's
            raise UserError(f"checkpoint {path!r} trains {_trained(saved)}; model {model_id!r} trains "
                            f"{_trained(t.lora_config)}; load it into a new training client "
                            "(create_training_client_from_state), which takes the checkpoint's layers")  # fmt: skip
        self.backend.load_adapter_state_dict(t.name, snap.tensors, snap.peft_config, source=path)
        if with_optimizer:
            state = snap.optimizer
            if "scheduler" not in state:  # written before clients had a schedule: AdamW's state alone
                scheduler = dict(self.backend.optimizer_state_dict(t.name)["scheduler"])
                scheduler.update(last_epoch=snap.adapter_step, _step_count=snap.adapter_step + 1)
                state = {"optimizer": state, "scheduler": scheduler}
            self.backend.load_optimizer_state_dict(t.name, state)
            self.slots.record_client_step(t.name, self.backend.adapter_step(t.name))
        else:  # weights only: AdamW starts over (the SDK's load_state: "optimizer resets"); it kept the old moments
            current = self.backend.optimizer_state_dict(t.name)
            self.backend.load_optimizer_state_dict(
                t.name, {**current, "optimizer": {**current["optimizer"], "state": {}}}
            )  # the step count (the journal's and the schedule's) goes on

    # -- the REST checkpoint routes -------------------------------------------------------------------------------
    def training_checkpoints(self, model_id: str) -> list[dict[str, Any]]:
        """The model's client checkpoints (`save_state` names; journal snapshots are not a client's), oldest first,
        as the SDK's `Checkpoint`: for each name the checkpoint it now resolves to (its newest save)."""
        from datetime import UTC, datetime

        name = slot_name(model_id)
        out = []
        for label in self.ckpt.labels(name):
            found = self.ckpt.find_labeled(name, label)
            if found is None or "tinker" not in found[1] or label == SNAPSHOT_LABEL:
                continue
            folder = found[0]
            stamp = (folder / "checkpoint.json").stat().st_mtime
            out.append({
                "checkpoint_id": f"weights/{label}",
                "checkpoint_type": "training",
                "time": datetime.fromtimestamp(stamp, UTC).isoformat(),
                "tinker_path": f"tinker://{model_id}/weights/{label}",
                "size_bytes": sum(f.stat().st_size for f in folder.iterdir() if f.is_file()),
                "public": False,
            })  # fmt: skip
        return out

    def training_runs(self) -> list[str]:
        """Model ids that hold a slot or have a client checkpoint on disk, sorted."""
        runs = set(self.tenants)
        adapters = self.ckpt.run_dir / "adapters"
        for folder in adapters.iterdir() if adapters.is_dir() else []:
            if MODEL_ID_PATTERN.fullmatch(folder.name.replace(".", ":")) and self.training_checkpoints(
                folder.name.replace(".", ":")
            ):
                runs.add(folder.name.replace(".", ":"))
        return sorted(runs)

    def run_info(self, model_id: str) -> dict[str, Any]:
        """Rank and layers of a model: its live tenant's, else its newest client checkpoint's; a UserError when
        neither exists."""
        if model_id in self.tenants:
            t = self.tenants[model_id]
            return {"rank": t.rank, "lora_config": t.lora_config}
        saved = self.training_checkpoints(model_id)
        if not saved:
            raise UserError(f"unknown training run {model_id!r}: it holds no slot and has no checkpoint")
        _, meta = self.ckpt.find_labeled(slot_name(model_id), saved[-1]["checkpoint_id"].split("/", 1)[1])
        return {"rank": meta["tinker"]["rank"], "lora_config": meta["tinker"].get("lora_config", {})}

    def delete_checkpoint(self, model_id: str, label: str, protected: set[str]) -> int:
        """Remove every checkpoint of the model labeled `label` (a name saved several times has several); returns
        how many. `protected`: folder names a journal snapshot needs (a restart rebuilds the model from them)."""
        name, label = slot_name(model_id), checkpoint_name("checkpoint_id", label)
        doomed = []
        while (found := self.ckpt.find_labeled(name, label)) is not None and "tinker" in found[1]:
            if found[0].name in protected:
                raise UserError(
                    f"checkpoint tinker://{model_id}/weights/{label} is the request journal's snapshot of the model "
                    "(a restart rebuilds it from there); save_state again first, then delete it"
                )
            doomed.append(self.ckpt.discard(found[0]))
        return len(doomed)

    # -- journal snapshots -----------------------------------------------------------------------------------------
    def snapshot(self, model_id: str, key: str, saved: str | None = None) -> tuple[dict[str, Any], dict[str, bytes]]:
        """The model's state for the journal (`Journal.compact`): a run checkpoint of its weights, optimizer and step
        count (written under request id `key`, or the client's own checkpoint at `saved` when the model has not
        changed since that save_state), how to rebuild it, and its live sampler versions' tensors. It holds no
        gradient: the server takes none between a forward_backward and its optim_step (`TinkerServer._compact_after`).
        `info["owned"]`: the journal wrote the checkpoint (and removes it once a newer snapshot supersedes it); a
        client's own is never removed."""
        from safetensors.torch import save as tensors_to_bytes

        t = self.tenant(model_id)
        if saved is not None:
            found = self.ckpt.find_labeled(*checkpoint_ref(saved))
            assert found is not None, f"{saved} was just written"
            folder, owned = found[0], False
        else:
            folder, owned = self._save(model_id, SNAPSHOT_LABEL, key), True
        with self._samplers_lock:
            live = [(path, self.samplers[path]) for path in t.sampler_paths]
            blobs = {
                path: tensors_to_bytes({k: t.contiguous() for k, t in self._tensors(v).items()}) for path, v in live
            }
            versions = [{"path": path, "engine_name": v.engine_name, "config": v.config} for path, v in live]
        info = {
            "folder": folder.name,
            "owned": owned,
            "name": t.name,
            "rank": t.rank,
            "lora_config": t.lora_config,
            "seed": t.seed,
            "sampler_versions": t.sampler_versions,
            "samplers": versions,
        }
        return info, blobs

    def restore(self, model_id: str, info: dict[str, Any], samplers: dict[str, bytes]) -> None:
        """Rebuild a model from its journal snapshot: slot, weights, optimizer and step count from the checkpoint,
        and its sampler versions (loaded into the engine when first sampled)."""
        from safetensors.torch import load as tensors_from_bytes

        t = self.create(model_id, int(info["rank"]), info.get("seed"), info.get("lora_config") or {})
        folder = self.ckpt.adapter_dir(t.name) / info["folder"]
        meta = json.loads((folder / "checkpoint.json").read_text())
        snap = self.ckpt.read_snapshot(folder, meta)
        self.backend.load_adapter_state_dict(t.name, snap.tensors, snap.peft_config, source=str(folder))
        self.backend.load_optimizer_state_dict(t.name, snap.optimizer)
        self.slots.record_client_step(t.name, self.backend.adapter_step(t.name))
        t.sampler_versions = int(info.get("sampler_versions", 0))
        with self._samplers_lock:
            for v in info.get("samplers", []):
                tensors = tensors_from_bytes(samplers[v["path"]])
                self.samplers[v["path"]] = SamplerVersion(v["engine_name"], tensors, v["config"], v["path"])
                self.freed.pop(v["path"], None)
                t.sampler_paths[v["path"]] = None
                self._hold(self.samplers[v["path"]])
            self.spill_over_budget()

    def _checkpoint(self, path: str) -> AdapterSnapshot:
        """The checkpoint `tinker://<model_id>/weights/<name>` names: that model's newest labeled <name>."""
        found = self.ckpt.find_labeled(*checkpoint_ref(path))
        if found is None or "tinker" not in found[1]:
            raise UserError(f"checkpoint {path!r} does not exist")
        try:
            return self.ckpt.read_snapshot(*found)
        except DamagedCheckpoint as e:
            raise UserError(f"checkpoint {path!r} cannot be read: {e}") from None

    def publish_sampler(self, model_id: str, name: str | None, inflight: bool = False) -> tuple[str, str]:
        """A new in-memory sampler version of the tenant: (its tinker:// path, its engine name). The model's least
        recently used version beyond `max_sampler_versions` is freed.

        `inflight` (the SDK's `kind="inflight"`): the version replaces the model's one inflight target, at the same
        path (`INFLIGHT_NAME`), so every inflight sampling client of the model samples the newest inflight weights
        (a sample that had looked up the replaced version takes the new one: `sample`)."""
        t = self.tenant(model_id)
        n = t.sampler_versions + 1
        label = INFLIGHT_NAME if inflight else checkpoint_name("path", name or f"s{n}")
        path = f"tinker://{model_id}/sampler_weights/{label}"
        t.sampler_versions = n
        engine_name = f"{t.name}.s{n}"
        version = SamplerVersion(
            engine_name, self.backend.adapter_state_dict(t.name), self.backend.peft_config(t.name), path
        )
        with self._samplers_lock:
            if path in t.sampler_paths:  # the same name again: the new weights replace the old version
                self._free_sampler(t, path, f"sampler weights {path!r} were replaced")
            self.samplers[path] = version
            self.freed.pop(path, None)
            t.sampler_paths[path] = None
            self._hold(version)
            # the inflight target is not counted (nor evicted): its clients would all fail until the next inflight save
            while sum(not is_inflight(p) for p in t.sampler_paths) > self.max_sampler_versions:
                old = next(p for p in t.sampler_paths if not is_inflight(p))
                self._free_sampler(
                    t,
                    old,
                    f"sampler weights {old!r} were evicted from memory: the server keeps at most "
                    f"{self.max_sampler_versions} sampler versions per model (--max-sampler-versions), least recently "
                    "used first; call save_weights_for_sampler again",
                )
        self._ensure_loaded(version)
        self.spill_over_budget()
        return path, engine_name

    def _free_sampler(self, t: ClientTenant, path: str, why: str) -> None:
        """Drop a version's tensors and its engine copy; its samples from now on fail with `why`."""
        with self._samplers_lock:
            v = self.samplers.pop(path)
            del t.sampler_paths[path]
            self.freed[path] = why
            while len(self.freed) > MAX_FREED_PATHS:
                self.freed.popitem(last=False)
            self._drop(v)
            v.live = False
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

    # -- sampler versions in host memory or spilled --------------------------------------------------------------------
    def _hold(self, v: SamplerVersion) -> None:
        """Count `v`'s host tensors (caller holds `_samplers_lock`); it is now the most recently used."""
        if v.path in self._in_host:
            self._in_host.move_to_end(v.path)
            return
        self._in_host[v.path] = None
        self.sampler_host_bytes += v.nbytes

    def _drop(self, v: SamplerVersion) -> None:
        """Forget `v`'s tensors and spill file (caller holds `_samplers_lock`)."""
        if v.path in self._in_host:
            del self._in_host[v.path]
            self.sampler_host_bytes -= v.nbytes
        if v.spilled is not None:
            self.sampler_disk_bytes -= v.spilled.stat().st_size
            v.spilled.unlink()
            v.spilled = None
        v.tensors = None

    def _newest(self, v: SamplerVersion) -> SamplerVersion:
        """`v`, or the version that replaced it when `v` is an inflight target an inflight save replaced (its clients
        take the newest weights); a UserError when neither is there."""
        return self.sampler(v.path) if _replaced(v) else v

    def _current_tensors(self, v: SamplerVersion) -> dict[str, torch.Tensor]:
        """`v`'s tensors, or its replacement's (`_newest`), also when the replacement lands while they are read."""
        for _ in range(4):
            v = self._newest(v)
            try:
                return self._tensors(v)
            except UserError:
                if not _replaced(v):
                    raise
        raise UserError(f"sampler weights {v.path!r} were replaced four times while this request waited; retry it")

    def _tensors(self, v: SamplerVersion) -> dict[str, torch.Tensor]:
        """`v`'s tensors, read back into host memory when it was spilled (it becomes the most recently used; others
        may spill to make room); a UserError when it was freed."""
        from safetensors.torch import load_file

        with self._samplers_lock:
            if not v.live:
                raise UserError(self.freed.get(v.path or "", f"sampler weights {v.path!r} were freed"))
            if v.tensors is None:
                assert v.spilled is not None, f"{v.path}: neither in memory nor spilled"
                path, v.spilled = v.spilled, None
                v.tensors = load_file(path)
                self.sampler_disk_bytes -= path.stat().st_size
                path.unlink()
                self.sampler_loads += 1
            self._hold(v)
            tensors = v.tensors
            self.spill_over_budget(keep=v.path)
            return tensors

    def spill_over_budget(self, keep: str | None = None) -> None:
        """Spill the least recently used versions' tensors (not `keep`'s) while the paged tenants' host bytes plus
        the versions' exceed `host_budget_bytes`."""
        if self.host_budget_bytes is None:
            return
        from safetensors.torch import save_file

        with self._samplers_lock:
            store = getattr(getattr(getattr(self.backend, "trainer", None), "ops", None), "store", None)
            paged = store.host_bytes if store is not None else 0
            for path in list(self._in_host):
                if paged + self.sampler_host_bytes <= self.host_budget_bytes:
                    return
                if path == keep:
                    continue
                v = self.samplers[path]
                if self._spill_dir is None:
                    import tempfile

                    self._spill_dir = Path(tempfile.mkdtemp(prefix="rl-multilora-samplers-"))
                self._spill_dir.mkdir(parents=True, exist_ok=True)
                file = self._spill_dir / f"{v.engine_name}.safetensors"
                save_file({k: t.contiguous() for k, t in (v.tensors or {}).items()}, file)
                del self._in_host[path]
                self.sampler_host_bytes -= v.nbytes
                v.tensors, v.spilled = None, file
                self.sampler_disk_bytes += file.stat().st_size
                self.sampler_spills += 1

    def _ensure_loaded(self, v: SamplerVersion) -> None:
        if v.engine_name is None:
            return
        with self._engine_lock:
            if v.engine_name in self._loaded:
                self._loaded.move_to_end(v.engine_name)
                return
        tensors = self._tensors(v)  # outside the engine lock: publish takes the samplers lock, then the engine's
        with self._engine_lock:
            if not v.live:  # freed while a sample of it was on its way
                raise UserError(self.freed.get(v.path or "", f"sampler weights {v.path!r} were freed"))
            if v.engine_name in self._loaded:
                self._loaded.move_to_end(v.engine_name)
                return
            room = len(self.tenants) if self.shared_engine else self.backend.max_loras
            if room < 1:
                raise UserError(f"sampler weights {v.path!r} cannot be served: its model was unloaded")
            while len(self._loaded) >= room:
                old, _ = self._loaded.popitem(last=False)
                self.engine.unload_adapter(old)
            self.engine.load_adapter(v.engine_name, tensors, v.config)
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
        """`n` samples of `prompt` from version `v`: (tokens, their log-probs, "stop" | "length") each. The prompt and
        `max_tokens` are checked against the model's limits (`check_sample`); `max_tokens` 0 is `n` empty answers."""
        max_new = self.check_sample(prompt, params)
        if max_new == 0:
            return [([], [], "length") for _ in range(n)]
        settings = sampling_settings(params)
        base = settings.pop("seed")
        requests = [
            GenerateRequest(
                input_ids=list(prompt),
                adapter=v.engine_name,
                sampling=SamplingParams(
                    **settings, max_new_tokens=max_new, seed=sample_seed(base if base is not None else seed, i)
                ),
            )
            for i in range(n)
        ]
        for _ in range(4):  # an LRU eviction by a concurrent sampler aborts rows: load again and resubmit
            if _replaced(v):  # an inflight save replaced it: its clients take the newest
                v = self._newest(v)
                for request in requests:
                    request.adapter = v.engine_name
            try:
                self._ensure_loaded(v)
            except UserError:
                if not _replaced(v):
                    raise
                continue  # replaced between the check and the load
            results = await self.engine.agenerate(requests)
            if all(r.finish_reason in ("stop", "length") for r in results):
                return [(r.output_ids, r.output_logprobs, r.finish_reason) for r in results]
            errors = [r.error for r in results if r.finish_reason == "error"]
            if errors and not any("loaded in the engine" in (e or "") for e in errors):
                raise UserError(errors[0])
        raise RuntimeError("sampling was aborted four times in a row")


def check_tokens(field_name: str, tokens: Any, vocab_size: int) -> list[int]:
    """`tokens` as ids when each is in [0, vocab_size), else a UserError naming the field, the first bad id and
    its position.

    >>> check_tokens("prompt", [1, 2], 10)
    [1, 2]
    >>> check_tokens("prompt", [1, 12], 10)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rl_multilora.tinker.ops.UserError: prompt[1]=12 is not allowed; allowed: a token id in [0, 10) ...
    """
    try:
        ids = np.asarray(tokens)
    except ValueError:  # ragged nesting
        ids = None
    if ids is None or ids.ndim != 1:
        raise UserError(f"{field_name} is not a flat list of token ids; allowed: a list of ints")
    if ids.size and not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"{field_name} holds {ids.dtype} values; allowed: integer token ids")
    bad = np.flatnonzero((ids < 0) | (ids >= vocab_size))
    if bad.size:
        i = int(bad[0])
        raise UserError(
            f"{field_name}[{i}]={int(ids[i])} is not allowed; allowed: a token id in [0, {vocab_size}) "
            "(the model's vocabulary)"
        )
    return [int(x) for x in ids]


def _datum_row(name: str, loss_fn: str, d: Datum, vocab_size: int, context_length: int | None = None) -> Row:
    """A datum as a training row of tenant `name`: position i of `model_input` predicts `target_tokens[i]`, so its
    targets are positions 1..N with their ids given; the loss's inputs per token. A UserError names an input that
    is missing, has the wrong length or a non-finite value, a token id outside the vocabulary, and a `model_input`
    longer than the model's context (positions past it are ones the model never saw; the sampler refuses them too)."""
    n = len(d.tokens)
    if n == 0:
        raise UserError("model_input has 0 tokens; allowed: 1 or more (position i predicts target_tokens[i])")
    if context_length is not None and n > context_length:
        raise UserError(
            f"model_input has {n} tokens; allowed: at most {context_length} (the model's context, "
            "max_position_embeddings)"
        )

    def vec(key: str) -> list[float] | None:
        if key not in d.inputs:
            return None
        values = np.asarray(d.inputs[key])
        if values.ndim > 1 and values.shape[0] == n:  # Tinker's top-K distillation: K targets per position
            raise UserError(
                f"loss_fn_inputs[{key!r}] has shape {tuple(values.shape)}; allowed: shape ({n},), one per model_input "
                "token ((N, K) targets, Tinker's top-K distillation, are not supported by this server)"
            )
        values = values.reshape(-1)
        if values.shape[0] != n:
            raise UserError(f"loss_fn_inputs[{key!r}] has {values.shape[0]} values for {n} model_input tokens")
        bad = np.flatnonzero(~np.isfinite(values.astype(np.float64)))
        if bad.size:
            i = int(bad[0])
            raise UserError(
                f"loss_fn_inputs[{key!r}][{i}]={float(values[i])} is not allowed; allowed: finite numbers "
                f"({bad.size} of its {n} values are not)"
            )
        return values.tolist()

    definition = REGISTRY[loss_fn]
    for key in ("target_tokens", *definition.inputs):
        if key not in d.inputs:
            raise UserError(f"loss_fn {loss_fn!r} needs loss_fn_inputs[{key!r}]; got {sorted(d.inputs)}")
    # A key no loss reads (a misspelt `weights`, the cookbook's `mask`) is refused: ignored, a misspelt `weights`
    # trained every token at weight 1. Another loss's input (`advantages` beside cross_entropy) is accepted and not
    # read, so a client can send one set of datums to several losses.
    unknown = sorted(set(d.inputs) - ALL_LOSS_INPUTS)
    if unknown:
        known = ("target_tokens", *definition.inputs, *definition.optional_inputs)
        raise UserError(
            f"loss_fn_inputs[{unknown[0]!r}] is not an input of any loss this server serves; allowed for loss_fn "
            f"{loss_fn!r}: {', '.join(map(repr, known))}"
        )
    input_ids = check_tokens("model_input", d.tokens, vocab_size)
    vec("target_tokens")  # its length
    targets = check_tokens("loss_fn_inputs['target_tokens']", d.inputs["target_tokens"], vocab_size)
    weights = next((vec(k) for k in definition.optional_inputs if k in d.inputs), None)
    return Row(
        adapter=name,
        input_ids=input_ids,
        targets=list(range(1, n + 1)),
        advantage=0.0,
        rollout_logprobs=None,
        target_ids=targets,
        advantages=vec("advantages"),
        old_logprobs=vec("logprobs"),
        loss_weights=weights,
    )


def _prompt_len(row: Row) -> int | None:
    """The datum's prompt as its client marks it: the tokens before its first target with a non-zero weight and
    advantage (a GRPO client's datums of one group share it). Rows of one tenant with the same prompt then train it
    once (`rl_multilora.packing`: exact for any shared prefix, so this is only where to look for one); None when the
    first target already counts or nothing does.

    >>> _prompt_len(Row("t", [5, 6, 7, 8], [1, 2, 3, 4], 0.0, None, advantages=[0.0, 0.0, 1.5, 1.5]))
    3
    >>> _prompt_len(Row("t", [5, 6, 7], [1, 2, 3], 0.0, None, loss_weights=[1.0, 1.0, 1.0])) is None
    True
    """
    weights, advantages = row.loss_weights, row.advantages
    for k, position in enumerate(row.targets):
        if (weights is None or weights[k] != 0) and (advantages is None or advantages[k] != 0):
            return position if k > 0 else None
    return None


def _adam_settings(adam: dict[str, Any]) -> AdamSettings:
    """The request's `adam_params` as settings, each a finite number in its range (a UserError names the field)."""
    defaults = AdamSettings()
    low = {"learning_rate": 0.0, "beta1": 0.0, "beta2": 0.0, "eps": 0.0, "weight_decay": 0.0, "grad_clip_norm": 0.0}
    values: dict[str, float] = {}
    for key, lowest in low.items():
        value = adam.get(key, getattr(defaults, key))
        try:
            values[key] = finite_number(f"adam_params.{key}", value, low=lowest)
        except ValueError as e:
            raise UserError(str(e)) from None
    for key in ("beta1", "beta2"):
        if values[key] >= 1.0:
            raise UserError(f"adam_params.{key}={values[key]!r} is not allowed; allowed: a number in [0, 1)")
    return AdamSettings(**values)


def sample_seed(base: int, i: int) -> int:
    """Sample `i`'s seed of a request seeded `base`: `base` itself for the first, a hash of both for the others. It was
    `base + i`, so samples 1-3 of a request seeded 100 were samples 0-2 of one seeded 101 (a client seeding by step got
    repeated, correlated samples).

    >>> sample_seed(100, 0), sample_seed(100, 1) == sample_seed(101, 0), sample_seed(100, 1) == sample_seed(100, 1)
    (100, False, True)
    """
    if i == 0:
        return base % 2**63
    digest = hashlib.blake2b(f"{base}:{i}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") % 2**63


def sampling_settings(params: Any) -> dict[str, Any]:
    """A sample request's `sampling_params` as the engine's settings (`temperature`, `top_p`, `top_k`, `stop`,
    `stop_token_ids`, `seed`, `ignore_eos`), each checked: a UserError names the field, its value and what is allowed. Missing or
    null fields take the SDK's defaults (temperature 1, top_p 1, top_k -1, no stop, no seed).

    >>> sampling_settings({"temperature": 0.5, "stop": ["\\n", 2]})["stop_token_ids"]
    [2]
    >>> [sampling_settings(p)["ignore_eos"] for p in ({"stop": []}, {"stop": None}, {}, {"stop": ["x"]})]
    [True, False, False, False]
    >>> sampling_settings({"top_k": "a"})  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rl_multilora.tinker.ops.UserError: sampling_params.top_k='a' is not allowed; allowed: -1 (off) or an int >= 1
    """
    if not isinstance(params, dict):
        raise UserError(f"sampling_params={params!r} is not allowed; allowed: an object (the SDK's SamplingParams)")

    def get(key: str, default: Any) -> Any:
        value = params.get(key)
        return default if value is None else value

    temperature, top_p, top_k, seed, stop = (get("temperature", 1.0), get("top_p", 1.0), get("top_k", -1),
                                             params.get("seed"), get("stop", []))  # fmt: skip
    try:
        temperature = finite_number("sampling_params.temperature", temperature, low=0.0)
        top_p = finite_number("sampling_params.top_p", top_p)
    except ValueError as e:
        raise UserError(f"{e} (temperature: >= 0, 0 = greedy; top_p: in (0, 1])") from None
    if not 0.0 < top_p <= 1.0:
        raise UserError(f"sampling_params.top_p={top_p!r} is not allowed; allowed: a number in (0, 1]")
    if type(top_k) is not int or not (top_k == -1 or top_k >= 1):
        raise UserError(f"sampling_params.top_k={top_k!r} is not allowed; allowed: -1 (off) or an int >= 1")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise UserError(f"sampling_params.seed={seed!r} is not allowed; allowed: null or an int in [0, 2**63)")
    stops = [stop] if isinstance(stop, str) else stop
    ok = isinstance(stops, list) and all((isinstance(x, str) and x) or (type(x) is int and x >= 0) for x in stops)
    if not ok:
        raise UserError(
            f"sampling_params.stop={stop!r} is not allowed; allowed: a non-empty string, or a list of non-empty "
            "strings and token ids >= 0"
        )
    # `stop: []` (given, empty) disables every stop token, EOS included (the SDK's SamplingParams.stop); null keeps EOS
    return {"temperature": temperature, "top_p": top_p, "top_k": top_k, "seed": seed,
            "stop": [x for x in stops if isinstance(x, str)], "stop_token_ids": [x for x in stops if type(x) is int],
            "ignore_eos": params.get("stop") == []}  # fmt: skip


def _trained(lora_config: dict[str, Any]) -> str:
    """The layer groups a `lora_config` trains, for a message.

    >>> _trained({"train_attn": True, "train_mlp": False, "train_unembed": True})
    'train_attn, train_unembed'
    """
    return ", ".join(k for k, v in sorted(lora_config.items()) if v) or "nothing"


def lora_settings(lora_config: Any, max_rank: int) -> tuple[int, int | None, dict[str, Any]]:
    """A create_model request's `lora_config` (the SDK's LoraConfig; null: its defaults) as (rank, seed, the
    config), each field checked: a UserError names the field, its value and what is allowed.

    >>> lora_settings({"rank": 8, "train_unembed": False}, 32)
    (8, None, {'rank': 8, 'train_unembed': False})
    >>> lora_settings({"rank": 4.7}, 32)  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    rl_multilora.tinker.ops.UserError: lora_config.rank=4.7 is not allowed; allowed: an int in [1, 32]
    """
    lc = {} if lora_config is None else lora_config
    if not isinstance(lc, dict):
        raise UserError(f"lora_config={lora_config!r} is not allowed; allowed: an object (the SDK's LoraConfig)")
    rank = lc.get("rank", 32)
    if type(rank) is not int or not 1 <= rank <= max_rank:
        raise UserError(f"lora_config.rank={rank!r} is not allowed; allowed: an int in [1, {max_rank}]")
    seed = lc.get("seed")
    if seed is not None and (type(seed) is not int or not 0 <= seed < 2**63):
        raise UserError(f"lora_config.seed={seed!r} is not allowed; allowed: null or an int in [0, 2**63)")
    for key in _LAYER_GROUPS:
        if lc.get(key) is not None and not isinstance(lc[key], bool):
            raise UserError(f"lora_config.{key}={lc[key]!r} is not allowed; allowed: true, false or null")
    return rank, seed, lc


def finite_number(field_name: str, value: Any, low: float | None = None) -> float:
    """`value` as a float when it is a finite number (>= `low` when given), else a ValueError naming the field."""
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(float(value))
    if not ok or (low is not None and float(value) < low):
        allowed = "a finite number" + (f" >= {low}" if low is not None else "")
        raise ValueError(f"{field_name}={value!r} is not allowed; allowed: {allowed}")
    return float(value)
