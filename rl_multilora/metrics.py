"""Per-adapter metrics: metrics.jsonl (one object per adapter per step), console lines, optional wandb, and a PNG.

Each tenant's metrics are namespaced by its name (`<adapter>/reward_mean` in wandb), so tenants never share a
series. wandb is imported only when enabled.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rl_multilora.batch import AdapterStepStats
from rl_multilora.config import WandbSettings


@dataclass
class StepRecord:
    """One adapter's record of one global step, from the loop to metrics.jsonl, wandb and the console.

    `train` is what the training backend reported for the adapter (None when it had no samples this step); its
    fields appear in the row only then, as they always have. `to_row` is the metrics.jsonl object.
    """

    step: int
    adapter: str
    adapter_step: int
    reward_mean: float | None
    reward_std: float | None
    response_len_mean: float | None
    n_samples: int
    truncated_frac: float | None
    failed_samples: int
    reward_errors: int
    reward_timeouts: int
    reward_crashes: int  # samples lost to a reward that killed its worker (also counted in reward_errors)
    bad_rows: int
    weight_version: int | None
    row_share: float | None = None  # its share of the step's rows (fair shares decide it when rows are capped)
    slot_wait_s: float | None = None  # how long it waited for a slot after it was submitted
    train: AdapterStepStats | None = None
    nonfinite_streak: int = 0  # consecutive steps skipped for non-finite loss/grads (reported with `train`)
    version_lag_max: int | None = None  # async: most versions a sample of this step lagged its adapter's (at train)
    version_lag_mean: float | None = None
    pause_s: float = 0.0
    bytes_pushed: int = 0
    bytes_gathered: int = 0  # LoRA bytes moved between trainer ranks for the sync (0 with one rank)
    adapters_pushed: int = 0
    timings: dict[str, float] = field(default_factory=dict)  # rollout_s, reward_s, train_s, checkpoint_s, sync_s
    paging: dict[str, float] | None = None  # more tenants than slots: resident vs paged, page-ins and their time
    failed_reason: str | None = None  # the most common reason of this step's failed samples (`failed_samples` > 0)
    # the most common error of this step's samples whose reward raised, returned a non-number or timed out (scored
    # `reward.failure_value`, counted in reward_errors / reward_timeouts)
    reward_error_reason: str | None = None
    bad_row_reasons: dict[str, int] | None = None  # `bad_rows` by reason (missing_q, prompt_exceeds_context, ...)

    def to_row(self) -> dict[str, Any]:
        row: dict[str, Any] = {
            "step": self.step,
            "adapter": self.adapter,
            "adapter_step": self.adapter_step,
            "reward_mean": self.reward_mean,
            "reward_std": self.reward_std,
            "response_len_mean": self.response_len_mean,
            "n_samples": self.n_samples,
            "truncated_frac": self.truncated_frac,
            "failed_samples": self.failed_samples,
            "failed_reason": self.failed_reason,
            "reward_errors": self.reward_errors,
            "reward_timeouts": self.reward_timeouts,
            "reward_crashes": self.reward_crashes,
            "reward_error_reason": self.reward_error_reason,
            "bad_rows": self.bad_rows,
            "bad_row_reasons": self.bad_row_reasons,
            "weight_version": self.weight_version,
            "row_share": self.row_share,
            "slot_wait_s": self.slot_wait_s,
        }
        st = self.train
        if st is not None:
            row.update(
                loss=st.loss,
                pg_loss=st.pg_loss,
                kl=st.kl,
                entropy=st.entropy,
                grad_norm=st.grad_norm,
                lr=st.lr,
                clip_frac=st.clip_frac,
                logprob_gap=st.logprob_gap,
                dropped_groups=st.dropped_groups,
                skipped_nonfinite=bool(st.skipped_nonfinite),
                stepped=bool(st.stepped),
                optimizer_steps=st.n_steps,
                stale_samples=st.stale,
                nonfinite_streak=self.nonfinite_streak,
            )
            if st.tis_weight_mean is not None:  # a tenant with `tis` (docs/guides/losses.md)
                row.update(tis_weight_mean=st.tis_weight_mean, tis_capped_frac=st.tis_capped_frac)
        if self.version_lag_max is not None:
            row.update(version_lag_max=self.version_lag_max, version_lag_mean=self.version_lag_mean)
        row.update(pause_s=self.pause_s, bytes_pushed=self.bytes_pushed, adapters_pushed=self.adapters_pushed)
        row.update(bytes_gathered=self.bytes_gathered)
        row.update({k: round(v, 4) for k, v in self.timings.items()})
        if self.paging is not None:
            row.update(self.paging)
        return row


def _clean(v: Any) -> Any:
    if isinstance(v, float) and not math.isfinite(v):
        return None  # JSON has no NaN; null keeps the line parseable
    return v


class MetricsLogger:
    def __init__(self, run_dir: Path, wandb_cfg: WandbSettings | None = None, config: dict | None = None):
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fh = self.path.open("a")
        self._wandb = None
        if wandb_cfg is not None and wandb_cfg.mode != "disabled":
            import wandb

            self._wandb = wandb.init(
                project=wandb_cfg.project,
                entity=wandb_cfg.entity,
                name=wandb_cfg.name or Path(run_dir).name,
                mode=wandb_cfg.mode,
                dir=str(run_dir),
                config=config,
            )

    def log(self, record: StepRecord) -> None:
        """One adapter's metrics for one step: a metrics.jsonl row and, with wandb, `<adapter>/<key>` values."""
        self.log_row(record.to_row())

    def log_row(self, row: dict[str, Any]) -> None:
        """A row with at least `step`, `adapter`, `adapter_step` (a StepRecord's, or an eval result's)."""
        rec = {k: _clean(v) for k, v in row.items()}
        self._fh.write(json.dumps(rec) + "\n")
        self._fh.flush()
        if self._wandb is not None:
            name = rec["adapter"]
            # an eval row's keys only under eval/: its reward_mean (the held-out one) and adapter_step would replace
            # the training series' values logged at the same step
            evaluation = rec.get("kind") == "eval"
            payload = {
                f"{name}/{k}": v
                for k, v in rec.items()
                if k != "adapter" and isinstance(v, int | float) and (not evaluation or k.startswith("eval/"))
            }
            self._wandb.log(payload, step=rec["step"])

    def log_global(self, step: int, values: dict[str, float]) -> None:
        if self._wandb is not None:
            self._wandb.log({f"run/{k}": v for k, v in values.items()}, step=step)

    def close(self) -> None:
        self._fh.close()
        if self._wandb is not None:
            self._wandb.finish()


