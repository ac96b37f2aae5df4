"""Issue 24, round two, engine and HTTP side: one request's numbers never fail another's, request mistakes are 4xx in
SGLang's / OpenAI's shapes (never retried), and a maximal request neither stalls the event loop nor is read past the
body limit.

Every case runs the embedded engine on the offline tiny model (context 256, vocabulary 128) behind a real server.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest
import requests
import torch
from safetensors.torch import save_file

from rl_multilora.lora import MultiLoRAModel
from rollout.engines.embedded import EmbeddedEngine
from rollout.server.http_server import BackgroundServer
from rollout.sglang.protocol import encode_tensors_safetensors
from rollout.types import GenerateRequest, SamplingParams
from tests.tiny_models import tiny_model, tiny_tokenizer

openai = pytest.importorskip("openai")  # a dev dependency (pyproject [dev])
KEY = {"Authorization": "Bearer k3y"}
CONTEXT = 256  # the tiny model's max_position_embeddings


def _model(max_loras: int = 2) -> MultiLoRAModel:
    model = MultiLoRAModel.from_model(tiny_model(seed=0), max_loras=max_loras, max_rank=8)
    model.add_adapter("good", rank=4, alpha=8, seed=1)
    with torch.no_grad():
        for p in model.adapter_parameters("good"):
            p.normal_(0, 0.3)  # B is zero at init: make the adapter change the output
    return model


@pytest.fixture(scope="module")
def engine():
    model = _model()
    eng = EmbeddedEngine(model, tiny_tokenizer())
    eng.load_adapter("good", model.adapter_state_dict("good"), model.peft_config("good"))
    eng.model = model  # the tests build adapters of the same shapes from it
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def server(engine):
    with BackgroundServer(engine, api_key="k3y", model_name="tiny", tokenizer=tiny_tokenizer()) as s:
        yield s


def _post(server, path: str, body, **kw) -> requests.Response:
    data = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return requests.post(server.url + path, data=data, headers={**KEY, "Content-Type": "application/json"}, **kw)


def _counting_client(server) -> tuple[openai.OpenAI, list[str]]:
    """An openai client with its default retries that records every HTTP request it sends."""
    sent: list[str] = []
    http = httpx.Client(event_hooks={"request": [lambda r: sent.append(r.url.path)]})
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="k3y", http_client=http), sent


# ------------------------------------------------------------------- 6. one request's numbers stay its own


def test_non_finite_adapters_are_refused_naming_the_adapter_on_both_load_routes(engine, server, tmp_path):
    bad = {k: v.clone() for k, v in engine.model.adapter_state_dict("good").items()}
    key = sorted(bad)[0]
    bad[key].view(-1)[0] = float("inf")
    config = engine.model.peft_config("good")
    body = {
        "lora_name": "inf-tensors",
        "config_dict": config,
        "serialized_named_tensors": [encode_tensors_safetensors(bad)],
        "load_format": "safetensors",
    }
    r = _post(server, "/load_lora_adapter_from_tensors", body)
    assert r.status_code == 400 and r.json()["success"] is False
    assert "inf-tensors" in r.json()["error_message"] and "NaN or inf" in r.json()["error_message"]
    folder = tmp_path / "folder"
    folder.mkdir()
    (folder / "adapter_config.json").write_text(json.dumps(config))
    save_file(bad, str(folder / "adapter_model.safetensors"))
    r = _post(server, "/load_lora_adapter", {"lora_name": "inf-folder", "lora_path": str(folder)})
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert "inf-folder" in r.json()["error_message"] and "NaN or inf" in r.json()["error_message"], r.text
    assert set(engine.adapter_versions()) == {"good"}


def test_integer_adapter_tensors_are_refused_naming_the_tensor_and_dtype(engine, server):
    tensors = {k: v.clone() for k, v in engine.model.adapter_state_dict("good").items()}
    key = sorted(tensors)[0]
    tensors[key] = tensors[key].to(torch.int32)
    body = {
        "lora_name": "ints",
        "config_dict": engine.model.peft_config("good"),
        "serialized_named_tensors": [encode_tensors_safetensors(tensors)],
        "load_format": "safetensors",
    }
    r = _post(server, "/load_lora_adapter_from_tensors", body)
    assert r.status_code == 400 and r.json()["success"] is False, r.text
    assert f"{key} is int32; allowed: a floating-point dtype" in r.json()["error_message"]
    assert "ints" not in engine.adapter_versions()


def test_adapter_root_confines_load_lora_adapter_to_its_folder(engine, tmp_path):
    """engine-serve --adapter-root: a folder inside it loads; one outside it, a `..` out of it or a link inside it that
    points out is refused with a 400 naming lora_path and the root, before anything is read."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    config = engine.model.peft_config("good")
    for folder in (root / "ok", outside / "secret"):
        folder.mkdir(parents=True)
        (folder / "adapter_config.json").write_text(json.dumps(config))
        save_file(engine.model.adapter_state_dict("good"), str(folder / "adapter_model.safetensors"))
    (root / "link").symlink_to(outside / "secret")
    with BackgroundServer(engine, api_key="k3y", model_name="tiny", adapter_root=root) as server:
        for name, path in (("out1", outside / "secret"), ("out2", root / ".." / "outside" / "secret"),
                           ("out3", root / "link")):  # fmt: skip
            r = _post(server, "/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
            assert r.status_code == 400, r.text
            assert "lora_path=" in r.text and "--adapter-root" in r.text and str(root.resolve()) in r.text, r.text
        r = _post(server, "/load_lora_adapter", {"lora_name": "inside", "lora_path": str(root / "ok")})
        assert r.status_code == 200 and r.json()["success"] is True, r.text
    assert set(engine.adapter_versions()) == {"good", "inside"}
    engine.unload_adapter("inside")
    with pytest.raises(ValueError, match="adapter_root=.* allowed: an existing folder"):
        BackgroundServer(engine, adapter_root=tmp_path / "missing")


@pytest.mark.parametrize(
    "settings",
    [
        {"temperature": 1e-40},  # logits / T overflow to inf: softmax gives NaN for that row
        {"temperature": 1e-40, "top_p": 0.9, "top_k": 5},
        {"temperature": 1.0, "top_k": 2**70},  # larger than any tensor index
    ],
    ids=["tiny-temperature", "tiny-temperature-filtered", "huge-top-k"],
)
def test_extreme_sampling_numbers_of_one_row_leave_its_batch_alone(engine, settings):
    """The row itself behaves as its settings mean (a vanishing temperature is greedy, a top-k above the vocabulary
    is no top-k), and the other rows of its batch come out exactly as they do without it."""
    healthy = [
        GenerateRequest([5, 6, 7], None, SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)),
        GenerateRequest([5, 6, 8], "good", SamplingParams(temperature=0.7, top_p=0.9, max_new_tokens=4, seed=4)),
    ]
    alone = engine.generate(healthy)
    odd = GenerateRequest([9, 10, 11], "good", SamplingParams(max_new_tokens=4, seed=5, **settings))
    mixed = engine.generate([odd, *healthy])
    assert mixed[0].finish_reason == "length", mixed[0]
    assert all(0 <= t < 128 for t in mixed[0].output_ids)
    if settings["temperature"] < 1e-30:
        greedy = engine.generate([GenerateRequest([9, 10, 11], "good", SamplingParams(0.0, max_new_tokens=4))])
        assert mixed[0].output_ids == greedy[0].output_ids
    for got, want in zip(mixed[1:], alone, strict=True):
        assert (got.finish_reason, got.output_ids) == (want.finish_reason, want.output_ids)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", float("nan")),
        ("min_p", float("nan")),
        ("seed", 2**70),
        ("seed", -1),
    ],
)
def test_engine_refuses_a_bad_sampling_number_for_that_request_only(engine, field, value):
    """In-process callers get the same check as the server's: the request errors naming the field (NaN was greedy,
    a seed out of the generator's range failed the whole batch)."""
    healthy = GenerateRequest([5, 6, 7], None, SamplingParams(temperature=1.0, max_new_tokens=3, seed=3))
    (alone,) = engine.generate([healthy])
    bad = GenerateRequest([5, 6, 9], None, SamplingParams(max_new_tokens=3, **{"seed": 1, field: value}))
    got = engine.generate([bad, healthy])
    assert got[0].finish_reason == "error" and f"sampling.{field}=" in got[0].error, got[0]
    assert (got[1].finish_reason, got[1].output_ids) == (alone.finish_reason, alone.output_ids)


