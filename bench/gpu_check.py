"""GPU check: the CUDA-relevant checks and benches, each section in a process of its own, sized to one 600 s call.

    python bench/gpu_check.py --out gpu_check            # on a CUDA GPU: at most --budget-s (540 s)
    python bench/gpu_check.py --device cpu --small --extras --out tmp   # every section at tiny sizes, on CPU

Writes `OUT/gpu_check.json` (every section: ok, status, seconds, result or error) and `OUT/gpu_check.md` after every
section, and each section's output to `OUT/logs/NAME.log`. The sections, in the order they run (`SECTIONS`; each
killed at min(its cap, the budget left), so a hang, an out-of-memory or a sticky CUDA error costs that one only):

- `peft_parity_bf16`: a bf16 base with an fp32 adapter against PEFT's LoRA on the same weights (logits).
- `grouped_vs_loop`: the fast LoRA paths against the model's float32 per-row loop (`reference=True`), values and
  grads, over adapter mixes (distinct, uniform, skewed, one adapter, base rows mixed in).
- `engine_greedy_vs_peft`: the embedded engine's greedy tokens for a mixed batch = HF `generate` with PEFT, per row.
- `gpu_tests`: `pytest -m gpu` over the files that hold GPU tests, each test cut at 120 s.
- `grpo_tiny`: a short run of the tiny preset (`artifacts/tiny`, carried with the tree; skipped without it) for
  learning: reward first -> last.
- `grpo_smollm2_shape`: a few GRPO steps at SmolLM2-135M's shape with random weights: step time by phase,
  generated tokens/s and peak CUDA memory, beside the same run with `model.lora_autocast` (`lora_autocast`): both
  held at once and stepped in turn.
- `lora_overhead` / `decode_64_vs_1`: train-step (forward+backward) cost of base / 1 / 64 adapters (and one with
  `lora_autocast`, and PEFT's one adapter as it defaults and under `torch.autocast`), and engine decode
  tokens/s for 64 tenants mixed vs one adapter vs base, at SmolLM2-135M's shape and a Qwen3-shaped model (hidden
  2048), random bf16 weights built from a config (nothing downloaded).

With `--extras` (`EXTRAS`, settled by earlier GPU runs): `cpu_oracle_tests` (the CPU oracle tests by pytest),
`lora_overhead_profile` (the base and one-adapter steps under torch.profiler: kernels per step and their device time
against the wall time), and decode with the fused kernel off. Times are medians over interleaved repeats (CUDA
synchronized around each), never one run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's packages (and tests.tiny_models) when run as a script

from bench.bench_rollout import interleaved_seconds, median_seconds, random_adapter  # noqa: E402
from rl_multilora.lora import MultiLoRAModel, triton_decode  # noqa: E402
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
from rollout.types import GenerateRequest, SamplingParams  # noqa: E402
from tests.tiny_models import sum_task_adapter, tiny_tokenizer, write_sum_task  # noqa: E402

CPU_ORACLE_TESTS = (
    "tests/test_lora.py::test_bf16_base_matches_peft_with_fp32_scale",
    "tests/test_grouped_lora.py::test_fast_path_equals_reference_loop_values_and_grads",
    "tests/test_embedded_engine.py::test_greedy_mixed_batch_matches_peft_generate",
)


@dataclass(frozen=True)
class Shape:
    """A decoder's shape; weights are random (built with `from_config`)."""

    name: str
    family: str  # "llama" or "qwen3"
    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    vocab: int

    def build(self, dtype: torch.dtype, device: str, seed: int = 0):
        common = dict(
            vocab_size=self.vocab,
            hidden_size=self.hidden,
            intermediate_size=self.intermediate,
            num_hidden_layers=self.layers,
            num_attention_heads=self.heads,
            num_key_value_heads=self.kv_heads,
            max_position_embeddings=2048,
            tie_word_embeddings=self.family == "llama",  # SmolLM2 ties, Qwen3-1.7B-class models do too at 2048
        )
        config = LlamaConfig(**common) if self.family == "llama" else Qwen3Config(head_dim=128, **common)
        # initialized on the device itself: a 1.7B-parameter random init on the CPU would cost the lease a minute
        with torch.random.fork_rng(devices=[]), torch.device(device):
            torch.manual_seed(seed)
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        return model.eval()


SMOLLM2 = Shape("smollm2-135m", "llama", 576, 1536, 30, 9, 3, 49152)
QWEN3_2048 = Shape("qwen3-h2048", "qwen3", 2048, 6144, 28, 16, 8, 151936)
TINY = Shape("tiny", "qwen3", 64, 128, 2, 4, 2, 256)


