"""Multi-turn episodes on the shared engine: token bookkeeping, exactness against a re-run of the same turns, and
faults that cost only their own episode."""

from __future__ import annotations

import dataclasses
import time

import numpy as np
import pytest
import torch

from rollout.engines.embedded import EmbeddedEngine
from rollout.environments import EnvStep, ToolCall, parse_tool_calls
from rollout.generate_state import GenerateState, MultiLoRAHooks, observation_ids
from rollout.types import (
    AdapterRef,
    EnvironmentSpec,
    GenerateRequest,
    RewardSpec,
    Sample,
    SampleStatus,
    SamplingParams,
)
from tests.tiny_models import tiny_model, tiny_tokenizer

SAMPLING = SamplingParams(temperature=1.0, max_new_tokens=5, stop_token_ids=[1])


@pytest.fixture(scope="module")
def setup():
    from rl_multilora.lora import MultiLoRAModel

    model = MultiLoRAModel(tiny_model(), max_loras=2, max_rank=4)
    model.add_adapter("env", rank=4, alpha=8, seed=1)
    model.add_adapter("plain", rank=4, alpha=8, seed=2)
    tok = tiny_tokenizer()
    engine = EmbeddedEngine(model, tok)
    for name in ("env", "plain"):
        engine.load_adapter(name, model.adapter_state_dict(name), model.peft_config(name), version=3)
    yield engine, tok
    engine.close()


def _samples(tok, name: str, env: EnvironmentSpec | None, n: int = 2, group: int = 0) -> list[Sample]:
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    return [
        Sample(
            prompt=prompt,
            prompt_ids=list(ids),
            label="3",
            group_index=group,
            index=i,
            adapter=AdapterRef(name, 0),
            reward_spec=None if env else RewardSpec(name="gsm8k"),
            environment=env,
            metadata={"sampling_seed": 100 + i},
        )  # fmt: skip
        for i in range(n)
    ]


def _run(engine, tok, groups):
    return GenerateState(engine, tok, MultiLoRAHooks(), SAMPLING).run_sync(groups)


def _spec(cls: str, **kw) -> EnvironmentSpec:
    return EnvironmentSpec(path=f"tests.env_plugins:{cls}", **kw)


def test_episode_tokens_masks_and_exactness_against_a_rerun_of_each_turn(setup):
    engine, tok = setup
    spec = _spec("Echo", kwargs={"turns": 3}, max_tokens=200)
    (s, _) = _run(engine, tok, [_samples(tok, "env", spec)])
    assert s.status == SampleStatus.COMPLETED and s.metadata["turns"] == 3
    assert s.metadata["turn_rewards"][:2] == [0.25, 0.25] and s.reward == pytest.approx(
        sum(s.metadata["turn_rewards"])
    )
    assert len(s.response_ids) == len(s.loss_mask) == len(s.rollout_logprobs) and s.weight_version == 3
    # Re-run every model turn on the engine from the same context and seed: the same ids and log-probs; the
    # environment's ids in between are exactly the chat template's rendering of its message, masked out.
    context, pos = list(s.prompt_ids), 0
    for turn in range(3):
        seed = (100 + 7919 * turn) & 0x7FFFFFFF
        budget = 200 - pos
        req = GenerateRequest(
            list(context), "env", dataclasses.replace(SAMPLING, seed=seed, max_new_tokens=min(5, budget))
        )
        (again,) = engine.generate([req])
        n = len(again.output_ids)
        assert s.response_ids[pos : pos + n] == again.output_ids and s.loss_mask[pos : pos + n] == [1] * n
        # (log-probs within float rounding: the episode's turns were batched with the other episode's)
        assert s.rollout_logprobs[pos : pos + n] == pytest.approx(again.output_logprobs, abs=1e-5)
        context += again.output_ids
        pos += n
        if turn < 2:
            ended = bool(again.output_ids) and again.output_ids[-1] == tok.eos_token_id
            obs = observation_ids(tok, [{"role": "user", "content": "again"}], ended)
            assert s.response_ids[pos : pos + len(obs)] == obs and s.loss_mask[pos : pos + len(obs)] == [0] * len(obs)
            assert set(s.rollout_logprobs[pos : pos + len(obs)]) == {0.0}
            assert tok.decode(obs).endswith("<user>again\n<assistant>")
            context += obs
            pos += len(obs)
    assert pos == len(s.response_ids)


