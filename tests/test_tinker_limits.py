"""Limits of the Tinker door driven by the real `tinker` SDK: no input a client sends can make an adapter
non-finite, reach outside the vocabulary or the context, or hold a slot after the client is gone."""

from __future__ import annotations

import time

import httpx
import numpy as np
import pytest
import tinker
import torch
from tinker import types

from tests.test_tinker_server import BASE, TOKEN, _datum, _Running, _sft, tiny_model_folder  # noqa: F401

HEADERS = {"X-API-Key": TOKEN}


@pytest.fixture
def server(tmp_path):
    s = _Running(tmp_path / "state", max_tokens_cap=8)
    yield s
    s.close()


def _weights(ops, model_id: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in ops.backend.adapter_state_dict(ops.tenants[model_id].name).items()}


def _assert_identical(ops, model_id: str, before: dict[str, torch.Tensor]) -> None:
    after = ops.backend.adapter_state_dict(ops.tenants[model_id].name)
    assert after.keys() == before.keys()
    for k, v in before.items():
        assert torch.equal(after[k], v), k


def _rl_datum(tokens: list[int], advantages: np.ndarray, logprobs: np.ndarray) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], dtype=np.int64),
            "logprobs": logprobs.astype(np.float32),
            "advantages": advantages.astype(np.float32),
        },
    )


def test_bad_inputs_and_learning_rates_leave_the_adapter_bit_identical(server):
    ops = server.server.ops
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    tokens = list(range(5, 17))
    _sft(tc, 1, tokens)  # B is no longer zero: a NaN update would show everywhere
    before, step = _weights(ops, tc.model_id), ops.steps(tc.model_id)
    name = ops.tenants[tc.model_id].name
    moments = {i: {k: v.clone() for k, v in m.items()}
               for i, m in ops.backend.optimizer_state_dict(name)["optimizer"]["state"].items()}  # fmt: skip
    n = len(tokens) - 1
    adv, logp = np.ones(n), np.full(n, -1.0)
    refused = {
        r"loss_fn_inputs\['advantages'\]\[2\]=nan": _rl_datum(tokens, np.where(np.arange(n) == 2, np.nan, adv), logp),
        r"loss_fn_inputs\['logprobs'\]\[0\]=inf": _rl_datum(tokens, adv, np.where(np.arange(n) == 0, np.inf, logp)),
        r"model_input\[4\]=100000 is not allowed": _rl_datum(tokens[:4] + [100000] + tokens[5:], adv, logp),
        r"loss_fn_inputs\['target_tokens'\]\[10\]=-1 is not allowed": _rl_datum(tokens[:-1] + [-1], adv, logp),
    }
    for why, datum in refused.items():
        with pytest.raises(tinker.RequestFailedError, match=why) as err:
            tc.forward_backward([datum], "importance_sampling").result()
        assert err.value.category == types.RequestErrorCategory.User
    weights = _datum(tokens)
    weights.loss_fn_inputs["weights"] = types.TensorData.from_numpy(np.full(n, np.nan, dtype=np.float32))
    with pytest.raises(tinker.RequestFailedError, match=r"loss_fn_inputs\['weights'\]\[0\]=nan"):
        tc.forward_backward([weights], "cross_entropy").result()
    top_k = types.Datum(  # (N, K) targets (Tinker's top-K distillation): said plainly, not "3N values for N tokens"
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": np.array([[t, t, t] for t in tokens[1:]], dtype=np.int64),
                        "weights": np.full((n, 3), 1 / 3, dtype=np.float32)},
    )  # fmt: skip
    with pytest.raises(tinker.RequestFailedError, match=r"shape \(11, 3\); allowed: shape \(11,\).* top-K"):
        tc.forward_backward([top_k], "cross_entropy").result()

    # a gradient is pending; refused Adam settings leave it and the adapter alone
    tc.forward_backward([_datum(tokens)], "cross_entropy").result()
    for lr, why in ((float("nan"), "learning_rate=None"), (-1.0, "learning_rate=-1.0")):  # the SDK sends NaN as null
        with pytest.raises(tinker.RequestFailedError, match=f"adam_params.{why} is not allowed"):
            tc.optim_step(types.AdamParams(learning_rate=lr)).result()
    # a finite learning rate whose update overflows float32: the step is undone and reported
    for lr in (1e39, 3e38):  # torch refuses the first part way through the step; the second overflows to inf
        tc.forward_backward([_datum(tokens)], "cross_entropy").result()
        metrics = tc.optim_step(types.AdamParams(learning_rate=lr)).result().metrics
        assert metrics["skipped_nonfinite"] == 1.0 and np.isfinite(metrics["grad_norm"]), (lr, metrics)
    # a finite input whose loss is not finite (ratio exp(+1e30)): the forward answers, the next step is skipped
    tc.forward_backward([_rl_datum(tokens, adv, np.full(n, -1e30))], "importance_sampling").result()
    assert tc.optim_step(types.AdamParams(learning_rate=1e-2)).result().metrics["skipped_nonfinite"] == 1.0
    _assert_identical(ops, tc.model_id, before)
    assert ops.steps(tc.model_id) == step
    state = ops.backend.optimizer_state_dict(name)["optimizer"]["state"]
    for i, m in moments.items():
        for k, v in m.items():
            assert torch.equal(state[i][k], v), (i, k)
    _sft(tc, 1, tokens)  # still trains, to finite weights
    after = ops.backend.adapter_state_dict(name)
    assert ops.steps(tc.model_id) == step + 1 and all(torch.isfinite(v).all() for v in after.values())
    assert any(not torch.equal(after[k], v) for k, v in before.items())


