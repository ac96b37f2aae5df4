"""EmbeddedEngine against HF/PEFT references on tiny fp32 models.

References: greedy output must equal HF `generate(do_sample=False)` with the adapter loaded through
PEFT from a saved folder, and log-probs must equal the trainer's forward (`MultiLoRAModel` with
`adapter_names`). Adapters are PEFT-initialized with random non-zero A and B
(`init_lora_weights=False`), so every adapter really changes the output.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict

from rl_multilora.lora import MultiLoRAModel
from rollout.engines.embedded import EmbeddedEngine, nonfinite_rows
from rollout.engines.sampling import sample_next_tokens
from rollout.types import GenerateRequest, SamplingParams
from tests.tiny_models import EOS_ID, tiny_model, tiny_tokenizer

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
ADAPTERS = {"a": (4, 8, 1), "b": (8, 16, 2), "c": (2, 2, 3)}  # name -> (rank, alpha, seed)
PROMPTS = [[5, 17, 33, 48, 9, 71], [12, 40], [3, 99, 64, 21], [88, 7, 7]]


def greedy(max_new_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_new_tokens=max_new_tokens, **kw)


def sample(seed: int, max_new_tokens: int = 10, **kw) -> SamplingParams:
    return SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens, seed=seed, **kw)


def make_peft_adapter(folder, rank: int, alpha: int, seed: int, family: str = "qwen2"):
    """Save a random non-zero PEFT LoRA on the tiny `family` base; returns (folder, tensors, config dict)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS, init_lora_weights=False)
        peft_model = get_peft_model(tiny_model(family), config)
    peft_model.save_pretrained(folder)
    tensors = {k: v.detach().clone() for k, v in get_peft_model_state_dict(peft_model).items()}
    return folder, tensors, json.loads((folder / "adapter_config.json").read_text())


@pytest.fixture(scope="module")
def peft_adapters(tmp_path_factory):
    """name -> (folder, PEFT-named tensors, PEFT config dict) of random non-zero adapters on the tiny base."""
    return {
        name: make_peft_adapter(tmp_path_factory.mktemp(f"peft_{name}"), rank, alpha, seed)
        for name, (rank, alpha, seed) in ADAPTERS.items()
    }


@pytest.fixture
def model():
    return MultiLoRAModel.from_model(tiny_model(), max_loras=4, max_rank=16, target_modules="all-linear")


@pytest.fixture
def engine(model, peft_adapters):
    eng = EmbeddedEngine(model, tiny_tokenizer())
    for name, (_, tensors, config) in peft_adapters.items():
        assert eng.load_adapter(name, tensors, config) == 0
    yield eng
    eng.close()


def hf_greedy(prompt: list[int], max_new_tokens: int, folder=None, family: str = "qwen2") -> list[int]:
    """Reference: HF generate on a fresh base, through PEFT when `folder` is given."""
    ref = tiny_model(family)
    if folder is not None:
        ref = PeftModel.from_pretrained(ref, folder).eval()
    ids = torch.tensor([prompt])
    out = ref.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def test_greedy_mixed_batch_matches_peft_generate(engine, peft_adapters):
    names = [None, "a", "b", "c"]
    requests = [
        GenerateRequest(prompt, adapter=name, sampling=greedy(12))
        for prompt in PROMPTS
        for name in names  # every prompt under every adapter and the base: different lengths in one batch
    ]
    results = engine.generate(requests)
    for request, result in zip(requests, results, strict=True):
        folder = None if request.adapter is None else peft_adapters[request.adapter][0]
        expected = hf_greedy(request.input_ids, 12, folder)
        assert result.output_ids == expected, (request.adapter, request.input_ids)
        assert result.finish_reason == ("stop" if expected[-1] == EOS_ID else "length")
        assert result.weight_version == (None if request.adapter is None else 0)
        assert len(result.output_logprobs) == len(result.output_ids)
    by_adapter = {
        r.adapter: res.output_ids for r, res in zip(requests, results, strict=True) if r.input_ids == PROMPTS[0]
    }
    assert len({tuple(v) for v in by_adapter.values()}) == len(names), "adapters must change the greedy output"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_greedy_matches_peft_generate_on_other_families(family, tmp_path):
    folder, tensors, config = make_peft_adapter(tmp_path / "adapter", rank=4, alpha=8, seed=5, family=family)
    model = MultiLoRAModel.from_model(tiny_model(family), max_loras=2, max_rank=8, target_modules="all-linear")
    eng = EmbeddedEngine(model, tiny_tokenizer())
    try:
        eng.load_adapter("a", tensors, config)
        requests = [GenerateRequest(p, adapter=n, sampling=greedy(8)) for p in PROMPTS[:2] for n in ("a", None)]
        results = eng.generate(requests)
    finally:
        eng.close()
    for request, result in zip(requests, results, strict=True):
        adapter_folder = folder if request.adapter else None
        assert result.output_ids == hf_greedy(request.input_ids, 8, adapter_folder, family), request


