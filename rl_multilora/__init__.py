"""rl-multilora: GRPO training of many LoRA adapters at once on one shared frozen base."""

__version__ = "0.1.0"


def __getattr__(name):
    # Lazy so that `import rl_multilora` (e.g. for the CLI's argument parsing) does not import torch.
    if name == "MultiLoRAModel":
        from rl_multilora.lora import MultiLoRAModel

        return MultiLoRAModel
    raise AttributeError(name)


__all__ = ["MultiLoRAModel"]
