"""The LoRA layer's decode and training paths at SmolLM2-135M's shape, this checkout against an earlier revision.

Usage: `python bench/bench_lora_paths.py [--before REV] [--runs 5] [--threads 1] [--rows 16] [--seq-len 64]
[--decode-rows 64] [--skip-train] [--skip-decode] [--prefill] [--peft] [--saved]`

One process, one model with random weights of SmolLM2-135M's config (hidden 576, 30 layers, GQA 9/3, vocab 49152,
tied head; nothing is downloaded), 64 adapters of rank 8 (alpha 16) on every Linear with non-zero B. "before" is
`LoRALinear`'s methods of revision `--before` (read with `git show`, its module's own helpers with it) swapped in for
the measurement, with the engine bank's tensors in that revision's layout; "after" is this checkout.

- Decode: one decode step of `decode-rows` rows through an engine bank and a KV cache of 32 prompt tokens (what the
  embedded engine's `_forward` calls per step; the cache is cropped back after each step), all rows on the base,
  all on one adapter, or spread over 64 adapters (row i on adapter i % 64). Tokens/s = rows / step time.
- Prefill (`--prefill`): one no-grad forward of 24 rows x 40 tokens through the engine bank, all rows on the base or
  on 3 adapters mixed (row i on adapter i % 3), the last position's logits only (the embedded engine's prefill of a
  step's prompts on several tenants).
- Training: one forward+backward of `rows` x `seq-len` tokens (`inputs_embeds` requiring grad, so the base floor
  pays the same activation backward), with per-slot gradients kept in a `SlotGradSink` as the trainer keeps them
  (`MultiLoRAModel.use_slot_grads`, `rl_multilora/train_ops.py`): base, one adapter, 64 adapters round-robin;
  with `--peft`, PEFT's one adapter on its own copy of the base too.
- Saved bytes (`--saved`): what the decoder keeps for its backward over a bf16 base with float32 slots (PEFT's
  default dtypes), the one-node training path against the unfused one, one slot and two (`bench_saved`).

Variants run round-robin within each run (drifting load hits them alike). Each run records wall time and this
thread's CPU time (`time.thread_time`): on a shared, oversubscribed machine the wall time includes the time the
thread waited for a core, the CPU time does not. Medians with min-max over runs; ratios are medians of per-run
ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import subprocess
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's packages when run as a script

from bench.bench_smollm2 import lora_flop_share  # noqa: E402  (the same RANK, 8)
from rl_multilora.lora import LoRALinear, MultiLoRAModel  # noqa: E402
from rl_multilora.lora.bank import LoRABank  # noqa: E402

RANK = 8
N_MANY = 64
PROMPT = 32


def smollm2_config() -> LlamaConfig:
    """SmolLM2-135M's config.json numbers (artifacts/smollm2-135m/model)."""
    return LlamaConfig(
        vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
        num_key_value_heads=3, head_dim=64, max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
        rope_theta=100000.0,
    )  # fmt: skip


def build() -> MultiLoRAModel:
    torch.manual_seed(0)
    m = MultiLoRAModel.from_model(AutoModelForCausalLM.from_config(smollm2_config()).float(), N_MANY, RANK)
    for i in range(N_MANY):
        m.add_adapter(f"a{i}", rank=RANK, alpha=2 * RANK, seed=i)
        with torch.no_grad():  # non-zero B so every adapter does real work
            for p in m.adapter_parameters(f"a{i}")[1::2]:
                p.normal_(0, 0.01)
    return m


def load_revision_layer(rev: str) -> types.ModuleType:
    """`rl_multilora/lora/layer.py` as it was at `rev`, as a module of its own."""
    source = subprocess.run(
        ["git", "show", f"{rev}:rl_multilora/lora/layer.py"], cwd=ROOT, capture_output=True, text=True, check=True
    ).stdout
    module = types.ModuleType(f"layer_at_{rev}")
    exec(compile(source, f"{rev}:rl_multilora/lora/layer.py", "exec"), module.__dict__)
    return module