def test_logprobs_equal_trainer_forward_at_temperature_one(model, peft_adapters):
    for name, (folder, _, _) in peft_adapters.items():
        model.load_adapter(name, str(folder))
    eng = EmbeddedEngine(model, tiny_tokenizer(), eos_token_ids=[])
    try:
        for name in peft_adapters:
            eng.load_adapter(name, model.adapter_state_dict(name), model.peft_config(name))
        requests = [
            GenerateRequest(p, adapter=n, sampling=sample(seed=i))
            for i, (p, n) in enumerate(zip(PROMPTS, ["a", None, "b", "c"], strict=True))
        ]
        results = eng.generate(requests)
    finally:
        eng.close()
    with torch.no_grad():
        for request, result in zip(requests, results, strict=True):
            full = torch.tensor([request.input_ids + result.output_ids])  # (1, P + N)
            logits = model(full, attention_mask=torch.ones_like(full), adapter_names=[request.adapter]).logits
            start = len(request.input_ids) - 1
            logprobs = torch.log_softmax(logits[0, start:-1].float(), dim=-1)  # (N, V) predicts each output token
            expected = logprobs.gather(-1, torch.tensor(result.output_ids)[:, None]).squeeze(-1)
            torch.testing.assert_close(torch.tensor(result.output_logprobs), expected, atol=1e-5, rtol=1e-5)


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    row = GenerateRequest(PROMPTS[0], adapter="a", sampling=sample(seed=7, max_new_tokens=16))
    alone = engine.generate([row])[0]
    again = engine.generate([row])[0]
    assert alone.output_ids == again.output_ids
    others = [
        GenerateRequest(PROMPTS[1], adapter="b", sampling=sample(seed=1, max_new_tokens=30)),
        GenerateRequest(PROMPTS[2], adapter=None, sampling=sample(seed=2, top_k=5, top_p=0.8)),
        GenerateRequest(PROMPTS[0], adapter="a", sampling=sample(seed=8, max_new_tokens=16)),  # same prompt, shared
        GenerateRequest(PROMPTS[3] * 3, adapter="c", sampling=greedy()),  # longest prompt: row gets left padding
    ]
    batched = engine.generate(others[:2] + [row] + others[2:])[2]
    assert batched.output_ids == alone.output_ids
    torch.testing.assert_close(torch.tensor(batched.output_logprobs), torch.tensor(alone.output_logprobs))
    other_seed = engine.generate([GenerateRequest(PROMPTS[0], "a", sample(seed=8, max_new_tokens=16))])[0]
    assert other_seed.output_ids != alone.output_ids


def test_sampling_in_row_chunks_changes_no_token_or_logprob(engine, monkeypatch):
    """The engine samples a step's rows in chunks (`_SAMPLE_ELEMENTS`, a bound on the sampler's (rows, vocab)
    temporaries): chunks of one row and one chunk of every row give the same tokens and log-probs, bit for bit."""
    import rollout.engines.embedded as embedded

    requests = [
        GenerateRequest(PROMPTS[i % 4], adapter=[None, "a", "b", "c"][i % 4], sampling=params)
        for i, params in enumerate(
            [sample(seed=s, max_new_tokens=12) for s in range(5)]
            + [sample(seed=20 + s, top_k=7, top_p=0.9) for s in range(3)]
            + [greedy(8), greedy(12)]
        )
    ]
    monkeypatch.setattr(embedded, "_SAMPLE_ELEMENTS", 1 << 30)
    whole = engine.generate(requests)
    monkeypatch.setattr(embedded, "_SAMPLE_ELEMENTS", 1)
    chunked = engine.generate(requests)
    assert [r.output_ids for r in chunked] == [r.output_ids for r in whole]
    assert [r.output_logprobs for r in chunked] == [r.output_logprobs for r in whole]
    assert len({tuple(r.output_ids) for r in whole}) > 5  # the rows really differ


def test_n_samples_of_one_prompt_share_one_prefill(engine, model):
    prefill_rows = []
    hook = model.base_model.register_forward_pre_hook(
        lambda _m, args, kwargs: (
            prefill_rows.append(kwargs["input_ids"].shape[0])
            if kwargs.get("input_ids") is not None and kwargs["input_ids"].shape[1] > 1
            else None
        ),
        with_kwargs=True,
    )
    try:
        group = [GenerateRequest(PROMPTS[0], "a", sample(seed=s)) for s in range(6)]
        grouped = engine.generate(group + [GenerateRequest(PROMPTS[1], None, greedy())])
    finally:
        hook.remove()
    assert prefill_rows == [2], "one prefill row per distinct (prompt, adapter)"
    for request, result in zip(group, grouped[: len(group)], strict=True):
        assert engine.generate([request])[0].output_ids == result.output_ids


