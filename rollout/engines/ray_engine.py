"""`RayEngine`: an embedded engine in its own Ray actor process, behind the `RolloutEngine` interface.

Design choices:

- The actor builds its engine itself with the builder it is given (the run's is
  `rl_multilora.components.build_embedded_engine` over the run's `model` section, what `engine-serve` serves): its
  own copy of the frozen base and its own adapter bank, on the device Ray gives it
  (`num_gpus=1` puts it on a GPU of its own). Only LoRA tensors travel afterwards: `load_adapter` ships an adapter's
  PEFT-named tensors through Ray's object store, never the base.
- The actor is threaded (`max_concurrency`): concurrent `generate` calls (one per prompt group) reach the engine
  together, so they batch as in-process calls do, and `pause` is served while generations are running.
- `agenerate` awaits the actor's result without holding a thread, so one event loop can keep many engines busy.
- Ray's serialization runs between this project's own processes in one cluster (trusted); nothing from the network
  is unpickled.
"""

from __future__ import annotations

from typing import Any

import torch

from rl_multilora.host_memory import allocator_name, enter_ray_process, jemalloc_ray_options
from rollout.engines.base import RolloutEngine
from rollout.types import GenerateRequest, GenerateResult


def actor_placement() -> dict[str, Any]:
    """Where Ray put the calling actor: its node, placement group and assigned resources (bundle-indexed names
    such as `CPU_group_0_<pg>` say which bundle)."""
    import ray

    ctx = ray.get_runtime_context()
    return {"node": ctx.get_node_id(), "pg": ctx.get_placement_group_id(), "resources": ctx.get_assigned_resources()}


class _EngineActor:
    """Runs inside the actor process: an embedded engine built from the model folder."""

    def __init__(self, build: tuple, device: str | None, jemalloc: bool = False):
        enter_ray_process(jemalloc)  # started with it preloaded when asked (RayEngine's jemalloc)
        fn, *args = build
        self.engine, _ = fn(*args, device=device)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return self.engine.generate(requests)

    def load_adapter(self, name: str, tensors: dict, config: dict, version: int | None) -> int:
        return self.engine.load_adapter(name, tensors, config, version=version)

    def unload_adapter(self, name: str) -> None:
        self.engine.unload_adapter(name)

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def health(self) -> bool:
        return self.engine.health()

    def adapter_versions(self) -> dict[str, int]:
        return self.engine.adapter_versions()

    def placement(self) -> dict[str, Any]:
        return actor_placement()

    def allocator(self) -> str:
        return allocator_name()

    def close(self) -> None:
        self.engine.close()


class RayEngine(RolloutEngine):
    """A proxy to one `_EngineActor`; every call waits for the actor's answer (errors re-raise here).

    `build`: `(fn, *args)`; the actor runs `fn(*args, device=...)`, which returns `(engine, tokenizer)`. Ray ships
    `fn` by reference, so it must be importable in the actor's process. `jemalloc`: the actor's process starts with
    jemalloc preloaded (Ray's runtime_env, `host_memory.jemalloc_ray_options`; `model.host_allocator: jemalloc`) and refuses
    to start without it."""

    def __init__(
        self,
        build: tuple,
        num_gpus: float = 0,
        num_cpus: float = 1,
        max_concurrency: int = 256,
        scheduling_strategy: Any = None,
        jemalloc: bool = False,
    ):
        import ray

        actor_cls = ray.remote(_EngineActor).options(
            num_gpus=num_gpus, num_cpus=num_cpus, max_concurrency=max_concurrency,
            scheduling_strategy=scheduling_strategy, **jemalloc_ray_options(jemalloc),
        )  # fmt: skip
        self._actor = actor_cls.remote(build, "cuda" if num_gpus else None, jemalloc)
        ray.get(self._actor.health.remote())  # fail here, with the actor's error, if it cannot start
        # The actor is threaded: a load runs beside generate calls, into an embedded engine that publishes without
        # a pause.
        self.publishes_without_pause = True

    def _get(self, ref):
        import ray

        return ray.get(ref)

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return self._get(self._actor.generate.remote(requests))

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        return await self._actor.generate.remote(requests)

    def load_adapter(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int | None = None
    ) -> int:
        return self._get(self._actor.load_adapter.remote(name, tensors, config, version))

    def unload_adapter(self, name: str) -> None:
        self._get(self._actor.unload_adapter.remote(name))

    def pause(self) -> None:
        self._get(self._actor.pause.remote())

    def resume(self) -> None:
        self._get(self._actor.resume.remote())

    def health(self) -> bool:
        return self._get(self._actor.health.remote())

    def adapter_versions(self) -> dict[str, int]:
        return self._get(self._actor.adapter_versions.remote())

    def placement(self) -> dict[str, Any]:
        return self._get(self._actor.placement.remote())

    def allocator(self) -> str:
        """The malloc serving the actor's process: `jemalloc` or `glibc`."""
        return self._get(self._actor.allocator.remote())

    def close(self) -> None:
        import ray

        try:
            self._get(self._actor.close.remote())
        finally:
            ray.kill(self._actor)
