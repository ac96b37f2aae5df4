"""The embedded engine's prefix cache: reused KV gives the uncached path's tokens and log-probs, a load invalidates it,
it stays within its bound and evicts least recently used.

Tolerance: a reused prefix's KV was computed by decode steps and by a prefill of another shape than the uncached
path's one prefill of the whole prompt; in float32 the matmuls then sum in another order, so logits (and log-probs)
agree to ~1e-6, not bit for bit. Greedy tokens are compared exactly (the tiny models have no near ties at these
prompts) and log-probs at atol 1e-4. A prefill with no hit runs the uncached code path itself (`W0 = 0`), which the
oracles of test_embedded_engine.py pin.
"""

from __future__ import annotations

import pytest
import torch

from rl_multilora.lora import MultiLoRAModel
from rollout.engines.embedded import EmbeddedEngine
from rollout.engines.prefix_cache import BLOCK, PrefixCache
from rollout.types import GenerateRequest, SamplingParams
from tests.tiny_models import tiny_model, tiny_tokenizer


def _req(input_ids, adapter=None, sampling=None, **kw) -> GenerateRequest:
    """A request that a continuation will follow (`keep_prefix`), as a multi-turn episode's turns are."""
    return GenerateRequest(input_ids, adapter, sampling or SamplingParams(), keep_prefix=True, **kw)


ADAPTERS = {"a": (4, 8, 1), "b": (8, 16, 2)}  # name -> (rank, alpha, seed)
LOGPROB_ATOL = 1e-4


def _prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, 100, (n,), generator=g).tolist()


@pytest.fixture
def model():
    m = MultiLoRAModel.from_model(tiny_model(layers=2), max_loras=4, max_rank=16, target_modules="all-linear")
    for name, (rank, alpha, seed) in ADAPTERS.items():
        m.add_adapter(name, rank=rank, alpha=alpha, seed=seed)
        with torch.no_grad():  # non-zero B, so every adapter really changes the output
            for p in m.parameters():
                if p.requires_grad:
                    p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(seed)))
    return m


def _engines(model, **kw):
    """(cached, uncached) engines over the same model with the same adapters loaded."""
    engines = (
        EmbeddedEngine(model, tiny_tokenizer(), eos_token_ids=[], **kw),
        EmbeddedEngine(model, tiny_tokenizer(), eos_token_ids=[], prefix_cache_bytes=0, **kw),
    )
    for eng in engines:
        for name in ADAPTERS:
            eng.load_adapter(name, model.adapter_state_dict(name), model.peft_config(name))
    return engines


def _assert_same(cached, uncached):
    for c, u in zip(cached, uncached, strict=True):
        assert c.finish_reason == u.finish_reason == "length"
        assert c.output_ids == u.output_ids
        torch.testing.assert_close(
            torch.tensor(c.output_logprobs), torch.tensor(u.output_logprobs), atol=LOGPROB_ATOL, rtol=0
        )


def _episode_turns(engine, first: list[GenerateRequest], turns: int, env_tokens: list[int]):
    """Run `turns` turns of each request: the next prompt is the last one + its output + `env_tokens`."""
    requests, results = first, []
    for _ in range(turns):
        out = engine.generate(requests)
        results.append(out)
        requests = [
            _req(r.input_ids + o.output_ids + env_tokens[: 3 + i], r.adapter, r.sampling)
            for i, (r, o) in enumerate(zip(requests, out, strict=True))
        ]
    return results


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_next_turns_reuse_the_cache_and_match_the_uncached_engine(model, temperature):
    cached, uncached = _engines(model)
    sampling = SamplingParams(temperature=temperature, max_new_tokens=12, seed=7 if temperature else None)
    # adapters a, b and the base, prompts of different lengths: the cached prefill has gaps of several widths
    first = [_req(_prompt(i, 20 + 7 * i), adapter, sampling) for i, adapter in enumerate(["a", "b", None, "a", "b"])]
    env = _prompt(99, 9)
    try:
        got = _episode_turns(cached, first, 3, env)
        want = _episode_turns(uncached, first, 3, env)
        for c, u in zip(got, want, strict=True):
            _assert_same(c, u)
        # turns 2 and 3 reused all but the new tokens of every prompt; turn 1 reused nothing
        assert cached.prefix_cache.hits == 2 * len(first)
        new = sum(1 + 3 + i for i in range(len(first)))  # per turn: the last output token (never fed) + 3 + i env
        assert cached.prompt_tokens - cached.reused_tokens == sum(len(r.input_ids) for r in first) + 2 * new
        assert uncached.prefix_cache is None and uncached.reused_tokens == 0
    finally:
        cached.close(), uncached.close()