def test_a_wave_that_raises_runs_its_rows_again_alone_and_only_the_cause_fails():
    """A forward that raises whenever one poisoned prompt is in the batch (an input that gets past the checks): its
    row finishes with the error, and the rows it shared the wave with (seeded, sampled or greedy, on the base or an
    adapter) come back exactly as each does alone. The wave used to fail every row."""
    model = _model()
    eng = EmbeddedEngine(model, tiny_tokenizer())
    eng.load_adapter("good", model.adapter_state_dict("good"), model.peft_config("good"))
    healthy = [
        GenerateRequest([5, 6, 7], None, SamplingParams(temperature=1.0, max_new_tokens=5, seed=3)),
        GenerateRequest([5, 6, 8], "good", SamplingParams(temperature=0.0, max_new_tokens=5)),
        GenerateRequest([5, 6, 9], "good", SamplingParams(temperature=0.8, top_p=0.9, max_new_tokens=5, seed=4)),
    ]
    poison = GenerateRequest([5, 6, 66], None, SamplingParams(temperature=0.0, max_new_tokens=5))
    forward = eng._forward

    def flaky(ids, *args, **kwargs):  # a prefill holding the poisoned prompt raises, once per wave it is in
        if ids.shape[1] > 1 and bool((ids == 66).any()):
            raise RuntimeError("boom")
        return forward(ids, *args, **kwargs)

    try:
        alone = [eng.generate([r])[0] for r in healthy]  # each in a wave of its own, as the retries run
        batched = eng.generate(healthy)
        eng._forward = flaky
        got = eng.generate([healthy[0], poison, healthy[1], healthy[2]])
        assert got[1].finish_reason == "error" and "boom" in got[1].error, got[1]
        for want, have in zip(alone, [got[0], got[2], got[3]], strict=True):
            assert (have.finish_reason, have.output_ids, have.output_logprobs) == (
                want.finish_reason,
                want.output_ids,
                want.output_logprobs,
            )
        again = eng.generate(healthy)  # later waves batch as before
        assert [r.output_logprobs for r in again] == [r.output_logprobs for r in batched]
        assert eng._slot_rows.get(model.slot_of("good"), 0) == 0  # the restarted rows gave their slot back
    finally:
        eng._forward = forward
        eng.close()