@dataclass(frozen=True)
class Sizes:
    """How big each section runs: the GPU sizes, or `--small` for the CPU smoke run."""

    bench_shapes: tuple[Shape, ...]
    train_rows: int
    train_seq: int
    decode_rows: int
    prompt_len: int
    new_tokens: int
    runs: int
    decode_runs: int
    grpo_shape: Shape
    grpo_steps: int
    grpo_new_tokens: int
    tiny_steps: int
    oracle_tests: tuple[str, ...]
    torch_ops: bool = False  # decode: also the fused CUDA kernel turned off (`--extras`; settled by runs 6, 7, 9)


FULL = Sizes((SMOLLM2, QWEN3_2048), 16, 256, 64, 64, 64, 5, 3, SMOLLM2, 4, 128, 30, CPU_ORACLE_TESTS)
SMALL = Sizes((TINY,), 4, 8, 64, 4, 3, 2, 2, TINY, 2, 8, 2, CPU_ORACLE_TESTS[:1])
N_TENANTS = 64
RANK = 8
ADAPTER_CONFIG = {"peft_type": "LORA", "r": RANK, "lora_alpha": 2 * RANK, "target_modules": "all-linear"}


def synced_clock(device: str) -> Callable[[], float]:
    def clock() -> float:
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        return time.perf_counter()

    return clock


def randomize(m: MultiLoRAModel, name: str, seed: int) -> None:
    """Non-zero A and B at the adapter's true rank, padding left zero (PEFT's B = 0 init would make every
    comparison trivially pass)."""
    gen = torch.Generator().manual_seed(seed)
    s, r = m.slot_of(name), m.adapters[name].rank
    with torch.no_grad():
        for layer in m.base_model.modules():
            if hasattr(layer, "lora_A"):
                a, b = layer.lora_A[s], layer.lora_B[s]
                a[:r].copy_(torch.randn(a[:r].shape, generator=gen) * 0.05)
                b[:, :r].copy_(torch.randn(b[:, :r].shape, generator=gen) * 0.05)


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.float() - b.float()).abs().max().item()


# ---------------------------------------------------------------------------------------------------------------
# Sections: each takes (device, sizes, workdir) and returns a JSON-able dict; "ok" in it is the verdict


def cpu_oracle_tests(device: str, sizes: Sizes, workdir: Path) -> dict:
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "gpu or not gpu", *sizes.oracle_tests]
    start = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()[-1:] or [""]
    return {"ok": proc.returncode == 0, "tests": list(sizes.oracle_tests), "summary": tail[0],
            "pytest_s": round(time.perf_counter() - start, 2)}  # fmt: skip


GPU_TEST_FILES = (
    "tests/test_grouped_lora.py",
    "tests/test_triton_decode.py",
    "tests/test_expert_lora.py",
    "tests/test_sglang_gpu.py",
)  # fmt: skip  (every file with a `gpu`-marked test)


