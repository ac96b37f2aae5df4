"""Every component of a run, built from its `RunConfig` in one place: model, training backend, engines, sampling,
scorer and rollout generator.

`run`, `serve`, `eval`, `engine-serve` and the Ray engine actors all build through this module, so what a run
trained (dtype, target modules and expert Parameters, expert layout, slots, device) is what its evaluation and its
served engines load. Nothing else in the project calls `MultiLoRAModel.from_pretrained` on a config.

Design choices:
- Functions, not a factory class: each takes the config section it needs and returns one component, so a caller
  that needs one piece (eval needs a model and an engine, not a trainer) builds only that.
- An in-process embedded engine shares the training backend's frozen base when the backend has one in this process
  (`TrainingBackend.shared_model`); otherwise (trainer ranks on Ray) it loads its own copy here.
- Heavy imports stay inside the functions: importing this module costs nothing until something is built.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from rl_multilora.config import AdapterConfig, ConfigError, GRPOSettings, ModelConfig, RunConfig
from rl_multilora.errors import bad_value
from rollout.types import SamplingParams

if TYPE_CHECKING:
    import rewards
    from rl_multilora.backends.base import TrainingBackend
    from rl_multilora.lora import MultiLoRAModel
    from rollout.engines.base import RolloutEngine
    from rollout.generate_state import GenerateState
    from rollout.sglang.launcher import SGLangLauncher

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def resolve_device(name: str) -> torch.device:
    """`model.device`: "auto" is cuda when available, else cpu."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


# ------------------------------------------------------------------------------------------------ model and data


def build_model(m: ModelConfig, device: str | torch.device | None = None) -> MultiLoRAModel:
    """The frozen base of `m.path` with its LoRA slots, as the run trains it (dtype, targets, expert layout), on
    `device` (default: `m.device` resolved)."""
    from rl_multilora.lora import MultiLoRAModel

    model = MultiLoRAModel.from_pretrained(
        m.path,
        max_loras=m.max_loras,
        max_rank=m.max_rank,
        target_modules=m.target_modules,
        dtype=getattr(torch, m.dtype),
        target_parameters=m.target_parameters or [],
        expert_lora=m.expert_lora,
        lora_autocast=m.lora_autocast,
    )
    if m.gradient_checkpointing:
        model.gradient_checkpointing_enable()
    return model.to(resolve_device(m.device) if device is None else torch.device(device))


def read_adapter_folder(m: ModelConfig, folder: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A PEFT folder to serve or evaluate on the model `m` describes: read by the one loader
    (`rl_multilora.lora.read_peft_folder`: safetensors only, no links out, finite, rank <= `m.max_rank`), then its
    keys, shapes and targets checked against the model's LoRA modules on a meta-device skeleton, so a bad folder is
    refused before any weight is loaded. Raises `AdapterFolderError` naming the folder."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from rl_multilora.lora import AdapterFolderError, MultiLoRAModel, read_peft_folder
    from rl_multilora.lora.peft_io import parse_peft_adapter

    tensors, config = read_peft_folder(folder, max_rank=m.max_rank)
    with torch.device("meta"):
        skeleton = MultiLoRAModel(
            AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(m.path)),
            max_loras=1,
            max_rank=m.max_rank,
            target_modules=m.target_modules,
            target_parameters=m.target_parameters or [],
            expert_lora=m.expert_lora,
        )
    try:
        parse_peft_adapter(tensors, config, skeleton.layer_shapes, m.max_rank, str(folder), skeleton.expert_shapes)
    except ValueError as e:
        raise AdapterFolderError(f"adapter folder {folder}: does not fit the model {m.path}: {e}") from None
    return tensors, config


def build_tokenizer(m: ModelConfig):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(m.path)