def test_a_shared_prompt_batch_decodes_in_buffers_allocated_once(engine, model):
    """Bounded engine buffers: a group's rows write their own tokens' KV into buffers that grow by doubling up to
    what max_new_tokens needs (8 columns, then 11 here), not by one column per step, and every layer builds its
    attention's full KV in one scratch pair, so decode steps allocate no new KV tensors (a growing series of them
    fragmented the host heap); the outputs are those of rows run alone."""
    seen = []  # per decode call: (rows, layer 0's own-key buffer, the scratch's key buffer, capacity)

    def record(_m, args, kwargs):
        ids = kwargs.get("input_ids")
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        if ids is not None and ids.shape[1] == 1 and type(cache.layers[0]).__name__ == "_SharedPromptLayer":
            layer = cache.layers[0]
            seen.append((ids.shape[0], layer._key_buf.data_ptr(), layer.scratch.keys.data_ptr(), layer.capacity))

    hook = model.base_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        group = [GenerateRequest(PROMPTS[0], "a", sample(seed=s, max_new_tokens=12)) for s in range(5)]
        results = engine.generate(group)
    finally:
        hook.remove()
    assert len(seen) >= 3, "the group decoded in a shared-prompt batch"
    capacities = [capacity for *_, capacity in seen]
    assert set(capacities) <= {8, 11} and capacities == sorted(capacities), "8 columns, then max_new_tokens - 1"
    assert len({scratch for _, _, scratch, _ in seen}) == 1, "one scratch pair for every layer and step"
    for rows, capacity in {(rows, capacity) for rows, _, _, capacity in seen}:
        # a new own-KV buffer only when it grows or finished rows leave the batch
        assert len({buf for n, buf, _, c in seen if (n, c) == (rows, capacity)}) == 1
    for request, result in zip(group, results, strict=True):
        assert engine.generate([request])[0].output_ids == result.output_ids


def test_shared_prompt_layer_grows_past_its_capacity_with_the_same_kv():
    from transformers.cache_utils import DynamicLayer

    from rollout.engines.embedded import _KVScratch, _SharedPromptLayer

    torch.manual_seed(0)
    prompt = DynamicLayer()
    prompt.update(torch.randn(2, 3, 4, 5), torch.randn(2, 3, 4, 5))  # (U, H, P, D)
    row_prompt = torch.tensor([0, 1, 1])
    layer = _SharedPromptLayer(prompt, row_prompt, capacity=1, scratch=_KVScratch(1, prompt.keys))
    own_k, own_v = [], []
    for q in (1, 2, 1):  # 4 tokens into room for 1: two doublings
        k, v = torch.randn(3, 3, q, 5), torch.randn(3, 3, q, 5)
        own_k.append(k)
        own_v.append(v)
        full_k, full_v = layer.update(k, v)
        assert full_k.is_contiguous()
        assert torch.equal(full_k, torch.cat([prompt.keys[row_prompt], *own_k], dim=-2))
        assert torch.equal(full_v, torch.cat([prompt.values[row_prompt], *own_v], dim=-2))
    assert layer.get_seq_length() == 4 + 4
    assert layer.capacity >= 4


def test_top_k_one_is_greedy_and_top_p_keeps_the_top_token(engine):
    reference = engine.generate([GenerateRequest(PROMPTS[2], "b", greedy())])[0].output_ids
    for params in (sample(seed=3, top_k=1), sample(seed=4, top_p=1e-6)):
        assert engine.generate([GenerateRequest(PROMPTS[2], "b", params)])[0].output_ids == reference


@pytest.mark.parametrize(
    ("temperature", "top_k", "top_p"),
    [(1.0, -1, 1.0), (0.5, -1, 1.0), (1.0, 2, 1.0), (1.0, -1, 0.7), (2.0, 3, 0.9)],
)
def test_sampler_draws_from_the_filtered_tempered_distribution(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.2, -1.0, -3.0])
    n = 6000
    params = [SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)] * n
    generators = [torch.Generator().manual_seed(i) for i in range(n)]
    tokens = sample_next_tokens(logits.expand(n, -1), params, generators)
    # Reference in plain float64: temperature, keep the top-k, keep the prefix whose preceding mass <= top_p.
    probs = torch.softmax(logits.double() / temperature, -1)
    order = probs.argsort(descending=True)
    preceding = probs[order].cumsum(0) - probs[order]
    kept = order[(torch.arange(6) < (top_k if top_k > 0 else 6)) & (preceding <= top_p)]
    expected = torch.zeros(6, dtype=torch.float64)
    expected[kept] = probs[kept] / probs[kept].sum()
    observed = torch.bincount(tokens, minlength=6).double() / n
    assert observed[expected == 0].sum() == 0, "a filtered-out token was sampled"
    torch.testing.assert_close(observed, expected, atol=0.025, rtol=0)


