"""The tiny presets' settings, importable without torch (the CLI parses and validates before building anything).

`tiny` and `tiny-moe` are one recipe with two architectures: `TinyPresetConfig.family` picks the model class and the
expert fields size the mixture of experts; everything else (tokenizer, data, pretraining, folding, evaluation) is
shared. `PRESETS` maps each offline preset name to its default config.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass, fields

# pad, bos, eos (end of turn), then one token per chat role; ids 0..5 in this order.
SPECIAL_TOKENS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")


FAMILIES: tuple[str, ...] = ("llama", "qwen3_moe")
MOE_FIELDS: tuple[str, ...] = ("num_experts", "top_k", "moe_intermediate_size")


def named_rng(seed: int, purpose: str) -> random.Random:
    """An independent, reproducible stream per purpose, so adding draws in one place does not shift the others."""
    return random.Random(f"{seed}:{purpose}")


@dataclass(frozen=True)
class TinyPresetConfig:
    """Knobs of the tiny presets. The defaults (`tiny`) take ~2.5 CPU-minutes (one thread), base rewards ~0.25."""

    hidden_size: int = 128  # model width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 384  # dense MLP width (llama; unused by qwen3_moe, whose every layer is sparse)
    family: str = "llama"  # architecture: "llama" (dense) or "qwen3_moe" (every MLP a routed mixture of experts)
    num_experts: int = 0  # qwen3_moe: experts per layer (0 for llama)
    top_k: int = 0  # qwen3_moe: experts each token is routed to, weights renormalized over them (0 for llama)
    moe_intermediate_size: int = 0  # qwen3_moe: MLP width of each expert (0 for llama)
    vocab_size: int = 1024  # BPE vocabulary cap: 6 special + 256 byte tokens + merges (stops ~520: corpus exhausted)
    max_positions: int = 256  # model context; prompts + responses stay under ~100 tokens
    n_train: int = 2000  # rows per task in data/<task>/train.jsonl
    n_test: int = 200  # rows per task in data/<task>/test.jsonl (held out of pretraining)
    right_format_rate: float = 0.45  # share of pretraining responses in the task's answer format
    fold_temperature: float = 0.5  # saved model samples at T=1 like the trained one at this T (sharper digits)
    pretrain_steps: int = 1200  # AdamW steps; tests pass a handful
    batch_size: int = 16  # examples per step, tasks mixed (small batches, more steps: faster to learn per example)
    lr: float = 3e-3  # peak learning rate (tiny models take a high one; 1e-2 was worse, 5e-3 no better)
    warmup_steps: int = 20  # linear warmup, then cosine decay to 2 % of `lr`
    eval_prompts: int = 96  # test prompts sampled per task for the base stats (0 = skip)
    eval_max_new_tokens: int = 48  # generation cap for the base stats

    def __post_init__(self) -> None:
        problems = []
        for f in fields(self):
            value = getattr(self, f.name)
            floor = 0 if f.name in ("pretrain_steps", "warmup_steps", "eval_prompts", *MOE_FIELDS) else 1
            if f.type == "int" and (not isinstance(value, int) or value < floor):
                problems.append(f"{f.name}={value!r} must be an integer >= {floor}")
        if self.family not in FAMILIES:
            problems.append(f"family={self.family!r} must be one of {', '.join(map(repr, FAMILIES))}")
        elif self.family == "llama":
            for name in MOE_FIELDS:
                if getattr(self, name) != 0:
                    problems.append(f"{name}={getattr(self, name)!r} needs family='qwen3_moe' (must be 0 for llama)")
        else:
            if self.num_experts < 2:
                problems.append(f"num_experts={self.num_experts!r} must be >= 2 for qwen3_moe")
            if self.moe_intermediate_size < 1:
                problems.append(f"moe_intermediate_size={self.moe_intermediate_size!r} must be >= 1 for qwen3_moe")
            if not 1 <= self.top_k <= self.num_experts:
                problems.append(f"top_k={self.top_k!r} must be in [1, num_experts={self.num_experts}] for qwen3_moe")
        if not 0.0 <= self.right_format_rate <= 1.0:
            problems.append(f"right_format_rate={self.right_format_rate!r} must be in [0, 1]")
        if not 0.0 < self.fold_temperature <= 1.0:
            problems.append(f"fold_temperature={self.fold_temperature!r} must be in (0, 1]")
        if not self.lr > 0:
            problems.append(f"lr={self.lr!r} must be > 0")
        if self.num_heads and self.hidden_size % max(self.num_heads, 1):
            problems.append(f"hidden_size={self.hidden_size} must be a multiple of num_heads={self.num_heads}")
        if self.num_kv_heads and self.num_heads % max(self.num_kv_heads, 1):
            problems.append(f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}")
        if self.vocab_size < 256 + len(SPECIAL_TOKENS):
            problems.append(f"vocab_size={self.vocab_size} must be >= {256 + len(SPECIAL_TOKENS)} (bytes + specials)")
        if problems:
            raise ValueError("invalid TinyPresetConfig: " + "; ".join(problems))

    def settings(self) -> dict:
        """The recipe's settings as PROVISIONED.json records and compares them: every field, except that a dense
        (llama) config leaves out the MoE fields, so a `tiny` directory provisioned before they existed still matches
        its recipe (and its record reads as it did)."""
        settings = asdict(self)
        if self.family == "llama":
            for name in ("family", *MOE_FIELDS):
                del settings[name]
        return settings


# The offline presets by name: `tiny` is the dense Llama base; `tiny-moe` the same recipe on a Qwen3-MoE base with 4
# experts of width 144 per layer, top-2. Widths 96-192 all pretrain in ~0.11-0.15 s/step; their base stats differ
# more by chance than by trend (compare reward 0.12-0.36 at seed 0), and 144 gave all three tasks a reward in
# 0.3-0.4 with the format at ~40 %, and expert weights of three distinct sizes (E=4, 2I=288, H=128, I=144), so a
# transposed layout fails loudly.
PRESETS: dict[str, TinyPresetConfig] = {
    "tiny": TinyPresetConfig(),
    "tiny-moe": TinyPresetConfig(family="qwen3_moe", num_experts=4, top_k=2, moe_intermediate_size=144),
}
