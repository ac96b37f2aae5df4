"""Training backends: the seam between the run loop and whatever holds the trainable slots.

The loop and the tenant manager talk only to `TrainingBackend` (`base.py`). `LocalBackend` (`local.py`) is one
process on one device: the multi-LoRA model and the GRPO trainer in-process. A Ray + FSDP2 backend (trainer ranks as
actors) or a Megatron backend plugs in behind the same interface.
"""

from rl_multilora.backends.base import AdapterStepStats, TrainingBackend

__all__ = ["AdapterStepStats", "TrainingBackend"]
