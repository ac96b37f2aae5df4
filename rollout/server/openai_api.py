"""OpenAI-compatible routes on the engine server, as SGLang serves them: `/v1/models`, `/v1/completions`,
`/v1/chat/completions`, so the `openai` client and evaluation harnesses that speak that API can query any tenant.

- `/v1/models` lists the base (id = the served model name) and one card per loaded adapter (id = the adapter name,
  `parent` = the base), as SGLang lists LoRA adapters.
- `model` picks the adapter: `"<base>:<adapter>"` (SGLang's syntax), the adapter's name, or the base's name.
- Non-streaming only, `n = 1`; `max_tokens` (`max_completion_tokens`), `temperature`, `top_p`, `stop` and `seed`
  map to the engine's sampling settings; EOS ends a completion. Chat prompts use the tokenizer's chat template.
- The same auth as the rest of the server (a Bearer key, which the `openai` client sends as its `api_key`), the
  same pause handling and body limit (413), and errors in OpenAI's shape
  `{"error": {"message", "type", "param", "code"}}`: a request's mistake is a 4xx with type
  "invalid_request_error" and `param` naming the field (400; 404 `model_not_found` for an unknown model), which the
  `openai` client does not retry. Non-finite numbers (NaN, Infinity, 1e999) are refused naming the field.
- A prompt longer than the context, or a prompt plus `max_tokens` reaching it, is a 400 with SGLang's messages and
  OpenAI's code `context_length_exceeded` (param `prompt` / `messages`). As in SGLang, completions always check
  `max_tokens` (default 16); chat checks it only when given (otherwise the context caps the output).
- Templating and tokenizing a prompt run in a worker thread, as does parsing the body: a prompt of tens of MB takes
  seconds to tokenize, and on the event loop that stalled every request, `/health` included.
"""

from __future__ import annotations

import asyncio
import math
import time
import uuid
from typing import Any

from aiohttp import web

from rollout.server.state import SHUTDOWN_MESSAGE, STATE_KEY, NonFiniteNumberError, context_error, read_json
from rollout.types import GenerateRequest, SamplingParams

_SEED_RANGE = 2**64  # the engine's generators take an unsigned 64-bit seed


class OpenAIRequestError(ValueError):
    """A request's mistake: `param` is the field at fault, `code` OpenAI's machine-readable code (or None)."""

    def __init__(self, message: str, param: str | None, status: int = 400, code: str | None = None):
        super().__init__(message)
        self.param, self.status, self.code = param, status, code


def _error(message: str, status: int, param: str | None = None, code: str | None = None) -> web.Response:
    """OpenAI's error body. 4xx are the request's fault (the `openai` client retries none but 408/409/429)."""
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response(
        {"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status
    )


def _resolve_model(state, model: Any) -> str | None:
    """The engine adapter a request's `model` names (None: the base)."""
    loaded = state.engine.adapter_versions()
    if not isinstance(model, str) or not model:
        raise OpenAIRequestError(f"model={model!r} is not allowed; allowed: the base's name or an adapter's", "model")
    base, sep, adapter = model.rpartition(":")
    if sep and base == state.model_name:
        model = adapter
    if model == state.model_name:
        return None
    if model not in loaded:
        known = ", ".join([state.model_name, *sorted(loaded)])
        raise OpenAIRequestError(
            f"model={model!r} is not allowed; allowed: one of {known}", "model", status=404, code="model_not_found"
        )
    return model


def _sampling(body: dict[str, Any], tokenizer) -> SamplingParams:
    def number(key: str, default: float, low: float, high: float) -> float:
        value = body.get(key, default)
        if value is None:
            return default
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not low <= value <= high
        ):
            raise OpenAIRequestError(f"{key}={value!r} is not allowed; allowed: a number in [{low}, {high}]", key)
        return float(value)

    if body.get("n", 1) != 1:
        raise OpenAIRequestError(f"n={body.get('n')!r} is not allowed; allowed: 1", "n")
    if body.get("stream"):
        raise OpenAIRequestError(f"stream={body.get('stream')!r} is not allowed; allowed: false", "stream")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = body.get(key)
    max_tokens = 16 if max_tokens is None else max_tokens
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise OpenAIRequestError(f"{key}={max_tokens!r} is not allowed; allowed: an integer >= 1", key)
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise OpenAIRequestError(
            f"stop={body.get('stop')!r} is not allowed; allowed: a string or a list of strings", "stop"
        )
    seed = body.get("seed")
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < _SEED_RANGE):
        raise OpenAIRequestError(f"seed={seed!r} is not allowed; allowed: an integer in [0, 2**64)", "seed")
    eos = getattr(tokenizer, "eos_token_id", None)
    return SamplingParams(
        temperature=number("temperature", 1.0, 0.0, 2.0),
        top_p=number("top_p", 1.0, 1e-9, 1.0),
        max_new_tokens=max_tokens,
        stop=list(stop),
        stop_token_ids=[eos] if eos is not None else [],
        seed=seed,
    )


_ROLES = ("system", "developer", "user", "assistant", "tool")


