"""GenerateState and hooks against a fake engine: hook order, plugin loading, resubmits, per-request failure,
in-flight counts and concurrent submission of every adapter's groups."""

import asyncio
from pathlib import Path

import datasets
import pytest
from tiny_models import EOS_ID, tiny_tokenizer

from rollout.data_source import DatasetSpec, MultiLoRADataSource
from rollout.engines.base import RolloutEngine
from rollout.generate_state import (
    AdapterTags,
    GenerateState,
    GenerateStateHooks,
    HooksError,
    MultiLoRAHooks,
    load_hooks,
)
from rollout.types import AdapterRef, GenerateResult, RewardSpec, Sample, SampleStatus, SamplingParams

TESTS_DIR = str(Path(__file__).parent)
REWARD = RewardSpec(name="gsm8k")


class FakeEngine(RolloutEngine):
    """Deterministic engine: the response is a function of (prompt, seed) only.

    `aborts[(adapter, sample.index)] = k` returns "abort" (with partial tokens from a stale version)
    for the first k attempts of that request; `errors` lists (adapter, index) pairs that get an error
    result; `raise_for` names adapters whose whole call raises. With `barrier_parties`, every call
    waits until that many calls are in flight, which only succeeds if all groups are submitted at once.
    """

    def __init__(self, *, aborts=None, errors=(), raise_for=(), barrier_parties=None, response_len=4, observe=None):
        self.aborts = dict(aborts or {})
        self.errors = set(errors)
        self.raise_for = set(raise_for)
        self.barrier = asyncio.Barrier(barrier_parties) if barrier_parties else None
        self.response_len = response_len
        self.observe = observe  # called with each request list while the call is in flight
        self.requests = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.version = 7

    @staticmethod
    def _key(request):
        adapter, _, sample, _ = request.rid.split("/")
        return adapter, int(sample[1:])

    def _result(self, request) -> GenerateResult:
        key = self._key(request)
        if key in self.errors:
            return GenerateResult(finish_reason="error", error="boom")
        seed = request.sampling.seed or 0
        n = min(self.response_len, request.sampling.max_new_tokens)
        # ids 3..99 are printable characters of the tiny tokenizer
        ids = [3 + (sum(request.input_ids) + seed + k) % 90 for k in range(n)]
        if self.aborts.get(key, 0) > 0:
            self.aborts[key] -= 1
            return GenerateResult(
                output_ids=[99, 99],
                output_logprobs=[-9.0, -9.0],
                finish_reason="abort",
                weight_version=self.version - 1,
            )
        stop = n < request.sampling.max_new_tokens
        return GenerateResult(
            output_ids=ids + [EOS_ID] if stop else ids,
            output_logprobs=[-0.5] * (n + 1 if stop else n),
            finish_reason="stop" if stop else "length",
            weight_version=self.version,
        )

    def generate(self, requests):
        return [self._result(r) for r in requests]

    async def agenerate(self, requests):
        self.requests.extend(requests)
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            if self.observe is not None:
                self.observe(requests)
            if self.barrier is not None:
                await asyncio.wait_for(self.barrier.wait(), timeout=5)
            await asyncio.sleep(0)
            if {r.adapter for r in requests} & self.raise_for:
                raise RuntimeError("engine crashed")
            return self.generate(requests)
        finally:
            self.in_flight -= 1

    def load_adapter(self, name, tensors, config, version=None):
        return 0

    def unload_adapter(self, name):
        pass

    def pause(self):
        pass

    def resume(self):
        pass

    def health(self):
        return True


def make_groups(spec: dict[str, int], n: int = 2, prompt_ids=(10, 11, 12)) -> list[list[Sample]]:
    """Groups for {adapter: n_groups}; adapter names get slots in order; indices are unique in the step."""
    groups, index = [], 0
    for slot, (name, n_groups) in enumerate(spec.items()):
        for g in range(n_groups):
            group = []
            for s in range(n):
                group.append(
                    Sample(
                        prompt="p",
                        prompt_ids=list(prompt_ids),
                        group_index=g,
                        index=index,
                        adapter=AdapterRef(name, slot),
                        reward_spec=REWARD,
                        metadata={"sampling_seed": 1000 * slot + 10 * g + s},
                    )
                )
                index += 1
            groups.append(group)
    return groups


def make_state(engine, hooks=None, **kwargs):
    sampling = SamplingParams(temperature=0.7, max_new_tokens=8)
    return GenerateState(engine, tiny_tokenizer(), hooks or MultiLoRAHooks(), sampling, **kwargs)


def test_custom_hooks_from_import_path_see_exact_order(monkeypatch):
    monkeypatch.syspath_prepend(TESTS_DIR)
    hooks = load_hooks("hooks_plugins:RecordingHooks")
    groups = make_groups({"a": 2, "b": 1}, n=2)
    samples = make_state(FakeEngine(), hooks).run_sync(groups)
    events = hooks.events
    assert events[0] == ("start", None)
    assert events[1:4] == [("submit", ("a", 0)), ("submit", ("a", 1)), ("submit", ("b", 0))]
    assert events[-1] == ("end", 6)
    middle = events[4:-1]
    assert len(middle) == 6 + 3
    for group in groups:
        name, gi = group[0].adapter.name, group[0].group_index
        mine = [i for i, (_, detail) in enumerate(middle) if detail[:2] == (name, gi)]
        # each group: its samples in order, then its group_done, back to back (no awaits in between)
        assert [middle[i] for i in mine] == [("sample", (name, gi, s.index)) for s in group] + [("group", (name, gi))]
        assert mine == list(range(mine[0], mine[0] + len(group) + 1))
    assert [s.index for s in samples] == list(range(6))