def gpu_tests(device: str, sizes: Sizes, workdir: Path) -> dict:
    """`pytest -m gpu` over the files that hold GPU tests (bf16/CUDA isolation, the Triton decode kernel, expert LoRA,
    SGLang when installed), each test cut at 120 s. On CPU they skip, and the summary says so."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "-m", "gpu", "--timeout", "120",
           *GPU_TEST_FILES]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    failed = [line for line in lines if line.startswith(("FAILED", "ERROR"))]
    return {"ok": proc.returncode == 0, "summary": (lines or [""])[-1], "failed": failed[:20]}


def peft_parity_bf16(device: str, sizes: Sizes, workdir: Path) -> dict:
    from peft import LoraConfig, get_peft_model, set_peft_model_state_dict

    m = MultiLoRAModel.from_model(TINY.build(torch.bfloat16, device), max_loras=2, max_rank=24)
    m.add_adapter("a", rank=24, alpha=32, seed=0)
    randomize(m, "a", seed=1)
    peft_model = get_peft_model(
        TINY.build(torch.bfloat16, device), LoraConfig(r=24, lora_alpha=32, target_modules="all-linear")
    )
    set_peft_model_state_dict(peft_model, m.adapter_state_dict("a"))
    ids = torch.randint(3, TINY.vocab, (6, 16), generator=torch.Generator().manual_seed(0)).to(device)
    with torch.no_grad():
        got = m(ids, adapter_names=["a"] * 6).logits
        expected = peft_model(input_ids=ids).logits
    diff = max_diff(got, expected)
    # bf16 logits: exact on CPU (the test); on CUDA kernels may differ by a bf16 ulp of the logit scale
    return {"ok": diff <= 2e-2 * expected.float().abs().max().item(), "max_abs_diff": diff, "exact": diff == 0.0}


MIXES = {
    "distinct": ["r1", "r3", "r8", "r5"],
    "uniform": ["r1", "r3", "r8", "r5"] * 2,
    "skewed": ["r8", "r8", "r8", "r1", "r8", "r8"],
    "one_adapter": ["r3"] * 5,
    "base_rows_mixed_in": [None, "r1", None, "r8", "r8", None],
}


def grouped_vs_loop(device: str, sizes: Sizes, workdir: Path) -> dict:
    m = MultiLoRAModel.from_model(TINY.build(torch.float32, device), max_loras=6, max_rank=8)
    for i, (name, (rank, alpha)) in enumerate({"r1": (1, 0.7), "r3": (3, 7), "r5": (5, 9), "r8": (8, 12.3)}.items()):
        m.add_adapter(name, rank=rank, alpha=alpha, seed=i)
        randomize(m, name, seed=100 + i)
    out, ok = {}, True
    for mix, names in MIXES.items():
        ids = torch.randint(3, TINY.vocab, (len(names), 12), generator=torch.Generator().manual_seed(1)).to(device)
        results = []
        for reference in (False, True):
            m.zero_lora_grads()
            logits = m(ids, adapter_names=names, reference=reference).logits
            logits.float().logsumexp(-1).mean().backward()
            grads = [g.clone() for n in m.adapters for g in m.adapter_grads(n) if g is not None]
            results.append((logits.detach(), grads))
        (fast, fast_g), (ref, ref_g) = results
        value = max_diff(fast, ref)
        grad = max((max_diff(a, b) for a, b in zip(fast_g, ref_g, strict=True)), default=0.0)
        passed = value <= 1e-4 and grad <= 1e-4 and len(fast_g) == len(ref_g)
        ok &= passed
        out[mix] = {"ok": passed, "max_abs_diff": value, "grad_max_abs_diff": grad}
    return {"ok": ok, "mixes": out}


def engine_greedy_vs_peft(device: str, sizes: Sizes, workdir: Path) -> dict:
    from peft import PeftModel

    m = MultiLoRAModel.from_model(TINY.build(torch.float32, device), max_loras=4, max_rank=RANK)
    engine = EmbeddedEngine(m, None, max_batch_size=8, eos_token_ids=[])
    names = ["t0", "t1", "t2"]
    for i, name in enumerate(names):
        tensors, config = random_adapter(m, RANK, seed=10 + i)
        m.load_adapter_state_dict(name, tensors, config)
        m.export_adapter(name, workdir / "peft" / name)
        engine.load_adapter(name, tensors, config)
    gen = torch.Generator().manual_seed(2)
    rows = [(torch.randint(3, TINY.vocab, (5 + i,), generator=gen).tolist(), names[i % 3]) for i in range(6)]
    rows.append((rows[0][0], None))  # a base row in the same batch
    params = SamplingParams(temperature=0.0, max_new_tokens=sizes.new_tokens + 5)
    try:
        got = [
            r.output_ids for r in engine.generate([GenerateRequest(p, adapter=a, sampling=params) for p, a in rows])
        ]
    finally:
        engine.close()
    peft_model = PeftModel.from_pretrained(
        TINY.build(torch.float32, device), workdir / "peft" / "t0", adapter_name="t0"
    )
    for name in names[1:]:
        peft_model.load_adapter(workdir / "peft" / name, adapter_name=name)
    peft_model.eval()
    mismatched = []
    for i, (prompt, adapter) in enumerate(rows):
        ids = torch.tensor([prompt], device=device)
        if adapter is not None:
            peft_model.set_adapter(adapter)
        with torch.no_grad(), peft_model.disable_adapter() if adapter is None else contextlib.nullcontext():
            ref = peft_model.generate(
                input_ids=ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=params.max_new_tokens,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        if ref != got[i]:
            mismatched.append(i)
    return {"ok": not mismatched, "rows": len(rows), "mismatched_rows": mismatched}


def _tenants(shape: Shape, device: str, n: int, autocast: bool = False) -> tuple[MultiLoRAModel, list[str]]:
    m = MultiLoRAModel.from_model(
        shape.build(torch.bfloat16, device), max_loras=n, max_rank=RANK, lora_autocast=autocast
    )
    names = [f"t{i}" for i in range(n)]
    for i, name in enumerate(names):
        m.add_adapter(name, rank=RANK, alpha=2 * RANK, seed=i)
        randomize(m, name, seed=100 + i)
    return m, names


def lora_overhead(device: str, sizes: Sizes, workdir: Path) -> dict:
    return {"ok": True, "shapes": {shape.name: _overhead(shape, device, sizes) for shape in sizes.bench_shapes}}


def _train_ids(shape: Shape, device: str, sizes: Sizes) -> torch.Tensor:
    gen = torch.Generator().manual_seed(0)
    return torch.randint(3, shape.vocab, (sizes.train_rows, sizes.train_seq), generator=gen).to(device)


def _train_step(m: MultiLoRAModel, ids: torch.Tensor, adapters: list) -> Callable[[], None]:
    """One forward+backward of `ids` with each row on its adapter (None: the base), the LoRA gradients kept per slot in
    a sink as the trainer keeps them (`use_slot_grads`; GPU runs up to 16 measured stacked `.grad`s instead)."""
    m.use_slot_grads()
    with torch.no_grad():  # embeddings that require grad: the base floor pays the same activation backward
        embeds = m.base_model.get_input_embeddings()(ids)

    def run():
        m.zero_lora_grads()
        x = embeds.detach().requires_grad_()
        m(inputs_embeds=x, adapter_names=adapters).logits.float().logsumexp(-1).mean().backward()

    return run


def _peft_train_step(shape: Shape, device: str, ids: torch.Tensor, autocast: bool) -> Callable[[], None]:
    """PEFT's one-adapter step on the same bf16 base and batch: its default float32 adapter (`autocast_adapter_dtype`),
    and with `autocast` the whole forward under `torch.autocast(bf16)`, as TRL's `bf16: true` runs it."""
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(
        shape.build(torch.bfloat16, device), LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear")
    )
    with torch.no_grad():
        embeds = model.get_input_embeddings()(ids)
    cast = torch.autocast(ids.device.type, dtype=torch.bfloat16) if autocast else contextlib.nullcontext()

    def run():
        model.zero_grad(set_to_none=True)
        x = embeds.detach().requires_grad_()
        with cast:
            logits = model(inputs_embeds=x).logits
        logits.float().logsumexp(-1).mean().backward()

    return run