def test_sample_limits_answer_at_once(server):
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    sampler = sc.create_sampling_client(base_model=BASE).result()
    prompt = types.ModelInput.from_ints([1, 2, 3])
    context = server.server.ops.limits.context_length

    def sample(max_tokens, tokens=(1, 2, 3)):
        params = types.SamplingParams(max_tokens=max_tokens, seed=0, stop=[])
        return sampler.sample(types.ModelInput.from_ints(list(tokens)), 2, params).result().sequences

    start = time.monotonic()
    for max_tokens, why in ((10**9, "max_tokens=1000000000 is not allowed"), (9, "--max-tokens-cap"),
                            (-1, "max_tokens=-1 is not allowed")):  # fmt: skip
        with pytest.raises(tinker.BadRequestError, match=why):
            sample(max_tokens)
    for tokens, why in (([1, 100000], r"prompt\[1\]=100000"), ([-3, 1], r"prompt\[0\]=-3"),
                        ([1] * context, f"prompt has {context} tokens")):  # fmt: skip
        with pytest.raises(tinker.BadRequestError, match=why):
            sample(4, tokens)
    assert time.monotonic() - start < 10
    assert [s.tokens for s in sample(0)] == [[], []]
    assert [len(s.tokens) for s in sample(None)] == [8, 8]  # no max_tokens: the server's cap
    assert all(len(s.tokens) == 3 for s in sample(3))
    with pytest.raises(tinker.BadRequestError, match="max_tokens"):
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=10**9)).result()


