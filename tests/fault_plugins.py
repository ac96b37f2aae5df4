"""Faults for tests/test_resume.py and tests/test_faults.py: a self-killing `rl-multilora` and faulty rewards.

`python -m tests.fault_plugins POINT:N rl-multilora-args...` runs the CLI (e.g. `run CONFIG`) in this process and
SIGKILLs it, with no chance to clean up, at the N-th occurrence of POINT:
- `rollout`: right after the N-th sample finishes generating (other samples of the step are still in flight);
- `train`: right after the N-th per-adapter optimizer step (that step's other adapters are not stepped yet, and
  neither this adapter's scheduler nor its step counter);
- `checkpoint`: in the middle of the N-th checkpoint write (the PEFT files are in the temp folder, the optimizer
  state and checkpoint.json are not).
The faults are injected from outside by patching public seams (a hooks method, a torch optimizer post-hook, the
checkpoint module's `save_tree`), so the library carries no fault-injection code.
"""

from __future__ import annotations

import itertools
import os
import signal
import sys
from typing import Any

POINTS = ("rollout", "train", "checkpoint")


def arm(point: str, n: int) -> None:
    """Make this process SIGKILL itself at the `n`-th occurrence of `point` (one of POINTS)."""
    if point not in POINTS or n < 1:
        raise ValueError(f"kill point {point}:{n} is not allowed; use one of {POINTS} and N >= 1")
    count = itertools.count(1)

    def tick() -> None:
        if next(count) == n:
            sys.stderr.flush()
            os.kill(os.getpid(), signal.SIGKILL)

    if point == "rollout":
        from rollout.generate_state import MultiLoRAHooks

        done = MultiLoRAHooks.on_sample_done

        def on_sample_done(self, state, sample) -> None:
            done(self, state, sample)
            tick()

        MultiLoRAHooks.on_sample_done = on_sample_done
    elif point == "train":
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda optimizer, args, kwargs: tick())
    else:
        import rl_multilora.checkpoint as checkpoint

        save_tree = checkpoint.save_tree

        def killing_save_tree(obj: Any, folder, stem: str) -> None:
            tick()
            save_tree(obj, folder, stem)

        checkpoint.save_tree = killing_save_tree


def main(argv: list[str]) -> int:
    import torch

    from rl_multilora.cli import main as cli_main

    # The same thread count as tests/conftest.py, so this process computes exactly what the test process does.
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    point, n = argv[0].split(":")
    arm(point, int(n))
    return cli_main(argv[1:])


# -- faulty rewards (custom rewards by import path, `tests.fault_plugins:<name>`) -----------------------------------


def overflow_reward(prompt: str, response: str, label: Any, metadata: dict[str, Any], *, from_epoch: int = 0) -> float:
    """1.0 when the response has a digit while the adapter is in an epoch before `from_epoch`; from then on, finite
    but huge for half of each group, so the group mean overflows and the advantages are NaN.

    This is how a reward returning inf reaches the trainer in spirit (the executor already refuses a literal inf or
    NaN and counts it as an error); the trainer must skip that tenant's step, not train on NaN.

    >>> overflow_reward("p", "r2", "l", {"epoch": 0, "sample_index": 0}, from_epoch=1)
    1.0
    >>> overflow_reward("p", "r", "l", {"epoch": 1, "sample_index": 0}, from_epoch=1) > 1e307
    True
    """
    if metadata["epoch"] < from_epoch:
        return float(any(c.isdigit() for c in response))
    return 1.7e308 if metadata["sample_index"] % 2 == 0 else 0.0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
