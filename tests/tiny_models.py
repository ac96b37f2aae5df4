"""Tiny random causal LMs (Qwen2, Qwen3, Llama, Qwen3-MoE) built offline, for tests and benchmarks.

Nothing is downloaded: each model is built from its config class with a fixed seed, so two calls with
the same arguments give bit-identical weights (tests rely on this to build an oracle copy of a base).
`save_tiny_model` also writes a character-level tokenizer (printable ASCII, newline, tab and three
specials) whose ids fit in the default vocabulary, so the folder loads with `AutoTokenizer` and
`AutoModelForCausalLM` like a real checkpoint.
"""

from __future__ import annotations

import functools
import json
import string
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel, Qwen2Config, Qwen3Config, Qwen3MoeConfig

from rollout.engines.base import RolloutEngine
from rollout.types import GenerateResult

FAMILIES = ("qwen2", "qwen3", "llama")  # the dense families tests run over; "qwen3_moe" is asked for by name
# The packed expert Parameters of the qwen3_moe family, as PEFT's target_parameters name them.
MOE_EXPERTS = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
SPECIAL_TOKENS = ("<pad>", "<eos>", "<unk>")
PAD_ID, EOS_ID, UNK_ID = 0, 1, 2
# A role-tagged template made of plain characters, so prompts built with apply_chat_template stay in the vocab.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_config(family: str = "qwen2", hidden: int = 32, layers: int = 2, vocab: int = 128, heads: int = 4):
    """Config of a tiny `family` model: `heads` query heads, half as many KV heads (exercises GQA)."""
    if family not in (*FAMILIES, "qwen3_moe"):
        raise ValueError(f"family={family!r} is not supported; allowed: {', '.join(FAMILIES)}, qwen3_moe")
    if hidden % heads:
        raise ValueError(f"hidden={hidden} must be a multiple of heads={heads}")
    common = dict(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=max(1, heads // 2),
        max_position_embeddings=256,
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
        eos_token_id=EOS_ID,
        bos_token_id=None,
    )
    if family == "qwen2":
        return Qwen2Config(**common)
    if family == "qwen3":
        return Qwen3Config(head_dim=hidden // heads, **common)
    if family == "qwen3_moe":  # 4 experts of width hidden / 2, top-2, every layer sparse
        moe = dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=hidden // 2, norm_topk_prob=True)
        return Qwen3MoeConfig(head_dim=hidden // heads, **moe, **common)
    return LlamaConfig(head_dim=hidden // heads, **common)


def tiny_model(
    family: str = "qwen2", seed: int = 0, hidden: int = 32, layers: int = 2, vocab: int = 128, heads: int = 4
) -> PreTrainedModel:
    """A float32 random `family` causal LM in eval mode; the same arguments give the same weights."""
    config = tiny_config(family, hidden=hidden, layers=layers, vocab=vocab, heads=heads)
    # Seed a private RNG state: the caller's global RNG stream is left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).float()
    return model.eval()


def tiny_tokenizer():
    """Character-level fast tokenizer: one token per character, ids below 100, decode joins characters."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    chars = list(string.printable[:95]) + ["\n", "\t"]  # printable ASCII letters, digits, punctuation, space
    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS)}
    vocab.update({c: len(SPECIAL_TOKENS) + i for i, c in enumerate(chars)})
    # BPE without merges and without a pre-tokenizer splits text into single characters.
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def save_tiny_model(
    dir: str | Path, family: str = "qwen2", seed: int = 0, hidden: int = 32, layers: int = 2, vocab: int = 128
) -> Path:
    """Save a tiny model and its character tokenizer under `dir`; returns the folder path."""
    if vocab < 100:
        raise ValueError(f"vocab={vocab} is too small for the character tokenizer; allowed: >= 100")
    path = Path(dir)
    path.mkdir(parents=True, exist_ok=True)
    model = tiny_model(family, seed=seed, hidden=hidden, layers=layers, vocab=vocab)
    model.generation_config.pad_token_id = PAD_ID
    model.generation_config.eos_token_id = EOS_ID
    model.save_pretrained(path)
    tiny_tokenizer().save_pretrained(path)
    return path


def write_sum_task(path: str | Path, n: int, offset: int) -> Path:
    """A tiny JSONL dataset of sums ({"q": "3+1=", "a": "4"}) for end-to-end loop tests; returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w") as f:
        for i in range(n):
            a, b = i % 7 + offset, i % 5
            f.write(json.dumps({"q": f"{a}+{b}=", "a": str(a + b)}) + "\n")
    return path


def sum_task_adapter(data_dir: str | Path, name: str, seed: int, **over) -> dict:
    """A run-config adapter entry on `data_dir/<name>.jsonl` (see `write_sum_task`): rank 4, alpha 8, lr 1e-2,
    2 prompts per step and a reward for any digit (random text has one about half the time, so groups rarely
    come out uniform). Keyword arguments override or add fields."""
    return {
        "name": name,
        "rank": 4,
        "alpha": 8,
        "dataset": {
            "path": "json",
            "data_files": str(Path(data_dir) / f"{name}.jsonl"),
            "prompt_key": "q",
            "label_key": "a",
        },
        "reward": {"name": "format", "kwargs": {"pattern": "[0-9]"}},
        "lr": 1e-2,
        "prompts_per_step": 2,
        "seed": seed,
        **over,
    }


class ScriptedEngine(RolloutEngine):
    """An engine that answers each request with the next scripted text (then EOS), log-prob -0.5 per token, and keeps
    the requests it got: environment tests drive a whole episode with known model turns."""

    def __init__(self, tok, texts: list[str]):
        self.tok, self.texts, self.requests = tok, list(texts), []

    def generate(self, requests):
        out = []
        for r in requests:
            self.requests.append(r)
            ids = self.tok(self.texts.pop(0), add_special_tokens=False)["input_ids"] + [EOS_ID]
            out.append(GenerateResult(output_ids=ids, output_logprobs=[-0.5] * len(ids), weight_version=1))
        return out

    def load_adapter(self, name, tensors, config, version=None):
        return 1

    def unload_adapter(self, name): ...
    def pause(self): ...
    def resume(self): ...
    def health(self):
        return True


@functools.cache
def gemm_rows_independent() -> bool:
    """Whether this machine's matrix products give a row the same bits however many rows share the product. The
    tests that compare a tenant alone with the same rows in a mixed batch, or a paged run with an unpaged one, to the
    bit rely on it. On Intel CPUs (MKL, AVX512/AMX) it held; on an AMD EPYC (2026-11-28, the same torch 2.13.0+cpu
    wheel) MKL gives products of 1-3, 5-7 and 9-11 rows a kernel of their own, whose sums round differently, so a
    per-row product of a 7-token row differs in the last bits from the same row inside a larger product. There the
    tests hold the numbers to float rounding instead (`assert_same_bits`)."""
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        for k, n in ((32, 32), (32, 64), (64, 32), (8, 32), (32, 8)):
            w = torch.randn(n, k, generator=g).to(dtype)
            x = torch.randn(64, k, generator=g).to(dtype)
            whole = x @ w.T
            for m in range(1, 17):
                if not torch.equal(x[:m] @ w.T, whole[:m]) or not torch.equal(
                    torch.bmm(x[None, :m], w.T[None]), whole[None, :m]
                ):
                    return False
    return True


def assert_same_bits(got: torch.Tensor, want: torch.Tensor, ulps: int = 64) -> None:
    """`got` equals `want` bit for bit where `gemm_rows_independent()`; elsewhere within `ulps` units of float
    rounding at `want`'s scale (a fault that moves a number further, a row from another tenant say, still fails)."""
    got, want = got.detach(), want.detach()
    if gemm_rows_independent():
        assert torch.equal(got, want), f"not bit-identical: max diff {float((got - want).abs().max()):.3e}"
        return
    eps = torch.finfo(want.dtype).eps * ulps
    scale = float(want.abs().max()) if want.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=eps, atol=eps * max(scale, 1e-30))
