"""Run tinker-cookbook recipes, unmodified, against a model this repo serves.

    python -m rl_multilora.tinker.cookbook sl_loop --model-dir artifacts/tiny/model \\
        base_url=http://127.0.0.1:8000 model_name=meta-llama/Llama-3.2-1B:tiny batch_size=8 max_steps=5

runs `tinker_cookbook.recipes.sl_loop.main` (or `rl_loop`, or any module of the cookbook with a chz `main`) with its
own command line (chz `key=value`), after registering the served model's tokenizer with the cookbook. Nothing of
the cookbook is patched: only its public registries are used.

Why a launcher and why that model name:

- `sl_loop` and `rl_loop` call `get_tokenizer(model_name)`, which loads a tokenizer from the Hub unless one is
  registered under that name (`tokenizer_utils.register_tokenizer`, public). The launcher registers the tokenizer of
  `--model-dir` (the folder the server serves) under `model_name`, in the recipe's own process: a registry lives in
  one process, so it must be the process that runs the recipe.
- Both recipes then call `model_info.get_recommended_renderer_name(model_name)`, a fixed table with no public way to
  add a model. Its lookup drops everything after the first ':' (the cookbook's checkpoint-suffix convention), while
  the tokenizer registry and `create_lora_training_client(base_model=...)` see the whole name. So the served model
  is named `<table entry>:<anything>`, the table entry chosen for its renderer: `meta-llama/Llama-3.2-1B` (and the
  other base models of the table) gives `role_colon`, a plain-text `User: ... / Assistant: ...` format that any
  tokenizer renders; a ChatML model (e.g. SmolLM2) can take `Qwen/Qwen3-4B-Instruct-2507` (`qwen3_instruct`, whose
  `<|im_start|>` / `<|im_end|>` its tokenizer has). The server is started with that name as `--base-model-name`.
  `check_model_name` refuses, before any request, a name whose table entry or renderer the cookbook does not know.
- Recipes that take a `renderer_name` (sl_basic, rl_basic, math_rl, ...) can also use `rl_multilora/chat_template`,
  registered here with `renderers.register_renderer` (public): it renders with the served model's own chat template.
- The recipes load their data with `datasets.load_dataset("openai/gsm8k", "main")` and
  `load_dataset("HuggingFaceH4/no_robots")`. `datasets` reads a local folder of that name in the working directory
  before the Hub, which is how an offline machine (and `tests/test_tinker_cookbook.py`) gives them data.

`rl_loop` runs as shipped, with its default loss `stable_reinforce`: the server records what its sampling client
samples (`record_stability_info`) and checks each datum's provenance against it. The objective it computes under that
name is this project's own, not Tinker's (Tinker does not publish it; docs/guides/tinker.md states the formula), so
its numbers differ from Tinker's service; `loss_fn=importance_sampling` (or `cispo`, `gspo`) picks a published loss.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_RENDERER = "rl_multilora/chat_template"
INSTALL = (
    'pip install -e ".[cookbook]" && pip install --no-deps "tinker-cookbook==0.6.1"  '
    "(its tml-renderers>=0.4.1 requirement is not on PyPI; only Inkling models import it)"
)


def _cookbook():
    try:
        from tinker_cookbook import model_info, renderers, tokenizer_utils
    except ModuleNotFoundError as e:
        raise SystemExit(f"tinker-cookbook is not importable ({e}); install it with: {INSTALL}") from e
    return model_info, renderers, tokenizer_utils


def check_model_name(model_name: str) -> str:
    """The renderer the cookbook's table gives `model_name`; a ValueError naming the fix when it has none."""
    model_info, _, _ = _cookbook()
    try:
        return model_info.get_recommended_renderer_name(model_name)
    except Exception as e:  # KeyError, ValueError, or the cookbook's ConfigurationError for an unknown org
        raise ValueError(
            f"model_name={model_name!r} has no entry in tinker-cookbook's model table ({type(e).__name__}: {e}), so "
            "sl_loop / rl_loop cannot pick a renderer for it; allowed: '<table entry>:<your name>', e.g. "
            "'meta-llama/Llama-3.2-1B:tiny' (renderer role_colon), with the server's --base-model-name the same"
        ) from e


def register(model_name: str, model_dir: str | Path, chat_template_as: str | None = None) -> None:
    """Register `model_dir`'s tokenizer under `model_name` and the chat-template renderer (as
    `CHAT_TEMPLATE_RENDERER`, and also as `chat_template_as`, e.g. the table's `role_colon`, when given), in this
    process."""
    _, renderers, tokenizer_utils = _cookbook()
    model_dir = Path(model_dir)
    if not (model_dir / "tokenizer_config.json").is_file():
        raise ValueError(f"model_dir={str(model_dir)!r} holds no tokenizer_config.json; allowed: a HF model folder")

    def tokenizer():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(str(model_dir))

    tokenizer_utils.register_tokenizer(model_name, tokenizer)
    for name in {CHAT_TEMPLATE_RENDERER, chat_template_as} - {None}:
        renderers.register_renderer(name, lambda tok, image_processor=None: ChatTemplateRenderer(tok))