@pytest.mark.parametrize("use_filters", [False, True])
def test_a_temperature_below_float32s_range_samples_the_argmax_and_leaves_its_neighbours_alone(use_filters):
    """1e-300 passed the `> 0` check but was 0 in a float32 tensor: 0 / 0 = NaN at the row's maximum, an index one
    past the vocabulary, and the whole batch failed with it (a reviewer's repro through the Tinker door)."""
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    extra = {"top_p": 0.9} if use_filters else {}
    params = [SamplingParams(temperature=t, **extra) for t in (1e-300, 1e-45, 1.0)]
    generators = [torch.Generator().manual_seed(i) for i in range(3)]
    tokens = sample_next_tokens(logits.clone(), params, generators)
    assert tokens[:2].tolist() == logits[:2].argmax(-1).tolist()
    alone = sample_next_tokens(logits[2:].clone(), params[2:], [torch.Generator().manual_seed(2)])
    assert tokens[2] == alone[0]


def test_stop_strings_stop_token_ids_eos_and_length(model, engine, peft_adapters):
    tok = tiny_tokenizer()
    free = engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(20, stop_token_ids=[]))])[0]
    assert free.finish_reason == "length" and len(free.output_ids) == 20
    ids = free.output_ids
    # Stop token id: the output ends at (and includes) its first occurrence.
    target = ids[5]
    res = engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(20, stop_token_ids=[target]))])[0]
    assert res.finish_reason == "stop" and res.output_ids == ids[: ids.index(target) + 1]
    # Stop string spanning two tokens: the ids are kept up to the token that completes it.
    stop = tok.decode(ids[6:8])
    res = engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(20, stop=[stop]))])[0]
    cut = next(k for k in range(1, 21) if stop in tok.decode(ids[:k]))
    assert res.finish_reason == "stop" and res.output_ids == ids[:cut]
    # EOS (engine-level set): the same rule as a stop token.
    eos_engine = EmbeddedEngine(model, tok, eos_token_ids=[ids[3]])
    try:
        eos_engine.load_adapter("a", *peft_adapters["a"][1:])
        res = eos_engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(20))])[0]
        # ignore_eos (SGLang's; a Tinker client's stop=[]): EOS does not end the row, an explicit stop id still does
        free = eos_engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(20, ignore_eos=True))])[0]
        stopped = eos_engine.generate(
            [GenerateRequest(PROMPTS[0], "a", greedy(20, ignore_eos=True, stop_token_ids=[ids[3]]))]
        )[0]
    finally:
        eos_engine.close()
    assert res.finish_reason == "stop" and res.output_ids == ids[: ids.index(ids[3]) + 1]
    assert free.finish_reason == "length" and free.output_ids == ids[:20]
    assert stopped.finish_reason == "stop" and stopped.output_ids == res.output_ids
    zero = engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(0))])[0]
    assert zero.finish_reason == "length" and zero.output_ids == []
    # The context length (max_position_embeddings=256) caps the output, as SGLang clips max_new_tokens.
    near_end = engine.generate([GenerateRequest([7] * 250, "a", greedy(20, stop_token_ids=[]))])[0]
    assert (near_end.finish_reason, len(near_end.output_ids)) == ("length", 6) or near_end.output_ids[-1] == EOS_ID
    too_long = engine.generate([GenerateRequest([7] * 256, "a", greedy())])[0]
    assert too_long.finish_reason == "error" and "context length 256" in too_long.error


