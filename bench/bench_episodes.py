"""What a step with multi-turn tenants costs: episodes vs the same tokens generated and trained single-turn.

Workload: `tenants` adapters, `groups` prompt groups of `group` samples each per tenant. Multi-turn: every sample is
an episode of `turns` model turns of exactly `turn_tokens` tokens (EOS off), the environment answering each turn
but the last with a fixed message (the chat template's tokens for it, loss-masked). Single-turn, the same tokens:
each sample's prompt is the episode's prompt followed by as many tokens as its environment turns had (prefilled,
as the episode's environment tokens are), and it generates all `turns * turn_tokens` model tokens in one turn; the
trainer gets rows of the same length with the same number of loss positions. Both run in one process on one engine and one trainer, alternating, for
`--repeats` timed runs after a warm-up; medians and the ratio multi / single per phase.

The multi-turn rollout re-prefills the context at each turn (the embedded engine keeps no cache between requests),
so its extra cost is prefill of the growing context plus the environment's turns; training costs the same.

    python bench/bench_episodes.py [--quick]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # for tests.* when run as a script

import torch  # noqa: E402

from rl_multilora.config import GRPOSettings, OptimSettings  # noqa: E402
from rl_multilora.lora import MultiLoRAModel  # noqa: E402
from rl_multilora.trainer import MultiLoRATrainer  # noqa: E402
from rollout.engines.embedded import EmbeddedEngine  # noqa: E402
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a smaller model and fewer repeats (a smoke run)")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    hidden, layers, tenants, groups, group, turns, turn_tokens = (
        (32, 2, 2, 2, 2, 3, 4, 2) if args.quick else (128, 4, 4, 2, 4, 3, 16)
    )[:7]
    repeats = 2 if args.quick else args.repeats
    torch.manual_seed(0)
    tok = tiny_tokenizer()
    model = MultiLoRAModel(tiny_model(hidden=hidden, layers=layers), max_loras=tenants, max_rank=8)
    trainer = MultiLoRATrainer(model, GRPOSettings(micro_batch_size=64, drop_uniform_groups=False), pad_token_id=0)
    for t in range(tenants):
        model.add_adapter(f"t{t}", rank=8, alpha=16, seed=t)
        trainer.add_adapter(f"t{t}", OptimSettings(), lr=1e-3, max_steps=10_000)
    engine = EmbeddedEngine(model, tok, max_batch_size=256, eos_token_ids=[])
    for t in range(tenants):
        engine.load_adapter(f"t{t}", model.adapter_state_dict(f"t{t}"), model.peft_config(f"t{t}"), version=0)
    spec = EnvironmentSpec(path="__main__:FixedTurns", kwargs={"turns": turns}, max_turns=turns, max_tokens=10_000)
    multi_sampling = SamplingParams(temperature=1.0, max_new_tokens=turn_tokens)
    single_sampling = SamplingParams(temperature=1.0, max_new_tokens=turns * turn_tokens)

    env_tokens: list[int] = []  # per sample, how many environment tokens its episode had (set by the warm-up)

    def step(env: EnvironmentSpec | None) -> dict[str, float]:
        sampling = multi_sampling if env else single_sampling
        groups_ = _samples(tok, tenants, groups, group, env)
        if env is None:  # the episode's environment tokens move into the prompt: the same prefill work
            flat = [s for g in groups_ for s in g]
            for s, n in zip(flat, env_tokens, strict=True):
                s.prompt_ids = s.prompt_ids + [tok.convert_tokens_to_ids("x")] * n
        t0 = time.perf_counter()
        samples = GenerateState(engine, tok, MultiLoRAHooks(), sampling).run_sync(groups_)
        t1 = time.perf_counter()
        if env is not None and not env_tokens:
            env_tokens.extend(len(s.loss_mask) - sum(s.loss_mask) for s in samples)
        for i, s in enumerate(samples):
            s.reward = float(i % 2)  # every group has signal: both paths train every row
        stats = trainer.train_step(samples, {f"t{t}": 0 for t in range(tenants)})
        t2 = time.perf_counter()
        tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
        model_tokens = sum(sum(s.loss_mask) for s in samples)
        assert all(st.stepped for st in stats.values()), stats
        return {"rollout_s": t1 - t0, "train_s": t2 - t1, "tokens": tokens, "model_tokens": model_tokens}

    step(spec), step(None)  # warm-up
    runs: dict[str, list[dict[str, float]]] = {"multi": [], "single": []}
    for _ in range(repeats):
        runs["multi"].append(step(spec))
        runs["single"].append(step(None))
    print(
        f"# {tenants} tenants x {groups} groups x {group} samples; episodes of {turns} turns x {turn_tokens} tokens; "
        f"model hidden {hidden}, {layers} layers; {repeats} runs each, medians (min-max); torch "
        f"{torch.__version__}, {torch.get_num_threads()} threads"
    )
    print("| path | model tokens | all tokens (prompt + response) | rollout s | train s | step s |")
    print("|---|---|---|---|---|---|")
    med = {}
    for path, rs in runs.items():
        cell = {}
        for key in ("rollout_s", "train_s"):
            vals = [r[key] for r in rs]
            cell[key] = f"{statistics.median(vals):.3f} ({min(vals):.3f}-{max(vals):.3f})"
        totals = [r["rollout_s"] + r["train_s"] for r in rs]
        med[path] = {k: statistics.median(r[k] for r in rs) for k in ("rollout_s", "train_s")}
        med[path]["step_s"] = statistics.median(totals)
        print(
            f"| {path} | {int(rs[0]['model_tokens'])} | {int(rs[0]['tokens'])} | {cell['rollout_s']} | "
            f"{cell['train_s']} | {med[path]['step_s']:.3f} ({min(totals):.3f}-{max(totals):.3f}) |"
        )
    ratio = {k: med["multi"][k] / med["single"][k] for k in ("rollout_s", "train_s", "step_s")}
    print(
        f"multi / single (medians): rollout {ratio['rollout_s']:.2f}x, train {ratio['train_s']:.2f}x, "
        f"step {ratio['step_s']:.2f}x"
    )


if __name__ == "__main__":
    main()
