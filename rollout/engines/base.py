"""The one interface every rollout engine implements (embedded torch, SGLang over HTTP, ...)."""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from rollout.types import GenerateRequest, GenerateResult


class RolloutEngine(abc.ABC):
    """Generates completions for requests that each name their adapter (or none for the base).

    Weight sync contract: `pause()` stops generation steps (in-flight requests either finish after
    `resume()` or come back with finish_reason "abort"), `load_adapter` / `unload_adapter` change
    adapters while paused, `resume()` continues. Each adapter has its own weight version, which
    every result reports, so stale samples can be detected.

    `publishes_without_pause`: the engine can take a new version of an adapter while requests run (they finish on
    the version they started with; see the embedded engine's versioned publish), so an asynchronous run publishes
    without pausing it.
    """

    publishes_without_pause: bool = False

    @property
    def eos_ids(self) -> frozenset[int]:
        """Token ids every request stops on besides its own `stop_token_ids` (an environment turn that ends on one
        does not get the chat template's end-of-turn marker again); empty where the engine does not say."""
        return frozenset()

    @abc.abstractmethod
    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Run a batch of requests to completion; results are in request order."""

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        """Async form used by GenerateState. Engines that batch concurrent calls override this."""
        return await asyncio.to_thread(self.generate, requests)

    @abc.abstractmethod
    def load_adapter(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int | None = None
    ) -> int:
        """Load (or replace) adapter `name` from in-memory PEFT-named tensors and a PEFT config dict.

        Returns the adapter's new weight version (`version` if given, else the previous one + 1).
        """

    @abc.abstractmethod
    def unload_adapter(self, name: str) -> None:
        """Forget adapter `name`; later requests naming it fail with a clear error."""

    @abc.abstractmethod
    def pause(self) -> None:
        """Stop running generation steps until `resume()`."""

    @abc.abstractmethod
    def resume(self) -> None:
        """Continue generation after `pause()`."""

    @abc.abstractmethod
    def health(self) -> bool:
        """True when the engine can serve requests."""

    def adapter_versions(self) -> dict[str, int]:
        """Loaded adapters and their current weight versions."""
        return {}

    @contextlib.contextmanager
    def waves_within(self, max_wave_tokens: int | None) -> Iterator[None]:
        """A KV bound on the engine's waves for the block (evals: `eval.max_wave_tokens`); None leaves the engine's
        own. Engines that take one (the embedded engine) override this; the others refuse a bound."""
        if max_wave_tokens is not None:
            raise ValueError(
                f"max_wave_tokens={max_wave_tokens!r} is not allowed with {type(self).__name__}; allowed: None "
                "(only the embedded engine bounds its waves)"
            )
        yield

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release resources (threads, processes, connections)."""