def slowed(model, delay_s: float = 0.01):
    """Slow every model call down and signal once decoding has started, to catch a request mid-flight."""
    decoding = threading.Event()

    def hook(_module, _args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.shape[1] == 1:
            decoding.set()
        time.sleep(delay_s)

    return decoding, model.base_model.register_forward_pre_hook(hook, with_kwargs=True)


def run_in_thread(fn, *args):
    box = {}
    thread = threading.Thread(target=lambda: box.setdefault("out", fn(*args)))
    thread.start()
    return thread, box


def test_pause_load_resume_uses_new_weights_and_versions(engine, peft_adapters):
    requests = [GenerateRequest(PROMPTS[0], "a", greedy()), GenerateRequest(PROMPTS[1], "b", greedy())]
    before = engine.generate(requests)
    _, tensors, config = peft_adapters["a"]
    changed = {k: v * 1.5 if "lora_B" in k else v for k, v in tensors.items()}
    engine.pause()
    assert engine.load_adapter("a", changed, config) == 1
    engine.resume()
    after = engine.generate(requests)
    assert engine.adapter_versions() == {"a": 1, "b": 0, "c": 0}
    assert after[0].weight_version == 1 and after[1].weight_version == 0
    assert after[0].output_ids != before[0].output_ids
    assert after[1].output_ids == before[1].output_ids, "other adapters must not change"
    assert engine.load_adapter("a", tensors, config, version=7) == 7
    restored = engine.generate(requests)
    assert restored[0].output_ids == before[0].output_ids and restored[0].weight_version == 7


def test_training_the_model_slot_does_not_change_the_engine_until_load(model, peft_adapters):
    folder = peft_adapters["a"][0]
    model.load_adapter("a", str(folder))
    eng = EmbeddedEngine(model, tiny_tokenizer())
    try:
        eng.load_adapter("a", model.adapter_state_dict("a"), model.peft_config("a"))
        request = [GenerateRequest(PROMPTS[0], "a", greedy(12))]
        before = eng.generate(request)[0].output_ids
        assert before == hf_greedy(PROMPTS[0], 12, folder)
        with torch.no_grad():  # what an optimizer step does to the trainer's slots
            for param in model.parameters():
                if param.requires_grad:
                    param.add_(torch.randn_like(param) * 0.5)
        assert eng.generate(request)[0].output_ids == before
        eng.load_adapter("a", model.adapter_state_dict("a"), model.peft_config("a"))
        assert eng.generate(request)[0].output_ids != before
    finally:
        eng.close()


def test_unknown_adapter_fails_only_that_request(engine):
    results = engine.generate(
        [GenerateRequest(PROMPTS[0], "a", greedy()), GenerateRequest(PROMPTS[0], "nope", greedy())]
    )
    assert results[0].finish_reason in ("stop", "length") and results[0].output_ids
    assert results[1].finish_reason == "error" and "'nope'" in results[1].error and results[1].output_ids == []
    engine.unload_adapter("b")
    gone = engine.generate([GenerateRequest(PROMPTS[0], "b", greedy())])[0]
    assert gone.finish_reason == "error" and "'b'" in gone.error
    with pytest.raises(KeyError, match="'b'"):
        engine.unload_adapter("b")


@pytest.mark.parametrize(
    ("field", "value", "allowed"),
    [
        ("temperature", -1.0, ">= 0"),
        ("top_p", 0.0, "(0, 1]"),
        ("top_k", 0, "-1 (off)"),
        ("max_new_tokens", -2, ">= 0"),
    ],
)
def test_bad_sampling_values_fail_that_request_with_a_clear_error(engine, field, value, allowed):
    params = greedy()
    setattr(params, field, value)
    bad, good = engine.generate([GenerateRequest(PROMPTS[0], "a", params), GenerateRequest(PROMPTS[1], "a", greedy())])
    assert bad.finish_reason == "error" and f"sampling.{field}={value!r}" in bad.error and allowed in bad.error
    assert good.finish_reason in ("stop", "length")
    assert engine.generate([GenerateRequest([], None, greedy())])[0].error.startswith("input_ids=[]")
    assert "[0, 128)" in engine.generate([GenerateRequest([500], None, greedy())])[0].error


def test_pause_abort_returns_in_flight_requests_as_abort(engine, model):
    decoding, hook = slowed(model)
    try:
        thread, box = run_in_thread(
            engine.generate, [GenerateRequest(PROMPTS[0], "a", greedy(200, stop_token_ids=[]))]
        )
        assert decoding.wait(10)
        engine.pause()  # default mode: abort
        thread.join(10)
        result = box["out"][0]
        assert result.finish_reason == "abort" and result.output_ids == [] and result.weight_version == 0
        # While paused nothing runs; a queued request runs after resume.
        thread, box = run_in_thread(engine.generate, [GenerateRequest(PROMPTS[1], "b", greedy(3))])
        time.sleep(0.2)
        assert "out" not in box
        engine.resume()
        thread.join(10)
        assert box["out"][0].finish_reason in ("stop", "length") and box["out"][0].output_ids
    finally:
        hook.remove()


def test_pause_wait_lets_in_flight_requests_finish_on_the_old_weights(engine, model, peft_adapters):
    expected = engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(30, stop_token_ids=[]))])[0]
    decoding, hook = slowed(model)
    try:
        thread, box = run_in_thread(engine.generate, [GenerateRequest(PROMPTS[0], "a", greedy(30, stop_token_ids=[]))])
        assert decoding.wait(10)
        # If pause returned before the row finished, the reload below would abort it (version check).
        engine.pause(mode="wait")
        _, tensors, config = peft_adapters["a"]
        engine.load_adapter("a", {k: v * 2 for k, v in tensors.items()}, config)
        engine.resume()
        thread.join(10)
    finally:
        hook.remove()
    assert box["out"][0].output_ids == expected.output_ids and box["out"][0].weight_version == 0
    with pytest.raises(ValueError, match="pause mode='later'"):
        engine.pause(mode="later")


