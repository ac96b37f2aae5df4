"""`MultiEngine`: several rollout engines behind one `RolloutEngine`, for more rollout throughput.

Design choices:

- Requests are spread by prompt group: the requests of one `agenerate` call (GenerateState sends one call per
  prompt group) go to one engine, so the group's samples share their prefill there; a `generate` batch is cut into
  runs of consecutive requests with the same prompt and adapter, each run kept on one engine. Each call or run goes
  to the engine with the fewest requests in flight (ties: the lowest index), counted across concurrent calls.
- Results do not depend on which engine served a request: every engine samples each row with its own generator
  seeded from the request (`SamplingParams.seed`), whatever else is in its batch.
- The weight sync contract holds for the set: `pause()` pauses every engine before any adapter changes,
  `load_adapter` / `unload_adapter` reach every engine (the same version on each, checked), `resume()` resumes them
  all. One pause per step, whatever the number of engines.
- Engines are any `RolloutEngine`s: embedded engines in this process (each with its own adapter bank over the
  shared frozen base) or remote ones; `close()` closes them all.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from rollout.engines.base import RolloutEngine
from rollout.types import GenerateRequest, GenerateResult

logger = logging.getLogger(__name__)


class MultiEngine(RolloutEngine):
    """`engines` behind one interface: groups spread by least in-flight requests, syncs fanned out to all."""

    def __init__(self, engines: Sequence[RolloutEngine]):
        if not engines:
            raise ValueError("MultiEngine needs at least one engine")
        self.engines = list(engines)
        self.publishes_without_pause = all(e.publishes_without_pause for e in self.engines)
        self._in_flight = [0] * len(self.engines)
        self._served = [0] * len(self.engines)  # requests each engine has taken (for status and tests)
        self._lock = threading.Lock()

    # -- placement ----------------------------------------------------------------------------------------------

    @property
    def eos_ids(self) -> frozenset[int]:
        return frozenset().union(*(e.eos_ids for e in self.engines))

    def _claim(self, n: int) -> int:
        with self._lock:
            index = min(range(len(self.engines)), key=lambda i: (self._in_flight[i], i))
            self._in_flight[index] += n
            self._served[index] += n
            return index

    def _release(self, index: int, n: int) -> None:
        with self._lock:
            self._in_flight[index] -= n

    @property
    def served(self) -> list[int]:
        """Requests each engine has taken so far."""
        with self._lock:
            return list(self._served)

    @contextlib.contextmanager
    def waves_within(self, max_wave_tokens: int | None) -> Iterator[None]:
        """Every engine's `waves_within` (embedded engines) for the block."""
        with contextlib.ExitStack() as stack:
            for engine in self.engines:
                stack.enter_context(engine.waves_within(max_wave_tokens))
            yield

    # -- generation ---------------------------------------------------------------------------------------------

    async def agenerate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        index = self._claim(len(requests))  # the whole call (one prompt group) on one engine
        try:
            return await self.engines[index].agenerate(requests)
        finally:
            self._release(index, len(requests))

    def generate(self, requests: list[GenerateRequest]) -> list[GenerateResult]:
        runs = _runs(requests)
        if len(self.engines) == 1 or len(runs) == 1:
            index = self._claim(len(requests))
            try:
                return self.engines[index].generate(requests)
            finally:
                self._release(index, len(requests))
        placed: dict[int, list[int]] = {}  # engine -> request positions, in order
        for start, stop in runs:
            index = self._claim(stop - start)
            placed.setdefault(index, []).extend(range(start, stop))

        def serve(index: int) -> list[GenerateResult]:
            positions = placed[index]
            try:
                return self.engines[index].generate([requests[p] for p in positions])
            finally:
                self._release(index, len(positions))

        results: list[GenerateResult | None] = [None] * len(requests)
        with ThreadPoolExecutor(max_workers=len(placed)) as pool:
            for index, out in zip(placed, pool.map(serve, placed), strict=True):
                for p, result in zip(placed[index], out, strict=True):
                    results[p] = result
        return results  # type: ignore[return-value]

    # -- weights --------------------------------------------------------------------------------------------------

    def load_adapter(
        self, name: str, tensors: dict[str, torch.Tensor], config: dict[str, Any], version: int | None = None
    ) -> int:
        versions = [engine.load_adapter(name, tensors, config, version=version) for engine in self.engines]
        if len(set(versions)) != 1:
            raise RuntimeError(f"engines loaded adapter {name!r} at different versions {versions}; pass version=")
        return versions[0]

    @property
    def bank_page_ins(self) -> int | None:
        """Adapters the engines paged into their banks (None when none of them pages)."""
        counts = [getattr(e, "bank_page_ins", None) for e in self.engines]
        return None if all(c is None for c in counts) else sum(c or 0 for c in counts)

    def unload_adapter(self, name: str) -> None:
        for engine in self.engines:
            engine.unload_adapter(name)

    def pause(self) -> None:
        """Pause every engine; when one fails, those already paused are resumed and its error is raised."""
        for i, engine in enumerate(self.engines):
            try:
                engine.pause()
            except BaseException:
                for paused in self.engines[:i]:
                    try:
                        paused.resume()
                    except Exception:
                        logger.exception("multi-engine: resuming an engine after another's failed pause failed")
                raise

    def resume(self) -> None:
        """Resume every engine, each even when another fails (one engine left paused holds its requests for good);
        the first error is raised after all were tried."""
        errors = []
        for engine in self.engines:
            try:
                engine.resume()
            except Exception as exc:
                errors.append(exc)
        if errors:
            raise errors[0]

    def health(self) -> bool:
        return all(engine.health() for engine in self.engines)

    def adapter_versions(self) -> dict[str, int]:
        """Adapters loaded on every engine, at the lowest version any engine holds (equal after a sync)."""
        per_engine = [engine.adapter_versions() for engine in self.engines]
        common = set(per_engine[0]).intersection(*per_engine[1:])
        return {name: min(v[name] for v in per_engine) for name in sorted(common)}

    def engine_adapter_versions(self) -> list[dict[str, int]]:
        """Each engine's own adapters and versions (what `status` shows)."""
        return [engine.adapter_versions() for engine in self.engines]

    def close(self) -> None:
        for engine in self.engines:
            engine.close()


def _runs(requests: Sequence[GenerateRequest]) -> list[tuple[int, int]]:
    """[start, stop) runs of consecutive requests with the same prompt and adapter (a prompt group's samples)."""
    runs: list[tuple[int, int]] = []
    for i, request in enumerate(requests):
        if runs and _same_group(requests[runs[-1][0]], request):
            runs[-1] = (runs[-1][0], i + 1)
        else:
            runs.append((i, i + 1))
    return runs


def _same_group(a: GenerateRequest, b: GenerateRequest) -> bool:
    return a.adapter == b.adapter and a.input_ids == b.input_ids