def _overhead(shape: Shape, device: str, sizes: Sizes) -> dict:
    """Forward+backward ms of one batch on the base, on one adapter, and spread over 64 adapters; one adapter with
    `lora_autocast` (its products in bf16, the slots float32); PEFT's one adapter on the same batch, as it defaults
    and under `torch.autocast(bf16)`."""
    m, names = _tenants(shape, device, N_TENANTS)
    mac, names_ac = _tenants(shape, device, 1, autocast=True)
    ids = _train_ids(shape, device, sizes)
    fns = {
        "base": _train_step(m, ids, [None] * sizes.train_rows),
        "one": _train_step(m, ids, [names[0]] * sizes.train_rows),
        "mixed64": _train_step(m, ids, [names[i % N_TENANTS] for i in range(sizes.train_rows)]),
        "one_autocast": _train_step(mac, ids, [names_ac[0]] * sizes.train_rows),
        "peft_one": _peft_train_step(shape, device, ids, autocast=False),
        "peft_one_autocast": _peft_train_step(shape, device, ids, autocast=True),
    }
    ms = {k: 1e3 * s for k, s in median_seconds(fns, sizes.runs, synced_clock(device)).items()}
    del m, mac, fns
    _free(device)
    return {"rows": sizes.train_rows, "seq_len": sizes.train_seq, "fwd_bwd_ms": ms,
            "one_over_base": ms["one"] / ms["base"], "mixed64_over_one": ms["mixed64"] / ms["one"],
            "one_autocast_over_base": ms["one_autocast"] / ms["base"],
            "peft_one_over_base": ms["peft_one"] / ms["base"],
            "peft_one_autocast_over_base": ms["peft_one_autocast"] / ms["base"]}  # fmt: skip


def lora_overhead_profile(device: str, sizes: Sizes, workdir: Path) -> dict:
    return {
        "ok": True,
        "shapes": {shape.name: _overhead_profile(shape, device, sizes) for shape in sizes.bench_shapes},
    }


def _overhead_profile(shape: Shape, device: str, sizes: Sizes) -> dict:
    """Where one adapter's extra training time goes: `lora_overhead`'s base and one-adapter steps under
    torch.profiler, `sizes.runs` steps each after a warm-up. Per step: kernels launched and their summed device time
    (CUDA), or ops and their summed self CPU time (CPU), against the step's wall time (which the profiler inflates).
    A device-time ratio near the LoRA's FLOP share beside a much larger wall-time ratio says the step is bound by
    launching kernels, not by them. `one_autocast` is the same adapter with `lora_autocast` (its products in the base's
    bf16, the float32 slots cast per forward) instead of PEFT's default (each LoRA Linear's input cast to float32 and
    its output summed in float32); `top_*` list the one-adapter steps' costliest kernels (or ops) by device (CPU)
    time."""
    from torch.profiler import ProfilerActivity, profile

    cuda = device.startswith("cuda")
    clock = synced_clock(device)
    ids = _train_ids(shape, device, sizes)
    out, top = {}, {}
    for key, autocast, adapter in (("base", False, False), ("one", False, True), ("one_autocast", True, True)):
        m, names = _tenants(shape, device, 1, autocast=autocast)
        step = _train_step(m, ids, [names[0] if adapter else None] * sizes.train_rows)
        step()  # warm-up
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as prof:
            start = clock()
            for _ in range(sizes.runs):
                step()
            wall = (clock() - start) / sizes.runs
        if cuda:
            costs = [(e.name, e.time_range.elapsed_us()) for e in prof.events() if e.device_type.name == "CUDA"]
        else:
            costs = [(e.name, e.self_cpu_time_total) for e in prof.events() if e.device_type.name == "CPU"]
        out[key] = {"wall_ms": 1e3 * wall, "kernels": len(costs) / sizes.runs,
                    "busy_ms": sum(us for _, us in costs) / 1e3 / sizes.runs}  # fmt: skip
        if adapter:
            by_name: dict[str, list[float]] = {}
            for name, us in costs:
                by_name.setdefault(name, []).append(us)
            top[f"top_{key}"] = sorted(
                ({"name": n[:120], "calls": len(v) / sizes.runs, "ms": sum(v) / 1e3 / sizes.runs}
                 for n, v in by_name.items()), key=lambda r: -r["ms"],
            )[:12]  # fmt: skip
        del m, step
        _free(device)
    base = out["base"]
    ratios = {
        f"{k}_{what}_over_base": out[k][what] / base[what]
        for k in ("one", "one_autocast")
        for what in ("wall_ms", "busy_ms", "kernels")
    }
    return {"rows": sizes.train_rows, "seq_len": sizes.train_seq, "unit": "CUDA kernels" if cuda else "CPU ops",
            "per_step": out, **ratios, **top}  # fmt: skip