def test_a_nan_adapter_row_fails_alone_over_http_and_is_not_retried():
    """An adapter that went NaN inside the engine (the server refuses such loads; an in-process one can diverge): on
    /generate its row ends with an error message while the base row of the same body comes back as without it; on
    /v1 it is a 500 the openai client does not retry (the same adapter would give NaN again)."""
    model = _model()
    eng = EmbeddedEngine(model, tiny_tokenizer())
    nan = {k: torch.full_like(v, float("nan")) for k, v in model.adapter_state_dict("good").items()}
    eng.load_adapter("nan", nan, model.peft_config("good"))
    try:
        with BackgroundServer(eng, api_key="k3y", model_name="tiny", tokenizer=tiny_tokenizer()) as s:
            base = {"input_ids": [5, 6, 7], "sampling_params": {"temperature": 0, "max_new_tokens": 3}}
            alone = _post(s, "/generate", base).json()
            both = {
                "input_ids": [[5, 6, 8], [5, 6, 7]],
                "lora_path": ["nan", None],
                "sampling_params": base["sampling_params"],
            }
            r = _post(s, "/generate", both)
            assert r.status_code == 200, r.text
            bad, good = r.json()
            assert bad["meta_info"]["finish_reason"]["status_code"] == 500
            assert "NaN or inf logits" in bad["meta_info"]["finish_reason"]["message"]
            assert good["output_ids"] == alone["output_ids"]
            client, sent = _counting_client(s)
            with pytest.raises(openai.InternalServerError, match="NaN or inf logits"):
                client.completions.create(model="nan", prompt="hi", max_tokens=2)
            assert sent == ["/v1/completions"]
    finally:
        eng.close()


