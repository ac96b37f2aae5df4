"""The tiny preset's settings, importable without torch (the CLI parses and validates before building anything)."""

from __future__ import annotations

import random
from dataclasses import dataclass, fields

# pad, bos, eos (end of turn), then one token per chat role; ids 0..5 in this order.
SPECIAL_TOKENS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>")


def named_rng(seed: int, purpose: str) -> random.Random:
    """An independent, reproducible stream per purpose, so adding draws in one place does not shift the others."""
    return random.Random(f"{seed}:{purpose}")


@dataclass(frozen=True)
class TinyPresetConfig:
    """Knobs of the tiny preset. The defaults take ~2.5 CPU-minutes (one thread) and give base rewards of ~0.25."""

    hidden_size: int = 128  # model width
    num_layers: int = 4  # decoder layers
    num_heads: int = 4  # attention heads
    num_kv_heads: int = 2  # key/value heads (grouped-query attention)
    intermediate_size: int = 384  # MLP width
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
            floor = 0 if f.name in ("pretrain_steps", "warmup_steps", "eval_prompts") else 1
            if f.type == "int" and (not isinstance(value, int) or value < floor):
                problems.append(f"{f.name}={value!r} must be an integer >= {floor}")
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
