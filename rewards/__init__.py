"""Reward functions for rl-multilora: built-ins by name, custom functions by import path, a fault-isolating executor.

Every tenant's `RewardSpec` (rollout.types) names exactly one reward:

- `name`: a built-in, one of `BUILTINS` (gsm8k, math, dapo, exact_match, f1, format, reasoning_gym);
- `path`: a custom function, `"package.module:function"`.

The custom reward signature (the contract, checked by `validate` when an adapter is registered)::

    def my_reward(prompt: str, response: str, label: Any, metadata: dict, **kwargs) -> float: ...
    async def my_reward(prompt, response, label, metadata, **kwargs) -> float: ...   # also fine

    @rewards.batched                                   # one call per adapter per step
    def my_rewards(prompts: list[str], responses: list[str], labels: list, metadatas: list[dict],
                   **kwargs) -> list[float]: ...

The four data arguments are passed positionally (or by those names, for keyword-only functions); the keys of
`spec.kwargs` are passed as keyword arguments. `label` is whatever the dataset row holds; `metadata` is the
sample's metadata dict. The return value must be a finite number. `@rewards.with_format_check(check)` declares
the answer format so `spec.format_bonus` can be used with a custom reward.

Entry points:

- `validate(spec)` / `resolve(spec)`: raise `RewardConfigError` (a ValueError) naming the field, the value and
  what is allowed; `resolve` returns the function.
- `score(spec, prompt, response, label, metadata=None)`: one sample, in this process (tests, notebooks).
- `RewardExecutor(num_workers=2)`: the training loop's scorer. `executor.score_samples(samples)` sets
  `sample.reward` on every sample and returns a `RewardReport` with per-adapter error / timeout counts. Rewards run
  in persistent worker processes; a reward that raises or runs past `spec.timeout_s` scores `spec.failure_value`
  for that sample only, and a hung worker is killed and replaced (the adapter's samples still queued then are not
  started: no reward, marked FAILED). `executor.wait_ready()` blocks until the
  workers have started. Workers isolate faults, not privileges: they run your code as the trainer's user.
"""

from rewards import builtin as builtin
from rewards import reasoning_gym as reasoning_gym
from rewards.executor import RewardExecutor, RewardReport
from rewards.registry import (
    BUILTINS,
    RewardConfigError,
    RewardFn,
    batched,
    register,
    resolve,
    score,
    validate,
    with_format_check,
)

__all__ = [
    "BUILTINS",
    "RewardConfigError",
    "RewardExecutor",
    "RewardFn",
    "RewardReport",
    "batched",
    "register",
    "resolve",
    "score",
    "validate",
    "with_format_check",
]