def test_a_prefill_mixing_hits_and_misses_matches_the_uncached_engine(model):
    cached, uncached = _engines(model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    first = [_req(_prompt(i, 24), "a", greedy) for i in range(3)]
    try:
        turn1 = cached.generate(first)
        _assert_same(turn1, uncached.generate(first))
        second = [_req(r.input_ids + o.output_ids + [5, 6], "a", greedy) for r, o in zip(first, turn1, strict=True)]
        fresh = [_req(_prompt(50, 40), "a", greedy), _req(_prompt(51, 17), "b", greedy)]
        hits_before = cached.prefix_cache.hits
        _assert_same(cached.generate(second + fresh), uncached.generate(second + fresh))
        assert cached.prefix_cache.hits == hits_before + 3
    finally:
        cached.close(), uncached.close()


def test_a_group_prefills_its_prompt_once_and_a_later_sample_reuses_a_finished_sibling(model):
    cached, uncached = _engines(model)
    prompt = _prompt(3, 30)
    group = [_req(prompt, "b", SamplingParams(temperature=1.0, max_new_tokens=8, seed=s)) for s in range(4)]
    try:
        _assert_same(cached.generate(group), uncached.generate(group))
        assert cached.prompt_tokens == len(prompt)  # 4 samples, one prefill of the prompt
        late = [_req(prompt, "b", SamplingParams(temperature=1.0, max_new_tokens=8, seed=9))]
        _assert_same(cached.generate(late), uncached.generate(late))
        assert cached.reused_tokens == len(prompt) - 1  # all but the last token, whose logits it needs
    finally:
        cached.close(), uncached.close()


def test_loading_new_weights_invalidates_that_adapters_entries(model):
    cached, uncached = _engines(model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    first = [_req(_prompt(7, 30), "a", greedy), _req(_prompt(8, 30), "b", greedy)]
    try:
        out = cached.generate(first)
        assert len(cached.prefix_cache) == 2
        with torch.no_grad():
            for p in model.parameters():
                if p.requires_grad:
                    p.mul_(-1.5)  # the trainer's step: new weights for both adapters in the model
        for eng in (cached, uncached):  # same version number as before: the cache must not trust versions
            eng.load_adapter("a", model.adapter_state_dict("a"), model.peft_config("a"), version=0)
        assert len(cached.prefix_cache) == 1  # a's entry dropped at load, b's kept
        second = [_req(r.input_ids + o.output_ids + [4], r.adapter, greedy) for r, o in zip(first, out, strict=True)]
        reused = cached.reused_tokens
        _assert_same(cached.generate(second), uncached.generate(second))
        assert cached.reused_tokens - reused == len(second[1].input_ids) - 2  # b hit (all but its 2 new); a missed
        cached.unload_adapter("b")
        assert all(e.adapter[0] != "b" for e in cached.prefix_cache._entries.values())
    finally:
        cached.close(), uncached.close()


def test_the_engine_cache_stays_within_its_bound(model):
    per_token = 2 * 2 * 16 * 4  # layers x (K, V) x (2 kv heads x head dim 8) x float32 bytes
    eng = EmbeddedEngine(model, tiny_tokenizer(), eos_token_ids=[], prefix_cache_bytes=3 * 40 * per_token)
    eng.load_adapter("a", model.adapter_state_dict("a"), model.peft_config("a"))
    greedy = SamplingParams(temperature=0.0, max_new_tokens=9)
    try:
        for i in range(6):  # six entries of 40 tokens (31 prompt + 9 output - 1 never fed) into room for three
            eng.generate([_req(_prompt(20 + i, 31), "a", greedy)])
            assert eng.prefix_cache.nbytes <= eng.prefix_cache.max_bytes
        assert len(eng.prefix_cache) == 3 and eng.prefix_cache.evictions == 3
        with pytest.raises(ValueError, match="prefix_cache_bytes"):
            EmbeddedEngine(model, None, prefix_cache_bytes=-1)
    finally:
        eng.close()


# ------------------------------------------------------------------ PrefixCache on its own


def _kv(n: int, fill: float = 0.0):
    """One layer of KV for n tokens, (H=1, n, D=2): 4 * n float32 per tensor."""
    return [torch.full((1, n, 2), fill)], [torch.full((1, n, 2), fill)]


def test_lookup_finds_the_longest_shared_prefix_of_any_entry_and_never_another_adapters():
    cache = PrefixCache(10_000)
    cache.set_generation("a", 1)
    long = list(range(3 * BLOCK + 5))
    assert cache.insert(("a", 1), long, *_kv(len(long), 1.0))
    # a query that shares 2 blocks + 3 tokens, then differs
    query = long[: 2 * BLOCK + 3] + [999] * 10
    entry, m = cache.lookup(("a", 1), query, len(query) - 1)
    assert m == 2 * BLOCK + 3 and entry.tokens == tuple(long)
    assert cache.lookup(("a", 1), long + [7], BLOCK + 1)[1] == BLOCK + 1  # capped by max_len
    assert cache.lookup(("a", 2), query, len(query))[0] is None  # another load of the same adapter
    assert cache.lookup(("b", 1), query, len(query))[0] is None  # another adapter
    assert cache.lookup(("a", 1), long[: BLOCK - 1] + [999], 99)[0] is None  # shorter than a block: not reused
    assert not cache.insert(("a", 1), long[:40], *_kv(40))  # covered by the longer entry: not stored twice
    assert not cache.insert(("b", 7), long, *_kv(len(long)))  # b was never loaded (or was unloaded)


def test_insert_past_the_bound_evicts_least_recently_used():
    per_entry = 2 * 4 * 2 * BLOCK  # K and V, (1, BLOCK, 2) float32
    cache = PrefixCache(3 * per_entry)
    keys = [[i] * BLOCK for i in range(5)]
    for k in keys[:3]:
        assert cache.insert((None, 0), k, *_kv(BLOCK))
    assert cache.lookup((None, 0), keys[0] + [1], BLOCK)[0] is not None  # 0 is now the most recently used
    assert cache.insert((None, 0), keys[3], *_kv(BLOCK))  # evicts 1, the least recently used
    assert cache.lookup((None, 0), keys[1] + [1], BLOCK)[0] is None
    assert all(cache.lookup((None, 0), keys[i] + [1], BLOCK)[0] is not None for i in (0, 2, 3))
    assert cache.nbytes == 3 * per_entry and len(cache) == 3 and cache.evictions == 1
    assert not cache.insert((None, 0), list(range(4 * BLOCK)), *_kv(4 * BLOCK))  # larger than the bound: skipped
    assert len(cache) == 3


def test_a_turn_that_extends_the_entry_it_reused_replaces_it():
    cache = PrefixCache(10_000)
    turn1 = list(range(BLOCK + 4))
    cache.insert((None, 0), turn1, *_kv(len(turn1)))
    entry, m = cache.lookup((None, 0), turn1 + [50, 51], len(turn1) + 1)
    assert m == len(turn1)
    turn2 = turn1 + [50, 51, 52]
    assert cache.insert((None, 0), turn2, *_kv(len(turn2)), replaces=entry.id)
    assert len(cache) == 1 and cache.lookup((None, 0), turn2 + [1], len(turn2))[1] == len(turn2)


def test_single_turn_requests_keep_nothing_and_match_the_uncached_engine_bit_for_bit(model):
    """Without `keep_prefix` (single-turn GRPO rows, Tinker samples) nothing is cached, so a single-turn run takes
    exactly the uncached path: no memory held, no reuse rounding differently."""
    cached, uncached = _engines(model)
    sampling = SamplingParams(temperature=1.0, max_new_tokens=8, seed=3)
    prompt = _prompt(3, 40)
    try:
        for _ in range(2):  # the second round finds nothing to reuse
            requests = [GenerateRequest(prompt, "a", sampling), GenerateRequest(_prompt(4, 33), "b", sampling)]
            got, want = cached.generate(requests), uncached.generate(requests)
            for c, u in zip(got, want, strict=True):
                assert c.output_ids == u.output_ids and c.output_logprobs == u.output_logprobs
        assert cached.prefix_cache.hits == 0 and cached.reused_tokens == 0 and len(cached.prefix_cache) == 0
    finally:
        cached.close(), uncached.close()
