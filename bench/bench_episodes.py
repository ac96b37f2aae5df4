"""What a step with multi-turn tenants costs: episodes vs the same tokens generated and trained single-turn, with
the embedded engine's prefix cache on and off, side by side in one process.

Workload: `tenants` adapters, `groups` prompt groups of `group` samples each per tenant. Multi-turn: every sample is
an episode of `turns` model turns of exactly `turn_tokens` tokens (EOS off), the environment answering each turn
but the last with a fixed message (the chat template's tokens for it, loss-masked). Single-turn, the same tokens:
each sample's prompt is the episode's prompt followed by as many tokens as its environment turns had (prefilled,
as the episode's environment tokens are), and it generates all `turns * turn_tokens` model tokens in one turn; the
trainer gets rows of the same length with the same number of loss positions. Those prompt tokens are by default
the same for every sample of a group, so the single-turn path prefills and trains them once per group, which the
episodes cannot (their environment tokens follow each sample's own turns); `--baseline own` gives every sample
filler of its own instead, so that neither path shares what the other cannot.

Two engines over the one model and trainer: `cache` (the default `prefix_cache_bytes`) and `no cache` (0, the
engine before the prefix cache: every turn prefills the whole growing context again). Each timed run does the four
(engine, path) steps in an order that alternates between runs; after every step the trained adapters are loaded into
both engines (a weight sync, untimed), so no step reuses an earlier step's KV. Reported: medians (min-max) of
`--repeats` runs after a warm-up, and per engine the multi / single ratio of each run (median, min-max), of wall
time and of this process's CPU time (steadier than wall time on a machine others share).

    python bench/bench_episodes.py [--quick]                               # tiny preset shape (hidden 128, 4 layers)
    python bench/bench_episodes.py --model artifacts/smollm2-135m/model    # a real HF folder (SmolLM2-135M)
    python bench/bench_episodes.py --baseline own                          # single-turn shares no more than episodes
"""

from __future__ import annotations

import argparse
import itertools
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.* when run as a script

import torch  # noqa: E402

from rl_multilora.config import GRPOSettings, OptimSettings  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rl_multilora.trainer import MultiLoRATrainer  # noqa: E402
from rollout.engines.embedded import DEFAULT_PREFIX_CACHE_BYTES, EmbeddedEngine  # noqa: E402
from rollout.environments import Environment, EnvStep  # noqa: E402
from rollout.generate_state import GenerateState, MultiLoRAHooks  # noqa: E402
from rollout.types import AdapterRef, EnvironmentSpec, RewardSpec, Sample, SamplingParams  # noqa: E402
from tests.tiny_models import tiny_model, tiny_tokenizer  # noqa: E402


class FixedTurns(Environment):
    """Answers `turns - 1` model turns with the same message, then ends; reward 1 for a digit in the last turn."""

    def __init__(self, turns: int):
        self.turns, self.seen = turns, 0

    def step(self, action: str) -> EnvStep:
        self.seen += 1
        if self.seen >= self.turns:
            return EnvStep(reward=float(any(c.isdigit() for c in action)), done=True)
        return EnvStep(observation=[{"role": "user", "content": "go on"}])


def _samples(tok, tenants: int, groups: int, group: int, env: EnvironmentSpec | None) -> list[list[Sample]]:
    out = []
    for t in range(tenants):
        for g in range(groups):
            text = tok.apply_chat_template(
                [{"role": "user", "content": f"{t}+{g}="}], tokenize=False, add_generation_prompt=True
            )
            ids = tok(text, add_special_tokens=False)["input_ids"]
            out.append(
                [
                    Sample(
                        prompt=text,
                        prompt_ids=list(ids),
                        label="0",
                        group_index=g,
                        index=i,
                        adapter=AdapterRef(f"t{t}", t),
                        reward_spec=None if env else RewardSpec(name="format"),
                        environment=env,
                        metadata={"sampling_seed": 1000 * g + i},
                    )  # fmt: skip
                    for i in range(group)
                ]
            )
    return out