def test_publishing_a_version_mid_request_lets_running_rows_finish_on_theirs_and_pauses_no_one(
    engine, model, peft_adapters
):
    """A new version of `a` loaded without a pause (a free slot exists: 3 adapters, 4 slots) goes into another slot:
    `a`'s running row finishes on version 0 with exactly version 0's tokens, a row started afterwards runs on
    version 1, `b`'s long row never stops, and the load returns while both are still decoding. The old slot is
    freed once its last row is done."""
    _, tensors, config = peft_adapters["a"]
    doubled = {k: v * 2 for k, v in tensors.items()}
    long = greedy(60, stop_token_ids=[])
    expected_old = engine.generate([GenerateRequest(PROMPTS[0], "a", long)])[0]
    expected_b = engine.generate([GenerateRequest(PROMPTS[1], "b", long)])[0]
    decoding, hook = slowed(model)
    try:
        thread, box = run_in_thread(
            engine.generate, [GenerateRequest(PROMPTS[0], "a", long), GenerateRequest(PROMPTS[1], "b", long)]
        )
        assert decoding.wait(10)
        start = time.monotonic()
        assert engine.load_adapter("a", doubled, config) == 1  # no pause
        load_s = time.monotonic() - start
        assert "out" not in box  # both rows were still decoding when the publish returned
        after = engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(5, stop_token_ids=[]))])[0]
        thread.join(30)
    finally:
        hook.remove()
    old, other = box["out"]
    assert old.finish_reason == "length" and old.weight_version == 0 and old.output_ids == expected_old.output_ids
    assert other.finish_reason == "length" and other.output_ids == expected_b.output_ids
    assert after.weight_version == 1 and load_s < 0.5  # it waited one slowed decode step at most, not 60
    assert engine._retiring == {} and engine._slot_rows.get(0, 0) == 0  # the old slot was freed
    fresh = EmbeddedEngine(model, tiny_tokenizer())
    try:
        fresh.load_adapter("a", doubled, config)
        assert (
            fresh.generate([GenerateRequest(PROMPTS[0], "a", long)])[0].output_ids
            == engine.generate([GenerateRequest(PROMPTS[0], "a", long)])[0].output_ids
        )  # the new slot holds exactly the new weights
    finally:
        fresh.close()


def test_reloading_an_adapter_mid_request_without_a_free_slot_aborts_it_instead_of_mixing_versions(
    engine, model, peft_adapters
):
    engine.load_adapter("d", *peft_adapters["a"][1:])  # all 4 slots taken: no room to keep version 0 running
    decoding, hook = slowed(model)
    try:
        requests = [
            GenerateRequest(PROMPTS[0], "a", greedy(100, stop_token_ids=[])),
            GenerateRequest(PROMPTS[1], "b", greedy(20)),
        ]
        thread, box = run_in_thread(engine.generate, requests)
        assert decoding.wait(10)
        engine.load_adapter("a", *peft_adapters["a"][1:])  # no pause: the engine must still never mix versions
        thread.join(10)
    finally:
        hook.remove()
    stale, other = box["out"]
    assert stale.finish_reason == "abort" and stale.output_ids == [] and "version 0 to 1" in stale.error
    assert other.finish_reason in ("stop", "length") and other.weight_version == 0


@pytest.mark.parametrize("how", ["in place", "unload then load"])
def test_reloading_an_adapter_under_the_same_version_mid_request_aborts_it_instead_of_mixing_weights(
    engine, model, peft_adapters, how
):
    """A caller that passes the version (the weight sync, evals) may reload other weights under the same number, into
    the same slot (no free one; or the lowest free one after an unload): rows compared version and slot only, so a
    running row went on decoding on the new weights over the old ones' KV (a reviewer's repro)."""
    engine.load_adapter("d", *peft_adapters["a"][1:])  # all 4 slots taken
    version = engine.load_adapter("a", *peft_adapters["a"][1:])
    decoding, hook = slowed(model)
    try:
        thread, box = run_in_thread(
            engine.generate, [GenerateRequest(PROMPTS[0], "a", greedy(100, stop_token_ids=[]))]
        )
        assert decoding.wait(10)
        if how == "unload then load":
            engine.unload_adapter("a")
        engine.load_adapter("a", *peft_adapters["b"][1:], version=version)  # b's weights, a's version number
        thread.join(10)
    finally:
        hook.remove()
    [stale] = box["out"]
    if how == "in place":
        assert stale.finish_reason == "abort" and "reloaded under the same version" in stale.error, stale
    else:  # the unload alone ends it, whatever comes after
        assert stale.finish_reason == "abort" and stale.output_ids == [], stale