def _check_message(i: int, m: dict[str, Any]) -> None:
    """One chat message's role and content, as OpenAI takes them: content a string, a list of text parts, or null
    for an assistant message with tool calls. A 400 naming the field (a template renders anything it is given)."""
    role, content = m.get("role"), m.get("content")
    if role not in _ROLES:
        raise OpenAIRequestError(
            f"messages[{i}].role={role!r} is not allowed; allowed: one of {', '.join(_ROLES)}", f"messages[{i}].role"
        )
    text_parts = isinstance(content, list) and all(
        isinstance(part, dict) and part.get("type") == "text" and isinstance(part.get("text"), str) for part in content
    )
    tool_call = content is None and role == "assistant" and bool(m.get("tool_calls"))
    if not (isinstance(content, str) or text_parts or tool_call):
        raise OpenAIRequestError(
            f"messages[{i}].content={content!r:.100} is not allowed; allowed: a string or a list of text parts "
            "({type: text, text}); null only for an assistant message with tool_calls",
            f"messages[{i}].content",
        )


def _prompt_ids(tok, body: dict[str, Any], chat: bool) -> list[int]:
    """The request's prompt as token ids: the chat template and the tokenizer, or the ids it sent (run in a thread)."""
    if chat:
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) for m in messages):
            raise OpenAIRequestError(
                "messages is not allowed; allowed: a non-empty list of {role, content}", "messages"
            )
        for i, m in enumerate(messages):
            _check_message(i, m)
        tools = body.get("tools")
        if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) for t in tools)):
            raise OpenAIRequestError(f"tools={tools!r} is not allowed; allowed: a list of tool objects", "tools")
        try:
            text = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        except Exception as exc:  # a template error on the request's messages (jinja raises its own types)
            raise OpenAIRequestError(
                f"messages could not be formatted by the chat template: {exc}", "messages"
            ) from exc
        return list(tok(text, add_special_tokens=False)["input_ids"])
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, str) and prompt:
        return list(tok(prompt)["input_ids"])
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
        return list(prompt)
    raise OpenAIRequestError(
        f"prompt={str(prompt)[:80]} is not allowed; allowed: a non-empty string or a list of token ids", "prompt"
    )


def _check_context(n_prompt: int, body: dict[str, Any], max_tokens: int, chat: bool, context_len: int | None) -> None:
    """SGLang's length checks with OpenAI's code: completions always send max_tokens (default 16) to the check,
    chat only when the request gives one."""
    if context_len is None:
        return
    given = body.get("max_completion_tokens") is not None or body.get("max_tokens") is not None
    message = context_error(n_prompt, max_tokens if (given or not chat) else None, context_len)
    if message is not None:
        raise OpenAIRequestError(message, "messages" if chat else "prompt", code="context_length_exceeded")


async def _complete(request: web.Request, chat: bool) -> web.Response:
    state = request.app[STATE_KEY]
    if state.tokenizer is None:
        return _error("this server has no tokenizer: the OpenAI routes need one (engine-serve loads it)", 400)
    try:
        body = await read_json(request)  # parsed in a thread
    except NonFiniteNumberError as e:
        return _error(str(e), 400, param=e.field)
    except ValueError as e:
        return _error(f"the body is not valid JSON: {e}", 400)
    if not isinstance(body, dict):
        return _error("the body must be a JSON object", 400)
    tok = state.tokenizer
    try:
        adapter = _resolve_model(state, body.get("model"))
        sampling = _sampling(body, tok)
        # Templating and tokenizing a long prompt take seconds: in a thread, never on the event loop.
        ids = await asyncio.to_thread(_prompt_ids, tok, body, chat)
        _check_context(len(ids), body, sampling.max_new_tokens, chat, state.context_length)
    except OpenAIRequestError as e:
        return _error(str(e), e.status, e.param, e.code)
    await state.running.wait()  # as /generate: wait out a weight sync's pause
    if state.closing:
        return _error(SHUTDOWN_MESSAGE, 503)
    # keep_prefix: a chat client (a verifiers episode) re-sends this conversation with its next message
    req = GenerateRequest(input_ids=ids, adapter=adapter, sampling=sampling, rid=uuid.uuid4().hex, keep_prefix=True)
    (result,) = await state.engine.agenerate([req])
    if result.finish_reason == "error" and " is not allowed; allowed: " in (result.error or ""):
        # The engine's request checks (e.g. a token id out of the vocabulary) answer in this grammar: the request's
        # fault, a 400 the openai client does not retry (a 503 made it retry three times).
        return _error(result.error, 400)
    if result.finish_reason == "abort":  # a weight sync's pause or an adapter swapped mid-request: try again
        return _error(f"generation did not finish: {result.error or 'aborted'}", 503)
    if result.finish_reason == "error":
        # The engine failed this request alone (e.g. NaN or inf logits from its adapter): the same request would fail
        # again, so the openai client is told not to retry it (it retries every 5xx unless this header says no).
        response = _error(f"generation failed: {result.error or 'engine error'}", 500)
        response.headers["x-should-retry"] = "false"
        return response
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
