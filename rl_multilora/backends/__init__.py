"""Training backends: the seam between the run loop and whatever holds the trainable slots.

The loop and the tenant manager talk only to `TrainingBackend` (`base.py`). `LocalBackend` (`local.py`) is one
process on one device: the multi-LoRA model and the GRPO trainer in-process. `RayFSDPBackend` (`ray_fsdp.py`,
`trainer.world_size > 1`) runs trainer ranks as Ray actors over a model sharded with FSDP2 (`fsdp.py`). A Megatron
backend would plug in behind the same interface.
"""

from rl_multilora.backends.base import TrainingBackend
from rl_multilora.batch import AdapterStepStats

__all__ = ["AdapterStepStats", "TrainingBackend"]