def test_concurrent_agenerate_calls_share_one_batch(engine, model):
    groups = [
        [GenerateRequest(PROMPTS[i], name, sample(seed=10 * i + k)) for k in range(3)]
        for i, name in enumerate(["a", "b", None, "c"])
    ]
    prefill_rows = []
    hook = model.base_model.register_forward_pre_hook(
        lambda _m, args, kwargs: (
            prefill_rows.append(kwargs["input_ids"].shape[0]) if kwargs["input_ids"].shape[1] > 1 else None
        ),
        with_kwargs=True,
    )

    async def rollout():
        return await asyncio.gather(*(engine.agenerate(g) for g in groups))

    try:
        results = asyncio.run(rollout())
    finally:
        hook.remove()
    assert prefill_rows == [4], "all groups of all adapters prefilled together, one row per distinct prompt"
    for group, group_results in zip(groups, results, strict=True):
        assert [r.output_ids for r in group_results] == [r.output_ids for r in engine.generate(group)]


def test_requests_arriving_mid_decode_join_the_running_batch(engine, model):
    long = GenerateRequest(PROMPTS[2] * 3, "a", greedy(60, stop_token_ids=[]))
    late = [GenerateRequest(PROMPTS[1], "b", greedy(5)), GenerateRequest(PROMPTS[0], None, sample(seed=3))]
    alone = [engine.generate([r])[0] for r in [long, *late]]
    decoding, hook = slowed(model, delay_s=0.02)
    try:
        long_thread, long_box = run_in_thread(engine.generate, [long])
        assert decoding.wait(10)
        late_results = engine.generate(late)  # admitted into the running wave, not queued behind it
        assert "out" not in long_box, "the late requests must finish while the long one is still decoding"
        long_thread.join(20)
    finally:
        hook.remove()
    for got, want in zip([long_box["out"][0], *late_results], alone, strict=True):
        assert got.output_ids == want.output_ids
        torch.testing.assert_close(torch.tensor(got.output_logprobs), torch.tensor(want.output_logprobs))


def test_more_requests_than_max_batch_size_stream_through_the_free_room(model, peft_adapters):
    eng = EmbeddedEngine(model, tiny_tokenizer(), max_batch_size=2)
    try:
        for name in ("a", "b"):
            eng.load_adapter(name, *peft_adapters[name][1:])
        requests = [
            GenerateRequest(PROMPTS[i % 4], [None, "a", "b"][i % 3], greedy(3 + 4 * (i % 3), stop_token_ids=[]))
            for i in range(7)
        ]
        batched = eng.generate(requests)
        assert [r.output_ids for r in batched] == [eng.generate([r])[0].output_ids for r in requests]
        assert [len(r.output_ids) for r in batched] == [r.sampling.max_new_tokens for r in requests]
    finally:
        eng.close()


def test_load_adapter_validates_config_and_tensors(engine, peft_adapters):
    _, tensors, config = peft_adapters["b"]
    key = next(iter(tensors))
    bogus = "base_model.model.model.layers.0.self_attn.nope.lora_A.weight"
    cases = [
        (tensors, {**config, "use_rslora": True}, "use_rslora=True is not allowed; allowed: False"),
        (tensors, {**config, "r": 32}, "r=32 is not allowed; allowed: an integer from 1 to max_rank=16"),
        (tensors, {**config, "peft_type": "IA3"}, "peft_type='IA3'"),
        (tensors, {**config, "r": 4}, r"has shape \(8, 32\); expected \(4, 32\)"),
        ({**tensors, "model.layers.0.q_proj.weight": tensors[key]}, config, "unexpected key"),
        ({k: v for k, v in tensors.items() if "layers.0.self_attn.q_proj.lora_B" not in k}, config, "no lora_B"),
        ({**tensors, bogus: tensors[key]}, config, "'model.layers.0.self_attn.nope' is not a LoRA target"),
    ]
    for bad_tensors, bad_config, message in cases:
        with pytest.raises(ValueError, match=message) as info:
            engine.load_adapter("x", bad_tensors, bad_config)
        assert "adapter 'x'" in str(info.value)
    with pytest.raises(ValueError, match="version='2'"):
        engine.load_adapter("x", tensors, config, version="2")
    for name in ("", "a/b", "a\n", ".."):  # the adapter-name rule of rl_multilora.lora
        with pytest.raises(ValueError, match=r"adapter name=.* is not allowed; allowed: "):
            engine.load_adapter(name, tensors, config)
    assert "x" not in engine.adapter_versions()
    # A failed reload leaves the old weights and version in place.
    before = engine.generate([GenerateRequest(PROMPTS[0], "b", greedy())])[0]
    with pytest.raises(ValueError):
        engine.load_adapter("b", tensors, {**config, "r": 4})
    after = engine.generate([GenerateRequest(PROMPTS[0], "b", greedy())])[0]
    assert after.output_ids == before.output_ids and after.weight_version == 0
    engine.load_adapter("d", *peft_adapters["a"][1:])  # the fourth and last slot
    with pytest.raises(RuntimeError, match="all 4 engine slots are in use"):
        engine.load_adapter("e", *peft_adapters["a"][1:])