# ------------------------------------------------------------------- 7. request mistakes are 4xx, never retried


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        ('{"temperature": NaN}', "sampling_params.temperature"),
        ('{"top_p": Infinity}', "sampling_params.top_p"),
        ('{"temperature": 1e999}', "sampling_params.temperature"),  # JSON has no inf, but Python reads 1e999 as one
        ('{"temperature": -Infinity}', "sampling_params.temperature"),
    ],
)
def test_generate_refuses_non_finite_numbers_naming_the_field(server, raw, field):
    """Before: NaN and -Infinity were refused without saying where, 1e999 was read as an infinite temperature."""
    r = _post(server, "/generate", '{"input_ids": [5, 6], "sampling_params": ' + raw + "}")
    assert r.status_code == 400, r.text
    assert r.json()["message"].startswith(f"{field}="), r.text
    assert "finite" in r.json()["message"]


@pytest.mark.parametrize("seed", [2**64, -1])
def test_generate_refuses_a_seed_the_generator_cannot_take(server, seed):
    """Refused by the server itself, naming SGLang's field (it reached the engine before, which failed the batch)."""
    r = _post(server, "/generate", {"input_ids": [5, 6], "sampling_params": {"sampling_seed": seed}})
    assert r.status_code == 400, r.text
    assert r.json()["message"].startswith(f"sampling_params.sampling_seed={seed} is not allowed"), r.text


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ('"temperature": NaN', "temperature"),
        ('"top_p": 1e999', "top_p"),
        ('"temperature": 7', "temperature"),
        ('"max_tokens": 0', "max_tokens"),
        ('"seed": 100000000000000000000000', "seed"),
    ],
)
def test_openai_request_errors_have_openai_shape_and_are_not_retried(server, extra, param):
    client, sent = _counting_client(server)
    body = '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], ' + extra + "}"
    r = _post(server, "/v1/chat/completions", body)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert param in error["message"]
    kwargs = json.loads("{" + extra + "}", parse_constant=float)
    if all(v == v and abs(v) != float("inf") for v in kwargs.values()):  # the client cannot send NaN or inf
        with pytest.raises(openai.BadRequestError):
            client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], **kwargs)
        assert sent == ["/v1/chat/completions"]  # one try: the client's two retries are for server errors


def test_messages_the_chat_template_refuses_are_a_400_on_messages(engine):
    tok = tiny_tokenizer()
    tok.chat_template = "{{ raise_exception('this template takes no system message') }}"
    with BackgroundServer(engine, api_key="k3y", model_name="tiny", tokenizer=tok) as s:
        client, sent = _counting_client(s)
        with pytest.raises(openai.BadRequestError, match="takes no system message") as err:
            client.chat.completions.create(model="tiny", messages=[{"role": "system", "content": "x"}])
    assert err.value.param == "messages" and sent == ["/v1/chat/completions"]


def test_generate_refuses_a_prompt_plus_max_new_tokens_over_the_context_as_sglang(server):
    """SGLang's two checks, its messages and /generate's error shape (`{"error": {"message"}}`, 400)."""
    r = _post(server, "/generate", {"input_ids": [5] * 300, "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 400, r.text
    assert (
        r.json()["error"]["message"]
        == "The input (300 tokens) is longer than the model's context length (256 tokens)."
    )
    r = _post(server, "/generate", {"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 56}})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"].startswith(
        "Requested token count exceeds the model's maximum context length of 256 tokens. You requested a total of "
        "256 tokens: 200 tokens from the input messages and 56 tokens for the completion."
    )
    # Without max_new_tokens SGLang checks the prompt only, and the context caps the output.
    r = _post(server, "/generate", {"input_ids": [5] * 200, "sampling_params": {"temperature": 0}})
    assert r.status_code == 200 and r.json()["meta_info"]["finish_reason"]["type"] in ("length", "stop"), r.text
    r = _post(server, "/generate", {"input_ids": [5] * 200, "sampling_params": {"max_new_tokens": 55}})
    assert r.status_code == 200, r.text


def test_openai_context_overflow_is_a_400_with_openai_code_not_retried(server):
    client, sent = _counting_client(server)
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model="tiny", prompt="1" * 200, max_tokens=100)
    assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
    assert "Requested token count exceeds the model's maximum context length of 256 tokens" in str(err.value)
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "1" * 300}], max_tokens=2)
    assert err.value.code == "context_length_exceeded" and err.value.param == "messages"
    assert "is longer than the model's context length (256 tokens)" in str(err.value)
    assert sent == ["/v1/completions", "/v1/chat/completions"]


# ------------------------------------------------------------------- 8. body limit and a free event loop