def context_length(m: ModelConfig) -> int | None:
    """The base's context length (`max_position_embeddings` of its text config), or None when it declares none."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(m.path)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text, "max_position_embeddings", None)


def build_data_source(cfg: RunConfig, tokenizer):
    """Every tenant's prompts; rows too long for the model's context are bad rows of their tenant."""
    from rollout.data_source import MultiLoRADataSource

    return MultiLoRADataSource(tokenizer, context_len=context_length(cfg.model))


def pad_token_id(tokenizer) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def build_sampling(cfg: RunConfig, tokenizer) -> SamplingParams:
    """The rollouts' sampling settings (the eval's too, with temperature 0 for its greedy answers)."""
    r = cfg.rollout
    return SamplingParams(
        temperature=r.temperature,
        top_p=r.top_p,
        top_k=r.top_k,
        max_new_tokens=r.max_new_tokens,
        stop=list(r.stop),
        stop_token_ids=[tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else [],
    )


def tenant_sampling(base: SamplingParams, a: AdapterConfig) -> SamplingParams | None:
    """Adapter `a`'s own sampling settings: `base` (the run's) with the fields of `a.sampling` it sets (None without
    any: its samples use the rollout's)."""
    changes = {k: v for k, v in a.sampling.model_dump().items() if v is not None} if a.sampling else {}
    return dataclasses.replace(base, **changes) if changes else None


def build_scorer(cfg: RunConfig) -> rewards.RewardExecutor:
    """The reward executor: killable worker processes that score every tenant's samples with its own reward."""
    import rewards

    return rewards.RewardExecutor(num_workers=cfg.rewards.num_workers)


# ------------------------------------------------------------------------------------------------ training side


def build_backend(cfg: RunConfig, pad: int) -> TrainingBackend:
    """One process (`LocalBackend`) or `trainer.world_size` Ray trainer ranks over an FSDP2-sharded model."""
    if cfg.trainer.world_size > 1:
        from rl_multilora.backends.ray_fsdp import RayFSDPBackend

        return RayFSDPBackend(cfg, pad_token_id=pad)
    r = cfg.rollout
    spill = cfg.model.spill_dir or str(Path(cfg.run_dir) / "paged")
    return build_local_backend(
        cfg.model, cfg.grpo, pad, temperature=r.logit_temperature, norm_len=r.max_new_tokens, spill_dir=spill
    )


def build_local_backend(
    m: ModelConfig,
    grpo: GRPOSettings,
    pad: int,
    temperature: float = 1.0,
    norm_len: int | None = None,
    spill_dir: str | None = None,
) -> TrainingBackend:
    """The model of `m` and the trainer's per-tenant operations over it, in this process: the GRPO run's backend
    and the standalone Tinker server's (`grpo` then only gives the defaults nobody uses: clients name their loss).
    With `m.max_tenants` > `m.max_loras` the trainer pages tenants through a host `TenantStore` (spilling to
    `m.spill_dir`, else `spill_dir`, else a temporary folder)."""
    from rl_multilora.backends.local import LocalBackend
    from rl_multilora.tenant_store import TenantStore
    from rl_multilora.trainer import MultiLoRATrainer

    model = build_model(m)
    store = None
    if m.paging:
        budget = None if m.host_budget_gb is None else int(m.host_budget_gb * 2**30)
        store = TenantStore(budget, m.spill_dir or spill_dir)
    trainer = MultiLoRATrainer(model, grpo, pad, temperature=temperature, norm_len=norm_len, store=store)
    return LocalBackend(model, trainer, max_tenants=m.max_tenants)


# ------------------------------------------------------------------------------------------------ rollout side


def build_embedded_engine(
    m: ModelConfig,
    max_batch_size: int = 256,
    device: str | None = None,
    prefix_cache_mb: int = 256,
    max_wave_tokens: int | None = None,
):
    """An embedded engine over its own copy of the base (what `engine-serve` serves and each Ray engine actor
    runs), and its tokenizer."""
    from rollout.engines.embedded import EmbeddedEngine

    tokenizer = build_tokenizer(m)
    engine = EmbeddedEngine(
        build_model(m, device),
        tokenizer,
        max_batch_size=max_batch_size,
        prefix_cache_bytes=prefix_cache_mb * 2**20,
        max_wave_tokens=max_wave_tokens,
    )
    return engine, tokenizer


def build_engine(cfg: RunConfig, backend: TrainingBackend, tokenizer) -> tuple[RolloutEngine, SGLangLauncher | None]:
    """The rollout engine the config names (several: a `MultiEngine` over them) and the SGLang server it launched,
    if any. All speak the `RolloutEngine` interface."""
    r = cfg.rollout
    if r.engine == "embedded":
        from rollout.engines.embedded import EmbeddedEngine

        if r.engine_actors:
            return _one_or_many(_ray_engines(cfg, backend)), None
        model = backend.shared_model or build_model(cfg.model)
        engines = [
            EmbeddedEngine(
                model,
                tokenizer,
                max_batch_size=r.max_batch_size,
                page_adapters=cfg.model.paging,
                prefix_cache_bytes=r.prefix_cache_mb * 2**20,
                max_wave_tokens=r.max_wave_tokens,
            )
            for _ in range(r.num_engines)
        ]
        return _one_or_many(engines), None
    from rollout.sglang.client import SGLangEngine
    from rollout.sglang.launcher import SGLangLauncher
    from rollout.sglang.protocol import sglang_expert_shapes

    if r.engine == "http":
        field, value = ("rollout.url", r.url) if r.num_engines == 1 else ("rollout.urls", r.urls)
        urls = r.urls if r.num_engines > 1 else [r.url]
        try:
            engines = [SGLangEngine(u, api_key=r.api_key, tensor_format="safetensors") for u in urls]
        except (RuntimeError, ValueError, OSError) as e:
            raise ConfigError([bad_value(field, value, str(e))]) from None
        for u, engine in zip(urls, engines, strict=True):  # no server there: said now, not as a crash at the sync
            if not _answers(engine, HTTP_ENGINE_WAIT_S):
                raise ConfigError([bad_value(field, u, f"a server that answers GET /health (none did in "
                                             f"{HTTP_ENGINE_WAIT_S:g} s)")])  # fmt: skip
        return _one_or_many(engines), None
    # A model whose expert LoRA SGLang cannot serve exactly fails here, before a minutes-long server start.
    model = backend.shared_model or build_model(cfg.model)
    expert_shapes = sglang_expert_shapes(model)
    launcher = None
    url = r.url
    if url is None:  # launch a colocated SGLang server on this host
        launcher = SGLangLauncher(
            model_path=cfg.model.path,
            port=r.sglang_port,
            # SGLang counts base-model rows as one of the batch's adapters.
            max_loras_per_batch=cfg.model.max_loras + 1,
            max_lora_rank=cfg.model.max_rank,
            lora_target_modules=cfg.model.target_modules,
            lora_backend=r.sglang_lora_backend,
            extra_args=r.sglang_args,
            api_key=r.api_key,
            expert_lora=bool(expert_shapes),
        )
    try:
        if launcher is not None:
            url = launcher.start()
        # SGLang wants one serialized copy of the tensors per tensor-parallel rank: take the size from the launch
        # arguments, or ask an attached server.
        tp_size = launcher.tp_size if launcher is not None else None
        engine = SGLangEngine(
            url,
            api_key=r.api_key,
            tensor_format="sglang",
            module_shapes=model.layer_shapes,
            expert_shapes=expert_shapes,
        )
        engine.tp_size = tp_size or engine.server_tp_size() or 1
    except (RuntimeError, ValueError, OSError) as e:  # the server did not start, or does not answer
        if launcher is not None:
            launcher.stop()
        field, value = ("rollout.url", r.url) if r.url is not None else ("rollout.engine", r.engine)
        raise ConfigError([bad_value(field, value, f"an SGLang server that starts and answers ({e})")]) from None
    return engine, launcher


# How long a run waits for rollout.url's server to answer GET /health before it says none does: a server still
# starting, or a busy one (SGLang's /health runs a one-token generation), gets that long in all.
HTTP_ENGINE_WAIT_S = 30.0


def _answers(engine, wait_s: float) -> bool:
    """Whether `engine`'s server (an `SGLangEngine`) answers its health check within `wait_s` (a server still starting
    gets that long; one that accepts connections and never answers is given up on then too)."""
    import time

    deadline = time.monotonic() + wait_s
    while True:
        if engine.health(timeout_s=max(0.0, deadline - time.monotonic())):  # a server that accepts but never answers
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.5)


