"""Request mistakes are the client's, answered 4xx in SGLang's / OpenAI's shapes: NaN or Infinity in a body, a prompt
longer than the model's context (which the openai client retried as a 503), an oversized body (413, unread); and
tokenizing a huge chat prompt does not stall the event loop for everyone else (/health)."""

from __future__ import annotations

import threading
import time

import pytest
import requests
import torch

from rl_multilora.lora import MultiLoRAModel
from rollout.engines.embedded import EmbeddedEngine
from rollout.server.http_server import BackgroundServer
from tests.tiny_models import tiny_model, tiny_tokenizer

openai = pytest.importorskip("openai")  # a dev dependency (pyproject [dev])
KEY = {"Authorization": "Bearer k3y"}


@pytest.fixture(scope="module")
def served():
    tok = tiny_tokenizer()
    model = MultiLoRAModel.from_model(tiny_model(seed=0), max_loras=1, max_rank=8)
    engine = EmbeddedEngine(model, tok)
    with BackgroundServer(engine, api_key="k3y", model_name="tiny", tokenizer=tok, max_body_bytes=2 * 1024**2) as s:
        yield s, openai.OpenAI(base_url=f"{s.url}/v1", api_key="k3y", max_retries=0)
    engine.close()


def test_nan_and_infinity_are_refused_not_read_as_greedy(served):
    server, _ = served
    body = '{"input_ids": [5, 6], "sampling_params": {"temperature": NaN, "max_new_tokens": 2}}'
    r = requests.post(f"{server.url}/generate", data=body, headers={**KEY, "Content-Type": "application/json"})
    assert r.status_code == 400 and "NaN is not a number JSON allows" in r.text
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "temperature": Infinity}'
    r = requests.post(
        f"{server.url}/v1/chat/completions", data=body, headers={**KEY, "Content-Type": "application/json"}
    )
    assert r.status_code == 400 and "Infinity" in r.json()["error"]["message"]


def test_a_body_nested_too_deeply_is_a_400_on_every_json_route(served):
    """Arrays nested 100,000 deep (200 KB) made `json.loads` raise RecursionError, which no handler caught: a 500 on
    /generate, the OpenAI routes and /load_lora_adapter (a reviewer's repro)."""
    server, _ = served
    deep = "[" * 100_000 + "]" * 100_000
    for route, body in (("/generate", f'{{"input_ids": {deep}}}'), ("/v1/completions", f'{{"prompt": {deep}}}'),
                        ("/load_lora_adapter", f'{{"lora_name": {deep}}}')):  # fmt: skip
        r = requests.post(server.url + route, data=body, headers={**KEY, "Content-Type": "application/json"})
        assert r.status_code == 400 and "nests too deeply" in r.text, (route, r.status_code, r.text[:200])


def test_a_prompt_longer_than_the_context_is_a_400_the_client_does_not_retry(served):
    _, client = served
    with pytest.raises(openai.BadRequestError, match="context length"):
        client.completions.create(model="tiny", prompt="1" * 300, max_tokens=2)  # the tiny model's context: 256


def test_an_oversized_body_is_refused_with_413(served):
    server, _ = served
    big = '{"input_ids": [' + ",".join(["5"] * 1_200_000) + "]}"  # about 2.4 MB of JSON, over the 2 MiB limit
    r = requests.post(f"{server.url}/generate", data=big, headers={**KEY, "Content-Type": "application/json"})
    assert r.status_code == 413 and "Maximum request body size" in r.text


def test_health_answers_while_a_huge_chat_prompt_is_tokenized(served):
    server, client = served
    prompt = "a" * 1_900_000  # just under the body limit; its template + tokenization take seconds here
    done = threading.Event()

    def send():
        try:
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}], max_tokens=1)
        except openai.BadRequestError:
            pass  # longer than the context: refused, after tokenizing
        finally:
            done.set()

    worker = threading.Thread(target=send)
    worker.start()
    time.sleep(0.2)
    latencies = []
    while not done.is_set():
        t0 = time.perf_counter()
        assert requests.get(f"{server.url}/health", timeout=5).status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    worker.join(30)
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies  # several probes while it was busy


def test_a_nan_adapter_fails_only_its_own_requests_in_a_shared_batch():
    """The engine's own guard (the server refuses NaN adapters before; a diverged in-process adapter can still get
    there): the NaN adapter's rows finish with an error, the base's and the healthy adapter's rows in the same batch
    come out as they do without it."""
    from rollout.types import GenerateRequest, SamplingParams

    tok = tiny_tokenizer()
    model = MultiLoRAModel.from_model(tiny_model(seed=0), max_loras=2, max_rank=8)
    model.add_adapter("good", rank=4, alpha=8, seed=1)
    model.add_adapter("bad", rank=4, alpha=8, seed=2)
    engine = EmbeddedEngine(model, tok)
    try:
        engine.load_adapter("good", model.adapter_state_dict("good"), model.peft_config("good"))
        nan = {k: torch.full_like(v, float("nan")) for k, v in model.adapter_state_dict("bad").items()}
        engine.load_adapter("bad", nan, model.peft_config("bad"))
        sampling = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
        healthy = [GenerateRequest([5, 6, 7], None, sampling), GenerateRequest([5, 6, 8], "good", sampling)]
        alone = engine.generate(healthy)
        mixed = engine.generate([GenerateRequest([5, 6, 9], "bad", sampling), *healthy])
        assert mixed[0].finish_reason == "error" and "NaN or inf logits" in mixed[0].error
        for got, want in zip(mixed[1:], alone, strict=True):
            assert got.finish_reason == want.finish_reason and got.output_ids == want.output_ids
    finally:
        engine.close()


def test_generate_answers_a_prompt_longer_than_the_context_with_400(served):
    server, _ = served
    body = {"input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 2}}  # the tiny model's context: 256
    r = requests.post(f"{server.url}/generate", json=body, headers=KEY)
    assert r.status_code == 400 and "context length" in r.text
