"""The engine server's OpenAI-compatible routes, driven by the `openai` Python client: it lists the base and the
loaded adapters and gets completions from any tenant, equal to the engine's own greedy output."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from rl_multilora.lora import MultiLoRAModel
from rollout.engines.embedded import EmbeddedEngine
from rollout.server.http_server import BackgroundServer
from rollout.types import GenerateRequest, SamplingParams
from tests.tiny_models import tiny_model, tiny_tokenizer

openai = pytest.importorskip("openai")  # a dev dependency (pyproject [dev])


@pytest.fixture(scope="module")
def served():
    tok = tiny_tokenizer()
    model = MultiLoRAModel.from_model(tiny_model(seed=0), max_loras=2, max_rank=8, target_modules="all-linear")
    model.add_adapter("tenant-a", rank=4, alpha=8, seed=1)
    with torch.no_grad():
        for p in model.adapter_parameters("tenant-a"):
            p.normal_(0, 0.3)  # B is zero at init: make the adapter change the output
    engine = EmbeddedEngine(model, tok)
    engine.load_adapter("tenant-a", model.adapter_state_dict("tenant-a"), model.peft_config("tenant-a"), version=3)
    with BackgroundServer(engine, api_key="k3y", model_name="tiny-base", tokenizer=tok) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="k3y", max_retries=0)
        yield client, engine, tok
    engine.close()


def _greedy(engine, tok, adapter, messages, n):
    ids = tok(tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    sp = SamplingParams(temperature=0.0, max_new_tokens=n, stop_token_ids=[tok.eos_token_id])
    (r,) = engine.generate([GenerateRequest(input_ids=ids["input_ids"], adapter=adapter, sampling=sp)])
    return tok.decode(r.output_ids, skip_special_tokens=True)


def test_models_lists_the_base_and_each_loaded_adapter(served):
    client, _, _ = served
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"tiny-base", "tenant-a"}
    assert cards["tenant-a"].model_dump().get("parent") == "tiny-base"


@pytest.mark.parametrize("model", ["tiny-base:tenant-a", "tenant-a", "tiny-base"])
def test_chat_completion_from_a_tenant_equals_the_engines_greedy_output(served, model):
    client, engine, tok = served
    messages = [{"role": "user", "content": "2+3="}]
    out = client.chat.completions.create(model=model, messages=messages, max_tokens=8, temperature=0)
    adapter = None if model == "tiny-base" else "tenant-a"
    assert out.choices[0].message.content == _greedy(engine, tok, adapter, messages, 8)
    assert out.usage.completion_tokens <= 8 and out.choices[0].finish_reason in ("stop", "length")


def test_text_completion_and_errors(served):
    client, engine, tok = served
    out = client.completions.create(model="tenant-a", prompt="1+1=", max_tokens=5, temperature=0)
    ids = tok("1+1=")["input_ids"]
    sp = SamplingParams(temperature=0.0, max_new_tokens=5, stop_token_ids=[tok.eos_token_id])
    (r,) = engine.generate([GenerateRequest(input_ids=ids, adapter="tenant-a", sampling=dataclasses.replace(sp))])
    assert out.choices[0].text == tok.decode(r.output_ids, skip_special_tokens=True)
    with pytest.raises(openai.NotFoundError, match="model='nope' is not allowed"):
        client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    with pytest.raises(openai.BadRequestError, match="max_tokens=0"):
        client.completions.create(model="tenant-a", prompt="x", max_tokens=0)


@pytest.mark.parametrize(
    ("messages", "extra", "fragment"),
    [
        ([{"role": {"a": 1}, "content": "x"}], {}, "messages[0].role={'a': 1} is not allowed"),
        ([{"role": "user", "content": {"a": 1}}], {}, "messages[0].content={'a': 1} is not allowed"),
        ([{"role": "user", "content": None}], {}, "messages[0].content=None is not allowed"),
        ([{"role": "user", "content": [{"type": "text", "text": 5}]}], {}, "messages[0].content=[{"),
        ([{"role": "user", "content": "x"}], {"tools": "x"}, "tools='x' is not allowed"),
    ],
)
def test_a_malformed_chat_message_is_a_400_naming_it(served, messages, extra, fragment):
    """A reviewer's: a role or content of any type reached the chat template, which rendered it, and answered 200."""
    client, _, _ = served
    with pytest.raises(openai.BadRequestError, match=re.escape(fragment)):
        client.chat.completions.create(model="tenant-a", messages=messages, max_tokens=2, extra_body=extra)


def test_a_wrong_key_is_refused(served):
    client, _, _ = served
    bad = openai.OpenAI(base_url=str(client.base_url), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