def test_async_environments_and_turn_limits(setup):
    engine, tok = setup
    (a, _) = _run(engine, tok, [_samples(tok, "env", _spec("AsyncEcho", kwargs={"turns": 2}))])
    assert a.status == SampleStatus.COMPLETED and a.metadata["turns"] == 2
    (b, _) = _run(engine, tok, [_samples(tok, "env", _spec("NeverDone", max_turns=3))])
    assert b.status == SampleStatus.TRUNCATED and b.metadata["turns"] == 3 and b.reward == pytest.approx(0.3)
    (c, _) = _run(engine, tok, [_samples(tok, "env", _spec("NeverDone", max_turns=50, max_tokens=30))])
    assert c.status == SampleStatus.TRUNCATED and len(c.response_ids) <= 30
    # max_tokens past the model's context: the episode ends TRUNCATED where the context is full, with the rewards it
    # earned, instead of failing the turn that would not fit
    context = engine.context_length
    (d, _) = _run(engine, tok, [_samples(tok, "env", _spec("NeverDone", max_turns=500, max_tokens=100 * context))])
    assert d.status == SampleStatus.TRUNCATED and d.reward is not None and d.reward > 0
    assert len(d.prompt_ids) + len(d.response_ids) <= context


@pytest.mark.parametrize(
    ("cls", "reason"),
    [
        ("Raising", "environment raised RuntimeError: environment bug"),
        ("Hanging", "environment step ran past environment.turn_timeout_s=0.5"),
        ("AsyncHanging", "environment step ran past environment.turn_timeout_s=0.5"),
        ("Garbage", "step returned dict, not an EnvStep"),
        ("NaNReward", "reward=nan"),
        # BaseExceptions that asyncio would re-raise out of the rollout's loop, or read as the rollout's cancellation
        ("Exiting", "environment raised SystemExit: 3"),
        ("AsyncExiting", "environment raised SystemExit: 3"),
        ("AsyncCancelled", "environment raised CancelledError"),
        ("ExitingInit", "environment raised KeyboardInterrupt: from the constructor"),
        # a reviewer's finds: each was taken silently or said wrongly
        ("DoneString", "step returned done='False' (str); allowed: True or False"),
        ("ObsString", "step returned observation='try again' (str); allowed: a list of {'role': str, 'content': str}"),
        ("ResetReturnsObs", "environment reset returned ('Welcome! The rules: ...', {}) (tuple); allowed: None"),
        ("NoStep", "NoStep does not define step(action) -> EnvStep"),
    ],
)
def test_a_misbehaving_environment_costs_only_its_own_episodes(setup, cls, reason):
    engine, tok = setup
    plain_alone = _run(engine, tok, [_samples(tok, "plain", None, group=1)])
    bad = _samples(tok, "env", _spec(cls, turn_timeout_s=0.5))
    plain = _samples(tok, "plain", None, group=1)
    _run(engine, tok, [bad, plain])
    for s in bad:
        assert s.status == SampleStatus.FAILED and reason in s.metadata["error"] and s.reward is None
    for s, alone in zip(plain, plain_alone, strict=True):  # the other tenant's rollout is untouched
        assert s.status == alone.status and s.response_ids == alone.response_ids
        assert s.rollout_logprobs == pytest.approx(alone.rollout_logprobs, abs=1e-6)


def test_an_episode_past_its_timeout_fails_alone(setup):
    engine, tok = setup
    (s, _) = _run(engine, tok, [_samples(tok, "env", _spec("Hanging", turn_timeout_s=10, episode_timeout_s=0.5))])
    assert s.status == SampleStatus.FAILED and "episode_timeout_s=0.5" in s.metadata["error"]


def test_a_blocking_environment_constructor_times_out_alone(setup):
    """A reviewer's case: the constructor ran on the rollout's event loop, so a 3 s one stalled every episode and
    tenant one after the other and no timeout fired. It runs under environment.turn_timeout_s like reset and step."""
    engine, tok = setup
    plain_alone = _run(engine, tok, [_samples(tok, "plain", None, group=1)])
    slow = _samples(tok, "env", _spec("SlowInit", kwargs={"delay": 3.0}, turn_timeout_s=0.5, episode_timeout_s=5))
    plain = _samples(tok, "plain", None, group=1)
    start = time.monotonic()
    _run(engine, tok, [slow, plain])
    assert time.monotonic() - start < 2.5  # both episodes' constructors at once, each cut at 0.5 s
    for s in slow:
        assert (
            s.status == SampleStatus.FAILED
            and "construction ran past environment.turn_timeout_s=0.5" in s.metadata["error"]
        )
    assert [s.response_ids for s in plain] == [s.response_ids for s in plain_alone]