def _cell(vals: list[float], fmt: str = "{:.3f}") -> str:
    return f"{fmt.format(statistics.median(vals))} ({fmt.format(min(vals))}-{fmt.format(max(vals))})"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer repeats (a smoke run)")
    ap.add_argument("--model", default=None, help="an HF model folder (default: the tiny preset's shape, random)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--tenants", type=int, default=4)
    ap.add_argument("--groups", type=int, default=2, help="prompt groups per tenant")
    ap.add_argument("--group", type=int, default=4, help="samples per group")
    ap.add_argument("--turns", type=int, default=3)
    ap.add_argument("--turn-tokens", type=int, default=16)
    ap.add_argument(
        "--no-share-prompts",
        action="store_true",
        help="train every row on its own (grpo.share_prompts false), as the trainer did before a group's prompt "
        "trained once; default: the trainer's default (shared)",
    )
    ap.add_argument(
        "--baseline",
        choices=("shared", "own"),
        default="shared",
        help="the single-turn rows' environment tokens: `shared` (default), the same filler for every sample of a "
        "group, so the engine prefills and the trainer trains the group's prompt once; `own`, a filler of each "
        "sample's own, as the episodes' environment tokens are (each follows its sample's own turns, so nothing "
        "after the first prompt can be shared): then neither path shares what the other cannot",
    )
    ap.add_argument(
        "--always-pack",
        action="store_true",
        help="pack every group of shared-prompt rows, as the trainer did before it estimated which groups save by it "
        "(rl_multilora.packing.worth_packing); default: the trainer's estimate",
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    tenants, groups, group, turns, turn_tokens = args.tenants, args.groups, args.group, args.turns, args.turn_tokens
    if args.quick:
        tenants, groups, group, turns, turn_tokens = 2, 2, 2, 3, 4
    repeats = 2 if args.quick else args.repeats
    torch.manual_seed(0)
    if args.model:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(args.model)
        model = MultiLoRAModel.from_pretrained(args.model, max_loras=tenants, max_rank=8, target_modules="all-linear")
        shape = f"{args.model}"
    else:
        hidden, layers = (32, 2) if args.quick else (128, 4)
        tok = tiny_tokenizer()
        model = MultiLoRAModel(tiny_model(hidden=hidden, layers=layers), max_loras=tenants, max_rank=8)
        shape = f"tiny, hidden {hidden}, {layers} layers"
    grpo = GRPOSettings(micro_batch_size=64, drop_uniform_groups=False, share_prompts=not args.no_share_prompts)
    trainer = MultiLoRATrainer(model, grpo, pad_token_id=0)
    if args.always_pack:
        trainer.ops.pair_cost = 0.0
    for t in range(tenants):
        model.add_adapter(f"t{t}", rank=8, alpha=16, seed=t)
        trainer.add_adapter(f"t{t}", OptimSettings(), lr=1e-3, max_steps=10_000)
    engines = {
        "cache": EmbeddedEngine(model, tok, max_batch_size=256, eos_token_ids=[]),
        "no cache": EmbeddedEngine(model, tok, max_batch_size=256, eos_token_ids=[], prefix_cache_bytes=0),
    }
    versions = itertools.count()

    def sync() -> None:  # what a run's weight sync does after a step: every engine gets the trained adapters
        v = next(versions)
        for engine in engines.values():
            for t in range(tenants):
                engine.load_adapter(f"t{t}", model.adapter_state_dict(f"t{t}"), model.peft_config(f"t{t}"), version=v)

    sync()
    spec = EnvironmentSpec(path="__main__:FixedTurns", kwargs={"turns": turns}, max_turns=turns, max_tokens=10_000)
    multi_sampling = SamplingParams(temperature=1.0, max_new_tokens=turn_tokens)
    single_sampling = SamplingParams(temperature=1.0, max_new_tokens=turns * turn_tokens)

    filler = [tok.convert_tokens_to_ids(c) for c in "xyzwvutsrqponmlk"]  # single letters, one token each
    env_tokens: list[int] = []  # per sample, how many environment tokens its episode had (set by the warm-up)

    def step(engine: EmbeddedEngine, env: EnvironmentSpec | None) -> dict[str, float]:
        sampling = multi_sampling if env else single_sampling
        groups_ = _samples(tok, tenants, groups, group, env)
        if env is None:  # the episode's environment tokens move into the prompt: the same prefill work
            flat = [s for g in groups_ for s in g]
            for k, (s, n) in enumerate(zip(flat, env_tokens, strict=True)):
                if args.baseline == "shared":
                    s.prompt_ids = s.prompt_ids + [filler[0]] * n
                else:  # each sample's own tokens (seeded by its place in the step)
                    pick = random.Random(k)
                    s.prompt_ids = s.prompt_ids + [pick.choice(filler) for _ in range(n)]
        prompt0, reused0 = engine.prompt_tokens, engine.reused_tokens
        c0, t0 = time.process_time(), time.perf_counter()
        samples = GenerateState(engine, tok, MultiLoRAHooks(), sampling).run_sync(groups_)
        c1, t1 = time.process_time(), time.perf_counter()
        if env is not None and not env_tokens:
            env_tokens.extend(len(s.loss_mask) - sum(s.loss_mask) for s in samples)
        for i, s in enumerate(samples):
            s.reward = float(i % 2)  # every group has signal: both paths train every row
        stats = trainer.train_step(samples, {f"t{t}": 0 for t in range(tenants)})
        c2, t2 = time.process_time(), time.perf_counter()
        sync()
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        model_tokens = sum(sum(s.loss_mask) for s in samples)
        assert all(st.stepped for st in stats.values()), stats
        asked = engine.prompt_tokens - prompt0
        return {
            "rollout_s": t1 - t0,
            "train_s": t2 - t1,
            "step_s": t2 - t0,
            "step_cpu_s": c2 - c0,
            "rollout_cpu_s": c1 - c0,
            "train_cpu_s": c2 - c1,
            "tokens": tokens,
            "model_tokens": model_tokens,
            "prefilled": asked - (engine.reused_tokens - reused0),
        }

    keys = [(name, path) for name in engines for path in ("multi", "single")]
    for name, path in keys:  # warm-up (the first multi-turn step also measures the environment's token counts)
        step(engines[name], spec if path == "multi" else None)
    runs: dict[tuple[str, str], list[dict[str, float]]] = {k: [] for k in keys}
    for r in range(repeats):
        for name, path in keys if r % 2 == 0 else keys[::-1]:
            runs[(name, path)].append(step(engines[name], spec if path == "multi" else None))
    for engine in engines.values():
        engine.close()
    print(
        f"# {tenants} tenants x {groups} groups x {group} samples; episodes of {turns} turns x {turn_tokens} tokens; "
        f"model {shape}; prefix cache {DEFAULT_PREFIX_CACHE_BYTES // 2**20} MiB vs off; {repeats} runs each, "
        f"medians (min-max); torch {torch.__version__}, {torch.get_num_threads()} threads; trainer share_prompts "
        f"{grpo.share_prompts}{' (every group packs)' if args.always_pack else ''}; single-turn baseline's environment tokens: {args.baseline}"
    )
    print(
        "| engine | path | model tokens | all tokens | tokens prefilled | rollout s | train s | step s | "
        "rollout CPU s | train CPU s | step CPU s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for (name, path), rs in runs.items():
        print(
            f"| {name} | {path} | {int(rs[0]['model_tokens'])} | {int(rs[0]['tokens'])} | "
            f"{int(statistics.median(r['prefilled'] for r in rs))} | {_cell([r['rollout_s'] for r in rs])} | "
            f"{_cell([r['train_s'] for r in rs])} | {_cell([r['step_s'] for r in rs])} | "
            f"{_cell([r['rollout_cpu_s'] for r in rs])} | {_cell([r['train_cpu_s'] for r in rs])} | "
            f"{_cell([r['step_cpu_s'] for r in rs])} |"
        )
    for name in engines:
        multi, single = runs[(name, "multi")], runs[(name, "single")]
        ratios = {
            key: [m[key] / s[key] for m, s in zip(multi, single, strict=True)]
            for key in ("rollout_s", "step_s", "step_cpu_s", "rollout_cpu_s", "train_cpu_s")
        }
        print(
            f"{name}: multi / single per run, median (min-max): step {_cell(ratios['step_s'], '{:.2f}')}x, "
            f"rollout {_cell(ratios['rollout_s'], '{:.2f}')}x, step CPU time {_cell(ratios['step_cpu_s'], '{:.2f}')}x "
            f"(rollout {_cell(ratios['rollout_cpu_s'], '{:.2f}')}x, train {_cell(ratios['train_cpu_s'], '{:.2f}')}x)"
        )
        for key in ("step_cpu_s", "rollout_cpu_s", "train_cpu_s"):  # each run's ratio, to pool invocations
            print(f"{name}: per run {key} multi / single: {' '.join(f'{r:.3f}' for r in ratios[key])}")


if __name__ == "__main__":
    main()