def eval_line(row: dict[str, Any]) -> str:
    """The console line of an eval row."""
    what = "base (adapter off)" if row.get("eval/base") else f"adapter step {row['adapter_step']}"
    value = row.get("eval/reward_mean")
    extra = "".join(
        f" | {k.removeprefix('eval/')} {v:.3f}" for k, v in row.items() if k.startswith("eval/pass@") and v is not None
    )
    reward = "-" if value is None else f"{value:.3f}"
    failed = f" | {row['eval/errors']} answers failed (counted 0)" if row.get("eval/errors") else ""
    return (
        f"step {row['step']:>4} | {row['adapter']:<12} | held-out reward {reward} on {row['eval/n_prompts']} prompts, "
        f"{what}{extra}{failed}"
    )


def console_line(record: StepRecord) -> str:
    rec = record.to_row()

    def f(k, fmt="{:.3f}"):
        v = rec.get(k)
        return "-" if v is None else fmt.format(v)

    return (
        f"step {rec['step']:>4} | {rec['adapter']:<12} | astep {rec['adapter_step']:>3} | reward {f('reward_mean')} "
        f"± {f('reward_std')} | len {f('response_len_mean', '{:.1f}')} | loss {f('loss', '{:+.4f}')} "
        f"| kl {f('kl', '{:.4f}')} | gnorm {f('grad_norm')} | lr {f('lr', '{:.2e}')} | v{rec.get('weight_version')}"
        + _failed_part(rec)
        + _reward_errors_part(rec)
    )