def test_a_failing_forward_retries_its_rows_alone_and_the_engine_keeps_serving(engine, model):
    """A forward that raises once (a transient out of memory): the wave's rows run again, each alone, and come back
    as they do alone. One that raises every time: each row fails with the error. Either way the engine serves on."""
    requests = [GenerateRequest(p, "a", greedy(10)) for p in PROMPTS[:2]]
    alone = [engine.generate([r])[0] for r in requests]
    calls = []

    def explode(on_call):
        def hook(_module, _args, _kwargs):
            calls.append(1)
            if on_call is None or len(calls) == on_call:
                raise RuntimeError("simulated out of memory")

        return model.base_model.register_forward_pre_hook(hook, with_kwargs=True)

    hook = explode(on_call=3)
    try:
        retried = engine.generate(requests)
    finally:
        hook.remove()
    assert [(r.finish_reason, r.output_ids) for r in retried] == [(r.finish_reason, r.output_ids) for r in alone]
    hook = explode(on_call=None)
    try:
        failed = engine.generate(requests)
    finally:
        hook.remove()
    assert [r.finish_reason for r in failed] == ["error", "error"]
    assert all("simulated out of memory" in r.error and r.output_ids == [] for r in failed)
    assert engine.health()
    ok = engine.generate([GenerateRequest(PROMPTS[0], "a", greedy(10))])[0]
    assert ok.finish_reason in ("stop", "length") and ok.output_ids


def test_close_stops_the_worker_and_fails_new_requests(engine):
    assert engine.health()
    engine.close()
    assert not engine.health()
    result = engine.generate([GenerateRequest(PROMPTS[0], "a", greedy())])[0]
    assert result.finish_reason == "error" and "closed" in result.error


def test_a_new_adapter_takes_the_slot_an_older_version_still_holds(engine, model, peft_adapters):
    """Slots: a, b, c and one free. A new version of a mid-request takes the free slot (a's old version keeps
    running in its own); a new adapter d loaded then gets the old version's slot instead of failing for lack of
    one, and the old version's row comes back "abort" rather than decoding on d's weights."""
    _, tensors, config = peft_adapters["a"]
    decoding, hook = slowed(model)
    try:
        thread, box = run_in_thread(
            engine.generate, [GenerateRequest(PROMPTS[0], "a", greedy(100, stop_token_ids=[]))]
        )
        assert decoding.wait(10)
        engine.load_adapter("a", {k: v * 2 for k, v in tensors.items()}, config)  # into the free slot
        engine.load_adapter("d", *peft_adapters["b"][1:])  # no free slot left: takes a's old one
        thread.join(30)
    finally:
        hook.remove()
    (old,) = box["out"]
    assert old.finish_reason == "abort" and old.output_ids == [] and old.weight_version == 0
    expected = engine.generate([GenerateRequest(PROMPTS[1], "b", greedy(8))])[0].output_ids
    assert engine.generate([GenerateRequest(PROMPTS[1], "d", greedy(8))])[0].output_ids == expected
    assert engine._retiring == {}


def test_a_caller_whose_event_loop_closed_does_not_take_the_engine_down(engine):
    """A verifiers episode that times out closes its event loop while its request still waits in the engine: the
    worker must drop those results and go on serving everyone else (before, delivering them raised "Event loop is
    closed" in the worker thread, the worker died and every tenant's rollout hung)."""
    request = GenerateRequest(PROMPTS[0], adapter="a", sampling=greedy(4))
    engine.pause()
    with pytest.raises(TimeoutError):
        asyncio.run(asyncio.wait_for(engine.agenerate([request]), timeout=0.05))  # the loop is closed after this
    engine.resume()
    [result] = engine.generate([request])  # served after the orphaned rows were finished
    assert result.error is None and len(result.output_ids) > 0
    assert engine.health()


def test_nonfinite_rows_flags_nan_and_inf_and_keeps_huge_finite_logits():
    """The engine's per-row check (its fast path is the rows' sums): a NaN, an inf, a -inf, or both infinities in a
    row make it non-finite; finite logits whose sum overflows float32 stay finite (the exact check settles them)."""
    logits = torch.randn(6, 50)
    logits[1, 3] = float("nan")
    logits[2, 7] = float("inf")
    logits[3, 0] = -float("inf")
    logits[4, 1], logits[4, 2] = float("inf"), -float("inf")
    logits[5] = 3e37  # 50 x 3e37 overflows float32's 3.4e38
    assert torch.isinf(logits[5].sum())
    assert nonfinite_rows(logits) == [1, 2, 3, 4]
    assert nonfinite_rows(torch.randn(4, 50)) == []
