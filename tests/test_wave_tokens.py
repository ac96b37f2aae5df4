"""`max_wave_tokens`: the embedded engine bounds the KV token positions a decode wave may come to hold (rows join in
queue order while they fit, a shared prompt counted once), with each row's tokens and log-probs unchanged."""

from __future__ import annotations

import pytest
import torch

from rl_multilora.config import ConfigError, parse_run_config
from rl_multilora.lora import MultiLoRAModel
from rollout.engines.embedded import EmbeddedEngine
from rollout.types import GenerateRequest, SamplingParams
from tests.test_embedded_engine import ADAPTERS, PROMPTS, make_peft_adapter
from tests.tiny_models import tiny_model, tiny_tokenizer


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    return {
        name: make_peft_adapter(tmp_path_factory.mktemp(f"wave_{name}"), rank, alpha, seed)[1:]
        for name, (rank, alpha, seed) in ADAPTERS.items()
        if name in ("a", "b")
    }


def _engine(adapters, **kw) -> EmbeddedEngine:
    model = MultiLoRAModel.from_model(tiny_model(), max_loras=4, max_rank=16, target_modules="all-linear")
    eng = EmbeddedEngine(model, tiny_tokenizer(), **kw)
    for name, (tensors, config) in adapters.items():
        eng.load_adapter(name, tensors, config)
    return eng


def _record_waves(eng: EmbeddedEngine) -> list[tuple[int, int, int]]:
    """(rows, positions the rows will hold by their own count, positions as `_fitting` counts a fresh wave) of every
    decode step."""
    seen = []
    real = eng._decode_step

    def decode_step(batch):
        rows = batch.rows
        prompts = {(r.request.adapter, tuple(r.request.input_ids)) for r in rows}
        own = sum(len(r.output_ids) + eng._tokens_left(r) for r in rows)
        seen.append((len(rows), sum(eng._row_tokens(r) for r in rows), own + sum(len(p[1]) for p in prompts)))
        return real(batch)

    eng._decode_step = decode_step
    return seen


def _requests(max_new: int = 8) -> list[GenerateRequest]:
    params = SamplingParams(temperature=0.0, max_new_tokens=max_new, stop_token_ids=[])
    return [GenerateRequest(p, name, params) for p in PROMPTS for name in (None, "a", "b")]  # 12 distinct prompts


def test_distinct_prompts_run_in_waves_within_the_bound_with_the_same_outputs(adapters):
    free = _engine(adapters)
    bounded = _engine(adapters, max_wave_tokens=40)
    try:
        requests = _requests()
        want = free.generate(requests)
        waves = _record_waves(bounded)
        got = bounded.generate(requests)
    finally:
        free.close()
        bounded.close()
    assert max(rows for rows, _, _ in waves) < len(requests)  # the bound split them
    assert all(per_row <= 40 or rows == 1 for rows, per_row, _ in waves), waves
    for g, w in zip(got, want, strict=True):
        assert g.output_ids == w.output_ids
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(w.output_logprobs))


def test_a_group_sharing_its_prompt_counts_the_prompt_once(adapters):
    # 6 samples of a 6-token prompt, 4 new tokens each: 6 + 6 x 4 = 30 positions shared; 6 x 10 = 60 if each row
    # counted the prompt. A bound of 30 takes the whole group in one wave, and no more.
    eng = _engine(adapters, max_wave_tokens=30)
    try:
        waves = _record_waves(eng)
        group = [
            GenerateRequest(
                PROMPTS[0], "a", SamplingParams(temperature=1.0, max_new_tokens=4, seed=s, stop_token_ids=[])
            )
            for s in range(6)
        ]
        eng.generate(group)
    finally:
        eng.close()
    assert waves and waves[0][0] == 6 and waves[0][2] == 30, waves


def test_a_row_over_the_bound_runs_alone(adapters):
    eng = _engine(adapters, max_wave_tokens=5)
    try:
        waves = _record_waves(eng)
        results = eng.generate(_requests(max_new=3)[:3])
    finally:
        eng.close()
    assert [len(r.output_ids) for r in results] == [3, 3, 3]
    assert {rows for rows, _, _ in waves} == {1}


