"""`RayFSDPBackend`: trainer ranks as Ray actors, the base and the LoRA slots sharded over them with FSDP2.

Design choices:

- `trainer.world_size: N` starts N actors in one placement group (one CPU, or one GPU with CUDA, per bundle). Rank 0
  reports its node address and a free port, every rank joins one `torch.distributed` group (`cpu:gloo,cuda:nccl`)
  and a 1-D device mesh, and builds the model with `fsdp.load_sharded`: the ranks are grouped by the Ray node they
  landed on, and the first rank of each node alone reads the weight files.
- Every call of the `TrainingBackend` interface goes to all ranks at once and returns when all have answered:
  adding and removing tenants, loading adapters, and `train_step`, which hands every rank the whole batch through
  one object in Ray's object store (put once, not once per rank). Each rank derives the same advantages and
  per-tenant counts from it and trains its token-balanced share; `MultiLoRATrainer` keeps each tenant's
  normalization, clipping, NaN skip and optimizer consistent across ranks. Rank 0's stats are the step's (they are
  summed over ranks).
- `adapter_state_dict` gathers only the adapter's slot rows to rank 0 (`fsdp.gather_adapter_state_dict`) and
  counts the bytes that moved (`gathered_bytes`); optimizer state comes from the rank holding the slot, in the same
  layout as one process, so checkpoints keep their format and resume with another world size.
- `trainer.colocate_engines` puts rollout engine actor i in rank i's bundle (same node, half of its GPU), as
  verl's colocated layout does; otherwise engines take resources of their own.
- The driver holds no model (`shared_model` is None): an in-process embedded engine loads its own unsharded copy
  (`rl_multilora.components.build_engine`); with `rollout.engine_actors` or a server engine none is loaded here.
"""

from __future__ import annotations

import logging
import socket
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from rl_multilora.backends.base import TrainingBackend
from rl_multilora.backends.local import LocalBackend
from rl_multilora.batch import AdapterStepStats
from rl_multilora.config import AdapterConfig, RunConfig
from rl_multilora.host_memory import allocator_name, enter_ray_process, jemalloc_ray_options
from rl_multilora.losses import TenantAlgo
from rl_multilora.rows import Row
from rl_multilora.tenant_optim import AdamSettings
from rl_multilora.train_ops import FwdBwdOut

log = logging.getLogger(__name__)

PLACEMENT_TIMEOUT_S = 120.0  # how long the trainer ranks' placement group may wait for resources
CLOSE_TIMEOUT_S = 30.0  # how long closing waits for the ranks to leave their process group before killing them


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


