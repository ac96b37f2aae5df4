"""The tiny-agents preset: the tiny base, briefly pretrained further on tool calls and a multi-turn game.

`python -m rl_multilora.presets.tiny_agents --out artifacts/tiny-agents` starts from the provisioned tiny base
(`artifacts/tiny/model`, provisioned first when missing) and writes `OUT/model`, `OUT/data/<task>/{train,test}.jsonl`
for five tasks (the tiny preset's three, copied, plus `calc` and `guess`) and `OUT/PROVISIONED.json` with the new
base's sampled success per task. The tiny preset itself is untouched: the main job's numbers are its base's.
`--seed N` needs a tiny base of seed N: the base's seed is checked (another is refused, never mixed), and
artifacts/tiny is only ever provisioned at seed 0, so another seed takes `--tiny DIR` (provisioned there if missing).

The two new tasks (their environments are `examples/multi_lora/agents.py`; the rules below are shared by the
pretraining transcripts, the base-stats episodes and those environments, so all three agree to the character):

- `calc`: "Compute 37 * 46 with the calculator. End with 'Answer: N'." Products of two-digit numbers (32-99), all
  4-digit: far beyond the base's head arithmetic. A turn holding
  `<tool_call>{"name": "mul", "arguments": {"a": 37, "b": 46}}</tool_call>` (tools `mul` and `add`) gets a `tool`
  message with the result; a turn without a call is the final answer, 1 when its last line is `Answer: <result>`.
- `guess`: "Guess my number between 40 and 48. Reply with one number." A wrong guess gets a user turn "Higher." or
  "Lower.", at most `GUESSES` guesses; a right one at guess k scores `DISCOUNT ** (k - 1)`.

Design choices:

- Sample-reachable levers, as in the tiny preset's format choice: the transcripts call the tool at rate
  `tool_rate` (else they answer directly with a random 4-digit number, so a direct answer is almost never right), and a
  guess after feedback follows it (one step the way it says) at rate `follow_rate`, else it repeats the previous guess. The base then succeeds sometimes when sampled and greedy decoding takes the commoner,
  losing branch; GRPO has to find the tool and the feedback.
- Tokens: `<|tool|>` is a new special token and role of the chat template (the tiny template allows no `tool`
  role); `<tool_call>` and `</tool_call>` are added (non-special) tokens, as in Qwen's tokenizer, so they survive
  `decode(skip_special_tokens=True)` and cost one token each. The embedding rows of the three new tokens start at
  the mean of the others (`resize_token_embeddings`).
- Transcript ids are built as the rollout builds an episode: the chat prompt's ids, then each assistant turn's ids
  + EOS, then each environment turn's ids exactly as `rollout.generate_state.observation_ids` renders them. The loss
  is on the assistant turns and their EOS only.
- The game's transcripts step by one toward the secret, not to the middle of what is left: a bisection needs the
  interval's midpoint, two-digit arithmetic from the whole history, which ~2 CPU-minutes do not teach this base;
  "one more / one less than my last guess" is one copy and one carry. Four guesses then win when the first is
  within 3 of the secret, and fewer guesses pay more, so both the first guess and following the feedback count.
- Continued pretraining mixes the three tiny tasks back in (right format at the tiny preset's rate, test questions
  excluded), so their levers stay; the temperature fold of the tiny base is undone before training and redone
  after (`tiny.fold_temperature`).
- One intra-op thread, seeded streams per purpose: the same files for the same seed on the same torch build.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import random
import re
import shutil
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from rl_multilora.presets.tiny_config import named_rng

log = logging.getLogger("rl_multilora.presets.tiny_agents")

MARKER = "PROVISIONED.json"
OLD_TASKS: tuple[str, ...] = ("gsm8k", "arith", "compare")
NEW_TASKS: tuple[str, ...] = ("calc", "guess")
TOOL_ROLE = "<|tool|>"
TOOL_TAGS: tuple[str, ...] = ("<tool_call>", "</tool_call>")

# The tiny template, with a `tool` role.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant', 'tool'] %}"
    "{{ raise_exception('role must be system, user, assistant or tool, got ' + message['role']) }}"
    "{% endif %}"
    "{{ '<|' + message['role'] + '|>\n' + message['content'] + eos_token + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% endif %}"
)

# ------------------------------------------------------------------------------------------------ task rules

CALC_TOOLS: dict[str, tuple[str, Callable[[int, int], int], tuple[int, int]]] = {
    # name: (operator in the question, function, operand range): every result has 4 digits
    "mul": ("*", lambda a, b: a * b, (32, 99)),
    "add": ("+", lambda a, b: a + b, (1000, 4999)),
}
# The questions are products only: every operand then sits at one fixed distance from where the call copies it (the
# tiny base learns copying by relative position, see tiny_tasks), and 3 k transcripts teach it; `add` is there for
# the model to call by mistake (and get a wrong result), as a real calculator offers more than one tool.
CALC_QUESTION_TOOL = "mul"
GUESS_WIDTH = 9  # numbers lo..lo+8
GUESSES = 4  # guesses per game
DISCOUNT = 0.8  # reward of a right guess at guess k: DISCOUNT ** (k - 1)
HIGHER, LOWER, NOT_A_NUMBER = "Higher.", "Lower.", "Reply with one number."

_ANSWER_LINE = re.compile(r"^Answer:\s*(-?\d+)\s*$")
_GUESS = re.compile(r"^\s*(-?\d+)\s*\.?\s*$")
_CALC_QUESTION = re.compile(r"^Compute (\d+) ([*+]) (\d+) with the calculator")


@dataclass(frozen=True)
class AgentExample:
    task: str  # "calc" or "guess"
    question: str
    label: str  # calc: the result; guess: the secret number

    def row(self) -> dict[str, str]:
        return {"question": self.question, "answer": self.label}


def calc_example(rng: random.Random) -> AgentExample:
    op, fn, (lo, hi) = CALC_TOOLS[CALC_QUESTION_TOOL]
    a, b = rng.randint(lo, hi), rng.randint(lo, hi)
    question = f"Compute {a} {op} {b} with the calculator. End with 'Answer: N'."
    return AgentExample("calc", question, str(fn(a, b)))


def guess_example(rng: random.Random) -> AgentExample:
    lo = rng.randint(10, 90)
    question = f"Guess my number between {lo} and {lo + GUESS_WIDTH - 1}. Reply with one number."
    return AgentExample("guess", question, str(rng.randint(lo, lo + GUESS_WIDTH - 1)))


def calc_tool(name: str, a: int, b: int) -> int:
    """The calculator's tools (`mul`, `add`) on integers; anything else raises, and the environment says so.

    >>> calc_tool("mul", 37, 46)
    1702
    """
    if name not in CALC_TOOLS:
        raise ValueError(f"unknown tool {name!r}")
    if isinstance(a, bool) or isinstance(b, bool) or not isinstance(a, int) or not isinstance(b, int):
        raise TypeError(f"{name} takes integers a and b, got {a!r} and {b!r}")
    return CALC_TOOLS[name][1](a, b)


def final_answer(text: str) -> str | None:
    """The number on the last line `Answer: N` of a turn, or None.

    >>> final_answer("Answer: 1702"), final_answer("It is 1702.")
    ('1702', None)
    """
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    match = _ANSWER_LINE.match(lines[-1]) if lines else None
    return match.group(1) if match else None


def read_guess(text: str) -> int | None:
    """A guess turn's number: the whole turn is one integer (a trailing period allowed), else None.

    >>> read_guess(" 45"), read_guess("45 or 46")
    (45, None)
    """
    match = _GUESS.match(text)
    return int(match.group(1)) if match else None


def guess_feedback(guess: int | None, secret: int) -> str | None:
    """The user's answer to a guess: None when right, else "Higher.", "Lower." or a request for one number.

    >>> guess_feedback(40, 45), guess_feedback(45, 45)
    ('Higher.', None)
    """
    if guess is None:
        return NOT_A_NUMBER
    if guess == secret:
        return None
    return HIGHER if guess < secret else LOWER


def guess_reward(guess_number: int) -> float:
    """The reward of a right guess at guess `guess_number` (1-based)."""
    return DISCOUNT ** (guess_number - 1)


# ------------------------------------------------------------------------------------------------ transcripts


def tool_call_text(name: str, a: int, b: int) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": {"a": a, "b": b}}) + "</tool_call>"


def calc_transcript(ex: AgentExample, use_tool: bool, rng: random.Random) -> list[dict[str, str]]:
    """The messages after the user's question: a tool call, its result and the answer; or a direct answer, a
    number of the result's width drawn at random (the base cannot multiply in its head, and its transcripts say
    so). Not a near miss: near misses taught the base to estimate the product from the question, and it then
    estimated after the tool's result too instead of copying it (greedy: args right 100 %, result copied 8 %)."""
    result = int(ex.label)
    if not use_tool:
        return [{"role": "assistant", "content": f"Answer: {rng.randint(1000, 9999)}"}]
    a, op, b = _CALC_QUESTION.match(ex.question).groups()
    name = next(n for n, spec in CALC_TOOLS.items() if spec[0] == op)
    return [
        {"role": "assistant", "content": tool_call_text(name, int(a), int(b))},
        {"role": "tool", "content": str(result)},
        {"role": "assistant", "content": f"Answer: {result}"},
    ]