def test_episodes_share_no_state_through_their_kwargs(setup):
    """A reviewer's case: kwargs were copied one level deep, so an episode drawing from a list kwarg emptied it for
    the next episodes (and the tenant's spec): the third step's episodes failed with IndexError."""
    engine, tok = setup
    spec = _spec("DrawsFromItsDeck", kwargs={"deck": [1, 0, 0, 0]})
    for _ in range(3):
        out = _run(engine, tok, [_samples(tok, "env", spec)])
        assert [(s.status, s.reward) for s in out] == [(SampleStatus.COMPLETED, 1.0)] * 2
    assert spec.kwargs == {"deck": [1, 0, 0, 0]}


def test_an_episode_caps_at_the_context_given_to_the_rollout_on_any_engine(setup):
    """Behind several engines (or HTTP) the engine does not say its context length: the rollout is given the model's
    (as a run does, components.build_generator) and the episode ends TRUNCATED there, as on one embedded engine.
    It used to fail the turn that did not fit, and the episode was left out of training."""
    from rollout.engines.multi import MultiEngine

    engine, tok = setup
    multi = MultiEngine([engine])
    assert getattr(multi, "context_length", None) is None
    spec = _spec("NeverDone", max_turns=500, max_tokens=100 * engine.context_length)
    for given in (engine.context_length, None):
        (d, _) = GenerateState(multi, tok, MultiLoRAHooks(), SAMPLING, context_length=given).run_sync(
            [_samples(tok, "env", spec)]
        )
        if given is None:  # nothing said the context: the engine refuses the turn that outgrows it
            assert d.status == SampleStatus.FAILED and "context length" in d.metadata["error"]
        else:
            assert d.status == SampleStatus.TRUNCATED and d.reward is not None and d.reward > 0
            assert len(d.prompt_ids) + len(d.response_ids) <= engine.context_length


def test_tool_calls_are_parsed_and_dispatched():
    from tests.env_plugins import Calculator

    env = Calculator()
    from rollout.environments import Task

    env.reset(Task("what is 1+2?", label="3"))
    step = env.step('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    assert step.observation == [{"role": "tool", "content": "3"}] and not step.done
    step = env.step('<tool_call>{"name": "mul", "arguments": {}}</tool_call>')
    assert "unknown tool 'mul'" in step.observation[0]["content"]
    assert env.step("3") == EnvStep(reward=1.0, done=True)
    assert parse_tool_calls('<tool_call>{"name": "add", "arguments": {"a": 1}}') == [ToolCall("add", {"a": 1})]


def test_an_environment_tenant_trains_next_to_others_as_it_trains_alone(tmp_path):
    """Isolation with episodes: a multi-turn tenant (its own sampling too) trained beside a single-turn one ends
    where it ends alone, and so does the single-turn one; its environment tokens never reach its metrics as
    response tokens of a single turn."""
    from safetensors.torch import load_file

    from rl_multilora.checkpoint import CheckpointManager
    from rl_multilora.config import parse_run_config
    from rl_multilora.loop import run
    from rl_multilora.metrics import read_metrics
    from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    write_sum_task(tmp_path / "data" / "env.jsonl", 30, 1)
    write_sum_task(tmp_path / "data" / "plain.jsonl", 30, 3)
    env = sum_task_adapter(tmp_path / "data", "env", 5, max_steps=3, reward=None)
    env["environment"] = {"path": "tests.env_plugins:Echo", "kwargs": {"turns": 2}, "max_tokens": 40}
    env["sampling"] = {"temperature": 0.8, "max_new_tokens": 5}
    plain = sum_task_adapter(tmp_path / "data", "plain", 6, max_steps=3)

    def cfg(name: str, adapters: list[dict]) -> dict:
        return {
            "run_dir": str(tmp_path / name),
            "model": {"path": str(tmp_path / "model"), "max_loras": 2, "max_rank": 8},
            "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
            "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
            "logging": {"plot": False, "progress": False},
            "rewards": {"num_workers": 1},
            "adapters": adapters,
        }

    both = run(parse_run_config(cfg("both", [env, plain])))
    assert both.tenants.get("env").adapter_step == 3 and both.tenants.get("env").state.value == "REMOVED"
    run(parse_run_config(cfg("env_alone", [env])))
    run(parse_run_config(cfg("plain_alone", [plain])))
    for name, alone in (("env", "env_alone"), ("plain", "plain_alone")):
        got = load_file(str(CheckpointManager(tmp_path / "both").latest(name) / "adapter_model.safetensors"))
        want = load_file(str(CheckpointManager(tmp_path / alone).latest(name) / "adapter_model.safetensors"))
        for k in want:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=f"{name}/{k}")
    rows = [r for r in read_metrics(tmp_path / "both") if r["adapter"] == "env"]
    assert all(r["failed_samples"] == 0 and r["reward_mean"] is not None for r in rows)


