"""Tinker's stability protocol and this project's `stable_reinforce`: records of what the server sampled
(`record_stability_info`, `sequence_id`), checked against a datum's provenance (`Datum.with_provenance`).

The store and the provenance checks are tested on their own (a fake clock, hand-made datums); the protocol through
the real `tinker` SDK against a server on a tiny random model (tests.tiny_models), as rl_loop drives it.
"""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from rl_multilora.tinker.stability import StabilityRecords
from rl_multilora.tinker.wire import Datum, Span
from tests.test_tinker_server import BASE, TOKEN, _Running, tiny_model_folder  # noqa: F401

PROMPT = [1, 7, 9, 11]
SAMPLED = [20, 21, 22]
LOGPROBS = [-1.5, -0.25, -2.0]


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _store(**kw) -> StabilityRecords:
    s = StabilityRecords(**kw)
    s.record("s1", ["seq-a"], PROMPT, [(SAMPLED, LOGPROBS, "stop")])
    return s


def _rl_loop_datum(prompt=PROMPT, sampled=SAMPLED, sid="seq-a", adv=1.0, **spans) -> Datum:
    """rl_loop's datum: input prompt + sampled[:-1], targets 0 on the prompt (as rl_loop sends) then the sampled
    tokens, its provenance as rl_loop's `with_sampled_provenance` (spans may be replaced)."""
    p, s = len(prompt), len(sampled)
    tokens = np.array(prompt + sampled[:-1], dtype=np.int64)
    inputs = {
        "target_tokens": np.array([0] * (p - 1) + sampled, dtype=np.int64),
        "advantages": np.array([0.0] * (p - 1) + [adv] * s, dtype=np.float32),
    }
    input_spans = spans.get("input_spans", [Span("prompt", sid, 0, p), Span("sampled", sid, 0, s - 1)])
    target_spans = spans.get("target_spans", [Span("prompt", sid, 1, p - 1), Span("sampled", sid, 0, s)])
    return Datum(tokens, inputs, input_spans, target_spans)


def test_resolve_gives_the_recorded_logprobs_on_sampled_tokens_only():
    got = _store().resolve("s1", _rl_loop_datum(), "data[0]")
    assert got.sampled == [0.0] * 3 + [1.0] * 3
    np.testing.assert_allclose(got.sampler_logprobs, [0.0] * 3 + LOGPROBS)


def test_records_expire_after_ttl_unused_refresh_on_use_and_evict_lru():
    clock = Clock()
    s = StabilityRecords(ttl_s=100.0, max_tokens=20, clock=clock)
    s.record("s1", ["a", "b"], PROMPT, [(SAMPLED, LOGPROBS, "stop")] * 2)  # 7 tokens each
    clock.now = 90.0
    assert s.get("s1", "a") is not None  # used: its TTL starts again
    assert s.get("s2", "a") is None  # another session's: not there for it
    clock.now = 150.0
    assert s.get("s1", "b") is None and s.expired == 1  # unused for 150 s
    assert s.get("s1", "a") is not None
    s.record("s1", ["c"], PROMPT, [(SAMPLED, LOGPROBS, "stop")])
    clock.now = 151.0
    s.get("s1", "a")  # a is now more recently used than c
    s.record("s1", ["d"], PROMPT, [(SAMPLED, LOGPROBS, "stop")])  # 21 tokens > 20: the least recently used goes
    assert s.get("s1", "c") is None and s.evicted == 1 and s.tokens == 14
    assert s.get("s1", "a") is not None and s.get("s1", "d") is not None
    s.drop_session("s1")
    assert s.stats()["records"] == 0 and s.tokens == 0
    with pytest.raises(ValueError, match=r"num_samples=4 .* could record 28 tokens; allowed: at most 20"):
        s.check_room(4, 4, 3)
    ids = s.new_ids(64)
    assert len(set(ids)) == 64 and all(len(i) >= 24 for i in ids)