def test_the_default_body_limit_is_32_mib_with_a_clear_413_before_reading(engine):
    with BackgroundServer(engine, api_key="k3y", tokenizer=tiny_tokenizer()) as s:
        big = b'{"input_ids": [' + b"5," * (17 * 1024**2) + b"5]}"  # 34 MB
        for path in ("/generate", "/v1/completions"):
            r = _post(s, path, big)
            assert r.status_code == 413, (path, r.status_code, r.text[:200])
            message = r.json()["error"]["message"]
            assert "Maximum request body size 33554432 exceeded" in message and "--max-body-mb" in message, message


def test_adapter_pushes_have_their_own_larger_limit(engine):
    """Adapter tensors are the big bodies a weight sync sends; prompts are not."""
    with BackgroundServer(engine, api_key="k3y", tokenizer=tiny_tokenizer(), max_body_bytes=1024**2) as s:
        body = {
            "lora_name": "good2",
            "config_dict": engine.model.peft_config("good"),
            "serialized_named_tensors": [encode_tensors_safetensors(engine.model.adapter_state_dict("good"))],
            "load_format": "safetensors",
            "padding": "x" * (2 * 1024**2),  # unknown fields are ignored, as SGLang does
        }
        r = _post(s, "/load_lora_adapter_from_tensors", body)
        assert r.status_code == 200 and r.json()["success"], r.text
        assert _post(s, "/unload_lora_adapter", {"lora_name": "good2"}).status_code == 200
        r = _post(s, "/generate", {"input_ids": [5], "padding": "x" * (2 * 1024**2)})
        assert r.status_code == 413


def _probe_health(url: str, send) -> list[float]:
    """Latencies of /health probes taken while `send()` runs in another thread."""
    done = threading.Event()

    def run():
        try:
            send()
        finally:
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    time.sleep(0.1)
    latencies = []
    while not done.is_set():
        t0 = time.perf_counter()
        assert requests.get(f"{url}/health", timeout=10).status_code == 200
        latencies.append(time.perf_counter() - t0)
        time.sleep(0.05)
    worker.join(60)
    return latencies


def test_health_answers_within_a_second_while_a_maximal_generate_body_is_handled(engine):
    """A body just under the default 32 MiB limit: 16 million prompt token ids, parsed, checked and refused (longer
    than the context) without stalling the event loop."""
    with BackgroundServer(engine, api_key="k3y", tokenizer=tiny_tokenizer()) as s:
        body = b'{"input_ids": [' + b"5," * (16 * 1024**2 - 16) + b"5]}"
        assert len(body) < 32 * 1024**2
        status = []
        latencies = _probe_health(s.url, lambda: status.append(_post(s, "/generate", body, timeout=120).status_code))
    print(f"/health latencies while a {len(body) / 1e6:.1f} MB /generate was handled: {latencies}")
    assert status == [400]
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


def test_health_answers_within_a_second_while_a_maximal_chat_prompt_is_tokenized(engine):
    """The chat template and the tokenizer run in a thread: a prompt just under the (here 4 MiB) body limit takes
    seconds to tokenize on the tiny character tokenizer."""
    with BackgroundServer(
        engine, api_key="k3y", model_name="tiny", tokenizer=tiny_tokenizer(), max_body_bytes=4 * 1024**2
    ) as s:
        client = openai.OpenAI(base_url=f"{s.url}/v1", api_key="k3y", max_retries=0)
        prompt = "a" * (4 * 1024**2 - 200)
        errors = []

        def send():
            try:
                client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}])
            except openai.BadRequestError as exc:
                errors.append(exc.code)

        latencies = _probe_health(s.url, send)
    print(f"/health latencies while a 4 MiB chat prompt was tokenized: {latencies}")
    assert errors == ["context_length_exceeded"]
    assert len(latencies) >= 3 and max(latencies) < 1.0, latencies


# ------------------------------------------------ a reviewer's concurrency cases: nobody's rows, shutdown, unload


def _post_and_close(server, path: str, body: dict, wait: float) -> None:
    """Send a request on a raw socket and close it `wait` seconds later, as a client that gives up does."""
    import socket

    data = json.dumps(body).encode()
    with socket.create_connection((server.host, server.port)) as s:
        s.sendall(
            f"POST {path} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer k3y\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n".encode()
            + data
        )
        time.sleep(wait)