def decode_64_vs_1(device: str, sizes: Sizes, workdir: Path) -> dict:
    return {"ok": True, "shapes": {shape.name: _decode(shape, device, sizes) for shape in sizes.bench_shapes}}


def _decode(shape: Shape, device: str, sizes: Sizes) -> dict:
    """Engine greedy decode tokens/s of one batch on the base, on one adapter, and spread over 64 adapters."""
    m, names = _tenants(shape, device, N_TENANTS)
    engine = EmbeddedEngine(m, None, max_batch_size=sizes.decode_rows, eos_token_ids=[])
    gen = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(3, shape.vocab, (sizes.prompt_len,), generator=gen).tolist() for _ in range(sizes.decode_rows)
    ]
    params = SamplingParams(temperature=0.0, max_new_tokens=sizes.new_tokens)

    def call(adapters):
        requests = [GenerateRequest(p, adapter=a, sampling=params) for p, a in zip(prompts, adapters, strict=True)]
        return lambda: engine.generate(requests)

    try:
        for name in names:
            engine.load_adapter(name, m.adapter_state_dict(name), ADAPTER_CONFIG)
        one, mixed = [names[0]] * sizes.decode_rows, [names[i % N_TENANTS] for i in range(sizes.decode_rows)]
        fns = {"base": call([None] * sizes.decode_rows), "one": call(one), "mixed64": call(mixed)}
        kernel = device.startswith("cuda") and triton_decode.usable(
            torch.empty(1, device=device), torch.empty(1, 1, 1)
        )
        if kernel and sizes.torch_ops:  # the same steps with the fused decode kernel off: the torch-ops path
            fns |= {"one_torch_ops": without_kernel(call(one)), "mixed64_torch_ops": without_kernel(call(mixed))}
        times = interleaved_seconds(fns, sizes.decode_runs, synced_clock(device))
    finally:
        engine.close()
    _free(device)
    tokens = sizes.decode_rows * sizes.new_tokens
    rate = {k: tokens / statistics.median(t) for k, t in times.items()}
    spread = {k: [round(tokens / max(t)), round(tokens / min(t))] for k, t in times.items()}
    result = {"rows": sizes.decode_rows, "new_tokens": sizes.new_tokens, "runs": sizes.decode_runs,
              "fused_kernel": kernel, "tokens_per_s": rate, "tokens_per_s_min_max": spread,
              "mixed64_over_one": rate["mixed64"] / rate["one"],
              "mixed64_over_one_per_run": ratios(times["one"], times["mixed64"])}  # fmt: skip
    if kernel and sizes.torch_ops:
        result["torch_ops_mixed64_over_one_per_run"] = ratios(times["one_torch_ops"], times["mixed64_torch_ops"])
        result["kernel_over_torch_ops_one"] = rate["one"] / rate["one_torch_ops"]
        result["kernel_over_torch_ops_mixed64"] = rate["mixed64"] / rate["mixed64_torch_ops"]
    return result


def without_kernel(fn: Callable[[], object]) -> Callable[[], object]:
    """`fn` with the fused CUDA decode kernel turned off (the LoRA layers' torch-ops decode path)."""

    def run():
        triton_decode.ENABLED = False
        try:
            return fn()
        finally:
            triton_decode.ENABLED = True

    return run