def contiguous_bank(bank: LoRABank) -> LoRABank:
    """The same slots in the layout CPU banks had before they were stored rank-minor: (S, R, in), (S, out, R)."""
    old = LoRABank(bank.layer_shapes, bank.max_loras, bank.max_rank, bank.dtype, bank.device)
    old._a = {k: v.contiguous() for k, v in bank._a.items()}
    old._b = {k: v.contiguous() for k, v in bank._b.items()}
    old._rank, old._alpha, old._modules = list(bank._rank), list(bank._alpha), list(bank._modules)
    return old


@contextlib.contextmanager
def layer_code(cls: type | None) -> Iterator[None]:
    """Swap `LoRALinear`'s methods (`forward`, `_linear_lora`, ...) for those of `cls`, a revision's `LoRALinear`, for
    the duration (None: this checkout's). Each swapped method runs its own revision's helpers (its module's globals).
    """
    if cls is None:
        yield
        return
    names = [k for k, v in vars(cls).items() if callable(v) and not k.startswith("__")]
    current = {k: vars(LoRALinear).get(k) for k in names}
    for k in names:
        setattr(LoRALinear, k, vars(cls)[k])
    try:
        yield
    finally:
        for k, v in current.items():
            if v is None:
                delattr(LoRALinear, k)
            else:
                setattr(LoRALinear, k, v)


def time_interleaved(fns: dict[str, Callable[[], object]], warmup: int, runs: int) -> dict[str, dict[str, list]]:
    """Wall and thread-CPU seconds of every fn per run, round-robin; each run starts one variant later than the one
    before (a fixed order gave the later variants a few percent more: the same code measured 1-4 % slower in the
    "after" rows than in the "before" rows)."""
    times = {key: {"wall": [], "cpu": []} for key in fns}
    keys = list(fns)
    for i in range(warmup + runs):
        for key in keys[i % len(keys) :] + keys[: i % len(keys)]:
            fn = fns[key]
            wall, cpu = time.perf_counter(), time.thread_time()
            fn()
            cpu, wall = time.thread_time() - cpu, time.perf_counter() - wall
            if i >= warmup:
                times[key]["wall"].append(wall)
                times[key]["cpu"].append(cpu)
    return times


def spread(values: list[float], fmt: str) -> str:
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def ratios(num: list[float], den: list[float]) -> list[float]:
    return [a / b for a, b in zip(num, den, strict=True)]


def print_table(title: str, times: dict, refs: list[str], unit: Callable[[float], float], fmt: str, label: str):
    """One row per variant: its value (wall and CPU) and its per-run ratio over each variant in `refs` (by CPU time,
    then wall); `unit` turns seconds into the value shown (for decode, tokens/s, where a ratio is inverted)."""
    print(f"\n{title}")
    head = " | ".join(f"vs {r} (cpu; wall)" for r in refs)
    print(f"| variant | {label} cpu | {label} wall | {head} |")
    print("|---|---|---|" + "---|" * len(refs))
    for key, t in times.items():
        cells = [spread([unit(s) for s in t["cpu"]], fmt), spread([unit(s) for s in t["wall"]], fmt)]
        for ref in refs:
            invert = unit(2.0) < unit(1.0)  # a throughput: the ratio is ref time over this time
            per = {c: ratios(times[ref][c], t[c]) if invert else ratios(t[c], times[ref][c]) for c in ("cpu", "wall")}
            cells.append(f"{spread(per['cpu'], '{:.3f}')}; {spread(per['wall'], '{:.3f}')}")
        print(f"| {key} | " + " | ".join(cells) + " |", flush=True)


def _bank_of(before: types.ModuleType, bank: LoRABank) -> LoRABank:
    """The engine bank in the layout `before`'s revision stored it: rank-minor from `bag_layout` on (this one's),
    the model's own layout before that."""
    return bank if getattr(before, "bag_layout", None) is not None else contiguous_bank(bank)