def guess_transcript(ex: AgentExample, follow_rate: float, rng: random.Random) -> list[dict[str, str]]:
    """A game: a uniform first guess, then each guess after feedback either one step the way it says (at
    `follow_rate`) or the previous guess again; ends at the right guess or after GUESSES."""
    lo = int(re.search(r"between (\d+)", ex.question).group(1))
    guess, secret = rng.randint(lo, lo + GUESS_WIDTH - 1), int(ex.label)
    messages = []
    for _ in range(GUESSES):
        messages.append({"role": "assistant", "content": str(guess)})
        feedback = guess_feedback(guess, secret)
        if feedback is None:
            break
        messages.append({"role": "user", "content": feedback})
        if rng.random() < follow_rate:
            guess += 1 if feedback == HIGHER else -1
    return messages[:-1] if messages[-1]["role"] == "user" else messages


# ------------------------------------------------------------------------------------------------ the recipe


@dataclass(frozen=True)
class AgentsPresetConfig:
    """Knobs of the tiny-agents preset (continued pretraining of the tiny base)."""

    n_train: int = 2000  # calc rows in data/calc/train.jsonl
    n_test: int = 200  # calc rows in data/calc/test.jsonl (held out of pretraining)
    guess_train: int = 600  # guess rows in data/guess/train.jsonl (the game has 81 x 9 = 729 distinct rows)
    guess_test: int = 100  # guess rows in data/guess/test.jsonl (held out of pretraining)
    tool_rate: float = 0.5  # share of calc transcripts that call the tool (else a direct, random answer)
    follow_rate: float = 0.35  # share of guesses after feedback that follow it (else the previous guess again)
    right_format_rate: float = 0.45  # the tiny tasks' format rate, as in the tiny preset
    mix: tuple[float, float, float] = (0.35, 0.4, 0.25)  # tiny tasks / calc / guess share of a batch
    pretrain_steps: int = 1000  # AdamW steps
    batch_size: int = 16
    lr: float = 1.5e-3  # peak; warmup then cosine to 2 %
    warmup_steps: int = 20
    fold_temperature: float = 0.5  # the tiny base's fold, undone before training and redone after
    eval_prompts: int = 96  # test prompts per task for the base stats (0 = skip)
    eval_max_new_tokens: int = 48  # per model turn

    def __post_init__(self) -> None:
        problems = []
        for name in ("tool_rate", "follow_rate", "right_format_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                problems.append(f"{name}={getattr(self, name)!r} must be in [0, 1]")
        if len(self.mix) != 3 or min(self.mix) < 0 or sum(self.mix) <= 0:
            problems.append(f"mix={self.mix!r} must be three non-negative shares, not all 0")
        for name in ("n_train", "n_test", "guess_train", "guess_test", "batch_size", "eval_max_new_tokens"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                problems.append(f"{name}={getattr(self, name)!r} must be an integer >= 1")
        for name in ("pretrain_steps", "warmup_steps", "eval_prompts"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 0:
                problems.append(f"{name}={getattr(self, name)!r} must be an integer >= 0")
        if not self.lr > 0:
            problems.append(f"lr={self.lr!r} must be > 0")
        if problems:
            raise ValueError("invalid AgentsPresetConfig: " + "; ".join(problems))


def agent_splits(seed: int, sizes: dict[str, tuple[int, int]]) -> dict[str, dict[str, list[AgentExample]]]:
    """Per task (`sizes[task]` = (train, test) rows): test rows first, then train rows that are none of them (a
    guess row is its question and secret)."""
    makers = {"calc": calc_example, "guess": guess_example}
    splits = {}
    for task, (n_train, n_test) in sizes.items():
        make, out = makers[task], {}
        seen: set[tuple[str, str]] = set()
        for split, n in (("test", n_test), ("train", n_train)):
            rng, rows = named_rng(seed, f"agents-{task}-{split}"), []
            for _ in range(50 * n + 100):
                if len(rows) == n:
                    break
                ex = make(rng)
                if (ex.question, ex.label) not in seen:
                    seen.add((ex.question, ex.label))
                    rows.append(ex)
            if len(rows) < n:
                raise ValueError(f"n={n} distinct {task} rows are more than the generator can produce")
            out[split] = rows
        splits[task] = out
    return splits


def extend_tokenizer(tokenizer) -> None:
    """Add the `tool` role token and the tool-call tags; set the template with the `tool` role."""
    tokenizer.add_tokens([TOOL_ROLE], special_tokens=True)
    tokenizer.add_tokens(list(TOOL_TAGS))
    tokenizer.chat_template = CHAT_TEMPLATE


def episode_ids(tokenizer, question: str, messages: list[dict[str, str]]) -> tuple[list[int], list[int]]:
    """Ids and loss mask (1 on assistant turns + their EOS) of a transcript, built as a rollout builds an episode."""
    from rl_multilora.presets.tiny import chat_prompt
    from rollout.generate_state import observation_ids

    ids = tokenizer(chat_prompt(tokenizer, question), add_special_tokens=False)["input_ids"]
    mask = [0] * len(ids)
    pending: list[dict[str, str]] = []
    for m in messages:
        if m["role"] != "assistant":
            pending.append(m)
            continue
        if pending:
            obs = observation_ids(tokenizer, pending, ended_turn=True)
            ids, mask, pending = ids + obs, mask + [0] * len(obs), []
        turn = tokenizer(m["content"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        ids, mask = ids + turn, mask + [1] * len(turn)
    return ids, mask


def _batch(tokenizer, rows: list[tuple[list[int], list[int]]]):
    import torch

    width = max(len(ids) for ids, _ in rows)
    ids = torch.full((len(rows), width), tokenizer.pad_token_id, dtype=torch.long)  # (B, T), right-padded
    attn = torch.zeros((len(rows), width), dtype=torch.long)  # (B, T)
    labels = torch.full((len(rows), width), -100, dtype=torch.long)  # (B, T), loss on assistant tokens only
    for i, (row, mask) in enumerate(rows):
        ids[i, : len(row)] = torch.tensor(row)
        attn[i, : len(row)] = 1
        labels[i, : len(row)] = torch.tensor([t if m else -100 for t, m in zip(row, mask, strict=True)])
    return ids, attn, labels


def continue_pretraining(model, tokenizer, cfg: AgentsPresetConfig, seed: int, exclude: set[str], on_step=None):
    """AdamW on freshly drawn transcripts of all five tasks (none of `exclude`, the test questions)."""
    import torch

    from rl_multilora.presets.tiny import PRETRAIN_MIX, render_response
    from rl_multilora.presets.tiny_tasks import generate_example

    rng = named_rng(seed, "agents-pretrain")
    torch.manual_seed(seed)
    decay = [p for p in model.parameters() if p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.ndim < 2]
    optim = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.01}, {"params": no_decay, "weight_decay": 0.0}],
        lr=cfg.lr,
        betas=(0.9, 0.95),
    )

    def draw() -> tuple[list[int], list[int]]:
        kind = rng.choices(("tiny", "calc", "guess"), weights=cfg.mix)[0]
        if kind == "tiny":
            ex = generate_example(rng.choices(OLD_TASKS, weights=[PRETRAIN_MIX[t] for t in OLD_TASKS])[0], rng)
            messages = [{"role": "assistant", "content": render_response(ex, rng.random() < cfg.right_format_rate)}]
        elif kind == "calc":
            ex = calc_example(rng)
            messages = calc_transcript(ex, rng.random() < cfg.tool_rate, rng)
        else:
            ex = guess_example(rng)
            messages = guess_transcript(ex, cfg.follow_rate, rng)
        key = ex.question if kind == "tiny" else f"{ex.question}\x00{ex.label}"
        return None if key in exclude else episode_ids(tokenizer, ex.question, messages)

    model.train()
    losses, start = [], time.perf_counter()
    for step in range(cfg.pretrain_steps):
        rows = []
        while len(rows) < cfg.batch_size:
            row = draw()
            if row is not None:
                rows.append(row)
        ids, attn, labels = _batch(tokenizer, rows)
        if step < cfg.warmup_steps:
            lr = cfg.lr * (step + 1) / cfg.warmup_steps
        else:
            progress = (step - cfg.warmup_steps) / max(1, cfg.pretrain_steps - cfg.warmup_steps)
            lr = cfg.lr * (0.02 + 0.98 * 0.5 * (1.0 + math.cos(math.pi * progress)))
        for group in optim.param_groups:
            group["lr"] = lr
        loss = model(input_ids=ids, attention_mask=attn, labels=labels).loss
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step + 1, losses[-1])
    model.eval()
    tail = losses[-10:] or [float("nan")]
    return {
        "steps": cfg.pretrain_steps,
        "first_loss": losses[0] if losses else float("nan"),
        "final_loss": sum(tail) / len(tail),
        "seconds": time.perf_counter() - start,
    }


# ------------------------------------------------------------------------------------------------ base stats


class _Episode:
    """The rules of one calc or guess episode, as the environments in examples/multi_lora/agents.py apply them."""

    def __init__(self, ex: AgentExample):
        self.ex, self.turns, self.reward, self.used_tool = ex, 0, 0.0, False

    def step(self, text: str) -> list[dict[str, str]] | None:
        """The environment's messages after model turn `text`, or None when the episode is done."""
        from rollout.environments import ToolCall, parse_tool_calls

        self.turns += 1
        if self.ex.task == "calc":
            calls = parse_tool_calls(text)
            if not calls:
                self.reward = float(final_answer(text) == self.ex.label)
                return None
            self.used_tool = True
            out = []
            for call in calls:
                try:
                    assert isinstance(call, ToolCall), call
                    out.append(str(calc_tool(call.name, **call.arguments)))
                except Exception as e:  # noqa: BLE001 - the model's bad call, answered as an error
                    out.append(f"error: {e}")
            return [{"role": "tool", "content": r} for r in out]
        feedback = guess_feedback(read_guess(text), int(self.ex.label))
        if feedback is None:
            self.reward = guess_reward(self.turns)
            return None
        return None if self.turns >= GUESSES else [{"role": "user", "content": feedback}]


@dataclass(frozen=True)
class AgentBaseStats:
    n: int
    reward: float  # mean episode reward (calc: 0/1; guess: discounted)
    success: float  # share of episodes solved
    tool_rate: float  # calc: share of episodes with a tool call; guess: share that followed every feedback
    mean_turns: float
    examples: tuple[str, ...]


def sample_episodes(
    model,
    tokenizer,
    examples: list[AgentExample],
    max_turns: int,
    max_new_tokens: int,
    seed: int,
    greedy: bool = False,
):
    """Run one episode per example, sampled at T=1 (or greedy), all episodes batched turn by turn; returns their
    `_Episode`s, each episode's model turns as text, and (guess) whether every guess after feedback followed it."""
    import torch

    from rl_multilora.presets.tiny import chat_prompt
    from rollout.generate_state import observation_ids

    torch.manual_seed(seed)
    episodes = [_Episode(ex) for ex in examples]
    contexts = [
        tokenizer(chat_prompt(tokenizer, ex.question), add_special_tokens=False)["input_ids"] for ex in examples
    ]
    texts = [[] for _ in examples]
    followed = [True] * len(examples)
    active = list(range(len(examples)))
    for _ in range(max_turns):
        if not active:
            break
        width = max(len(contexts[i]) for i in active)
        ids = torch.tensor([[tokenizer.pad_token_id] * (width - len(contexts[i])) + contexts[i] for i in active])
        attn = (
            torch.arange(width)[None, :] >= torch.tensor([width - len(contexts[i]) for i in active])[:, None]
        ).long()
        with torch.no_grad():
            out = model.generate(
                input_ids=ids,
                attention_mask=attn,
                **(
                    {"do_sample": False}
                    if greedy
                    else {"do_sample": True, "temperature": 1.0, "top_k": 0, "top_p": 1.0}
                ),
                max_new_tokens=max_new_tokens,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )[:, width:].tolist()  # (B, new)
        still = []
        for i, new in zip(active, out, strict=True):
            ended = tokenizer.eos_token_id in new
            new = (
                new[: new.index(tokenizer.eos_token_id) + 1]
                if ended
                else [t for t in new if t != tokenizer.pad_token_id]
            )
            text = tokenizer.decode(new, skip_special_tokens=True)
            texts[i].append(text)
            ep = episodes[i]
            if ep.ex.task == "guess" and len(texts[i]) > 1:
                prev, now, secret = read_guess(texts[i][-2]), read_guess(text), int(ep.ex.label)
                if prev is not None and (now is None or (now > prev) != (prev < secret) or now == prev):
                    followed[i] = False
            obs = ep.step(text)
            if obs is None:
                continue
            contexts[i] = contexts[i] + new + observation_ids(tokenizer, obs, ended_turn=ended)
            still.append(i)
        active = still
    return episodes, texts, followed


def evaluate_agent_base(model, tokenizer, test: dict[str, list[AgentExample]], cfg: AgentsPresetConfig, seed: int):
    stats = {}
    for task, examples in test.items():
        examples = examples[: cfg.eval_prompts]
        if not examples:
            continue
        episodes, texts, followed = sample_episodes(
            model, tokenizer, examples, max_turns=GUESSES if task == "guess" else 3,
            max_new_tokens=cfg.eval_max_new_tokens, seed=seed,
        )  # fmt: skip
        n = len(episodes)
        lever = [e.used_tool for e in episodes] if task == "calc" else followed
        stats[task] = AgentBaseStats(
            n=n,
            reward=sum(e.reward for e in episodes) / n,
            success=sum(e.reward > 0 for e in episodes) / n,
            tool_rate=sum(lever) / n,
            mean_turns=sum(e.turns for e in episodes) / n,
            examples=tuple(" | ".join(t) for t in texts[:3]),
        )
    return stats


# ------------------------------------------------------------------------------------------------ provisioning


def _sizes(cfg: AgentsPresetConfig) -> dict[str, tuple[int, int]]:
    return {"calc": (cfg.n_train, cfg.n_test), "guess": (cfg.guess_train, cfg.guess_test)}


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


DEFAULT_TINY = "artifacts/tiny"  # the main job's base: provisioned here only at seed 0, the seed the main job trains


def provision_agents(
    out: str | Path,
    tiny: str | Path | None = None,
    seed: int = 0,
    force: bool = False,
    config: AgentsPresetConfig | None = None,
) -> Path:
    """Write the tiny-agents base and its five datasets into `out`, from the tiny base in `tiny`; nothing is done
    when `out` already holds this recipe, unless `force`.

    The base must have been provisioned with `seed`: its three datasets are copied and the new ones drawn from
    `seed`, so a base of another seed would mix two seeds under one record; it is refused instead (the error names
    both). A missing base is provisioned first, at `seed`, in `tiny`; without `tiny`, in artifacts/tiny and at seed 0
    only, since the main job trains on that folder at seed 0 and would refuse another seed there: another seed needs
    `tiny=DIR` (--tiny DIR), a base of its own. The recipe holds the base's own (preset, seed, settings), so another
    base makes `out` another recipe. The marker is read before `provision_lock(out)` (a finished build needs no write
    access) and again under it: a second provisioning of `out` at the same time waits, then finds it done."""
    from rl_multilora.provision import writing

    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed={seed!r} (--seed) is not allowed; allowed: an integer >= 0")
    cfg = config or AgentsPresetConfig()
    out, chosen = Path(out), tiny is not None
    tiny = Path(tiny) if chosen else Path(DEFAULT_TINY)
    recipe = {
        "preset": "tiny-agents",
        "seed": seed,
        "settings": asdict(cfg) | {"mix": list(cfg.mix)},
        "base": _base_recipe(tiny, seed, chosen),
    }
    if _done(out, tiny, recipe, force):
        return out
    with writing(out, force):
        if _done(out, tiny, recipe, force):
            return out
        return _provision_agents(out, tiny, seed, cfg, recipe)


def _done(out: Path, tiny: Path, recipe: dict, force: bool) -> bool:
    from rl_multilora.provision import already_built

    if not already_built(out, _compared_recipe(out, tiny, recipe), force):
        return False
    log.info("%s already holds tiny-agents (seed %d): nothing to do (--force rebuilds it)", out, recipe["seed"])
    return True


def _base_recipe(tiny: Path, seed: int, chosen: bool) -> dict:
    """The tiny base's identity (preset, seed, settings), read from its PROVISIONED.json, or the tiny preset's
    recipe at `seed` when it is still to be provisioned. Refuses a base of another seed, and a missing default base
    at a seed other than 0 (see `provision_agents`), naming --seed, the folder and what it holds."""
    from rl_multilora.presets.tiny_config import PRESETS
    from rl_multilora.provision import read_marker

    try:
        record = read_marker(tiny)
    except ValueError as err:
        raise ValueError(
            f"the tiny base in {str(tiny)!r} is damaged: {err} (--force here rebuilds only OUT; rebuild the base with "
            f"`rl-multilora provision --preset tiny --out {tiny} --force`)"
        ) from None
    if record is None:
        if not chosen and seed != 0:
            raise ValueError(
                f"seed={seed} (--seed {seed}) needs a tiny base provisioned with seed {seed}, and the default base "
                f"{DEFAULT_TINY!r} is only ever provisioned at seed 0 (the main job trains on it); pass tiny=DIR "
                f"(--tiny DIR) for a base of seed {seed} of its own (provisioned there if missing)"
            )
        return {"preset": "tiny", "seed": seed, "settings": PRESETS["tiny"].settings()}
    if record.get("seed") != seed:
        raise ValueError(
            f"seed={seed} (--seed {seed}) does not match the tiny base in {str(tiny)!r}, which holds "
            f"preset={record.get('preset')!r} seed={record.get('seed')!r}; pass tiny=DIR (--tiny DIR) for a base "
            f"provisioned with seed {seed} (provisioned there if missing), or --seed {record.get('seed')!r}"
        )
    return {key: record.get(key) for key in ("preset", "seed", "settings")}


def _compared_recipe(out: Path, tiny: Path, recipe: dict) -> dict:
    """What `out`'s record is compared with. Records written before the recipe held its base ("base") name the base
    only by its model folder ("from"): one whose folder is `tiny`'s is compared without "base" (its seed still has
    to match, and `_base_recipe` checked the base's), so an existing preset needs no 3-minute rebuild for a field
    it predates. Any other record is compared with the whole recipe."""
    from rl_multilora.provision import read_marker

    try:
        previous = read_marker(out)
    except ValueError:
        return recipe  # already_built reports it
    if previous is None or "base" in previous or "from" not in previous:
        return recipe
    if Path(previous["from"]).resolve() != (tiny / "model").resolve():
        return recipe
    return {key: value for key, value in recipe.items() if key != "base"}


def _provision_agents(out: Path, tiny: Path, seed: int, cfg: AgentsPresetConfig, recipe: dict) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_multilora.presets.tiny import fold_temperature
    from rl_multilora.provision import MARKER as TINY_MARKER
    from rl_multilora.provision import provision

    marker = out / MARKER
    if not (tiny / TINY_MARKER).exists():
        log.info("no tiny base in %s: provisioning it first (seed %d)", tiny, seed)
        provision("tiny", tiny, seed=seed)
    marker.unlink(missing_ok=True)
    for sub in ("model", "data"):
        path = out / sub
        if path.is_symlink() or path.is_file():  # the link goes, never what it points at (as `provision` clears)
            path.unlink()
        else:
            shutil.rmtree(path, ignore_errors=True)
    out.mkdir(parents=True, exist_ok=True)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same files on any machine with this torch build (as the tiny preset)
    start, cpu_start, timings = time.perf_counter(), time.process_time(), {}
    try:
        splits = agent_splits(seed, _sizes(cfg))
        for task, by_split in splits.items():
            for split, rows in by_split.items():
                _write_jsonl(out / "data" / task / f"{split}.jsonl", [ex.row() for ex in rows])
        exclude = {f"{ex.question}\x00{ex.label}" for by_split in splits.values() for ex in by_split["test"]}
        for task in OLD_TASKS:
            shutil.copytree(tiny / "data" / task, out / "data" / task)
            for line in (tiny / "data" / task / "test.jsonl").read_text().splitlines():
                row = json.loads(line)
                exclude.add(row.get("question") or row.get("problem"))

        tokenizer = AutoTokenizer.from_pretrained(tiny / "model")
        model = AutoModelForCausalLM.from_pretrained(tiny / "model", dtype=torch.float32)
        extend_tokenizer(tokenizer)
        model.resize_token_embeddings(len(tokenizer), mean_resizing=True)
        model.config.vocab_size = len(tokenizer)
        fold_temperature(model, 1.0 / cfg.fold_temperature)  # undo the tiny base's fold: train the real logits
        every = max(1, cfg.pretrain_steps // 10)

        def on_step(step: int, loss: float) -> None:
            if step % every == 0 or step == cfg.pretrain_steps:
                log.info("continued pretraining: step %d/%d, loss %.3f", step, cfg.pretrain_steps, loss)

        train_stats = continue_pretraining(model, tokenizer, cfg, seed, exclude, on_step)
        timings["pretrain_s"] = train_stats["seconds"]
        fold_temperature(model, cfg.fold_temperature)

        model_dir = out / "model"
        model.save_pretrained(model_dir)
        tokenizer.save_pretrained(model_dir)
        config_path = model_dir / "tokenizer_config.json"  # as the tiny preset: loads on transformers 4.x too
        tok_config = json.loads(config_path.read_text())
        tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(tok_config, indent=2, sort_keys=True) + "\n")

        t0 = time.perf_counter()
        test = {task: by_split["test"] for task, by_split in splits.items()}
        base = {task: asdict(s) for task, s in evaluate_agent_base(model, tokenizer, test, cfg, seed).items()}
        base |= _old_task_stats(model, tokenizer, tiny, cfg, seed)
        timings["eval_s"] = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    timings["total_s"] = time.perf_counter() - start
    timings["cpu_s"] = time.process_time() - cpu_start
    record = {
        **recipe,
        "from": str(tiny / "model"),
        "model": {
            "parameters": sum(p.numel() for p in model.parameters()),
            "vocab_size": len(tokenizer),
            "torch": torch.__version__,
            "pretrain": train_stats,
        },
        "data": {task: {"train": n_train, "test": n_test} for task, (n_train, n_test) in _sizes(cfg).items()},
        "base_stats": base,
        "timings": timings,
    }
    tmp = out / (MARKER + ".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    tmp.replace(marker)
    summary = ", ".join(f"{t} {s['reward']:.2f}" for t, s in base.items())
    log.info("tiny-agents in %s (%.0f s); base sampled reward: %s", out, timings["total_s"], summary)
    return out


def _old_task_stats(model, tokenizer, tiny: Path, cfg: AgentsPresetConfig, seed: int) -> dict[str, dict]:
    """The tiny tasks on the new base, sampled as the tiny preset measures them."""
    from rl_multilora.presets.tiny import evaluate_base
    from rl_multilora.presets.tiny_config import PRESETS
    from rl_multilora.presets.tiny_tasks import PROMPT_FIELD, TaskExample

    test = {}
    for task in OLD_TASKS:
        rows = [json.loads(line) for line in (tiny / "data" / task / "test.jsonl").read_text().splitlines()]
        label = (lambda r: r["answer"].rsplit("#### ", 1)[-1]) if task == "gsm8k" else (lambda r: r["answer"])
        test[task] = [TaskExample(task, r[PROMPT_FIELD[task]], label(r), ()) for r in rows]
    tiny_cfg = replace(PRESETS["tiny"], eval_prompts=cfg.eval_prompts)
    stats = evaluate_base(model, tokenizer, test, tiny_cfg, seed)
    return {
        task: {"reward": s.reward, "format_rate": s.format_rate, "correct_rate": s.correct_rate}
        for task, s in stats.items()
    }


def main(argv: list[str] | None = None) -> int:
    """`python -m rl_multilora.presets.tiny_agents` (examples/multi_lora/provision_agents.sh). A refused seed, base or
    folder prints the reason and returns 2, no traceback, as `rl-multilora provision` does."""
    from rl_multilora.presets.arguments import non_negative_int

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="artifacts/tiny-agents", help="output directory")
    parser.add_argument(
        "--tiny",
        default=None,
        help=f"the tiny base's directory, provisioned there at --seed if missing (default {DEFAULT_TINY}, "
        "provisioned only at seed 0: another seed needs --tiny DIR)",
    )
    parser.add_argument("--seed", type=non_negative_int, default=0, help="the base's seed too (it must match)")
    parser.add_argument("--force", action="store_true", help="rebuild even if OUT already holds this recipe")
    parser.add_argument(
        "--pretrain-steps", type=non_negative_int, default=None, help="override the step count (tests)"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    try:
        cfg = AgentsPresetConfig()
        if args.pretrain_steps is not None:
            cfg = replace(cfg, pretrain_steps=args.pretrain_steps)
        provision_agents(args.out, args.tiny, seed=args.seed, force=args.force, config=cfg)
    except (ValueError, FileExistsError, FileNotFoundError, PermissionError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