@pytest.mark.parametrize("value", [0, -3, 2.5, True])
def test_bad_values_are_refused_with_what_is_allowed(value):
    model = MultiLoRAModel.from_model(tiny_model(), max_loras=1, max_rank=4, target_modules="all-linear")
    with pytest.raises(ValueError, match=r"max_wave_tokens=.* is not allowed; allowed: an integer >= 1"):
        EmbeddedEngine(model, max_wave_tokens=value)


def test_the_config_field_names_the_bad_value(tmp_path):
    cfg = {"run_dir": str(tmp_path), "model": {"path": "x"}, "rollout": {"max_wave_tokens": 0}, "adapters": []}
    with pytest.raises(ConfigError, match="rollout.max_wave_tokens"):
        parse_run_config(cfg)


@pytest.mark.parametrize("engine", ["sglang", "http"])
def test_engines_that_do_not_read_the_bound_refuse_it(tmp_path, engine):
    rollout = {"engine": engine, "max_wave_tokens": 4096}
    if engine == "http":
        rollout["url"] = "http://127.0.0.1:30000"
    cfg = {"run_dir": str(tmp_path), "model": {"path": "x"}, "rollout": rollout, "adapters": []}
    with pytest.raises(
        ConfigError, match=rf"rollout.max_wave_tokens.*null with engine '{engine}'.*--max-total-tokens"
    ):
        parse_run_config(cfg)
    rollout.pop("max_wave_tokens")
    parse_run_config(cfg)  # the same config without it is valid


def test_waves_within_bounds_only_its_block_with_the_same_outputs(adapters):
    from rollout.engines.multi import MultiEngine

    eng = _engine(adapters)
    try:
        requests = _requests()
        want = eng.generate(requests)
        waves = _record_waves(eng)
        with eng.waves_within(40):
            got = eng.generate(requests)
        inside = list(waves)
        after = eng.generate(requests)
        with eng.waves_within(None):  # None: the engine's own bound (none here)
            assert eng._max_wave_tokens is None
        with pytest.raises(ValueError, match=r"max_wave_tokens=0 is not allowed; allowed: an integer >= 1"):
            with eng.waves_within(0):
                pass
        assert eng._max_wave_tokens is None
        other = _engine(adapters, max_wave_tokens=100)
        both = MultiEngine([eng, other])
        with both.waves_within(40):
            assert (eng._max_wave_tokens, other._max_wave_tokens) == (40, 40)
        assert (eng._max_wave_tokens, other._max_wave_tokens) == (None, 100)
        other.close()
    finally:
        eng.close()
    assert max(rows for rows, _, _ in inside) < len(requests)
    assert all(per_row <= 40 or rows == 1 for rows, per_row, _ in inside), inside
    assert max(rows for rows, _, _ in waves[len(inside) :]) == len(requests)  # after the block: one wave again
    for g, a, w in zip(got, after, want, strict=True):
        assert g.output_ids == a.output_ids == w.output_ids
        torch.testing.assert_close(torch.tensor(g.output_logprobs), torch.tensor(w.output_logprobs))


@pytest.mark.parametrize(
    "rollout", [{"engine": "sglang"}, {"engine": "embedded", "engine_actors": True, "num_engines": 1}]
)
def test_the_evals_bound_needs_an_embedded_engine_in_this_process(tmp_path, rollout):
    cfg = {"run_dir": str(tmp_path), "model": {"path": "x"}, "rollout": rollout, "eval": {"max_wave_tokens": 2048},
           "adapters": []}  # fmt: skip
    with pytest.raises(ConfigError, match=r"eval.max_wave_tokens=2048 is not allowed; allowed: null unless"):
        parse_run_config(cfg)
    cfg["eval"].pop("max_wave_tokens")
    parse_run_config(cfg)


def test_engines_without_waves_take_no_bound_and_run_evals_unchanged_without_one():
    from tests.tiny_models import ScriptedEngine

    eng = ScriptedEngine(tiny_tokenizer(), [])
    with eng.waves_within(None):  # what run_evals asks of every engine when eval.max_wave_tokens is null
        pass
    with pytest.raises(ValueError, match=r"max_wave_tokens=64 is not allowed with ScriptedEngine; allowed: None"):
        with eng.waves_within(64):
            pass