@pytest.mark.parametrize(
    "change, why",
    [
        (dict(sid="seq-zz"), r"data\[0\].model_input_spans\[0\].sequence_id='seq-zz' is not a sequence this session"),
        (dict(input_spans=None), r"data\[0\] has loss_fn_input_spans only; loss_fn 'stable_reinforce' needs both"),
        (dict(input_spans=[Span("prompt", "seq-a", 0, 4), Span("sampled", "seq-a", 0, 1)]),
         r"data\[0\].model_input_spans cover 5 positions; allowed: .* tile the 6 positions of model_input"),
        (dict(target_spans=[Span("prompt", "seq-a", 1, 3), Span("sampled", "seq-a", 1, 3)]),
         r"loss_fn_input_spans\[1\] \(offset=1, length=3\) is not allowed; .* within the 3 sampled tokens"),
        (dict(sampled=[20, 99, 22]), r"data\[0\].model_input\[5\]=99 is not allowed: the span names sampled token 1 "
         r"of sequence_id 'seq-a', which was 21"),
        (dict(prompt=[1, 7, 8, 11]), r"data\[0\].model_input\[2\]=8 is not allowed: the span names prompt token 2"),
        (dict(input_spans=[Span("prompt", "seq-a", 0, 4), Span("", "", 0, 2)]),
         r"model_input_spans\[1\] is neither prompt_tokens nor sampled_tokens"),
    ],
)  # fmt: skip
def test_resolve_refuses_naming_field_and_value(change, why):
    with pytest.raises(ValueError, match=why):
        _store().resolve("s1", _rl_loop_datum(**change), "data[0]")


def test_resolve_refuses_foreign_tampered_targets_wrong_context_and_prompt_advantages():
    s = _store()
    with pytest.raises(ValueError, match=r"sequence_id='seq-a' is not a sequence this session sampled"):
        s.resolve("s2", _rl_loop_datum(), "data[0]")  # another session's record
    d = _rl_loop_datum()
    d.inputs["target_tokens"][-1] = 5
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['target_tokens'\]\[5\]=5 is not allowed: .* was 22"):
        s.resolve("s1", d, "data[0]")
    d = _rl_loop_datum()
    d.inputs["advantages"][1] = 0.5
    with pytest.raises(ValueError, match=r"loss_fn_inputs\['advantages'\]\[1\]=0.5 is not allowed: position 1 is a "):
        s.resolve("s1", d, "data[0]")
    # the sampled tokens' spans moved one target later: tokens check out span by span, but not their context
    d = _rl_loop_datum()
    d.tokens = np.array(PROMPT + [1] + SAMPLED[:-1])  # an extra copy of prompt token 0
    d.inputs = {"target_tokens": np.array([0] * 4 + SAMPLED), "advantages": np.array([0.0] * 4 + [1.0] * 3)}
    d.input_spans = [Span("prompt", "seq-a", 0, 4), Span("prompt", "seq-a", 0, 1), Span("sampled", "seq-a", 0, 2)]
    d.target_spans = [Span("prompt", "seq-a", 0, 4), Span("sampled", "seq-a", 0, 3)]
    with pytest.raises(ValueError, match=r"loss_fn_input_spans\[1\] puts sampled tokens 0..2 .* at target "
                                         r"positions 4..6; allowed: at positions 3.."):  # fmt: skip
        s.resolve("s1", d, "data[0]")


@pytest.fixture
def server(tmp_path):
    s = _Running(tmp_path / "state")
    yield s
    s.close()


# -- through the SDK ---------------------------------------------------------------------------------------------------


def with_sampled_provenance(datum: types.Datum, prompt_length: int, num_sampled: int, sequence_id: str):
    """tinker-cookbook rl_loop's own helper (recipes/rl_loop.py), copied so this test runs without the cookbook."""
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, length=prompt_length),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=num_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sequence_id, offset=1, length=prompt_length - 1),
            types.SampledProvenanceSpan(sequence_id=sequence_id, length=num_sampled),
        ],
    )