def test_held_out_eval_plays_an_environment_tenants_episodes(tmp_path):
    """Eval runs a tenant's episodes (its environment and own sampling), beside a single-turn tenant's greedy answers,
    in the run and in `rl-multilora eval`, which scores exactly what the run's final eval logged."""
    import json

    from rl_multilora import cli
    from rl_multilora.config import parse_run_config
    from rl_multilora.loop import run
    from rl_multilora.metrics import read_metrics
    from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    write_sum_task(tmp_path / "data" / "env_train.jsonl", 30, 1)
    write_sum_task(tmp_path / "data" / "env_test.jsonl", 10, 21)
    env = sum_task_adapter(tmp_path / "data", "env", 5, max_steps=2, reward=None)
    env["dataset"]["data_files"] = {
        "train": str(tmp_path / "data" / "env_train.jsonl"),
        "test": str(tmp_path / "data" / "env_test.jsonl"),
    }
    env["environment"] = {"path": "tests.env_plugins:Echo", "kwargs": {"turns": 2}, "max_tokens": 40}
    env["sampling"] = {"max_new_tokens": 5}
    plain = {**sum_task_adapter(tmp_path / "data", "plain", 6, max_steps=2), "dataset": dict(env["dataset"])}
    cfg = {
        "run_dir": str(tmp_path / "run"),
        "model": {"path": str(tmp_path / "model"), "max_loras": 2, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "eval": {"enabled": True, "n_prompts": 6},
        "adapters": [plain, env],  # the single-turn tenant's samples come first in the eval batch
    }
    run(parse_run_config(cfg))
    rows = [r for r in read_metrics(tmp_path / "run") if r.get("kind") == "eval" and r["adapter"] == "env"]
    final = [r for r in rows if not r["eval/base"]][-1]
    assert final["adapter_step"] == 2 and final["eval/n_prompts"] == 6 and final["eval/errors"] == 0
    assert 0.25 <= final["eval/reward_mean"] <= 1.25  # Echo pays 0.25 per turn plus 1 for a digit
    assert cli.main(["eval", str(tmp_path / "run"), "--out", str(tmp_path / "e.json")]) == 0
    got = {r["adapter"]: r for r in json.loads((tmp_path / "e.json").read_text())}
    assert got["env"]["adapter_result"]["reward_mean"] == final["eval/reward_mean"]
    assert got["plain"]["adapter_result"]["reward_mean"] is not None


def test_environment_tokens_get_no_gradient():
    """An episode's environment tokens (loss_mask 0) carry no loss: the trainer's gradient equals the autograd gradient
    of the surrogate over the model's own tokens only (first PPO epoch: -A * grad log-prob, token mean), and differs
    from the one that would include the environment's tokens."""
    from rl_multilora.config import GRPOSettings
    from tests.test_trainer import build, sample

    response = [8, 9, 10, 11, 12, 13, 14]
    mask = [1, 1, 0, 0, 0, 1, 1]  # model turn, environment turn, model turn
    rows = [
        sample("a", 0, 1.0, prompt=(5, 6, 7), response=response, loss_mask=mask),
        sample("a", 0, 0.0, prompt=(5, 6, 7), response=response[::-1], loss_mask=mask),
    ]

    def reference_norm(keep_all: bool) -> float:
        model, _ = build(["a"], GRPOSettings(micro_batch_size=4, normalize_std=False, drop_uniform_groups=False))
        loss, n = 0.0, 0
        for s, adv in zip(rows, (0.5, -0.5), strict=True):  # rewards 1, 0: advantages +-0.5 without std
            ids = torch.tensor([s.prompt_ids + s.response_ids])
            logits = model(ids, attention_mask=torch.ones_like(ids), adapter_names=["a"]).logits[0]
            logp = torch.log_softmax(logits.float(), -1)[2:-1].gather(-1, torch.tensor(s.response_ids)[:, None])[:, 0]
            keep = torch.ones(len(mask), dtype=torch.bool) if keep_all else torch.tensor(mask, dtype=torch.bool)
            loss = loss - (adv * logp[keep]).sum()
            n += int(keep.sum())
        (loss / n).backward()
        # the adapter's own gradients (its slot's part: the backward keeps gradients of the used slots only)
        norms = [g.norm() for g in model.adapter_grads("a") if g is not None]
        return float(torch.linalg.vector_norm(torch.stack(norms)))

    # build: the same seeds every time, so each call starts from the same adapter (lora_B = 0 at init: its A gets no
    # gradient; B's gradient is what differs)
    _, trainer = build(["a"], GRPOSettings(micro_batch_size=4, normalize_std=False, drop_uniform_groups=False))
    got = trainer.train_step(rows)["a"].grad_norm
    assert got == pytest.approx(reference_norm(keep_all=False), rel=1e-5)
    assert got != pytest.approx(reference_norm(keep_all=True), rel=1e-3)


@pytest.mark.parametrize(
    ("reward", "ok"),
    [(np.float32(0.5), 0.5), (np.int64(1), 1.0), (True, 1.0), (torch.tensor(0.25), 0.25), (2, 2.0),
     ("1", None), (b"1", None), (None, None), (float("inf"), None), (np.float64("nan"), None)],
)  # fmt: skip
def test_an_environment_reward_is_taken_as_a_reward_function_s_would_be(reward, ok):
    """A reward function's numpy scalar or bool counted; the same value from an environment failed the episode."""
    from rollout.environments import check_step

    if ok is None:
        with pytest.raises(ValueError, match="allowed: a finite number"):
            check_step(EnvStep(reward=reward, done=True))
        return
    step = check_step(EnvStep(reward=reward, done=True))
    assert type(step.reward) is float and step.reward == ok


def test_an_episode_published_over_between_turns_trains_as_its_oldest_turn():
    """An async publish between two turns gave the later turns the new version, and the episode was failed whole
    ('turns were generated by different adapter versions'): 85-90 % of a slow environment's look-ahead episodes."""
    from concurrent.futures import ThreadPoolExecutor

    from rl_multilora.lora import MultiLoRAModel
    from tests.env_plugins import GatedEcho

    model = MultiLoRAModel(tiny_model(), max_loras=2, max_rank=4)
    model.add_adapter("env", rank=4, alpha=8, seed=1)
    tok = tiny_tokenizer()
    engine = EmbeddedEngine(model, tok)
    try:
        engine.load_adapter("env", model.adapter_state_dict("env"), model.peft_config("env"), version=3)
        GatedEcho.entered.clear()
        GatedEcho.release.clear()
        spec = _spec("GatedEcho", kwargs={"turns": 2}, max_tokens=200)
        with ThreadPoolExecutor(1) as pool:
            running = pool.submit(_run, engine, tok, [_samples(tok, "env", spec, n=1)])
            assert GatedEcho.entered.wait(60)  # the first turn is done; the environment holds the episode
            engine.load_adapter("env", model.adapter_state_dict("env"), model.peft_config("env"), version=4)
            GatedEcho.release.set()
            (s,) = running.result(60)
    finally:
        GatedEcho.release.set()
        engine.close()
    assert s.status == SampleStatus.COMPLETED and s.metadata["turns"] == 2, s.metadata.get("error")
    assert s.metadata["turn_versions"] == [3, 4] and s.weight_version == 3
    assert len(s.rollout_logprobs) == len(s.response_ids) == len(s.loss_mask)


def test_an_episode_whose_engine_gave_no_log_probs_has_none_like_a_single_turn_sample():
    """An engine may return no `output_logprobs` (a single-turn sample then has none, and the trainer weighs its
    tokens without a rollout correction); an episode made up 0.0 for each token instead, so TIS read p = 1 and
    weighed every token down by its trainer probability (a reviewer's repro)."""
    from rl_multilora.batch import make_row
    from rollout.types import GenerateResult
    from tests.tiny_models import ScriptedEngine

    class _NoLogprobs(ScriptedEngine):
        def generate(self, requests):
            return [dataclasses.replace(r, output_logprobs=[]) for r in super().generate(requests)]

    tok = tiny_tokenizer()
    prompt = tok.apply_chat_template([{"role": "user", "content": "1+2="}], tokenize=False, add_generation_prompt=True)
    ids = tok(prompt, add_special_tokens=False)["input_ids"]
    params = SamplingParams(temperature=1.0, max_new_tokens=5)
    got = {}
    for kind, env, texts in (("single", None, ["3"]), ("episode", EnvironmentSpec(
            path="tests.env_plugins:Echo", kwargs={"turns": 2}, max_tokens=200), ["1", "3"])):  # fmt: skip
        sample = Sample(prompt=prompt, prompt_ids=list(ids), label="3", group_index=0, index=0,
                        adapter=AdapterRef("a", 0), reward_spec=None if env else RewardSpec(name="gsm8k"),
                        environment=env, metadata={"sampling_seed": 1})  # fmt: skip
        [done] = GenerateState(_NoLogprobs(tok, texts), tok, MultiLoRAHooks(), params).run_sync([[sample]])
        assert done.status == SampleStatus.COMPLETED, (kind, done.error)
        done.advantage = 1.0
        got[kind] = (done.rollout_logprobs, make_row(done).rollout_logprobs)
    assert got["episode"] == got["single"] == ([], None)
    assert isinstance(GenerateResult(output_ids=[1]).output_logprobs, list)  # an engine may leave them out


def test_a_numpy_done_and_reward_are_taken(setup):
    engine, tok = setup
    for s in _run(engine, tok, [_samples(tok, "env", _spec("NumpyDone"))])[:2]:
        assert s.status != SampleStatus.FAILED and s.reward == 0.5 and s.metadata["turn_rewards"] == [0.5]


def test_a_failing_close_is_logged_once_without_an_unrelated_context(setup, caplog, monkeypatch):
    """Each episode logged a two-part traceback, chained to an internal "no running event loop" (a reviewer's find).
    The first failure of a kind is logged with its own traceback; the same kind again is not."""
    from rollout import generate_state

    monkeypatch.setattr(generate_state, "_SAID", set())
    engine, tok = setup
    with caplog.at_level("WARNING", logger="rollout.generate_state"):
        done = _run(engine, tok, [_samples(tok, "env", _spec("CloseRaises"), n=4)])
    assert all(s.reward == 1.0 for s in done)
    (said,) = [r for r in caplog.records if "close failed" in r.getMessage()]
    assert said.exc_info is not None and str(said.exc_info[1]) == "close boom"
    assert said.exc_info[1].__context__ is None  # no "no running event loop" chained to it


def test_a_reset_that_returns_something_else_is_warned_about_once(setup, caplog, monkeypatch):
    """A reset returning a non-observation (True, self) trained before and still does; it is said once."""
    from rollout import generate_state

    monkeypatch.setattr(generate_state, "_SAID", set())
    engine, tok = setup
    with caplog.at_level("WARNING", logger="rollout.generate_state"):
        done = _run(engine, tok, [_samples(tok, "env", _spec("ResetReturnsTrue"), n=3)])
    assert all(s.status != SampleStatus.FAILED and s.reward == 1.0 for s in done)
    (said,) = [r for r in caplog.records if "reset returned" in r.getMessage()]
    assert "reset returned bool, which is ignored" in said.getMessage()


def test_validation_builds_an_async_environment_on_a_loop_as_an_episode_does(setup):
    """Validation built every class in a bare thread: an async one that binds its loop in __init__ (valid, and built
    on the rollout's loop by episodes) was refused with "no current event loop" (a reviewer's find)."""
    from rl_multilora.validate import _build_environment_once

    assert _build_environment_once(_spec("BindsTheLoop", turn_timeout_s=0.5)) is None
    engine, tok = setup
    assert all(s.reward == 1.0 for s in _run(engine, tok, [_samples(tok, "env", _spec("BindsTheLoop"))]))
    slow = _build_environment_once(_spec("SlowInit", kwargs={"delay": 2.0}, turn_timeout_s=0.3))
    assert "building it ran past environment.turn_timeout_s=0.3" in slow