def test_a_client_that_goes_away_has_its_rows_dropped(engine, server):
    """aiohttp's default left the handler running: every abandoned row generated to the end (a retrying client's
    three attempts all ran), and a 4-token request behind 4 such batches took 4.3 s. Now they stop as cancelled."""
    finished: list[tuple[str, str | None]] = []
    real = engine._finish

    def record(row, reason, error=None):
        finished.append((reason, error))
        return real(row, reason, error)

    engine._finish = record
    try:
        body = {"input_ids": [[5, 6, 7]] * 16, "sampling_params": {"max_new_tokens": 200, "ignore_eos": True}}
        for _ in range(2):
            _post_and_close(server, "/generate", body, wait=0.05)
        deadline = time.monotonic() + 10
        while len(finished) < 32 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        engine._finish = real
    assert finished.count(("abort", "cancelled")) == 32, finished
    start = time.monotonic()
    r = _post(server, "/generate", {"input_ids": [5, 6], "sampling_params": {"max_new_tokens": 2}})
    assert r.status_code == 200 and time.monotonic() - start < 2.0


def test_rows_of_an_adapter_unloaded_while_they_wait_in_the_queue_are_aborted_not_refused(engine):
    """Running rows came back "abort" (resubmit); queued ones got a 400 as if the request had been wrong, and a body
    mixing them with other rows failed whole."""
    model = engine.model
    engine.load_adapter("gone", model.adapter_state_dict("good"), model.peft_config("good"))
    request = GenerateRequest([5, 6, 7], "gone", SamplingParams(max_new_tokens=3))
    engine.pause(mode="wait")  # the request waits in the queue
    job = threading.Thread(target=lambda: got.extend(engine.generate([request])))
    got: list = []
    job.start()
    time.sleep(0.2)
    engine.unload_adapter("gone")
    engine.resume()
    job.join(30)
    assert got[0].finish_reason == "abort" and "unloaded while the request was queued; resubmit" in got[0].error


def test_a_shutdown_answers_requests_parked_by_a_pause_at_once(engine):
    """SIGTERM while paused left the parked requests unanswered and the process alive for about 2 minutes (aiohttp's
    two 60 s waits); they now get a 503 and the server stops in a moment."""
    server = BackgroundServer(engine, api_key="k3y", model_name="tiny").start()
    try:
        assert _post(server, "/pause_generation", {}).status_code == 200
        answers: list = []
        threads = [
            threading.Thread(
                target=lambda: answers.append(_post(server, "/generate", {"input_ids": [5, 6], "sampling_params": {}}))
            )
            for _ in range(4)
        ]
        for t in threads:
            t.start()
        time.sleep(0.3)
    finally:
        start = time.monotonic()
        server.stop()
    for t in threads:
        t.join(10)
    assert time.monotonic() - start < 5
    assert [r.status_code for r in answers] == [503] * 4 and all("shutting down" in r.text for r in answers)
    engine.resume()


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"input_ids": [5, 6], "rid": {"a": 1}}, "rid"),
        ({"input_ids": [[5, 6], [7]], "rid": ["r0", 3]}, "rid[1]"),
        ({"input_ids": [[5, 6], [7]], "rid": 7}, "rid"),
    ],
)
def test_generate_refuses_a_rid_that_is_not_a_string_naming_it(server, body, field):
    """SGLang's `rid` is a string or a list of them; a dict or a number was taken as a request id before."""
    r = _post(server, "/generate", body)
    assert r.status_code == 400, r.text
    assert r.json()["message"].startswith(f"{field}="), r.text
    assert _post(server, "/generate", {"input_ids": [[5, 6], [7]], "rid": ["r0", "r1"]}).status_code == 200


@pytest.mark.parametrize("version", [str(2**63), str(2**70), "-1", "x"])
def test_an_adapter_version_header_outside_int64_is_refused_naming_the_header(engine, server, version):
    body = {
        "lora_name": "v",
        "config_dict": engine.model.peft_config("good"),
        "serialized_named_tensors": [encode_tensors_safetensors(engine.model.adapter_state_dict("good"))],
        "load_format": "safetensors",
    }
    r = requests.post(
        server.url + "/load_lora_adapter_from_tensors", json=body, headers={**KEY, "X-Adapter-Version": version}
    )
    assert r.status_code == 400, r.text
    assert f"X-Adapter-Version='{version}' is not allowed" in r.text, r.text
