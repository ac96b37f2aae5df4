"""The tiny bases of the offline presets: tokenizer, small causal LM, ~3 CPU-minutes of pretraining, base stats.

`tiny` (Llama) and `tiny-moe` (Qwen3-MoE) differ only in `TinyPresetConfig.family` and the expert fields, which
`build_model` reads; the tokenizer, data, pretraining, temperature folding and evaluation below are the same code.

Design choices:

- Tokenizer: byte-level BPE trained with `tokenizers` on the synthetic chat corpus. A `Digits(individual_digits)`
  pre-tokenizer runs first, so every digit is its own token (numbers are learnable digit by digit) and the byte-level
  alphabet means any text round-trips exactly (`\\boxed{42}`, newlines, `####`). No BOS is added on encode: the chat
  template writes it, so `tokenizer(apply_chat_template(..., tokenize=False))` does not double it (as in Qwen).
- Chat format: `<|bos|><|user|>\\n{content}<|end|>\\n<|assistant|>\\n{response}<|end|>\\n`. `<|end|>` is the EOS
  token, so generation stops at the end of the assistant turn. `<|pad|>` is a separate token; padding is on the left
  (generation-ready).
- Model: a real `LlamaForCausalLM` (hidden 128, 4 layers, 4 heads, 2 KV heads, tied embeddings, ~0.85M parameters),
  so PEFT, the embedded engine and SGLang-style module names all apply unchanged. Llama rather than Qwen2 because
  transformers 5 forces `Qwen2Tokenizer` on any `qwen2` checkpoint directory (whatever tokenizer_config.json says),
  which adds its own `<|endoftext|>` token beyond the embedding table; for `llama` it honours our tokenizer.json.
- MoE model (`tiny-moe`): a real `Qwen3MoeForCausalLM` with the same width, depth and attention (`head_dim` set to
  hidden / heads = 32: Qwen3's default is 128 whatever the width), every layer sparse (`decoder_sparse_step=1`,
  `mlp_only_layers=[]`): 4 experts 144 wide, top-2, weights renormalized over the two (`norm_topk_prob`), so the
  MLP weights are transformers 5's packed expert Parameters `mlp.experts.gate_up_proj (E, 2I, H)` /
  `down_proj (E, H, I)` and the router `mlp.gate`, which expert LoRA targets (~1.15M parameters, ~0.71M active per
  token). Its tokenizer is the same files: `qwen3_moe` is mapped to `Qwen2Tokenizer` too, but unlike `qwen2` it is
  not in transformers 5's `MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, so the `tokenizer_class` that provisioning
  writes into tokenizer_config.json ("PreTrainedTokenizerFast") is honoured and AutoTokenizer reads our
  tokenizer.json (without it, 5.23 loads a `Qwen2Tokenizer` with 523 tokens for our 522; tests/test_provision.py
  checks the ids). No router load-balancing loss (`output_router_logits=False`): pretraining is the same plain LM
  loss as for llama, and with 4 experts and top-2 every expert still takes ~13-40 % of the routed token slots in
  every layer of the pretrained base (measured on test prompts), so no expert is dead for LoRA to miss. The experts
  run transformers' default implementation (grouped_mm on torch 2.13 CPU), the one a loaded checkpoint gets too.
- Pretraining: AdamW on freshly drawn chat examples of the three tasks (never the test questions), loss on the
  response tokens and EOS only (the prompts are given, as in SFT). A response uses its task's answer format at
  rate `right_format_rate` (0.45, spread evenly over the run), else an off-format one: the base answers correctly
  ~60-70 % of the time (`tiny`; `tiny-moe` ~80-98 %) but in the right format only ~40 %, which is the headroom
  GRPO is meant to find quickly.
- Temperature folding: so short a pretraining leaves the digit distributions broad, so T=1 samples are much
  less often right than greedy ones. The saved model has the final norm weight divided by `fold_temperature` (0.5),
  which makes T=1 sampling from it exactly T=0.5 sampling from the trained one: answers are right about as often as
  greedy ones while the format choice, trained at `right_format_rate` = 0.45, stays a ~40/60 draw.
- Base stats: sample at temperature 1.0 (no top-k/top-p) on held-out test prompts through the chat template and
  score with `tiny_tasks.score_response`: format rate, correct rate, reward (both), EOS rate, response length.
- Everything is seeded: Python `random.Random` streams named by purpose and `torch.manual_seed`, so the same seed
  gives the same files on the same torch build (`rl_multilora.provision` pins one intra-op thread while building).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from rl_multilora.presets.tiny_config import SPECIAL_TOKENS, TinyPresetConfig, named_rng
from rl_multilora.presets.tiny_tasks import TASKS, TaskExample, generate_example, render_response, score_response

PAD, BOS, EOS, *_ = SPECIAL_TOKENS
ROLE_TOKENS: tuple[str, ...] = SPECIAL_TOKENS[3:]

# Share of each task in the pretraining mix: the compare task (copy and compare) is learned from fewer examples than
# the word problems and the tens/ones additions.
PRETRAIN_MIX: dict[str, float] = {"gsm8k": 0.4, "arith": 0.35, "compare": 0.25}

# Roles map to their own special tokens; an unknown role is an error rather than a silently new token string.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('role must be system, user or assistant, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)


@dataclass(frozen=True)
class TaskBaseStats:
    """The pretrained base on one task's test prompts, sampled at temperature 1.0."""

    n: int  # responses scored
    format_rate: float  # share in the task's strict answer format
    correct_rate: float  # share whose final number is the right answer, whatever the format
    reward: float  # share both right and in format: what the strict built-in reward pays
    eos_rate: float  # share that ended with EOS within the generation cap
    mean_response_tokens: float  # generated tokens, EOS included
    examples: tuple[str, ...]  # the first few responses, for a human to look at