def test_a_session_without_heartbeats_frees_its_slot(tmp_path):
    """A client that stops (here: raw HTTP that never beats) loses its models after session_timeout_s: its queued
    requests fail, its slot, optimizer and sampler versions are freed, its checkpoint stays, the journal forgets it,
    and a new client gets the slot."""
    s = _Running(tmp_path / "state", max_loras=1, session_timeout_s=1.0)
    try:
        ops, url = s.server.ops, s.url + "/api/v1/"

        def call(route: str, body: dict) -> dict:
            r = httpx.post(url + route, json=body, headers=HEADERS, timeout=30)
            assert r.status_code == 200, r.text
            return r.json()

        def result(key: str) -> dict:
            return call("retrieve_future", {"request_id": key})

        sid = call("create_session", {"tags": [], "user_metadata": {}, "sdk_version": "0.38"})["session_id"]
        body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}}
        model_id = result(call("create_model", body)["request_id"])["model_id"]
        saved = result(call("save_weights", {"model_id": model_id, "seq_id": 1, "path": "kept"})["request_id"])
        result(call("save_weights_for_sampler", {"model_id": model_id, "seq_id": 2, "path": "v1"})["request_id"])
        stuck = call("optim_step", {"model_id": model_id, "seq_id": 9, "adam_params": {}})["request_id"]
        name = ops.tenants[model_id].name
        assert ops.backend.adapters == [name] and len(ops.samplers) == 1
        sc = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
        with pytest.raises(tinker.RequestFailedError, match="no free LoRA slot"):
            sc.create_lora_training_client(base_model=BASE, rank=4).result()

        start = time.monotonic()
        while model_id in ops.tenants and time.monotonic() - start < 10:
            time.sleep(0.05)
        assert time.monotonic() - start < 3.0  # timeout 1 s, checked every 0.25 s
        assert ops.backend.adapters == [] and not ops.samplers and name not in ops.backend.trainer.adapters
        assert "expired" in result(stuck)["error"]
        r = httpx.post(url + "session_heartbeat", json={"session_id": sid}, headers=HEADERS)
        assert r.status_code == 410 and "expired" in r.json()["detail"]
        assert ops.ckpt.find_labeled(name, saved["path"].split("/")[-1]) is not None  # its checkpoint stays
        assert model_id not in s.server.journal.live_models()
        assert not [k for k, *_ in s.server.journal.replay() if k.startswith(model_id)]
        sc = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4).result()  # the freed slot (a new session: the
        # first one was quiet for the timeout too)
        assert len(_sft(tc, 1, list(range(5, 15)))) == 1
    finally:
        s.close()