def _ray_engines(cfg: RunConfig, backend: TrainingBackend) -> list:
    """`rollout.num_engines` embedded engines as Ray actors, each building its own copy of the base with
    `build_embedded_engine` (a GPU each when CUDA is available, or half of trainer rank i's with
    `trainer.colocate_engines`). Joins the Ray cluster this process is in, or starts a local one."""
    import ray

    from rollout.engines.ray_engine import RayEngine

    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False)
    build = (
        functools.partial(
            build_embedded_engine,
            prefix_cache_mb=cfg.rollout.prefix_cache_mb,
            max_wave_tokens=cfg.rollout.max_wave_tokens,
        ),
        cfg.model,
        cfg.rollout.max_batch_size,
    )
    n = cfg.rollout.num_engines
    jemalloc = cfg.model.host_allocator == "jemalloc"  # each actor's process starts with it (Ray's runtime_env)
    if cfg.trainer.colocate_engines:
        engines = [RayEngine(build, **backend.engine_placement(i), jemalloc=jemalloc) for i in range(n)]
    else:
        gpus = 1 if torch.cuda.is_available() and cfg.model.device != "cpu" else 0
        engines = [RayEngine(build, num_gpus=gpus, jemalloc=jemalloc) for _ in range(n)]
    log.info("engine actors: %d, host allocator %s", n, "/".join(sorted({e.allocator() for e in engines})))
    return engines


def _one_or_many(engines: list) -> RolloutEngine:
    if len(engines) == 1:
        return engines[0]
    from rollout.engines.multi import MultiEngine

    return MultiEngine(engines)


def build_generator(cfg: RunConfig, engine: RolloutEngine, tokenizer) -> GenerateState:
    """The rollout driver: every tenant's groups to one engine, with the config's hooks and sampling."""
    from rollout.generate_state import GenerateState, load_hooks

    return GenerateState(
        engine,
        tokenizer,
        load_hooks(cfg.rollout.hooks),
        build_sampling(cfg, tokenizer),
        context_length=context_length(cfg.model),  # an episode's cap on any engine, HTTP and several included
    )
