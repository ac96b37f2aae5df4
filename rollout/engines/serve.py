"""`rl-multilora engine-serve`: the embedded engine served over SGLang's HTTP API (`main(argv)`).

Design choices:
- Heavy imports (transformers, the model, the engine, the aiohttp server) happen inside the functions, so the
  CLI can import this module cheaply; `http_server.py` re-exports `main` without an import cycle.
- Arguments are checked before the model loads, with one message per bad value in the project's grammar.
- Binds 127.0.0.1 unless told otherwise; `--api-key` (or env RL_MULTILORA_API_KEY) protects every endpoint but
  `/health*`, as SGLang does.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rollout.engines.base import RolloutEngine


def build_embedded_engine(
    model_dir: str, max_loras: int = 8, max_rank: int = 64, target_modules: str = "all-linear"
) -> tuple[RolloutEngine, Any]:
    """The embedded engine and tokenizer for an HF model folder (what `engine-serve` serves)."""
    # Heavy imports stay here: serving itself only needs aiohttp.
    from transformers import AutoTokenizer

    from rl_multilora.lora import MultiLoRAModel
    from rollout.engines.embedded import EmbeddedEngine

    targets: str | list[str] = target_modules
    if targets != "all-linear":
        targets = [t.strip() for t in target_modules.split(",") if t.strip()]
    model = MultiLoRAModel.from_pretrained(model_dir, max_loras=max_loras, max_rank=max_rank, target_modules=targets)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    return EmbeddedEngine(model, tokenizer), tokenizer


def main(argv: list[str] | None = None) -> int:
    """`rl-multilora engine-serve`: serve the embedded engine over SGLang's HTTP API."""
    parser = argparse.ArgumentParser(prog="rl-multilora engine-serve", description=main.__doc__)
    parser.add_argument("--model", required=True, help="model folder (HF format) to serve")
    parser.add_argument("--port", type=int, default=30000, help="TCP port (default 30000, as SGLang)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1: this host only)")
    parser.add_argument(
        "--api-key",
        default=os.environ.get("RL_MULTILORA_API_KEY"),
        help="require 'Authorization: Bearer <key>' on every endpoint but /health* (env RL_MULTILORA_API_KEY)",
    )
    parser.add_argument("--max-loras", type=int, default=8, help="adapter slots")
    parser.add_argument("--max-rank", type=int, default=64, help="largest LoRA rank a slot holds")
    parser.add_argument("--target-modules", default="all-linear", help="'all-linear' or comma-separated names")
    args = parser.parse_args(argv)
    for key in ("port", "max_loras", "max_rank"):
        if getattr(args, key) < 1:
            flag = f"--{key.replace('_', '-')}"
            parser.error(f"{flag}={getattr(args, key)!r} is not allowed; allowed: a positive integer")
    if not Path(args.model).is_dir():
        parser.error(f"--model={args.model!r} is not allowed; allowed: an existing model folder (HF format)")
    from rollout.engines.http_server import serve

    engine, tokenizer = build_embedded_engine(args.model, args.max_loras, args.max_rank, args.target_modules)
    try:
        serve(engine, host=args.host, port=args.port, api_key=args.api_key, model_name=args.model, tokenizer=tokenizer)
    finally:
        engine.close()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