def test_prompt_logprobs_are_the_sampler_versions(server):
    """compute_logprobs and include_prompt_logprobs / topk_prompt_logprobs score the prompt with the sampler
    version's frozen weights: equal to the trainer's log-probs when it was published, unchanged after the trainer
    steps on; the first position (and those before prompt_logprobs_last_n) unscored; unsupported options refused."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=4).result()
    tokens = list(range(5, 17))
    _sft(tc, 2, tokens, lr=5e-2)
    sampler = tc.save_weights_and_get_sampling_client().result()
    trained = tc.forward([_datum(tokens)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    prompt = types.ModelInput.from_ints(tokens)
    got = sampler.compute_logprobs(prompt).result()
    assert got[0] is None and len(got) == len(tokens)
    np.testing.assert_allclose(got[1:], trained, rtol=1e-5, atol=1e-5)
    last = sampler.compute_logprobs(prompt, prompt_logprobs_last_n=3).result()
    assert last[:-3] == [None] * (len(tokens) - 3)
    np.testing.assert_allclose(last[-3:], trained[-3:], rtol=1e-5, atol=1e-5)

    _sft(tc, 1, tokens, lr=5e-2)  # the training slot moves on; the published version does not
    res = sampler.sample(prompt, 2, types.SamplingParams(max_tokens=2, seed=0), include_prompt_logprobs=True,
                         topk_prompt_logprobs=3).result()  # fmt: skip
    assert len(res.sequences) == 2 and res.prompt_logprobs[0] is None and res.topk_prompt_logprobs[0] is None
    np.testing.assert_allclose(res.prompt_logprobs[1:], trained, rtol=1e-5, atol=1e-5)
    for i, top in enumerate(res.topk_prompt_logprobs[1:], start=1):
        ids, lps = zip(*top, strict=True)
        assert len(top) == 3 and list(lps) == sorted(lps, reverse=True) and lps[0] >= res.prompt_logprobs[i] - 1e-6
        if tokens[i] in ids:
            assert lps[ids.index(tokens[i])] == pytest.approx(res.prompt_logprobs[i], abs=1e-5)
    base = sc.create_sampling_client(base_model=BASE).result().compute_logprobs(prompt).result()
    assert np.abs(np.array(base[1:]) - np.array(trained)).max() > 1e-3  # the base is not the trained version

    for options, why in (({"topk_sample_logprobs": 2}, "topk_sample_logprobs is not supported"),
                         ({"prompt_alt_tokens_k": 2}, "prompt_alt_tokens_k is not supported")):  # fmt: skip
        with pytest.raises(tinker.BadRequestError, match=why):
            sampler.sample(prompt, 1, types.SamplingParams(max_tokens=1), **options).result()


def test_rest_client_lists_inspects_and_deletes_checkpoints(server):
    """The SDK's RestClient on the run's checkpoints: list a model's saved names, its training run, its weights
    info, delete a name (gone from disk and from the list); the routes need the token; capabilities name the
    served model, its context and the losses."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    rest = tinker.RestClient(base_url=server.url, api_key=TOKEN)
    caps = rest.get_server_capabilities().result()
    assert [(m.model_name, m.max_context_length) for m in caps.supported_models] == [
        (BASE, server.server.ops.limits.context_length)
    ]
    body = httpx.get(server.url + "/api/v1/get_server_capabilities", headers=HEADERS).json()
    assert {"cross_entropy", "importance_sampling", "ppo", "cispo"} <= set(body["loss_fns"])
    assert body["max_tokens_cap"] == 8 and body["prompt_logprobs"] is True

    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0, train_mlp=False).result()
    _sft(tc, 1, list(range(5, 15)))
    first = tc.save_state("first").result().path
    second = tc.save_state("second").result().path
    listed = rest.list_checkpoints(tc.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.tinker_path, c.checkpoint_type) for c in listed] == [
        ("weights/first", first, "training"), ("weights/second", second, "training")]  # fmt: skip
    assert all(c.size_bytes > 0 for c in listed)
    run = rest.get_training_run(tc.model_id).result()
    assert (run.training_run_id, run.base_model, run.lora_rank, run.is_lora) == (tc.model_id, BASE, 4, True)
    assert run.last_checkpoint.tinker_path == second
    assert [r.training_run_id for r in rest.list_training_runs().result().training_runs] == [tc.model_id]
    info = rest.get_weights_info_by_tinker_path(first).result()
    assert (info.lora_rank, info.train_mlp, info.train_attn) == (4, False, True)

    rest.delete_checkpoint_from_tinker_path(first).result()
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [second]
    name = server.server.ops.tenants[tc.model_id].name
    assert server.server.ops.ckpt.find_labeled(name, "first") is None
    with pytest.raises(tinker.RequestFailedError, match="does not exist"):
        sc.create_training_client_from_state(first).result()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(first).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_training_run("s0:train:7").result()
    r = httpx.get(f"{server.url}/api/v1/training_runs/{tc.model_id}/checkpoints", headers={"X-API-Key": "tml-no"})
    assert r.status_code == 401
    assert httpx.get(f"{server.url}/api/v1/training_runs/..%2Fx/checkpoints", headers=HEADERS).status_code == 400