def bench_decode(m: MultiLoRAModel, before: types.ModuleType, rows: int, warmup: int, runs: int) -> None:
    m.eval()
    bank = m.new_bank()
    banks = {"after": bank, "before": _bank_of(before, bank)}
    config = m.base_model.config
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, config.vocab_size, (rows, PROMPT), generator=g)
    token = torch.randint(0, config.vocab_size, (rows, 1), generator=g)
    mask = torch.ones(rows, PROMPT + 1, dtype=torch.long)
    position = torch.full((rows, 1), PROMPT)
    variants = {
        "base": torch.full((rows,), -1),
        "1 adapter": torch.zeros(rows, dtype=torch.long),
        f"{N_MANY} mixed": torch.arange(rows) % N_MANY,
    }
    fns: dict[str, Callable[[], object]] = {}
    for code in ("before", "after"):
        layer = before.LoRALinear if code == "before" else None
        for name, slots in variants.items():
            if name == "base" and code == "before":
                continue  # no LoRA compute: the same code either way
            cache = DynamicCache(config=config)
            with torch.no_grad(), layer_code(layer):
                m(prompt, attention_mask=mask[:, :PROMPT], adapter_slots=slots, lora_bank=banks[code],
                  past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip

            def step(slots=slots, cache=cache, bank=banks[code], layer=layer):
                with torch.no_grad(), layer_code(layer):
                    m(token, attention_mask=mask, position_ids=position, adapter_slots=slots, lora_bank=bank,
                      past_key_values=cache, use_cache=True, logits_to_keep=1)  # fmt: skip
                cache.crop(-1)

            fns[name if name == "base" else f"{name}, {code}"] = step
    fns = {"base": fns.pop("base"), **fns}  # the base row first
    times = time_interleaved(fns, warmup, runs)
    print_table(
        f"decode step: {rows} rows, KV cache of {PROMPT} tokens, bank of {N_MANY} adapters, rank {RANK}, {runs} runs",
        times, ["base", "1 adapter, after"], lambda s: rows / s, "{:.0f}", "tokens/s",
    )  # fmt: skip
    for code in ("before", "after"):
        one, mixed = times[f"1 adapter, {code}"], times[f"{N_MANY} mixed, {code}"]
        print(
            f"{code}: {N_MANY} mixed / 1 adapter tokens/s (cpu): {spread(ratios(one['cpu'], mixed['cpu']), '{:.3f}')}"
        )


def peft_step(embeds: torch.Tensor) -> Callable[[], None]:
    """PEFT's one-adapter forward+backward on its own copy of the same base (the same seed, float32) and inputs:
    rank 8 on every Linear, B non-zero, the same loss."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        AutoModelForCausalLM.from_config(smollm2_config()).float(),
        LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules="all-linear"),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.01)

    def step():
        model.zero_grad(set_to_none=True)
        x = embeds.detach().requires_grad_()
        model(inputs_embeds=x).logits.float().mean().backward()

    return step


def bench_prefill(m: MultiLoRAModel, before: types.ModuleType, warmup: int, runs: int) -> None:
    m.eval()
    bank = m.new_bank()
    banks = {"after": bank, "before": _bank_of(before, bank)}
    rows, length = 24, 40
    ids = torch.randint(0, m.base_model.config.vocab_size, (rows, length), generator=torch.Generator().manual_seed(2))

    def step(slots, code):
        with torch.no_grad(), layer_code(before.LoRALinear if code == "before" else None):
            m(ids, adapter_slots=slots, lora_bank=banks[code], logits_to_keep=1)

    mixed = torch.arange(rows) % 3
    fns: dict[str, Callable[[], object]] = {"base": lambda: step(torch.full((rows,), -1), "after")}
    for code in ("before", "after"):
        fns[f"3 mixed, {code}"] = lambda code=code: step(mixed, code)
    times = time_interleaved(fns, warmup, runs)
    print_table(
        f"prefill: {rows} rows x {length} tokens, no grad, bank of {N_MANY} adapters, rank {RANK}, {runs} runs",
        times, ["base"], lambda s: s, "{:.2f}", "seconds",
    )  # fmt: skip


def bench_train(
    m: MultiLoRAModel, before: types.ModuleType, rows: int, seq_len: int, warmup: int, runs: int, peft: bool = False
) -> None:
    m.train()
    m.use_slot_grads()
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, m.base_model.config.vocab_size, (rows, seq_len), generator=g)
    embeds = m.base_model.get_input_embeddings()(ids).detach()

    def step(names, layer):
        m.zero_lora_grads()
        x = embeds.detach().requires_grad_()
        with layer_code(layer):
            m(inputs_embeds=x, adapter_names=names).logits.float().mean().backward()

    variants = {"1 adapter": ["a0"] * rows, f"{N_MANY} mixed": [f"a{i % N_MANY}" for i in range(rows)]}
    fns: dict[str, Callable[[], object]] = {"base": lambda: step([None] * rows, None)}
    for code in ("before", "after"):
        layer = before.LoRALinear if code == "before" else None
        for name, names in variants.items():
            fns[f"{name}, {code}"] = lambda names=names, layer=layer: step(names, layer)
    if peft:
        fns["1 adapter, PEFT"] = peft_step(embeds)
    times = time_interleaved(fns, warmup, runs)
    share = lora_flop_share(m)
    print_table(
        f"training forward+backward: {rows} rows x {seq_len} tokens, rank {RANK} on every Linear, slot-gradient sink, "
        f"{runs} runs; LoRA FLOP share of the pass {share:.1%}",
        times, ["base"] + (["1 adapter, PEFT"] if peft else []), lambda s: s, "{:.2f}", "seconds",
    )  # fmt: skip


def bench_saved(rows: int, seq_len: int) -> None:
    """Bytes the decoder keeps for its backward with PEFT's default dtypes (bf16 base, float32 slots), parameters left
    out and each storage counted once (`torch.autograd.graph.saved_tensors_hooks`): the one-node path
    (`_LinearLoRA` with a float32 compute dtype) against the unfused one (casts, base Linear and `_GroupedLoRA` as
    separate nodes, what `LoRALinear.forward` runs when `_linear_lora` declines). Deterministic: one forward each."""
    m = build()
    m.base_model.to(torch.bfloat16)
    for layer in m.base_model.modules():
        if isinstance(layer, LoRALinear):  # the slots back to float32, as PEFT's autocast_adapter_dtype keeps them
            layer.lora_A.data, layer.lora_B.data = layer.lora_A.data.float(), layer.lora_B.data.float()
    ids = torch.randint(0, m.base_model.config.vocab_size, (rows, seq_len), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        embeds = m.base_model.get_input_embeddings()(ids)
    params = {p.untyped_storage().data_ptr() for p in m.parameters()}

    def saved_mib(names) -> float:
        held: dict[int, int] = {}

        def pack(t):
            if isinstance(t, torch.Tensor) and (ptr := t.untyped_storage().data_ptr()) not in params:
                held[ptr] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            m(inputs_embeds=embeds.detach().requires_grad_(), adapter_names=names, decoder_only=True)
        return sum(held.values()) / 2**20

    fused = LoRALinear._linear_lora
    print(f"\nsaved for backward by the decoder, bf16 base + float32 slots, {rows} rows x {seq_len} tokens (MiB)")
    print("| batch | unfused | one node | ratio |\n|---|---|---|---|")
    for label, names in (("one slot", ["a0"] * rows), ("two slots", ["a0", "a1"] * (rows // 2))):
        LoRALinear._linear_lora = lambda self, x, routing: None
        try:
            unfused = saved_mib(names)
        finally:
            LoRALinear._linear_lora = fused
        one = saved_mib(names)
        print(f"| {label} | {unfused:.1f} | {one:.1f} | {one / unfused:.2f}x |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default="95e18e8", help="the revision whose LoRALinear methods are 'before'")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--rows", type=int, default=16)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--decode-rows", type=int, default=64)
    p.add_argument("--skip-train", action="store_true")
    p.add_argument("--skip-decode", action="store_true")
    p.add_argument("--prefill", action="store_true", help="also a no-grad prefill through the bank (bench_prefill)")
    p.add_argument("--peft", action="store_true", help="training: also PEFT's one adapter on a copy of the base")
    p.add_argument("--saved", action="store_true", help="also bytes saved for backward, bf16 base (bench_saved)")
    args = p.parse_args()
    torch.set_num_threads(args.threads)
    before = load_revision_layer(args.before)
    print(
        f"SmolLM2-135M shape, random weights; torch {torch.__version__}; {args.threads} thread(s); "
        f"before={args.before}"
    )
    m = build()
    if not args.skip_decode:
        bench_decode(m, before, args.decode_rows, warmup=1, runs=args.runs)
    if args.prefill:
        bench_prefill(m, before, warmup=1, runs=args.runs)
    if not args.skip_train:
        bench_train(m, before, args.rows, args.seq_len, warmup=1, runs=args.runs, peft=args.peft)
    if args.saved:
        del m
        bench_saved(8, args.seq_len)


if __name__ == "__main__":
    main()