def test_load_hooks_errors_are_clear(monkeypatch):
    monkeypatch.syspath_prepend(TESTS_DIR)
    assert type(load_hooks(None)) is MultiLoRAHooks
    registry = {"a": AdapterTags(AdapterRef("a", 0), REWARD)}
    assert load_hooks("hooks_plugins:CountingMultiLoRAHooks", registry=registry).registry == registry
    with pytest.raises(HooksError, match=r"cannot import module 'no_such_hooks_module'"):
        load_hooks("no_such_hooks_module:Hooks")
    with pytest.raises(HooksError, match=r"module 'hooks_plugins' has no attribute 'Missing'"):
        load_hooks("hooks_plugins:Missing")
    with pytest.raises(HooksError, match=r"'NotAHooksClass' is .*not a subclass of .*GenerateStateHooks"):
        load_hooks("hooks_plugins:NotAHooksClass")
    with pytest.raises(HooksError, match=r"'not_a_class' is .*not a subclass"):
        load_hooks("hooks_plugins:not_a_class")
    with pytest.raises(HooksError, match=r"allowed: 'module:Class'"):
        load_hooks("hooks_plugins.RecordingHooks")
    with pytest.raises(HooksError, match=r"cannot construct RecordingHooks"):
        load_hooks("hooks_plugins:RecordingHooks", registry=registry)


def test_requests_and_filled_samples():
    engine = FakeEngine(response_len=3)
    samples = make_state(engine).run_sync(make_groups({"a": 1, "b": 1}, n=2))
    assert len(engine.requests) == 4
    for request, sample in zip(engine.requests, samples, strict=True):
        assert request.input_ids == sample.prompt_ids
        assert request.adapter == sample.adapter.name
        assert request.sampling.seed == sample.metadata["sampling_seed"]
        assert (request.sampling.temperature, request.sampling.max_new_tokens) == (0.7, 8)
    for sample in samples:
        expected = [3 + (sum(sample.prompt_ids) + sample.metadata["sampling_seed"] + k) % 90 for k in range(3)]
        assert sample.response_ids == expected + [EOS_ID]
        assert sample.response == tiny_tokenizer().decode(expected)  # EOS skipped
        assert sample.loss_mask == [1] * 4 and sample.rollout_logprobs == [-0.5] * 4
        assert (sample.status, sample.finish_reason, sample.weight_version) == (SampleStatus.COMPLETED, "stop", 7)

    truncated = make_state(FakeEngine(response_len=20)).run_sync(make_groups({"a": 1}, n=1))[0]
    assert (truncated.status, truncated.finish_reason, len(truncated.response_ids)) == (
        SampleStatus.TRUNCATED,
        "length",
        8,
    )


def test_abort_is_resubmitted_and_never_mixes_results():
    groups = make_groups({"a": 1, "b": 1}, n=2)
    # a's index 0 aborts twice then completes; b's index 2 aborts more often than allowed
    engine = FakeEngine(aborts={("a", 0): 2, ("b", 2): 10})
    state = make_state(engine, max_resubmits=3)
    samples = state.run_sync(groups)
    recovered, given_up = samples[0], samples[2]
    assert recovered.status == SampleStatus.COMPLETED and recovered.metadata["resubmits"] == 2
    assert recovered.weight_version == 7 and 99 not in recovered.response_ids  # nothing of the aborted tries
    assert len(recovered.response_ids) == len(recovered.rollout_logprobs) == len(recovered.loss_mask)
    attempts = [r for r in engine.requests if r.rid.startswith("a/g0/s0/")]
    assert [r.rid[-2:] for r in attempts] == ["a0", "a1", "a2"]
    assert {r.sampling.seed for r in attempts} == {recovered.metadata["sampling_seed"]}
    assert given_up.status == SampleStatus.ABORTED and given_up.metadata["resubmits"] == 3
    assert len([r for r in engine.requests if r.rid.startswith("b/g0/s2/")]) == 4
    assert samples[1].status == samples[3].status == SampleStatus.COMPLETED
    assert state.pending == 0


def test_errors_fail_only_their_requests():
    engine = FakeEngine(errors={("a", 1)}, raise_for={"b"})
    samples = make_state(engine).run_sync(make_groups({"a": 1, "b": 1, "c": 1}, n=2))
    statuses = [s.status for s in samples]
    assert statuses == [
        SampleStatus.COMPLETED,
        SampleStatus.FAILED,
        SampleStatus.FAILED,
        SampleStatus.FAILED,
        SampleStatus.COMPLETED,
        SampleStatus.COMPLETED,
    ]
    assert samples[1].metadata["error"] == "boom"
    assert samples[2].metadata["error"] == "RuntimeError: engine crashed"
    assert "error" not in samples[0].metadata