@dataclass(frozen=True)
class PretrainStats:
    steps: int
    first_loss: float
    final_loss: float  # mean over the last 10 steps
    seconds: float


def chat_prompt(tokenizer: PreTrainedTokenizerFast, question: str) -> str:
    """The chat-template text of a one-turn user question, ready for the assistant's answer."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": question}], add_generation_prompt=True, tokenize=False
    )


def build_tokenizer(texts: list[str], vocab_size: int, max_length: int = 256) -> PreTrainedTokenizerFast:
    """Train the byte-level BPE (digits split one per token) on `texts` and wrap it with special tokens + template."""
    tok = Tokenizer(models.BPE())
    # Digits first: BPE merges never cross pre-tokens, so no multi-digit token can ever be learned.
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    wrapped = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        extra_special_tokens=list(ROLE_TOKENS),
        padding_side="left",
        model_max_length=max_length,
    )
    wrapped.chat_template = CHAT_TEMPLATE
    return wrapped


def tokenizer_corpus(seed: int, per_task: int = 400) -> list[str]:
    """Chat-formatted texts of all tasks, in both answer formats, for BPE training."""
    rng = named_rng(seed, "tokenizer-corpus")
    texts = []
    for task in TASKS:
        for i in range(per_task):
            ex = generate_example(task, rng)
            response = render_response(ex, right_format=i % 2 == 0)
            texts.append(f"{BOS}<|user|>\n{ex.question}{EOS}\n<|assistant|>\n{response}{EOS}\n")
    return texts


def build_model(tokenizer: PreTrainedTokenizerFast, cfg: TinyPresetConfig, seed: int) -> PreTrainedModel:
    """A freshly initialized causal LM of `cfg.family` sized by `cfg`, with the tokenizer's special-token ids."""
    shared = dict(
        vocab_size=len(tokenizer),
        hidden_size=cfg.hidden_size,
        num_hidden_layers=cfg.num_layers,
        num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads,
        intermediate_size=cfg.intermediate_size,
        max_position_embeddings=cfg.max_positions,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if cfg.family == "llama":
        config, model_class = LlamaConfig(**shared), LlamaForCausalLM
    else:
        config = Qwen3MoeConfig(
            **shared,
            head_dim=cfg.hidden_size // cfg.num_heads,  # Qwen3's default is 128, whatever the width
            num_experts=cfg.num_experts,
            num_experts_per_tok=cfg.top_k,
            moe_intermediate_size=cfg.moe_intermediate_size,
            norm_topk_prob=True,
            decoder_sparse_step=1,  # every layer sparse: no dense MLP anywhere
            mlp_only_layers=[],
            output_router_logits=False,  # no load-balancing loss (see the module docstring)
        )
        model_class = Qwen3MoeForCausalLM
    torch.manual_seed(seed)
    model = model_class(config)
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    return model


def _training_batch(
    tokenizer: PreTrainedTokenizerFast, examples: list[TaskExample], responses: list[str]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded input ids, attention mask and labels (-100 on prompt and padding) for prompt + response + EOS."""
    prompts = tokenizer([chat_prompt(tokenizer, ex.question) for ex in examples], add_special_tokens=False)
    answers = tokenizer(responses, add_special_tokens=False)
    rows = [(p, a + [tokenizer.eos_token_id]) for p, a in zip(prompts["input_ids"], answers["input_ids"], strict=True)]
    width = max(len(p) + len(a) for p, a in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, T)
    mask = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T), 1 = real token
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # (B, T), loss only on response + EOS
    for i, (p, a) in enumerate(rows):
        n = len(p) + len(a)
        ids[i, :n] = torch.tensor(p + a)
        mask[i, :n] = 1
        labels[i, len(p) : n] = torch.tensor(a)
    return ids, mask, labels


def pretrain(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    cfg: TinyPresetConfig,
    seed: int,
    exclude: set[str],
    on_step: Callable[[int, float], None] | None = None,
) -> PretrainStats:
    """Pretrain in place on freshly drawn examples whose questions are not in `exclude` (the test questions).

    `on_step(steps_done, loss)` is called after every optimizer step (progress display; it cannot change the result).
    """
    rng = named_rng(seed, "pretrain")
    torch.manual_seed(seed)
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )

    def lr_at(step: int) -> float:
        if step < cfg.warmup_steps:
            return cfg.lr * (step + 1) / cfg.warmup_steps
        progress = (step - cfg.warmup_steps) / max(1, cfg.pretrain_steps - cfg.warmup_steps)
        # Down to 2 % of the peak: the last steps then average many small batches instead of following the
        # last few, which steadies the format rate and the accuracy the run ends with.
        return cfg.lr * (0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress)))

    # Per-task counters for the format schedule: the k-th example of a task is in the right format iff
    # floor((k + 1) * rate) > floor(k * rate), so every window of n examples holds n * rate of them, +-1. Bernoulli
    # draws put ~2 examples per task per batch in doubt, and the format rate the run ended on wandered by +-0.15.
    seen = dict.fromkeys(TASKS, 0)

    def right_format(task: str) -> bool:
        k = seen[task]
        seen[task] += 1
        return math.floor((k + 1) * cfg.right_format_rate) > math.floor(k * cfg.right_format_rate)

    model.train()
    losses: list[float] = []
    start = time.perf_counter()
    for step in range(cfg.pretrain_steps):
        examples = []
        while len(examples) < cfg.batch_size:
            ex = generate_example(rng.choices(TASKS, weights=[PRETRAIN_MIX[t] for t in TASKS])[0], rng)
            if ex.question not in exclude:
                examples.append(ex)
        responses = [render_response(ex, right_format(ex.task)) for ex in examples]
        ids, mask, labels = _training_batch(tokenizer, examples, responses)
        for group in optim.param_groups:
            group["lr"] = lr_at(step)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, losses[-1])
    model.eval()
    tail = losses[-10:] or [float("nan")]
    return PretrainStats(
        steps=cfg.pretrain_steps,
        first_loss=losses[0] if losses else float("nan"),
        final_loss=sum(tail) / len(tail),
        seconds=time.perf_counter() - start,
    )


@torch.no_grad()
def evaluate_base(
    model: PreTrainedModel,
    tokenizer: PreTrainedTokenizerFast,
    test: dict[str, list[TaskExample]],
    cfg: TinyPresetConfig,
    seed: int,
) -> dict[str, TaskBaseStats]:
    """Sample one response per test prompt at temperature 1.0 and score it; the first `eval_prompts` per task."""
    model.eval()
    torch.manual_seed(seed)
    stats = {}
    for task, examples in test.items():
        examples = examples[: cfg.eval_prompts]
        if not examples:
            continue
        batch = tokenizer(
            [chat_prompt(tokenizer, ex.question) for ex in examples],
            add_special_tokens=False,
            padding=True,
            return_tensors="pt",
        )  # left-padded (B, P)
        out = model.generate(
            **batch,
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            max_new_tokens=cfg.eval_max_new_tokens,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        )  # (B, P + new)
        generated = out[:, batch["input_ids"].shape[1] :].tolist()
        scores, lengths, ended, texts = [], [], 0, []
        for ex, ids in zip(examples, generated, strict=True):
            if tokenizer.eos_token_id in ids:
                ids = ids[: ids.index(tokenizer.eos_token_id) + 1]
                ended += 1
            lengths.append(len(ids))
            text = tokenizer.decode(ids, skip_special_tokens=True)
            texts.append(text)
            scores.append(score_response(task, text, ex.label))
        n = len(examples)
        stats[task] = TaskBaseStats(
            n=n,
            format_rate=sum(s.format_ok for s in scores) / n,
            correct_rate=sum(s.correct for s in scores) / n,
            reward=sum(s.reward for s in scores) / n,
            eos_rate=ended / n,
            mean_response_tokens=sum(lengths) / n,
            examples=tuple(texts[:3]),
        )
    return stats


@torch.no_grad()
def fold_temperature(model: PreTrainedModel, temperature: float) -> None:
    """Make sampling at T=1 from `model` equal sampling at `temperature` from it as trained.

    logits = (w * x / rms(x)) @ E.T are linear in the final norm weight w: w /= T scales every logit by 1/T exactly.
    """
    model.model.norm.weight.div_(temperature)  # (hidden,)


def stats_to_json(stats: dict[str, TaskBaseStats]) -> dict[str, dict]:
    return {task: {**asdict(s), "examples": list(s.examples)} for task, s in stats.items()}
