"""What a multi-turn episode's turns cost besides the model: the engine starts continuations that come back together
in one prefill, environment observations are rendered once, and environment calls reuse their threads.
Outputs never change: the continuations' tokens equal the uncached engine's, cached observations the rendered ones."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest
import torch

from rl_multilora.lora import MultiLoRAModel
from rollout.engines.embedded import EmbeddedEngine
from rollout.generate_state import _call, _DaemonThreads, _obs_caches, _observation_ids, observation_ids
from rollout.types import GenerateRequest, SamplingParams
from tests.tiny_models import tiny_model, tiny_tokenizer


def _prompt(seed: int, n: int) -> list[int]:
    return torch.randint(3, 100, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_continuations_arriving_a_few_ms_apart_start_in_one_prefill():
    """Rows that finished with `keep_prefix` are expected back: each arrival extends the coalescing wait, so
    continuations spread over more than `batch_wait_s` (but each within it of the last) share one prefill."""
    model = MultiLoRAModel.from_model(tiny_model(layers=2), max_loras=2, max_rank=8)
    cached = EmbeddedEngine(model, tiny_tokenizer(), eos_token_ids=[], batch_wait_s=0.1, continuation_wait_s=10.0)
    uncached = EmbeddedEngine(model, tiny_tokenizer(), eos_token_ids=[], prefix_cache_bytes=0)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=6)
    first = [GenerateRequest(_prompt(i, 20), None, greedy, keep_prefix=True) for i in range(5)]
    prefills: list[int] = []
    original = cached._prefill

    def counting(rows):
        prefills.append(len(rows))
        return original(rows)

    try:
        out = cached.generate(first)
        cached._prefill = counting
        second = [
            GenerateRequest(r.input_ids + o.output_ids + [5, 6, 7], None, greedy)
            for r, o in zip(first, out, strict=True)
        ]
        results: list = [None] * len(second)

        def send(i: int) -> None:
            results[i] = cached.generate([second[i]])[0]

        threads = []
        for i in range(len(second)):  # 0, 40, 80, 120, 160 ms: over the 100 ms window, each within it of the last
            threads.append(threading.Thread(target=send, args=(i,)))
            threads[-1].start()
            time.sleep(0.04)
        for t in threads:
            t.join()
        assert prefills == [5]
        want = uncached.generate(second)
        assert [r.output_ids for r in results] == [w.output_ids for w in want]
    finally:
        cached.close(), uncached.close()


def test_the_engine_rejects_a_bad_continuation_wait():
    model = MultiLoRAModel.from_model(tiny_model(layers=1), max_loras=1, max_rank=4)
    with pytest.raises(ValueError, match="continuation_wait_s"):
        EmbeddedEngine(model, tiny_tokenizer(), continuation_wait_s=-1.0)


def test_observation_ids_are_cached_per_content_and_equal_the_rendered_ones():
    tok = tiny_tokenizer()
    cases = [
        ([{"role": "user", "content": "go on"}], False),
        ([{"role": "user", "content": "go on"}], True),
        ([{"role": "tool", "content": "42"}, {"role": "user", "content": "and?"}], False),
        ([{"content": "go on", "role": "user"}], False),  # same content, other key order: a key of its own
    ]
    for messages, ended in cases * 2:  # the second round is served from the cache
        assert observation_ids(tok, messages, ended) == _observation_ids(tok, messages, ended)
    got = observation_ids(tok, [{"role": "user", "content": "x"}], False)
    got.append(-1)  # callers get their own list: mutating it never touches the cache
    assert observation_ids(tok, [{"role": "user", "content": "x"}], False) == _observation_ids(
        tok, [{"role": "user", "content": "x"}], False
    )

    class Odd:  # not JSON-like: rendered every time, never cached
        def __str__(self) -> str:
            return "odd"

    messages = [{"role": "user", "content": Odd()}]
    stored = len(_obs_caches[tok])
    assert observation_ids(tok, messages, False) == _observation_ids(tok, messages, False)
    assert len(_obs_caches[tok]) == stored


def test_environment_calls_reuse_threads_and_a_hung_call_holds_only_its_own():
    pool = _DaemonThreads(idle_s=5.0)
    seen: list[int] = []
    for _ in range(5):
        done = threading.Event()
        pool.submit(lambda done=done: (seen.append(threading.get_ident()), done.set()))
        assert done.wait(5)
        time.sleep(0.01)  # the thread is back among the idle ones
    assert len(set(seen)) == 1
    release = threading.Event()
    pool.submit(release.wait)  # hangs until released: it keeps its thread
    done = threading.Event()
    pool.submit(done.set)
    assert done.wait(5)
    release.set()

    async def episode_calls() -> list:
        slow = asyncio.create_task(_call(time.sleep, 10, timeout=0.2))
        fast = [await _call(lambda i=i: i * i, timeout=5) for i in range(4)]
        with pytest.raises(asyncio.TimeoutError):
            await slow
        return fast

    assert asyncio.run(episode_calls()) == [0, 1, 4, 9]


@pytest.mark.parametrize("where", ["engine", "request"])
def test_a_turn_ended_on_a_stop_token_other_than_eos_does_not_get_the_marker_again(where):
    """A Gemma-style model ends its turns on a token that is not the tokenizer's `eos_token` (`<end_of_turn>`, in the
    model's generation_config EOS ids or the request's stop_token_ids): the environment turn after it held the
    template's end-of-turn marker again, so the model trained on `...<end><end>` contexts the template never makes."""
    from rollout.generate_state import GenerateState, MultiLoRAHooks
    from rollout.types import AdapterRef, EnvironmentSpec, Sample, SampleStatus
    from tests.tiny_models import ScriptedEngine

    tok = tiny_tokenizer()
    (newline,) = tok("\n", add_special_tokens=False)["input_ids"]  # the tiny template's end-of-turn marker

    class EndsOnNewline(ScriptedEngine):  # ends each turn on "\n" (its own stop id), not on the tokenizer's EOS
        def generate(self, requests):
            out = super().generate(requests)
            for r in out:
                r.output_ids[-1] = newline
            return out

        @property
        def eos_ids(self) -> frozenset[int]:
            return frozenset({newline}) if where == "engine" else frozenset()

    engine = EndsOnNewline(tok, ["12", "3"])
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    sample = Sample(prompt=prompt, prompt_ids=tok(prompt, add_special_tokens=False)["input_ids"], label="3",
                    environment=EnvironmentSpec(path="tests.env_plugins:Echo", kwargs={"turns": 2}),
                    adapter=AdapterRef("env", 0), metadata={"sampling_seed": 1})  # fmt: skip
    stops = [newline] if where == "request" else []
    sampling = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=stops)
    (s,) = GenerateState(engine, tok, MultiLoRAHooks(), sampling).run_sync([[sample]])
    assert s.status == SampleStatus.COMPLETED, s.metadata.get("error")
    ids = lambda text: tok(text, add_special_tokens=False)["input_ids"]  # noqa: E731
    assert s.response_ids == ids("12") + [newline] + ids("<user>again\n<assistant>") + ids("3") + [newline]
    assert tok.decode(s.response_ids) == "12\n<user>again\n<assistant>3\n"  # the template's text, one marker
