"""OpenAI-compatible routes on the engine server, as SGLang serves them: `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, so the `openai` client and evaluation harnesses that speak that API can query any tenant.

- `/v1/models` lists the base (id = the served model name) and one card per loaded adapter (id = the adapter name,
  `parent` = the base), as SGLang lists LoRA adapters.
- `model` picks the adapter: `"<base>:<adapter>"` (SGLang's syntax), the adapter's name, or the base's name.
- Non-streaming only, `n = 1`; `max_tokens` (`max_completion_tokens`), `temperature`, `top_p`, `stop` and `seed`
  map to the engine's sampling settings; EOS ends a completion. Chat prompts use the tokenizer's chat template.
- The same auth as the rest of the server (a Bearer key, which the `openai` client sends as its `api_key`), the
  same pause handling, and errors in OpenAI's shape `{"error": {"message", "type", "code"}}` with status 400/404.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from aiohttp import web

from rollout.server.state import STATE_KEY, strict_json_loads
from rollout.types import GenerateRequest, SamplingParams


class OpenAIRequestError(ValueError):
    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


def _error(message: str, status: int) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"error": {"message": message, "type": kind, "code": status}}, status=status)


def _resolve_model(state, model: Any) -> str | None:
    """The engine adapter a request's `model` names (None: the base)."""
    loaded = state.engine.adapter_versions()
    if not isinstance(model, str) or not model:
        raise OpenAIRequestError(f"model={model!r} is not allowed; allowed: the base's name or an adapter's")
    base, sep, adapter = model.rpartition(":")
    if sep and base == state.model_name:
        model = adapter
    if model == state.model_name:
        return None
    if model not in loaded:
        known = ", ".join([state.model_name, *sorted(loaded)])
        raise OpenAIRequestError(f"model={model!r} is not allowed; allowed: one of {known}", status=404)
    return model


def _sampling(body: dict[str, Any], tokenizer) -> SamplingParams:
    def number(key: str, default: float, low: float, high: float | None = None) -> float:
        value = body.get(key, default)
        if value is None:
            return default
        if isinstance(value, bool) or not isinstance(value, int | float) or value < low or (high and value > high):
            bounds = f"a number in [{low}, {high}]" if high else f"a number >= {low}"
            raise OpenAIRequestError(f"{key}={value!r} is not allowed; allowed: {bounds}")
        return float(value)

    if body.get("n", 1) != 1:
        raise OpenAIRequestError(f"n={body.get('n')!r} is not allowed; allowed: 1")
    if body.get("stream"):
        raise OpenAIRequestError(f"stream={body.get('stream')!r} is not allowed; allowed: false")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens", 16))
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise OpenAIRequestError(f"max_tokens={max_tokens!r} is not allowed; allowed: an integer >= 1")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise OpenAIRequestError(f"stop={body.get('stop')!r} is not allowed; allowed: a string or a list of strings")
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise OpenAIRequestError(f"seed={seed!r} is not allowed; allowed: an integer")
    eos = getattr(tokenizer, "eos_token_id", None)
    return SamplingParams(
        temperature=number("temperature", 1.0, 0.0, 2.0),
        top_p=number("top_p", 1.0, 1e-9, 1.0),
        max_new_tokens=max_tokens,
        stop=list(stop),
        stop_token_ids=[eos] if eos is not None else [],
        seed=seed,
    )


async def _complete(request: web.Request, chat: bool) -> web.Response:
    state = request.app[STATE_KEY]
    if state.tokenizer is None:
        return _error("this server has no tokenizer: the OpenAI routes need one (engine-serve loads it)", 400)
    try:
        body = await request.json(loads=strict_json_loads)
    except ValueError as e:
        return _error(f"the body is not valid JSON: {e}", 400)
    if not isinstance(body, dict):
        return _error("the body must be a JSON object", 400)
    tok = state.tokenizer
    try:
        adapter = _resolve_model(state, body.get("model"))
        sampling = _sampling(body, tok)
        if chat:
            messages = body.get("messages")
            if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
                raise OpenAIRequestError("messages is not allowed; allowed: a non-empty list of {role, content}")
            # Templating and tokenizing a long prompt take seconds: in a thread, never on the event loop.
            text = await asyncio.to_thread(
                tok.apply_chat_template, messages, add_generation_prompt=True, tokenize=False
            )
            ids = (await asyncio.to_thread(tok, text, add_special_tokens=False))["input_ids"]
        else:
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
                prompt = prompt[0]
            if isinstance(prompt, str) and prompt:
                ids = (await asyncio.to_thread(tok, prompt))["input_ids"]
            elif isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
                ids = list(prompt)
            else:
                raise OpenAIRequestError(
                    f"prompt={str(prompt)[:80]} is not allowed; allowed: a non-empty string or a list of token ids"
                )
    except OpenAIRequestError as e:
        return _error(str(e), e.status)
    await state.running.wait()  # as /generate: wait out a weight sync's pause
    req = GenerateRequest(input_ids=list(ids), adapter=adapter, sampling=sampling, rid=uuid.uuid4().hex)
    (result,) = await state.engine.agenerate([req])
    if result.finish_reason == "error" and " is not allowed; allowed: " in (result.error or ""):
        # The engine's request checks (e.g. a prompt longer than the context) answer in this grammar: the request's
        # fault, a 400 the openai client does not retry (a 503 made it retry three times).
        return _error(result.error, 400)
    if result.finish_reason in ("error", "abort"):
        return _error(f"generation did not finish: {result.error or result.finish_reason}", 503)
    text = tok.decode(result.output_ids, skip_special_tokens=True)
    finish = "length" if result.finish_reason == "length" else "stop"
    usage = {
        "prompt_tokens": len(ids),
        "completion_tokens": len(result.output_ids),
        "total_tokens": len(ids) + len(result.output_ids),
    }
    common = {"id": f"{'chatcmpl' if chat else 'cmpl'}-{req.rid}", "created": int(time.time()), "model": body["model"]}
    if chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        return web.json_response({**common, "object": "chat.completion", "choices": [choice], "usage": usage})
    choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
    return web.json_response({**common, "object": "text_completion", "choices": [choice], "usage": usage})


async def _chat_completions(request: web.Request) -> web.Response:
    return await _complete(request, chat=True)


async def _completions(request: web.Request) -> web.Response:
    return await _complete(request, chat=False)


async def _models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    now = int(time.time())
    base = {"id": state.model_name, "object": "model", "created": now, "owned_by": "rl-multilora"}
    cards = [{**base, "root": state.model_name, "parent": None}]
    for name in sorted(state.engine.adapter_versions()):
        cards.append({**base, "id": name, "root": name, "parent": state.model_name})
    return web.json_response({"object": "list", "data": cards})


def add_openai_routes(app: web.Application) -> None:
    app.router.add_get("/v1/models", _models)
    app.router.add_post("/v1/completions", _completions)
    app.router.add_post("/v1/chat/completions", _chat_completions)