def test_keep_the_newest_checkpoint_deletes_the_previous_one_as_soon_as_the_save_resolves(server):
    """save_state(c_i) then delete c_(i-1) at once (keep only the newest): the save's future resolved before the
    journal's snapshot moved to c_i, so the delete was refused as the journal's snapshot (10 of 14 in a reviewer's
    repro). A save is now answered once its turn has compacted the journal."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    rest = tinker.RestClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=0).result()
    for k in range(3):  # sampler versions go into each snapshot: a slower compaction after each save
        tc.save_weights_for_sampler(f"keep-v{k}").result()
    previous = None
    for i in range(8):
        path = tc.save_state(f"keep{i}").result().path
        if previous is not None:
            rest.delete_checkpoint_from_tinker_path(previous).result()
        previous = path
    assert [c.tinker_path for c in rest.list_checkpoints(tc.model_id).result().checkpoints] == [previous]


def test_save_weights_external_writes_a_peft_folder_in_the_models_turn_and_the_model_goes_on(server, tmp_path):
    """`save_weights_external(name)` (a 404 before, which left a hole in the model's seq_ids: its next request
    waited for ever) writes the adapter as a PEFT folder PEFT loads, with the client's log-probs; the same name again
    replaces it; age encryption fails that request alone, and the model's later requests still run."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from tests.test_tinker_server import MODEL, _logprobs

    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    _sft(tc, 2, list(range(5, 15)), lr=5e-2)
    saved = tc.save_weights_external("hf").result()
    name = server.server.ops.tenants[tc.model_id].name
    folder = server.server.ops.ckpt.run_dir / "external" / name / "hf"
    assert saved.path == f"tinker://{tc.model_id}/external/hf"
    assert sorted(f.name for f in folder.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    tokens = list(range(5, 15))
    peft_model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(MODEL), str(folder))
    with torch.no_grad():
        logits = peft_model(input_ids=torch.tensor([tokens[:-1]])).logits[0].double()
    expected = torch.log_softmax(logits, -1).gather(-1, torch.tensor(tokens[1:])[:, None]).squeeze(-1)
    np.testing.assert_allclose(_logprobs(tc, tokens), expected.numpy(), rtol=1e-4, atol=1e-5)

    with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients is not supported"):
        tc.save_weights_external("enc", age_encryption_recipients=["age1xyz"]).result(timeout=30)
    assert not (folder.parent / "enc").exists()
    before = (folder / "adapter_model.safetensors").read_bytes()
    _sft(tc, 1, tokens, lr=5e-2)  # runs: no seq_id was skipped
    tc.save_weights_external("hf").result(timeout=30)  # the same name: replaced by the newer weights
    assert (folder / "adapter_model.safetensors").read_bytes() != before
    assert sorted(p.name for p in folder.parent.iterdir()) == ["hf"]  # no temp folder left


def test_training_clients_get_tokenizer_loads_the_served_folders_offline(server):
    """`get_info` names the served folder as the tokenizer (it holds it): `TrainingClient.get_tokenizer()` loaded
    the served name from the Hub before, which fails offline and for a name that is no Hub repository."""
    from transformers import AutoTokenizer

    from tests.test_tinker_server import MODEL

    tc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN).create_lora_training_client(BASE, rank=4).result()
    assert tc.get_info().model_data.tokenizer_id == str(MODEL.resolve())
    text = "12+34=46"
    assert tc.get_tokenizer().encode(text) == AutoTokenizer.from_pretrained(MODEL).encode(text)


def test_rest_client_lists_every_checkpoint_and_the_sessions_and_refuses_hosted_features_saying_so(server):
    """`list_user_checkpoints` (every model's, newest first, paged with a cursor), `list_sessions` / `get_session`
    (a session's models and sampling sessions) through the SDK's RestClient; publishing, a TTL and download URLs are
    refused with a 400 that says this server does not keep them (a 404 / 405 before, which read as a wrong URL)."""
    sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
    rest = tinker.RestClient(base_url=server.url, api_key=TOKEN)
    a = sc.create_lora_training_client(base_model=BASE, rank=4, seed=0).result()
    b = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    paths = [a.save_state("a1").result().path, b.save_state("b1").result().path]
    time.sleep(0.01)
    paths.append(a.save_state("a2").result().path)
    sampler = a.save_weights_and_get_sampling_client()
    sampler = sampler if isinstance(sampler, tinker.SamplingClient) else sampler.result()

    every = rest.list_user_checkpoints().result()
    assert [c.tinker_path for c in every.checkpoints] == paths[::-1]
    assert (every.cursor.offset, every.cursor.limit, every.cursor.total_count) == (0, 100, 3)
    page = rest.list_user_checkpoints(limit=1, offset=1).result()
    assert [c.tinker_path for c in page.checkpoints] == [paths[1]] and page.cursor.total_count == 3

    session = a.model_id.split(":")[0]
    assert rest.list_sessions().result().sessions == [session]
    got = rest.get_session(session).result()
    assert got.training_run_ids == [a.model_id, b.model_id] and len(got.sampler_ids) == 1
    with pytest.raises(tinker.NotFoundError):
        rest.get_session("nosuchsession").result()

    for call in (lambda: rest.publish_checkpoint_from_tinker_path(paths[0]).result(),
                 lambda: rest.unpublish_checkpoint_from_tinker_path(paths[0]).result(),
                 lambda: rest.set_checkpoint_ttl_from_tinker_path(paths[0], 3600).result()):  # fmt: skip
        with pytest.raises(tinker.BadRequestError, match="is not supported by this server"):
            call()
    with pytest.raises(tinker.BadRequestError, match="copying weights into another project is not supported"):
        tinker.ServiceClient(base_url=server.url, api_key=TOKEN, project_id="p").copy_weights(paths[0]).result()
    assert [c.tinker_path for c in rest.list_checkpoints(a.model_id).result().checkpoints] == [paths[0], paths[2]]
    r = httpx.get(server.url + "/api/v1/checkpoints", headers={"X-API-Key": "tml-no"})
    assert r.status_code == 401


