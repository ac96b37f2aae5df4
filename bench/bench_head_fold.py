"""The embedded engine's rollout with the output head's input folded (this checkout) and not (torch's own path).

    python bench/bench_head_fold.py                  # float32 and bfloat16, 4 rounds each
    python bench/bench_head_fold.py --dtypes float32 --rounds 6

HF models call `lm_head(hidden[:, -1:, :])`; in a prefill of more than one position that input is a strided view,
and with a frozen head `torch.matmul` broadcasts the head over the rows into `bmm` instead of one product
(`rl_multilora.lora.model._foldable_head_input`, which makes the input contiguous). This times, in one process on
one engine, the two ways alternating round by round:

- `grpo`: a GRPO rollout as the SmolLM2 example's step makes it: 12 prompts of 60 tokens x 8 samples (a group shares
  its prompt's prefill), 24 new tokens, temperature 0.7, EOS off (every row does the same work);
- `prefill`: 32 distinct prompts of 25 tokens, one new token: the shape of a multi-turn episode's next turn.

For each: the median wall and CPU seconds (min-max over the rounds) and the largest rise of the live heap (glibc's
`mallinfo2`) during a call, and whether both ways generated the same tokens in the warm-up round (greedy rows should; sampled rows can
differ, since the two products round differently and a last-bit change can flip a sampled token). The model has SmolLM2-135M's config
with random weights (the shape is what matters); the rows run on the base, since the head's cost does not depend on
the adapters.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rl_multilora.host_memory import heap_in_use, no_mkl_buffer_cache  # noqa: E402

no_mkl_buffer_cache()  # as `rl-multilora run` does, before torch is imported
import torch  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from bench.bench_lora_paths import smollm2_config  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rl_multilora.lora.model import _foldable_head_input  # noqa: E402
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.types import GenerateRequest, SamplingParams  # noqa: E402

MIB = 2**20


class HeapPeak:
    """The largest rise of the live heap above its value at `__enter__`, sampled every 0.5 ms."""

    def __enter__(self):
        self.start, self.peak, self._stop = heap_in_use(), 0, False
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def _run(self):
        while not self._stop:
            self.peak = max(self.peak, heap_in_use() - self.start)
            time.sleep(0.0005)

    def __exit__(self, *exc):
        self._stop = True
        self._thread.join()


def workloads(vocab: int) -> dict[str, list[GenerateRequest]]:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, vocab, (60,), generator=gen).tolist() for _ in range(12)]
    grpo = [
        GenerateRequest(prompt, sampling=SamplingParams(temperature=0.7, max_new_tokens=24, seed=8 * i + j))
        for i, prompt in enumerate(prompts)
        for j in range(8)
    ]
    greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
    prefill = [
        GenerateRequest(torch.randint(3, vocab, (25,), generator=gen).tolist(), sampling=greedy) for _ in range(32)
    ]
    return {"grpo": grpo, "prefill": prefill}


def run(dtype: torch.dtype, rounds: int, layers: int = 30) -> None:
    config = smollm2_config()
    config.num_hidden_layers = layers
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        base = AutoModelForCausalLM.from_config(config).to(dtype).eval()
    model = MultiLoRAModel.from_model(base, max_loras=3, max_rank=16)
    head = model.base_model.get_output_embeddings()
    engine = EmbeddedEngine(model, None, max_batch_size=96, eos_token_ids=[])
    work = workloads(model.base_model.config.vocab_size)
    outputs: dict[tuple[str, bool], list] = {}

    def fold(on: bool) -> None:
        if model._head_fold is not None:
            model._head_fold.remove()
            model._head_fold = None
        if on:
            model._head_fold = head.register_forward_pre_hook(_foldable_head_input)

    times = {(w, on): ([], [], []) for w in work for on in (True, False)}
    for r in range(rounds + 1):  # round 0 warms up
        order = (True, False) if r % 2 else (False, True)
        for w, requests in work.items():
            for on in order:
                fold(on)
                with HeapPeak() as heap:
                    wall, cpu = time.perf_counter(), time.process_time()
                    result = engine.generate(requests)
                    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
                outputs.setdefault((w, on), [o.output_ids for o in result])
                if r:
                    for column, value in zip(times[(w, on)], (wall, cpu, heap.peak / MIB), strict=True):
                        column.append(value)
    fold(True)
    engine.close()
    print(
        f"\n{str(dtype).removeprefix('torch.')}, {layers} layers, torch threads {torch.get_num_threads()}, "
        f"{rounds} rounds"
    )
    print(f"{'workload':<9} {'head input':<11} {'wall s':>22} {'CPU s':>22} {'heap rise MiB':>14}  same tokens")
    for w in work:
        same = outputs[(w, True)] == outputs[(w, False)]
        for on in (True, False):
            wall, cpu, heap = times[(w, on)]
            print(
                f"{w:<9} {'folded' if on else 'strided':<11} {cell(wall):>22} {cell(cpu):>22} {max(heap):>14.0f}"
                f"  {'yes' if same else 'NO'}"
            )
        ratio = [s / f for s, f in zip(times[(w, False)][0], times[(w, True)][0], strict=True)]
        print(f"{w:<9} strided / folded wall, per round: {' '.join(f'{x:.2f}' for x in ratio)}")


def cell(values: list[float]) -> str:
    return f"{statistics.median(values):.3f} ({min(values):.3f}-{max(values):.3f})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"], choices=["float32", "bfloat16"])
    ap.add_argument("--rounds", type=int, default=4, help="timed rounds after a warm-up (each runs both ways)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--layers", type=int, default=30, help="decoder layers (SmolLM2-135M: 30; fewer for a smoke run)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for name in args.dtypes:
        run(getattr(torch, name), args.rounds, args.layers)


if __name__ == "__main__":
    main()