def test_all_groups_submitted_before_any_completes_and_in_flight_counts(monkeypatch):
    monkeypatch.syspath_prepend(TESTS_DIR)
    hooks = load_hooks("hooks_plugins:CountingMultiLoRAHooks")
    groups = make_groups({"a": 3, "b": 2, "c": 1}, n=2)
    seen = []
    state = None

    def observe(requests):
        seen.append(
            (requests[0].adapter, hooks.in_flight("a"), hooks.in_flight("b"), hooks.in_flight("c"), state.pending)
        )

    engine = FakeEngine(barrier_parties=len(groups), observe=observe)
    state = make_state(engine, hooks)
    samples = state.run_sync(groups)
    # the barrier only opens when all 6 calls are in flight together; a serial submit would time out -> FAILED
    assert all(s.status == SampleStatus.COMPLETED for s in samples)
    assert engine.max_in_flight == len(groups)
    # while requests are in flight every group is counted for its adapter and every sample is pending
    assert all(entry[1:] == (3, 2, 1, 12) for entry in seen)
    # each adapter's count falls back to 0 as its groups finish
    assert hooks.seen_in_flight["a"][0] == 3 and hooks.seen_in_flight["a"][-1] == 1
    assert [hooks.in_flight(n) for n in "abc"] == [0, 0, 0] and all(hooks.drained(n) for n in "abc")
    assert hooks.stats("a") == {"in_flight_groups": 0, "groups_done": 3, "samples_by_status": {"completed": 6}}
    assert state.pending == 0


def test_multilora_hooks_tag_from_registry_and_reject_untagged():
    hooks = MultiLoRAHooks({"a": AdapterTags(AdapterRef("a", 2), REWARD)})
    groups = make_groups({"a": 1}, n=2)
    groups[0][0].reward_spec = None
    groups[0][1].adapter, groups[0][1].reward_spec = None, None
    groups[0][1].metadata["adapter_name"] = "a"
    engine = FakeEngine()
    samples = make_state(engine, hooks).run_sync(groups)
    assert samples[1].adapter == AdapterRef("a", 2) and all(s.reward_spec == REWARD for s in samples)
    assert [r.adapter for r in engine.requests] == ["a", "a"]

    untagged = make_groups({"z": 1}, n=1)
    untagged[0][0].reward_spec = None
    engine = FakeEngine()
    with pytest.raises(HooksError, match=r"no RewardSpec and adapter 'z' is not in the hooks registry"):
        make_state(engine, hooks).run_sync(untagged)
    assert engine.requests == []  # rejected before anything was sent
    assert hooks.drained("z")


def test_hook_exception_cancels_other_groups_and_resets_counts():
    class FailingHooks(MultiLoRAHooks):
        def on_sample_done(self, state, sample):
            if sample.adapter.name == "b":
                raise RuntimeError("hook bug")
            super().on_sample_done(state, sample)

    hooks = FailingHooks()
    state = make_state(FakeEngine(), hooks)
    with pytest.raises(RuntimeError, match="hook bug"):
        state.run_sync(make_groups({"a": 2, "b": 1}, n=1))
    assert state.pending == 0
    state.run_sync(make_groups({"a": 1}, n=1))  # the next rollout starts clean
    assert hooks.drained("a") and hooks.drained("b")


def test_run_sync_inside_a_running_loop_and_base_hooks():
    state = make_state(FakeEngine(), GenerateStateHooks())

    async def caller():
        return state.run_sync(make_groups({"a": 1}, n=2))

    samples = asyncio.run(caller())
    assert [s.status for s in samples] == [SampleStatus.COMPLETED] * 2
    with pytest.raises(ValueError, match=r"groups\[0\] is empty"):
        state.run_sync([[]])
    with pytest.raises(HooksError, match="not a GenerateStateHooks"):
        make_state(FakeEngine(), object())


def test_data_source_groups_run_end_to_end():
    tokenizer = tiny_tokenizer()
    source = MultiLoRADataSource(tokenizer)
    for slot, name in enumerate(("a", "b")):
        rows = datasets.Dataset.from_list([{"prompt": f"{name} question {i}", "label": str(i)} for i in range(4)])
        source.add_adapter(
            AdapterRef(name, slot),
            DatasetSpec(path="inline"),
            REWARD,
            seed=slot,
            prompts_per_step=2,
            n_samples_per_prompt=3,
            dataset=rows,
        )
    drawn = source.next_groups(["a", "b"])
    groups = drawn["a"] + drawn["b"]
    engine = FakeEngine()
    samples = make_state(engine).run_sync(groups)
    assert len(samples) == 12 and all(s.status == SampleStatus.COMPLETED for s in samples)
    assert len({r.rid for r in engine.requests}) == 12
    assert [r.sampling.seed for r in engine.requests] == [s.metadata["sampling_seed"] for s in samples]
    assert [r.adapter for r in engine.requests] == ["a"] * 6 + ["b"] * 6