def test_unreadable_forward_backward_fails_in_its_turn_and_the_model_goes_on(server):
    """A forward_backward whose data the server does not serve (here a bfloat16 tensor) is acknowledged and fails
    with a user error in its turn, so the model's next seq_id still runs (refusing it at once would leave a gap)."""
    from tinker.proto import tinker_public_pb2 as pb

    url = server.url + "/api/v1/"

    def call(route: str, headers: dict = HEADERS, **kwargs) -> dict:
        r = httpx.post(url + route, headers=headers, timeout=30, **kwargs)
        assert r.status_code == 200, r.text
        return r.json()

    def result(key: str) -> httpx.Response:
        return httpx.post(url + "retrieve_future", json={"request_id": key}, headers=HEADERS, timeout=30)

    sid = call("create_session", json={})["session_id"]
    body = {"session_id": sid, "model_seq_id": 0, "base_model": BASE, "lora_config": {"rank": 4}}
    model_id = result(call("create_model", json=body)["request_id"]).json()["model_id"]
    msg = pb.ForwardBackwardRequest(model_id=model_id, seq_id=1, loss_fn="cross_entropy")
    datum = msg.data.add()
    datum.model_input.add().encoded_text.tokens = np.arange(5, 9, dtype=np.int32).tobytes()
    for name in ("target_tokens", "weights"):
        datum.loss_fn_inputs[name].CopyFrom(pb.Tensor(dtype=pb.DTYPE_BFLOAT16, shape=[4], dense=b"\0" * 8))
    key = call("forward_backward", content=msg.SerializeToString(),
               headers={**HEADERS, "Content-Type": "application/x-protobuf"})["request_id"]  # fmt: skip
    failed = result(key).json()
    assert failed["category"] == "user" and "dtype 4 is not supported" in failed["error"], failed
    step = result(call("optim_step", json={"model_id": model_id, "seq_id": 2, "adam_params": {}})["request_id"])
    assert step.json()["metrics"]["grad_norm"] == 0.0  # ran: no gradient, nothing stepped


def test_a_datum_longer_than_the_models_context_fails_its_request_and_the_model_goes_on(server):
    """A forward_backward datum past `max_position_embeddings` trained on positions the model never saw (the sampler
    refused the same length): now its request fails in its turn, naming the limit, and the next one runs."""
    tc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN).create_lora_training_client(BASE, rank=4).result()
    context = server.server.ops.limits.context_length
    with pytest.raises(tinker.RequestFailedError, match=f"model_input has {context + 1} tokens; allowed: at most "
                       f"{context}"):  # fmt: skip
        tc.forward_backward([_datum([5] * (context + 2))], "cross_entropy").result(timeout=30)
    assert len(tc.forward_backward([_datum([5] * (context + 1))], "cross_entropy").result(timeout=30).loss_fn_outputs)