class _TrainerRank:
    """One trainer rank (inside its Ray actor): a shard of the model and the GRPO trainer over it."""

    def __init__(self, rank: int, world: int, cfg_json: dict[str, Any], pad_token_id: int):
        self.rank, self.world = rank, world
        self.cfg = RunConfig.model_validate(cfg_json)
        enter_ray_process(self.cfg.model.host_allocator == "jemalloc")  # started under it (model.host_allocator)
        self.pad_token_id = pad_token_id
        self.model = None
        self.trainer = None

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def placement(self) -> dict[str, Any]:
        from rollout.engines.ray_engine import actor_placement

        return actor_placement()

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def setup(self, master_addr: str, master_port: int, node_ranks: list[list[int]]) -> dict[str, Any]:
        import os

        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh

        from rl_multilora.backends.fsdp import load_sharded, meta_tensors
        from rl_multilora.trainer import MultiLoRATrainer

        os.environ.update(MASTER_ADDR=master_addr, MASTER_PORT=str(master_port))
        cuda = torch.cuda.is_available() and self.cfg.model.device != "cpu"
        dist.init_process_group("cpu:gloo,cuda:nccl" if cuda else "gloo", rank=self.rank, world_size=self.world)
        mesh = init_device_mesh("cuda" if cuda else "cpu", (self.world,))
        m = self.cfg.model
        self.model = load_sharded(
            m.path, mesh, m.max_loras, m.max_rank, m.target_modules, m.target_parameters, m.expert_lora,
            getattr(torch, m.dtype), node_ranks=node_ranks,
        )  # fmt: skip
        r = self.cfg.rollout
        self.trainer = MultiLoRATrainer(
            self.model, self.cfg.grpo, self.pad_token_id, temperature=r.logit_temperature, norm_len=r.max_new_tokens
        )
        self.local = LocalBackend(self.model, self.trainer)  # this rank's shard behind the one-process interface
        shard = {n: list(p.to_local().shape) for n, p in self.model.named_parameters()}
        return {
            "allocator": allocator_name(),
            "lora_modules": self.model.lora_modules,
            "lora_parameters": self.model.lora_parameters,
            "meta": meta_tensors(self.model),
            "shards": shard,
        }

    def add_adapter(self, cfg_json: dict[str, Any]) -> int:
        return self.local.add_adapter(AdapterConfig.model_validate(cfg_json))

    def remove_adapter(self, name: str) -> None:
        self.local.remove_adapter(name)

    def adapters(self) -> list[str]:
        return self.local.adapters

    def free_slots(self) -> list[int]:
        return self.local.free_slots()

    def train_step(self, samples, current_versions, max_steps) -> dict[str, AdapterStepStats]:
        return self.local.train_step(samples, current_versions, max_steps)

    def add_client(self, name: str, rank: int, alpha: float, seed: int | None, targets: list[str]) -> int:
        return self.local.add_client(name, rank, alpha, seed, targets)

    def forward_backward(self, rows, losses, backward: bool) -> tuple[list[int], FwdBwdOut]:
        mine, out = self.local.forward_backward_share(rows, losses, backward)
        out.logprobs = [t.cpu() for t in out.logprobs]
        out.ref_logprobs = None
        return mine, out

    def optim_step(self, name: str, adam: AdamSettings) -> tuple[bool, float | None]:
        return self.local.optim_step(name, adam)

    def adapter_step(self, name: str) -> int:
        return self.local.adapter_step(name)

    def adapter_state_dict(self, name: str) -> tuple[dict[str, torch.Tensor], int]:
        from rl_multilora.backends.fsdp import gather_adapter_state_dict

        state, received = gather_adapter_state_dict(self.model, name, dst=0)
        return _to_cpu(state), received  # a driver without this rank's GPU must be able to read them

    def peft_config(self, name: str) -> dict[str, Any]:
        return self.local.peft_config(name)

    def load_adapter_state_dict(self, name: str, tensors, config, source: str) -> None:
        self.local.load_adapter_state_dict(name, tensors, config, source)

    def optimizer_state_dict(self, name: str) -> tuple[bool, dict[str, Any]]:
        """(whether this rank holds the tenant's slot, its optimizer + scheduler state)."""
        return self.trainer.holds(name), _to_cpu(self.trainer.optimizer_state_dict(name))

    def load_optimizer_state_dict(self, name: str, state: dict[str, Any]) -> None:
        self.local.load_optimizer_state_dict(name, state)

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _to_cpu(obj: Any) -> Any:
    """`obj` with every tensor in it (nested dicts, lists, tuples) on the CPU."""
    if isinstance(obj, torch.Tensor):
        return obj.cpu()
    if isinstance(obj, Mapping):
        return {k: _to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(_to_cpu(v) for v in obj)
    return obj


def _ranks_by_node(node_ids: Sequence[str]) -> list[list[int]]:
    """The global ranks on each node, nodes in order of their first rank: `[[0, 1], [2, 3]]` for 2 nodes x 2."""
    nodes: dict[str, list[int]] = {}
    for rank, node in enumerate(node_ids):
        nodes.setdefault(node, []).append(rank)
    return list(nodes.values())


class RayFSDPBackend(TrainingBackend):
    """`world_size` trainer ranks as Ray actors over an FSDP2-sharded model (see the module docstring)."""

    def __init__(self, cfg: RunConfig, pad_token_id: int):
        import ray
        from ray.util.placement_group import placement_group, remove_placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not ray.is_initialized():
            ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False)
        self.cfg = cfg
        self._world = cfg.trainer.world_size
        gpu = torch.cuda.is_available() and cfg.model.device != "cpu"
        bundle = {"GPU": 1, "CPU": 1} if gpu else {"CPU": 1}
        # colocated: rank i and engine i share bundle i, half of its CPU and GPU each
        self._share = 0.5 if cfg.trainer.colocate_engines else 1.0
        self._gpu = gpu
        self._pg = placement_group([bundle] * self._world, strategy="PACK")
        try:
            ray.get(self._pg.ready(), timeout=PLACEMENT_TIMEOUT_S)
        except ray.exceptions.GetTimeoutError:
            remove_placement_group(self._pg)
            raise RuntimeError(
                f"trainer.world_size={self._world} needs {self._world} bundles of {bundle} on the Ray cluster, which "
                f"has {ray.available_resources()} free of {ray.cluster_resources()}; lower trainer.world_size or add "
                "nodes"
            ) from None
        actor = ray.remote(_TrainerRank)
        env = jemalloc_ray_options(cfg.model.host_allocator == "jemalloc")  # each rank's process starts with it
        self._ranks = [
            actor.options(
                num_cpus=self._share, num_gpus=self._share if gpu else 0, **env,
                scheduling_strategy=PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
            ).remote(i, self._world, cfg.model_dump(mode="json"), pad_token_id)
            for i in range(self._world)
        ]  # fmt: skip
        try:
            addr, port = ray.get(self._ranks[0].address.remote())
            self.node_ranks = _ranks_by_node(self._all("node_id"))
            info = self._all("setup", addr, port, self.node_ranks)
        except BaseException:
            self._release()  # a rank that failed to start must not leave the others and the placement group behind
            raise
        self._info = info[0]
        log.info("trainer ranks: %d, host allocator %s", self._world, "/".join(sorted({i["allocator"] for i in info})))
        self.rank_info = info  # per rank: its LoRA targets, meta tensors (none) and shard shapes
        self._gathered = 0

    def _all(self, method: str, *args) -> list[Any]:
        import ray

        return ray.get([getattr(r, method).remote(*args) for r in self._ranks])

    def engine_placement(self, i: int) -> dict[str, Any]:
        """Ray options that put rollout engine `i` in trainer rank i's bundle (same node, same GPU), taking the half
        of the bundle the rank left (`trainer.colocate_engines`)."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if not 0 <= i < self._world or self._share == 1.0:
            raise ValueError(f"engine {i} cannot be colocated: {self._world} trainer ranks, share {self._share}")
        return {
            "num_cpus": 1 - self._share,
            "num_gpus": (1 - self._share) if self._gpu else 0,
            "scheduling_strategy": PlacementGroupSchedulingStrategy(self._pg, placement_group_bundle_index=i),
        }

    def rank_placement(self) -> list[dict[str, Any]]:
        """Where Ray put each trainer rank (node, placement group, assigned resources)."""
        return self._all("placement")

    @property
    def world_size(self) -> int:
        return self._world

    @property
    def gathered_bytes(self) -> int:
        return self._gathered

    @property
    def max_loras(self) -> int:
        return self.cfg.model.max_loras

    @property
    def lora_modules(self) -> list[str]:
        return list(self._info["lora_modules"])

    @property
    def lora_parameters(self) -> list[str]:
        return list(self._info["lora_parameters"])

    @property
    def adapters(self) -> list[str]:
        return self._all("adapters")[0]

    def free_slots(self) -> list[int]:
        return self._all("free_slots")[0]

    def add_adapter(self, cfg: AdapterConfig) -> int:
        return self._all("add_adapter", cfg.model_dump(mode="json"))[0]

    def remove_adapter(self, name: str) -> None:
        self._all("remove_adapter", name)

    def train_step(
        self, samples: Sequence[Any], current_versions: Mapping[str, int], max_steps: Mapping[str, int]
    ) -> dict[str, AdapterStepStats]:
        import ray

        batch = ray.put(list(samples))  # serialized once for all ranks (Ray resolves the ref in each)
        return self._all("train_step", batch, dict(current_versions), dict(max_steps))[0]

    def add_client(self, name: str, rank: int, alpha: float, seed: int | None, target_modules: list[str]) -> int:
        return self._all("add_client", name, rank, alpha, seed, list(target_modules))[0]

    def forward_backward(
        self, rows: Sequence[Row], losses: Mapping[str, TenantAlgo], backward: bool = True
    ) -> FwdBwdOut:
        """Every rank gets the whole batch (one object in the store) and runs its token-balanced share; the rows'
        outputs come back from the rank that ran them, in the batch's order."""
        import ray

        batch = ray.put(list(rows))
        logprobs: list[torch.Tensor | None] = [None] * len(rows)
        row_loss = [0.0] * len(rows)
        merged = FwdBwdOut(logprobs=[], ref_logprobs=None, row_loss=[])
        for mine, out in self._all("forward_backward", batch, dict(losses), backward):
            for k, i in enumerate(mine):
                logprobs[i], row_loss[i] = out.logprobs[k], out.row_loss[k]
            for name, sums in out.sums.items():
                into = merged.sums.setdefault(name, {})
                for key, value in sums.items():
                    into[key] = into.get(key, 0.0) + value
            merged.nonfinite |= out.nonfinite
            merged.backwarded |= out.backwarded
        merged.logprobs, merged.row_loss = logprobs, row_loss
        return merged

    def optim_step(self, name: str, adam: AdamSettings) -> tuple[bool, float | None]:
        return self._all("optim_step", name, adam)[0]  # every rank agrees on the flags and the norm

    def adapter_step(self, name: str) -> int:
        return self._all("adapter_step", name)[0]

    @property
    def max_rank(self) -> int:
        return self.cfg.model.max_rank

    def adapter_state_dict(self, name: str) -> dict[str, torch.Tensor]:
        state, received = self._all("adapter_state_dict", name)[0]
        self._gathered += received
        return state

    def peft_config(self, name: str) -> dict[str, Any]:
        return self._all("peft_config", name)[0]

    def load_adapter_state_dict(
        self, name: str, tensors: Mapping[str, torch.Tensor], config: Mapping[str, Any], source: str
    ) -> None:
        import ray

        self._all("load_adapter_state_dict", name, ray.put(dict(tensors)), dict(config), source)

    def optimizer_state_dict(self, name: str) -> dict[str, Any]:
        for held, state in self._all("optimizer_state_dict", name):
            if held:
                return state
        raise RuntimeError(f"no trainer rank holds adapter {name!r}'s slot")

    def load_optimizer_state_dict(self, name: str, state: Mapping[str, Any]) -> None:
        self._all("load_optimizer_state_dict", name, dict(state))

    def close(self) -> None:
        import ray

        try:
            # A rank stuck in a collective (another rank failed mid-step) never answers: wait a while, then kill.
            ray.get([r.close.remote() for r in self._ranks], timeout=CLOSE_TIMEOUT_S)
        except Exception:  # noqa: BLE001 - closing: the actors are killed whatever happened
            pass
        finally:
            self._release()

    def _release(self) -> None:
        import ray
        from ray.util.placement_group import remove_placement_group

        for r in self._ranks:
            ray.kill(r)
        remove_placement_group(self._pg)