def _datum(prompt: list[int], seq, adv: float, client_logprobs: float | None = None) -> types.Datum:
    """rl_loop's datum of one sampled sequence (its padded `logprobs`, which stable_reinforce does not read)."""
    ob = len(prompt) - 1
    lps = [client_logprobs] * len(seq.tokens) if client_logprobs is not None else list(seq.logprobs)
    inputs = {
        "target_tokens": np.array([0] * ob + seq.tokens, dtype=np.int64),
        "logprobs": np.array([0.0] * ob + lps, dtype=np.float32),
        "advantages": np.array([0.0] * ob + [adv] * len(seq.tokens), dtype=np.float32),
    }
    d = types.Datum(model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]), loss_fn_inputs=inputs)
    return with_sampled_provenance(d, len(prompt), len(seq.tokens), seq.sequence_id)


def test_stable_reinforce_through_the_sdk_uses_the_recorded_logprobs(server):
    """A sampling client with record_stability_info=True gets fresh sequence ids; rl_loop's datums train under
    stable_reinforce with the loss of the float64 formula on the server-recorded log-probs (the client's own
    `logprobs` are not read); tampered, foreign and unrecorded sequences and a non-finite kl_coeff are refused."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
    prompt = [1, 30, 31, 32]
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    seqs = sampler.sample(types.ModelInput.from_ints(prompt), 2, types.SamplingParams(max_tokens=5, seed=2))
    seqs = seqs.result().sequences
    assert len({s.sequence_id for s in seqs}) == 2 and all(s.sequence_id.startswith("seq-") for s in seqs)
    import httpx

    memory = httpx.get(f"{server.url}/api/v1/memory", headers={"X-API-Key": TOKEN}).json()
    assert memory["counts"]["stability_records"] == 2 and memory["stability_records"] > 0
    caps = httpx.get(f"{server.url}/api/v1/get_server_capabilities", headers={"X-API-Key": TOKEN}).json()
    assert "stable_reinforce" in caps["loss_fns"] and caps["stability_records"]["ttl_s"] == 86400
    assert all(len(s.tokens) >= 2 for s in seqs), [s.tokens for s in seqs]
    seq = seqs[0]
    # the trainer's log-probs of the sampled tokens (no step runs before the checks below)
    plain = types.Datum(model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
                        loss_fn_inputs={"target_tokens": np.array(prompt[1:] + seq.tokens, dtype=np.int64)})  # fmt: skip
    logp = np.array(tc.forward([plain], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist())
    logp = logp[len(prompt) - 1 :]
    old = np.array(seq.logprobs, dtype=np.float32).astype(np.float64)
    adv, kl, cap = 0.75, 0.5, 1.0001
    log_r = logp - old
    expected = np.sum(-np.minimum(np.exp(log_r), cap) * adv * logp + kl * (np.exp(-log_r) + log_r - 1.0))
    cfg = {"kl_coeff": kl, "tis_cap": cap}
    for client_lp in (None, -7.0):  # what the client says the sampler's log-probs were does not matter
        got = tc.forward([_datum(prompt, seq, adv, client_lp)], "stable_reinforce", cfg).result()
        assert got.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-5)
    fb = tc.forward_backward([_datum(prompt, s, a) for s, a in zip(seqs, (1.0, -1.0), strict=True)],
                             "stable_reinforce").result()  # fmt: skip
    assert np.isfinite(fb.metrics["loss:sum"])
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["grad_norm"] > 0

    def refused(datum: types.Datum, why: str, config=None) -> None:
        with pytest.raises(tinker.RequestFailedError, match=why):
            tc.forward_backward([datum], "stable_reinforce", config).result()

    d = _datum(prompt, seq, 1.0)
    targets = d.loss_fn_inputs["target_tokens"].to_numpy().copy()
    targets[-1] = (targets[-1] + 1) % 60
    tampered = types.Datum(model_input=d.model_input, loss_fn_inputs={**d.loss_fn_inputs, "target_tokens": targets},
                           model_input_spans=d.model_input_spans, loss_fn_input_spans=d.loss_fn_input_spans)  # fmt: skip
    refused(tampered, r"data\[0\].loss_fn_inputs\['target_tokens'\]\[\d+\]=\d+ is not allowed: the span names")
    refused(_datum(prompt, seq, 1.0), r"loss_fn_config\['kl_coeff'\]=nan is not allowed", {"kl_coeff": float("nan")})
    refused(_datum(prompt, seq, 1.0), r"loss_fn_config\['kl_coeff'\]=-1.0 is not allowed", {"kl_coeff": -1.0})
    # spans that do not tile: built as a Datum directly (with_provenance would refuse them client-side)
    bad = types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs,
                      model_input_spans=d.model_input_spans[:1], loss_fn_input_spans=d.loss_fn_input_spans)  # fmt: skip
    refused(bad, r"data\[0\].model_input_spans cover 4 positions")
    refused(types.Datum(model_input=d.model_input, loss_fn_inputs=d.loss_fn_inputs), r"data\[0\] has no provenance")
    # a sampler without record_stability_info: its sequence ids name no record
    plain_sampler = tc.save_weights_and_get_sampling_client().result()
    unrecorded = plain_sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4))
    unrecorded = unrecorded.result().sequences[0]
    assert unrecorded.tokens
    refused(_datum(prompt, unrecorded, 1.0), f"sequence_id='{unrecorded.sequence_id}' is not a sequence this")
    # another session's sequence
    other = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    theirs = other.create_sampling_client(base_model=BASE, record_stability_info=True).result()
    foreign = theirs.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, seed=1))
    foreign = foreign.result().sequences[0]
    assert foreign.tokens
    refused(_datum(prompt, foreign, 1.0), f"sequence_id='{foreign.sequence_id}' is not a sequence this session")
    # the client still trains after every refusal
    assert np.isfinite(
        tc.forward_backward([_datum(prompt, seq, 1.0)], "stable_reinforce").result().metrics["loss:sum"]
    )


def test_sequence_ids_hold_for_a_retried_post_and_across_a_restart(tmp_path):
    """A retried sample POST (same seq_id) answers the same ids; after a restart the journal's replay samples the
    same tokens and records them under the same ids, so the client's stable_reinforce step still finds them; a
    session that ends drops its records."""
    import httpx

    from tests.test_tinker_journal import _OnPort
    from tests.test_tinker_server import _free_port

    port = _free_port()
    first = _OnPort(tmp_path / "state", port)
    sc = tinker.ServiceClient(base_url=first.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    sampler = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = [1, 30, 31, 32]
    seq = sampler.sample(types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=5, seed=4))
    seq = seq.result().sequences[0]
    body = {"sampling_session_id": sampler._sampling_session_id, "seq_id": 777, "num_samples": 2,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": prompt}]}, "record_stability_info": True,
            "sampling_params": {"max_tokens": 3}, "_server_sequence_ids": ["seq-mine", "seq-mine2"]}  # fmt: skip
    posts = [httpx.post(f"{first.url}/api/v1/asample", json=body, headers={"X-API-Key": TOKEN}) for _ in range(2)]
    ids = [p.json()["sample_sequence_ids"] for p in posts]
    assert ids[0] == ids[1] and len(set(ids[0])) == 2 and "seq-mine" not in ids[0]  # a client cannot pick them
    first.close()

    second = _OnPort(tmp_path / "state", port)
    try:
        fb = tc.forward_backward([_datum(prompt, seq, 1.0)], "stable_reinforce").result()
        assert np.isfinite(fb.metrics["loss:sum"])
        session = tc.model_id.split(":")[0]
        assert second.server.ops.records.get(session, seq.sequence_id).tokens.tolist() == seq.tokens
        second.server._expire(session)
        assert second.server.ops.records.get(session, seq.sequence_id) is None
    finally:
        second.close()