def _reward_errors_part(rec: dict[str, Any]) -> str:
    """` | reward errors 8/8: <why>` when the reward raised or timed out on samples this step: they score
    `failure_value` and train, so without it the console showed a plausible reward until the tenant FAILED."""
    n = (rec.get("reward_errors") or 0) + (rec.get("reward_timeouts") or 0)
    if not n:
        return ""
    return f" | reward errors {n}/{rec['n_samples']}: {_cut(rec.get('reward_error_reason') or '?')}"


def _failed_part(rec: dict[str, Any]) -> str:
    """` | failed 57/64: <why>` when samples failed this step (the reason shortened), else nothing."""
    if not rec.get("failed_samples"):
        return ""
    return f" | failed {rec['failed_samples']}/{rec['n_samples']}: {_cut(rec.get('failed_reason') or '?')}"


def _cut(reason: str, limit: int = 160) -> str:
    return reason if len(reason) <= limit else reason[: limit - 3] + "..."


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def training_points(rows: list[dict]) -> dict[str, list[tuple[int, float]]]:
    """Each adapter's (adapter step, training reward) points, at the step of the weights that sampled the rewards: a
    row's `adapter_step` counts the optimizer steps the row's update took (`optimizer_steps`), so its samples came
    from `adapter_step - optimizer_steps`, the step a held-out eval of the same weights is plotted at."""
    by_adapter: dict[str, list[tuple[int, float]]] = {}
    for r in rows:
        took = r.get("optimizer_steps", 1 if r.get("stepped") else 0)  # rows written before the field: one step
        by_adapter.setdefault(r["adapter"], []).append((r["adapter_step"] - (took or 0), r["reward_mean"]))
    return by_adapter


def plot_reward_curves(run_dir: str | Path, out: str | Path | None = None) -> Path | None:
    """One reward curve per adapter (per adapter step) into reward_curves.png; None when there is nothing to plot."""
    everything = read_metrics(run_dir)
    rows = [r for r in everything if r.get("reward_mean") is not None and r.get("kind") != "eval"]
    evals = [r for r in everything if r.get("kind") == "eval" and r.get("eval/reward_mean") is not None]
    if not rows:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    by_adapter = training_points(rows)
    fig, ax = plt.subplots(figsize=(7, 4))
    for name, pts in sorted(by_adapter.items()):
        pts.sort()
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        (raw,) = ax.plot(xs, ys, alpha=0.3, linewidth=1)
        # A trailing 5-step mean: per-step means over a few prompts are noisy.
        smooth = [sum(ys[max(0, i - 4) : i + 1]) / len(ys[max(0, i - 4) : i + 1]) for i in range(len(ys))]
        ax.plot(xs, smooth, color=raw.get_color(), linewidth=2, label=f"{name} (train, 5-step mean)")
        mine = [r for r in evals if r["adapter"] == name]
        base = [r["eval/reward_mean"] for r in mine if r.get("eval/base")]
        held = sorted((r["adapter_step"], r["eval/reward_mean"]) for r in mine if not r.get("eval/base"))
        if base:
            ax.axhline(base[-1], color=raw.get_color(), linestyle="--", linewidth=1, label=f"{name} (base, held-out)")
        if held:
            ax.plot(
                [p[0] for p in held],
                [p[1] for p in held],
                "o-",
                color=raw.get_color(),
                markersize=4,
                linewidth=1,
                label=f"{name} (held-out)",
            )
    ax.set_xlabel("adapter step (training: of the weights that sampled it)")
    ax.set_ylabel("mean reward")
    ax.set_title("Reward per adapter: training (lines), held-out (dots), base (dashed)")
    ax.grid(alpha=0.3)
    ax.legend()
    out = Path(out) if out else Path(run_dir) / "reward_curves.png"
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
    return out