def ratios(one: list[float], mixed: list[float]) -> dict:
    """Throughput of `mixed` over `one` per round (one's time over mixed's): median, min, max."""
    per_run = [a / b for a, b in zip(one, mixed, strict=True)]
    return {"median": statistics.median(per_run), "min": min(per_run), "max": max(per_run)}


def _free(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def _run_steps(cfg_data: dict, steps: int, device: str) -> tuple[list, list[dict]]:
    """Step a Runtime built from `cfg_data`; returns every step's records and per-step timings."""
    got = _run_interleaved({"run": cfg_data}, steps, device)["run"]
    return got["records"], got["timings"]


def _run_interleaved(datas: dict[str, dict], steps: int, device: str) -> dict[str, dict]:
    """Runtimes built from each of `datas`, all held at once and stepped in turn, the order alternating step by step
    (drift and warm-up hit each alike). Per key: each step's timings and, on CUDA, the GPU memory the runtime holds
    between steps (`resident_gib`) and the most any of its steps added to it (`step_rise_gib`); each step's records."""
    from rl_multilora.config import RunConfig
    from rl_multilora.loop import Runtime

    cuda = device.startswith("cuda")
    allocated = torch.cuda.memory_allocated if cuda else (lambda: 0)
    out: dict[str, dict] = {}
    rts = {}
    try:
        for key, data in datas.items():
            before = allocated()
            rts[key] = Runtime.build(RunConfig.model_validate(data))
            rts[key].start()
            out[key] = {"timings": [], "records": [], "resident_gib": (allocated() - before) / 2**30,
                        "step_rise_gib": 0.0}  # fmt: skip
        clock = synced_clock(device)
        for i in range(steps):
            for key in list(rts) if i % 2 == 0 else list(rts)[::-1]:
                if cuda:
                    torch.cuda.reset_peak_memory_stats()
                held = allocated()
                t0 = clock()
                res = rts[key].step()
                wall = clock() - t0
                if cuda:
                    rise = (torch.cuda.max_memory_allocated() - held) / 2**30
                    out[key]["step_rise_gib"] = max(out[key]["step_rise_gib"], rise)
                tokens = sum(r.response_len_mean * r.n_samples for r in res.records if r.n_samples)
                out[key]["timings"].append({"step_s": wall, "tokens": tokens, **res.timings})
                out[key]["records"].append(res.records)
    finally:
        for rt in rts.values():
            rt.close()
    return out


QUIET = {
    "eval": {"enabled": False},
    "checkpoint": {"save_every": 10_000, "resume": "never"},
    "logging": {"plot": False, "progress": False},
}


def grpo_tiny(device: str, sizes: Sizes, workdir: Path) -> dict:
    from rl_multilora.config import load_run_config

    config = ROOT / "examples/multi_lora/configs/tiny.yaml"
    if not (ROOT / "artifacts/tiny/model").exists():  # not a pass: nothing was checked
        return {
            "ok": False,
            "skipped": "artifacts/tiny is absent (examples/multi_lora/provision.sh makes it; carry it)",
        }
    data = load_run_config(config).model_dump(mode="json")
    data.update(QUIET, run_dir=str(workdir / "tiny"), max_global_steps=sizes.tiny_steps)
    data["model"]["device"] = device
    for a in data["adapters"]:
        for split, path in a["dataset"].get("data_files", {}).items():
            a["dataset"]["data_files"][split] = str(ROOT / path)
    data["model"]["path"] = str(ROOT / data["model"]["path"])
    records, timings = _run_steps(data, sizes.tiny_steps, device)
    rewards: dict[str, list[float]] = {}
    for step in records:
        for r in step:
            if r.reward_mean is not None:
                rewards.setdefault(r.adapter, []).append(r.reward_mean)
    k = max(1, sizes.tiny_steps // 5)  # reward first -> last fifth of the steps
    first_last = {a: [statistics.mean(v[:k]), statistics.mean(v[-k:])] for a, v in rewards.items()}
    # the verdict: every tenant scored without a reward error (a reward that cannot import fails every sample and
    # would read as a flat 0.0), and, in a run long enough to learn (10+ steps: not --small), every tenant's reward rose
    errors = {a: sum(r.reward_errors for step in records for r in step if r.adapter == a) for a in rewards}
    names = [a["name"] for a in data["adapters"]]
    learned = sizes.tiny_steps < 10 or all(first_last.get(a, [0, 0])[1] > first_last.get(a, [0, 0])[0] for a in names)
    ok = set(names) <= set(rewards) and not any(errors.values()) and learned
    return {"ok": ok, "steps": sizes.tiny_steps, "step_s_median": statistics.median(t["step_s"] for t in timings),
            "reward_first_last": first_last, "reward_errors": errors}  # fmt: skip


def grpo_smollm2_shape(device: str, sizes: Sizes, workdir: Path) -> dict:
    shape = sizes.grpo_shape
    model_dir = workdir / "grpo_model"
    shape.build(torch.bfloat16, "cpu").save_pretrained(model_dir)
    tiny_tokenizer().save_pretrained(model_dir)  # character-level: ids < 100 fit any vocab here
    adapters = []
    for i, task in enumerate(("s0", "s1", "s2", "s3")):
        write_sum_task(workdir / "data" / f"{task}.jsonl", 64, offset=i)
        adapters.append(sum_task_adapter(workdir / "data", task, seed=i, prompts_per_step=4, max_steps=1000))
    data = {
        **QUIET,
        "run_dir": str(workdir / "grpo"),
        "model": {"path": str(model_dir), "max_loras": 4, "max_rank": 8, "dtype": "bfloat16", "device": device},
        "rollout": {"engine": "embedded", "n_samples_per_prompt": 8, "max_new_tokens": sizes.grpo_new_tokens},
        "adapters": adapters,
    }
    datas = {}  # the default, and the trainer's LoRA products in bf16 (`model.lora_autocast`), stepped in turn
    for key, autocast in (("median", False), ("lora_autocast", True)):
        datas[key] = {
            **data,
            "run_dir": str(workdir / f"grpo_{key}"),
            "model": {**data["model"], "lora_autocast": autocast},
        }
    runs = {}
    for key, got in _run_interleaved(datas, 1 + sizes.grpo_steps, device).items():
        timed = got["timings"][1:]  # the first step pays lazy inits and kernel autotuning
        phases = sorted({k for t in timed for k in t if k.endswith("_s")})
        out = {k: statistics.median(t.get(k, 0.0) for t in timed) for k in phases}
        out["tokens_per_s"] = statistics.median(t["tokens"] / t["step_s"] for t in timed)
        cuda = device.startswith("cuda")  # what it holds plus its largest step's rise: its peak, were it alone
        out["peak_mem_gib"] = got["resident_gib"] + got["step_rise_gib"] if cuda else None
        runs[key] = out
    ok = all(r["tokens_per_s"] > 0 for r in runs.values())
    return {"ok": ok, "shape": shape.name, "timed_steps": len(timed), "interleaved": True, **runs}


# The default sections in the order they run: the oracles first (cheap, and what a GPU session must not miss), then
# the GPU tests, the GRPO runs, then the benches. Each has a cap in seconds at the GPU sizes (about 2x its time on an
# H100); a section runs in a process of its own, killed at min(cap, the budget left), so a hang, an out-of-memory or
# a sticky CUDA error costs that section only.
SECTIONS: dict[str, tuple[Callable[[str, Sizes, Path], dict], int]] = {
    "peft_parity_bf16": (peft_parity_bf16, 60),
    "grouped_vs_loop": (grouped_vs_loop, 60),
    "engine_greedy_vs_peft": (engine_greedy_vs_peft, 60),
    "gpu_tests": (gpu_tests, 150),
    "grpo_tiny": (grpo_tiny, 90),
    "grpo_smollm2_shape": (grpo_smollm2_shape, 200),
    "lora_overhead": (lora_overhead, 90),
    "decode_64_vs_1": (decode_64_vs_1, 150),
}
# Run with `--extras` (or named in `--only`): what earlier GPU runs settled (docs/benchmarks.md, runs 6-16).
EXTRAS: dict[str, tuple[Callable[[str, Sizes, Path], dict], int]] = {
    "cpu_oracle_tests": (cpu_oracle_tests, 90),
    "lora_overhead_profile": (lora_overhead_profile, 200),
}
MIN_SECTION_S = 20  # a section is not started with less budget left than this


def run_section(name: str, fn, device: str, sizes: Sizes, workdir: Path) -> dict:
    """One section in this process (the child `--section` runs): its entry, a failure included."""
    start = time.perf_counter()
    (workdir / name).mkdir(parents=True, exist_ok=True)
    try:
        result = fn(device, sizes, workdir / name)
        ok = bool(result.pop("ok"))
        status = "ok" if ok else ("skipped" if "skipped" in result else "failed")
        entry = {"ok": ok, "status": status, "result": result}
    except Exception as exc:  # noqa: BLE001 - a failed section is a result; the next one still runs
        entry = {"ok": False, "status": "failed", "error": f"{type(exc).__name__}: {exc}",
                 "where": traceback.format_exc(limit=-1)}  # fmt: skip
    entry["seconds"] = round(time.perf_counter() - start, 2)
    return entry


def spawn_section(name: str, timeout_s: float, args: argparse.Namespace, workdir: Path, out: Path) -> dict:
    """Run section `name` in a child process cut at `timeout_s`; its entry (a timeout or a crash is one too). The
    child's output goes to OUT/logs/NAME.log, which a killed section leaves for reading."""
    result = workdir / f"{name}.json"
    log = out / "logs" / f"{name}.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, str(Path(__file__).resolve()), "--section", name, "--device", args.device,
           "--workdir", str(workdir), "--result", str(result)]  # fmt: skip
    cmd += ["--small"] * args.small + ["--extras"] * args.extras + (["--shapes", *args.shapes] if args.shapes else [])
    start = time.perf_counter()
    with open(log, "w") as fh:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the section and anything it started (pytest's workers)
            proc.wait()
            code = None
    seconds = round(time.perf_counter() - start, 2)
    tail = log.read_text(errors="replace").strip().splitlines()[-5:]
    if code is None:
        return {"ok": False, "status": "timed out", "error": f"killed at {timeout_s:.0f} s", "log_tail": tail,
                "seconds": seconds}  # fmt: skip
    if code != 0 or not result.exists():
        return {"ok": False, "status": "failed", "error": f"exit code {code}", "log_tail": tail, "seconds": seconds}
    entry = json.loads(result.read_text())
    entry["seconds"] = seconds  # with the child's start (imports, CUDA context): what the lease paid
    return entry


def markdown(report: dict) -> str:
    lines = [f"# GPU check ({report['device_name']}, {report['date']})", "", "| section | status | s | result |",
             "|---|---|---|---|"]  # fmt: skip
    for name, e in report["sections"].items():
        detail = json.dumps(e.get("result", e.get("error")), default=str)
        status = e.get("status", "ok" if e["ok"] else "failed")
        lines.append(f"| {name} | {status if e['ok'] else f'**{status}**'} | {e['seconds']} | `{detail}` |")
    return "\n".join(lines) + "\n"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda", help="cuda (the check) or cpu (the smoke run)")
    p.add_argument("--small", action="store_true", help="tiny sizes: every section in well under a minute on CPU")
    p.add_argument("--out", default="gpu_check", help="folder for gpu_check.json, gpu_check.md and logs/")
    p.add_argument("--only", nargs="*", choices=[*SECTIONS, *EXTRAS], help="run these sections only (extras too)")
    p.add_argument(
        "--extras",
        action="store_true",
        help=f"also {', '.join(EXTRAS)} and decode with the fused kernel off (settled by earlier runs)",
    )
    p.add_argument(
        "--budget-s",
        type=float,
        default=540,
        help="the whole check's seconds: each section is killed at min(its cap, the budget left), and none "
        f"starts with under {MIN_SECTION_S} s left (recorded as skipped); default 540, for a 600 s call",
    )
    p.add_argument(
        "--shapes",
        nargs="*",
        choices=[s.name for s in (*FULL.bench_shapes, TINY)],
        help="the two benches at these shapes only (default: all of the sizes' shapes)",
    )
    p.add_argument("--min-section-s", type=float, default=MIN_SECTION_S, help=argparse.SUPPRESS)  # tests: smaller
    p.add_argument("--section", help=argparse.SUPPRESS)  # the child: run this one section, write --result
    p.add_argument("--workdir", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()  # fmt: skip
    logging.basicConfig(level=logging.WARNING)
    sizes = SMALL if args.small else FULL
    sizes = replace(sizes, torch_ops=args.extras)
    if args.shapes:
        sizes = replace(sizes, bench_shapes=tuple(s for s in sizes.bench_shapes if s.name in args.shapes))
    every = {**SECTIONS, **EXTRAS}
    if args.section:
        entry = run_section(args.section, every[args.section][0], args.device, sizes, Path(args.workdir))
        Path(args.result).write_text(json.dumps(entry, indent=1, default=str))
        return
    cuda = args.device.startswith("cuda")
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": args.device,
        "device_name": torch.cuda.get_device_name()
        if cuda and torch.cuda.is_available()
        else platform.processor() or platform.machine(),
        "small": args.small,
        "torch": torch.__version__,
        "sizes": asdict(sizes),
        "budget_s": args.budget_s,
        "sections": {},
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    names = args.only if args.only else [*SECTIONS, *(EXTRAS if args.extras else ())]
    start = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            left = args.budget_s - (time.perf_counter() - start)
            if left < args.min_section_s:  # what ran is kept; the lease is not overrun
                entry = {"ok": False, "status": "skipped", "error": f"{left:.0f} s of --budget-s={args.budget_s:g} left",
                         "seconds": 0.0}  # fmt: skip
            else:
                timeout = left if args.small else min(every[name][1], left)
                print(f"running {name} (at most {timeout:.0f} s)", flush=True)
                entry = spawn_section(name, timeout, args, Path(tmp), out)
            report["sections"][name] = entry
            print(f"{name:<22} {entry['status']:<9} {entry['seconds']:>7.1f}s", flush=True)
            (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))  # partial results survive
            (out / "gpu_check.md").write_text(markdown(report))
    print(f"wrote {out / 'gpu_check.json'} and {out / 'gpu_check.md'}")


if __name__ == "__main__":
    main()