def _renderer_base():
    from tinker_cookbook.renderers import base

    return base


class ChatTemplateRenderer:
    """A cookbook Renderer over the tokenizer's own chat template (`apply_chat_template`), text messages only.

    Defined lazily (the cookbook is an optional dependency): `ChatTemplateRenderer(tokenizer)` returns an instance of
    a subclass of the cookbook's `Renderer`. Each message is rendered as the template renders the conversation up to
    it minus the conversation before it, so the tokens are exactly the template's; the header is what the template
    puts before the content, the output the content and what follows it (end-of-turn).
    """

    def __new__(cls, tokenizer: Any):
        return _chat_template_class()(tokenizer)


_CLASS: list[type] = []


def _chat_template_class() -> type:
    if _CLASS:
        return _CLASS[0]
    base = _renderer_base()
    import tinker

    class _ChatTemplate(base.Renderer):
        @property
        def has_extension_property(self) -> bool:
            return True

        def _text(self, messages: list[dict], generation: bool = False) -> str:
            return self.tokenizer.apply_chat_template(
                [{"role": m["role"], "content": base.ensure_text(m["content"])} for m in messages],
                tokenize=False,
                add_generation_prompt=generation,
            )

        def _alone(self, message: dict) -> str:
            # what the template writes for `message` after another message: [u, m] less [u] (no template renders [])
            user = {"role": "user", "content": "u"}
            return self._text([user, message])[len(self._text([user])) :]

        @property
        def _bos_tokens(self) -> list[int]:
            # the template's prelude (BOS, a default system turn): [u] less what u alone is
            user = {"role": "user", "content": "u"}
            first, alone = self._text([user]), self._alone(user)
            prelude = first[: len(first) - len(alone)] if first.endswith(alone) else ""
            return self.tokenizer.encode(prelude, add_special_tokens=False) if prelude else []

        def render_message(self, message, ctx):
            mark = "\x00rl-multilora-content\x00"  # split the template's text of the message at its content
            head, tail = self._alone({"role": message["role"], "content": mark}).split(mark, 1)
            tail = base.ensure_text(message["content"]) + tail
            enc = lambda s: tinker.types.EncodedTextChunk(tokens=self.tokenizer.encode(s, add_special_tokens=False))  # noqa: E731
            return base.RenderedMessage(header=enc(head), output=[enc(tail)])

        def get_stop_sequences(self) -> list[int]:
            return [self.tokenizer.eos_token_id]

        def parse_response(self, response: list[int]):
            eos = self.tokenizer.eos_token_id
            ended = bool(response) and response[-1] == eos
            text = self.tokenizer.decode(response[:-1] if ended else response, skip_special_tokens=True)
            kind = base.ParseTermination.EOS if ended else base.ParseTermination.MALFORMED
            return base.Message(role="assistant", content=text.strip()), kind

    _CLASS.append(_ChatTemplate)
    return _ChatTemplate


RECIPES = {"sl_loop": "tinker_cookbook.recipes.sl_loop", "rl_loop": "tinker_cookbook.recipes.rl_loop"}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rl_multilora.tinker.cookbook",
        description="Run a tinker-cookbook recipe unmodified against a model served by rl-multilora.",
        epilog="Every argument after the options goes to the recipe (chz key=value), e.g. base_url=... "
        "model_name=meta-llama/Llama-3.2-1B:tiny max_steps=5. TINKER_API_KEY is the server's token.",
    )
    p.add_argument("recipe", help=f"{' | '.join(RECIPES)} | a module of the cookbook with a chz main")
    p.add_argument("--model-dir", required=True, help="the folder the server serves (its tokenizer is registered)")
    p.add_argument("--renderer", choices=("table", "chat_template"), default="table",
                   help="table: the renderer the cookbook's model table names (e.g. role_colon); chat_template: "
                   "that renderer name renders with the served model's own chat template, in this process")  # fmt: skip
    args, rest = p.parse_known_args(argv)
    names = [a.split("=", 1)[1] for a in rest if a.startswith("model_name=")]
    if not names:
        p.error("model_name=... is required: the served --base-model-name, '<cookbook table entry>:<your name>'")
    try:
        renderer = check_model_name(names[-1])
        register(names[-1], args.model_dir, renderer if args.renderer == "chat_template" else None)
    except ValueError as e:
        p.error(str(e))
    module = importlib.import_module(RECIPES.get(args.recipe, args.recipe))
    import chz

    chz.nested_entrypoint(module.main, argv=rest)
    return 0


if __name__ == "__main__":
    sys.exit(main())
