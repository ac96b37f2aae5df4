"""The Tinker server's routes against requests that used to be acknowledged and then hang, run wrong or leak: each
test drives `TinkerServer.app()` over HTTP with a stand-in for the model (`_Ops`: no weights, it records what the
server asks of it), so these checks take milliseconds; the real model's paths are tests/test_tinker_server.py's."""

from __future__ import annotations

import asyncio
import json
import re
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from aiohttp.test_utils import TestClient, TestServer
from tinker.proto import tinker_public_pb2 as pb

from rl_multilora.tinker.journal import Journal
from rl_multilora.tinker.ops import (
    ClientOps,
    ClientTenant,
    FwdBwdItem,
    ModelLimits,
    PartialBatch,
    SamplerVersion,
    UserError,
    sampling_settings,
)
from rl_multilora.tinker.server import Op, Result, TinkerServer
from rl_multilora.tinker.stability import StabilityRecords
from rl_multilora.tinker.wire import Datum, FwdBwdBody

TOKEN = "tml-hardening"
HEADERS = {"X-API-Key": TOKEN}
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}


class _Ops:
    """What the server calls on `ClientOps`, without a model: creates and unloads tenants, records optimizer steps
    and sample seeds."""

    def __init__(self) -> None:
        self.limits = ModelLimits(100, 64)
        self.records = StabilityRecords()
        self.tenants: dict[str, ClientTenant] = {}
        self.samplers: dict[str, SamplerVersion] = {}
        self.freed: dict[str, str] = {}  # paths of freed sampler versions -> why
        self.backend = SimpleNamespace(shared_model=None, max_rank=8, max_loras=4)
        self.slots = SimpleNamespace(end_client_reservations=lambda: None)
        self.optim_calls: list[dict] = []
        self.seeds: list[int] = []
        self.unloaded: list[str] = []

    def create(self, model_id, rank, seed, layers):
        self.tenants[model_id] = ClientTenant(model_id, model_id.replace(":", "."), rank, {}, seed)

    def tenant(self, model_id):
        if model_id not in self.tenants:
            raise UserError(f"unknown model_id {model_id!r}")
        return self.tenants[model_id]

    def unload(self, model_id):
        self.tenant(model_id)
        del self.tenants[model_id]
        self.unloaded.append(model_id)

    def steps(self, model_id):
        return len(self.optim_calls)

    def optim_step(self, model_id, params):
        self.tenant(model_id)
        self.optim_calls.append(params)
        return {"grad_norm": 0.0}

    def check_sample(self, prompt, params):
        sampling_settings(params)
        return self.limits.new_tokens(len(prompt), params.get("max_tokens"))

    def sampler(self, path):
        if path is not None and path not in self.samplers:
            raise UserError(f"model_path={path!r} names no sampler weights")
        return SamplerVersion(None)

    async def sample(self, version, prompt, n, params, seed):
        self.seeds.append(seed)
        return [([1, 2], [-0.1, -0.2], "length")] * n


class _Client:
    """A server on `journal_path` with `ops`, and helpers for its routes (inside one event loop)."""

    def __init__(self, ops: _Ops, journal_path: Path, **options) -> None:
        self.ops = ops
        self.server = TinkerServer(ops, Journal(journal_path), TOKEN, "tiny", poll_s=2.0, batch_wait_s=0.0, **options)
        self.http = TestClient(TestServer(self.server.app()))

    async def __aenter__(self) -> _Client:
        await self.http.start_server()
        return self

    async def __aexit__(self, *exc) -> None:
        await self.http.close()

    async def post(self, route: str, body) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body)
        r = await self.http.post(f"/api/v1/{route}", headers=HEADERS, data=data)
        return r.status, await r.json()

    async def result(self, request_id: str) -> dict:
        r = await self.http.post("/api/v1/retrieve_future", headers={**HEADERS, "Accept": "application/json"},
                                 data=json.dumps({"request_id": request_id}))  # fmt: skip
        status, value = r.status, await r.json()
        assert status == 200, value
        assert value.get("type") != "try_again", f"{request_id} did not resolve"
        return value

    async def session(self) -> str:
        return (await self.post("create_session", {}))[1]["session_id"]

    async def model(self, session: str, n: int = 0) -> str:
        status, out = await self.post("create_model", {"session_id": session, "model_seq_id": n, "base_model": "tiny",
                                                       "lora_config": {"rank": 4}})  # fmt: skip
        assert status == 200, out
        await self.result(out["request_id"])
        return out["model_id"]

    async def sample(self, sid: str, seq: int, params: dict | None = None) -> tuple[int, dict]:
        body = {"sampling_session_id": sid, "seq_id": seq, "num_samples": 1, "prompt": PROMPT,
                "sampling_params": params or {"max_tokens": 2}}  # fmt: skip
        return await self.post("asample", body)

    async def base_sampler(self, session: str, n: int = 0) -> str:
        body = {"session_id": session, "sampling_session_seq_id": n, "base_model": "tiny"}
        return (await self.post("create_sampling_session", body))[1]["sampling_session_id"]


def _run(coro) -> None:
    asyncio.run(coro)


def test_requests_that_could_never_run_are_refused_at_once(tmp_path):
    """Each of these was acknowledged and then answered try_again for ever (and replayed after every restart)."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            s = await c.session()
            m = await c.model(s)
            refused = {
                "model_id=.*:train:7.*no create_model": ("optim_step", {"model_id": f"{s}:train:7", "seq_id": 1}),
                "seq_id=0 is not allowed for optim_step": ("optim_step", {"model_id": m, "seq_id": 0}),
                "model_id='no/such:train:0' is not allowed": (
                    "create_model", {"session_id": "no/such", "model_seq_id": 0, "base_model": "tiny"}),
                "model_id='c0' is not allowed": ("load_weights", {"model_id": "c0", "seq_id": 0, "path": "tinker://x"}),
                "seq_id=-1 is not allowed": (
                    "forward_backward", pb.ForwardBackwardRequest(model_id=m, seq_id=-1).SerializeToString()),
                "model_id=.*:train:3.*no create_model": ("unload_model", {"model_id": f"{s}:train:3"}),
            }  # fmt: skip
            for why, (route, body) in refused.items():
                status, out = await c.post(route, body)
                assert status == 400 and re.search(why, out["detail"]), (route, status, out)
            status, out = await c.post("optim_step", {"model_id": m, "seq_id": 1, "adam_params": {}})
            assert status == 200 and "metrics" in await c.result(out["request_id"])
            # a retried POST of a request that ran gets its future; a seq_id the model is past (here the create's) is
            # refused (a retry of a request whose result is no longer kept, too: it would otherwise run again)
            status, again = await c.post("optim_step", {"model_id": m, "seq_id": 1, "adam_params": {}})
            assert status == 200 and again["request_id"] == out["request_id"]
            status, out = await c.post("load_weights", {"model_id": m, "seq_id": 0, "path": "tinker://x"})
            assert status == 400 and "seq_id=0" in out["detail"] and "allowed: an int >= 2" in out["detail"], out
            assert len(c.ops.optim_calls) == 1
            # a session the server does not know (its client outlived a --fresh restart) is taken on: it expires
            assert await c.model("s-before-fresh") == "s-before-fresh:train:0"
            assert "s-before-fresh" in c.server._last_seen

    _run(main())


def test_sampling_without_a_session_is_checked_and_never_shares_another_clients_request(tmp_path):
    """A reviewer's repros: without a sampling session, `seq_id` keyed the request as `base.<seq_id>`, so a second
    client's different request got the first one's samples; an unserved `base_model` or a `model_path` naming
    nothing was acknowledged; `create_sampling_session` took ended, unknown and malformed sessions."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            first = {"base_model": "tiny", "seq_id": 0, "num_samples": 1, "prompt": PROMPT,
                     "sampling_params": {"max_tokens": 2}}  # fmt: skip
            second = first | {"num_samples": 2, "prompt": {"chunks": [{"type": "encoded_text", "tokens": [4, 5]}]}}
            (s1, out1), (s2, out2) = await c.post("asample", first), await c.post("asample", second)
            assert s1 == s2 == 200 and out1["request_id"] != out2["request_id"], (out1, out2)
            assert len((await c.result(out2["request_id"]))["sequences"]) == 2
            refused = {
                "base_model='NOT-SERVED' is not served here": ("asample", first | {"base_model": "NOT-SERVED"}),
                "model_path='tinker://nothing' names no sampler weights": (
                    "asample", first | {"model_path": "tinker://nothing"}),
                "model_path=7 is not allowed": ("asample", first | {"model_path": 7}),
                "model_path=\\['x'\\] is not allowed": (
                    "create_sampling_session", {"session_id": "s", "sampling_session_seq_id": 0, "model_path": ["x"]}),
                "session_id='../../x y' is not allowed": (
                    "create_sampling_session", {"session_id": "../../x y", "sampling_session_seq_id": 0}),
                "sampling_session_seq_id=\\{'a': 1\\} is not allowed": (
                    "create_sampling_session", {"session_id": "s", "sampling_session_seq_id": {"a": 1}}),
            }  # fmt: skip
            for why, (route, body) in refused.items():
                status, out = await c.post(route, body)
                assert status == 400 and re.search(why, out["detail"]), (route, status, out)
            session = await c.session()
            assert (await c.post(f"sessions/{session}/finish", {}))[0] == 200
            status, out = await c.post(
                "create_sampling_session", {"session_id": session, "sampling_session_seq_id": 1}
            )
            assert status == 400 and "was finished by its client" in out["detail"], out

    _run(main())


def test_a_journal_with_requests_that_can_never_run_restarts(tmp_path):
    """A journal written before those checks may hold such requests: a restart fails them instead of waiting on them
    for ever (a sampling session naming weights that do not exist used to get no answer)."""
    journal = Journal(tmp_path / "j.sqlite")
    journal.append("session.s1", "create_session", json.dumps({"session_id": "s1"}).encode())
    journal.append("s1:train:7.1", "optim_step", json.dumps({"model_id": "s1:train:7", "seq_id": 1}).encode(),
                   "s1:train:7", 1)  # fmt: skip
    journal.close()

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            value = await c.result("s1:train:7.1")
            assert value["category"] == "user" and "can never run" in value["error"]
            body = {"session_id": "s1", "sampling_session_seq_id": 0, "model_path": "tinker://s1:train:7/sampler/x"}
            status, out = await asyncio.wait_for(c.post("create_sampling_session", body), 5)
            assert status == 400, out

    _run(main())


def test_only_adamw_is_run_and_bad_lora_configs_are_refused(tmp_path):
    """SDK 0.38 sends Dimuon's per-step parameters as `optimizer_params`, which the server did not read: the step ran
    as Adam at its defaults. Malformed lora_config fields failed late, as server errors with a traceback."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            s = await c.session()
            for lora_config, why in (({"rank": "x"}, "lora_config.rank='x'"), ([4], "lora_config=\\[4\\]"),
                                     ({"rank": 4.7}, "lora_config.rank=4.7"), ({"rank": 99}, "in \\[1, 8\\]"),
                                     ({"rank": 4, "train_mlp": "yes"}, "lora_config.train_mlp='yes'")):  # fmt: skip
                body = {"session_id": s, "model_seq_id": 0, "base_model": "tiny", "lora_config": lora_config}
                status, out = await c.post("create_model", body)
                assert status == 400 and re.search(why, out["detail"]), (lora_config, out)
            body = {
                "session_id": s,
                "model_seq_id": 0,
                "base_model": "tiny",
                "lora_config": {"rank": 4},
                "optimizer_config": {"type": "dimuon"},
            }
            status, out = await c.post("create_model", body)
            assert status == 400 and "optimizer_config.type='dimuon' is not allowed" in out["detail"], out
            m = await c.model(s)
            dimuon = {"type": "dimuon", "learning_rate": 0.5, "grad_clip_norm": 0.0, "beta1": 0.9}
            status, out = await c.post("optim_step", {"model_id": m, "seq_id": 1, "optimizer_params": dimuon})
            assert status == 200  # refused in its turn, so the model's seq_id order goes on
            value = await c.result(out["request_id"])
            assert value["category"] == "user" and "optimizer_params.type='dimuon'" in value["error"]
            status, out = await c.post("optim_step", {"model_id": m, "seq_id": 2,
                                                      "adam_params": {"learning_rate": 0.25}})  # fmt: skip
            assert "metrics" in await c.result(out["request_id"])
            assert c.ops.optim_calls == [{"learning_rate": 0.25}]

    _run(main())


@pytest.mark.parametrize(
    "params, why",
    [
        ({"temperature": "hot"}, "sampling_params.temperature='hot'"),
        ({"temperature": None, "top_k": "a"}, "sampling_params.top_k='a'"),
        ({"top_p": 0.0}, "sampling_params.top_p=0.0"),
        ({"seed": -1}, "sampling_params.seed=-1"),
        ({"stop": [1.5]}, "sampling_params.stop=\\[1.5\\]"),
        ({"stop": ["ok", ""]}, "sampling_params.stop=\\['ok', ''\\] is not allowed; allowed: a non-empty string"),
        ({"stop": ""}, "sampling_params.stop='' is not allowed"),
    ],
)
def test_bad_sampling_params_are_refused_at_once(tmp_path, params, why):
    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            sid = await c.base_sampler(await c.session())
            status, out = await c.sample(sid, 0, {"max_tokens": 2, **params})
            assert status == 400 and re.search(why, out["detail"]), out
            assert c.ops.seeds == []

    _run(main())


def test_samples_of_two_sessions_have_their_own_seeds_and_base_samples_leave_the_journal(tmp_path):
    """The default seed took the last 8 bytes of the request id ('pler.0.0'), the same in every session; a base
    model's sample stayed in the journal for ever and ran again at every restart."""

    async def main():
        ops = _Ops()
        async with _Client(ops, tmp_path / "j.sqlite") as c:
            sids = [await c.base_sampler(await c.session()) for _ in range(2)]
            keys = []
            for sid in sids:
                status, out = await c.sample(sid, 0)
                keys.append(out["request_id"])
                assert status == 200 and (await c.result(out["request_id"]))["type"] == "sample"
            assert ops.seeds[0] != ops.seeds[1]
            await asyncio.sleep(0.2)  # the finished samples' rows are swapped for their results in a thread
            assert not [k for k, kind, *_ in c.server.journal.replay() if kind == "sample"]
            assert not set(keys) & set(c.server.state.results)
            assert (await c.result(keys[0]))["type"] == "sample"  # from the journal's kept results
        again = _Ops()
        async with _Client(again, tmp_path / "j.sqlite") as c:
            await asyncio.sleep(0.2)
            assert again.seeds == []  # nothing sampled again
            assert (await c.result(keys[1]))["type"] == "sample"
            status, out = await c.sample(sids[0], 0)  # a retried POST: the same future, not a new sample
            assert status == 200 and out["request_id"] == keys[0] and again.seeds == []

    _run(main())


def test_samples_of_a_client_models_sampler_weights_leave_the_journal(tmp_path):
    """A sample of a live model's sampler weights stayed in the journal until that model's next snapshot: a model
    that only samples grew it by a row a sample, and every restart sampled them all again (a reviewer's repro: 100
    rows after 100 samples)."""

    async def main():
        ops = _Ops()
        async with _Client(ops, tmp_path / "j.sqlite") as c:
            s = await c.session()
            path = f"tinker://{await c.model(s)}/sampler_weights/w"
            ops.samplers[path] = SamplerVersion("w")
            body = {"session_id": s, "sampling_session_seq_id": 0, "model_path": path}
            sid = (await c.post("create_sampling_session", body))[1]["sampling_session_id"]
            keys = [(await c.sample(sid, seq))[1]["request_id"] for seq in range(3)]
            for key in keys:
                assert (await c.result(key))["type"] == "sample"
            await asyncio.sleep(0.2)  # the finished samples' rows are swapped for their results in a thread
            assert not [k for k, kind, *_ in c.server.journal.replay() if kind == "sample"]
            assert not any(k in keys for k, _ in c.server._model_keys[f"{s}:train:0"])
        again = _Ops()
        again.samplers[path] = SamplerVersion("w")
        async with _Client(again, tmp_path / "j.sqlite") as c:
            await asyncio.sleep(0.2)
            assert again.seeds == []  # nothing sampled again
            status, out = await c.sample(sid, 1)  # a retried POST: the same future, its result from the journal
            assert status == 200 and out["request_id"] == keys[1] and again.seeds == []
            assert (await c.result(keys[1]))["type"] == "sample"

    _run(main())


def test_an_ended_session_leaves_only_its_end_in_the_journal(tmp_path):
    """Every ended session left its models' results (two snapshots' worth) and a `models` row each for ever (a
    reviewer's repro: the journal grew with each closed session). Its models' results now join the bounded ones of
    finished samples; its end stays, so a restart still refuses the session."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            s = await c.session()
            m = await c.model(s)
            step = (await c.post("optim_step", {"model_id": m, "seq_id": 1, "adam_params": {}}))[1]["request_id"]
            assert (await c.post(f"sessions/{s}/finish", {}))[0] == 200
            await c.result(f"{m}.unload")
            db = c.server.journal._db
            for _ in range(50):  # the worker compacts the journal right after the unload resolves
                if not db.execute("SELECT 1 FROM done WHERE model_id = ?", (m,)).fetchone():
                    break
                await asyncio.sleep(0.02)
            assert [k for k, *_ in c.server.journal.replay()] == [f"session.{s}.end"]
            assert db.execute("SELECT COUNT(*) FROM models").fetchone()[0] == 0
            assert not db.execute("SELECT 1 FROM done WHERE model_id = ?", (m,)).fetchone()
        again = _Ops()
        async with _Client(again, tmp_path / "j.sqlite") as c:
            assert "metrics" in await c.result(step)  # an answered request's result is still there
            assert (await c.post("session_heartbeat", {"session_id": s}))[0] == 410
            status, _ = await c.post("create_model", {"session_id": s, "model_seq_id": 0, "base_model": "tiny"})
            assert status == 400 and not again.tenants  # a retried create of the ended session does not run again

    _run(main())


def test_a_create_whose_session_ended_while_it_waited_is_unloaded(tmp_path):
    """`_expire` lists a session's models from the tenants and the queued creates; a create the worker had already
    taken, waiting for its turn, was in neither, and its slot was never freed."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            s = await c.session()
            key = f"{s}.create.0"
            c.server.state.results[key] = Result(asyncio.Event())
            body = {"session_id": s, "model_seq_id": 0, "lora_config": {"rank": 4}}
            op = Op(key, "create_model", f"{s}:train:0", 0, body)
            c.server._expire(s)  # the session ends while the worker holds the create
            c.server._run_one(op)
            assert c.ops.unloaded == [f"{s}:train:0"] and not c.ops.tenants
            value = c.server.state.results[key].value
            assert value["category"] == "user" and "expired" in value["error"]

    _run(main())


def _fwdbwd_ops(fail_on_call: int | None, max_loras: int = 4):
    """A real `ClientOps` over a backend that records its calls `(tenants, backward)` and fails call `fail_on_call`
    (counting from 1) as an out-of-memory would."""
    calls: list[tuple[list[str], bool]] = []

    def forward_backward(rows, losses, backward=True):
        calls.append((sorted({r.adapter for r in rows}), backward))
        if len(calls) == fail_on_call:
            raise torch.OutOfMemoryError("out of memory (a stand-in)")
        return SimpleNamespace(logprobs=[torch.zeros(len(r.input_ids)) for r in rows], row_loss=[1.0] * len(rows))

    backend = SimpleNamespace(forward_backward=forward_backward, shared_model=None, max_rank=8, max_loras=max_loras)
    ops = ClientOps(backend, None, 0, None, limits=ModelLimits(100, 64))
    ops.spill_over_budget = lambda *a, **k: None
    for m in ("sa:train:0", "sb:train:0", "sc:train:0"):
        ops.tenants[m] = ClientTenant(m, m.replace(":", "."), 4, {}, None)
    return ops, calls


def _datum() -> Datum:
    return Datum(np.array([1, 2, 3]), {"target_tokens": np.array([2, 3, 4]), "weights": np.ones(3, np.float32)})


def test_a_mixed_batch_that_fails_part_way_runs_each_backward_once(tmp_path):
    """A's forward_backward and B's forward in one batch; B's call fails after A's backward ran. The fallback used to
    run A alone again: A's gradient was added twice."""
    ops, calls = _fwdbwd_ops(fail_on_call=2)
    server = TinkerServer(ops, Journal(tmp_path / "j.sqlite"), TOKEN, "tiny")
    batch = []
    for model_id, forward_only in (("sa:train:0", False), ("sb:train:0", True)):
        key = f"{model_id}.1"
        server.state.results[key] = Result(asyncio.Event())
        body = FwdBwdBody(model_id, 1, "cross_entropy", {}, forward_only, [_datum()])
        batch.append(Op(key, "forward_backward", model_id, 1, body))
    server._run_batch(batch)
    assert calls == [(["sa.train.0"], True), (["sb.train.0"], False), (["sb.train.0"], False)]
    for op in batch:
        assert isinstance(server.state.results[op.request_id].value, bytes)  # both answered with their outputs


def test_a_backend_call_holds_at_most_max_loras_tenants_and_a_partial_batch_says_what_ran():
    ops, calls = _fwdbwd_ops(fail_on_call=2, max_loras=2)
    items = [FwdBwdItem(m, "cross_entropy", {}, [_datum()], False) for m in ("sa:train:0", "sb:train:0", "sc:train:0")]
    with pytest.raises(PartialBatch) as err:
        ops.forward_backward(items)
    assert calls == [(["sa.train.0", "sb.train.0"], True), (["sc.train.0"], True)]
    assert sorted(err.value.done) == [0, 1] and isinstance(err.value.__cause__, torch.OutOfMemoryError)
    assert err.value.done[0][1] == {"loss:sum": 1.0}
    ops, calls = _fwdbwd_ops(fail_on_call=None, max_loras=2)
    assert [m for _, m in ops.forward_backward(items)] == [{"loss:sum": 1.0}] * 3 and len(calls) == 2


def test_a_create_the_worker_runs_after_its_sessions_finish_is_unloaded(tmp_path):
    """A reviewer's race: `finish_session` listed the session's models while the worker held a create it had taken
    out of the queue but not run; the create then ran, and its model kept a slot for ever (the session was off the
    expiry clock). Here the create blocks inside the worker until the finish has answered."""
    import threading

    class _SlowCreate(_Ops):
        def __init__(self) -> None:
            super().__init__()
            self.entered, self.go = threading.Event(), threading.Event()

        def create(self, model_id, rank, seed, layers):
            self.entered.set()
            assert self.go.wait(10)
            super().create(model_id, rank, seed, layers)

    async def main():
        ops = _SlowCreate()
        async with _Client(ops, tmp_path / "j.sqlite") as c:
            s = await c.session()
            body = {"session_id": s, "model_seq_id": 0, "base_model": "tiny", "lora_config": {"rank": 4}}
            status, out = await c.post("create_model", body)
            assert status == 200, out
            assert await asyncio.to_thread(ops.entered.wait, 10)  # the worker is running the create
            assert (await c.post(f"sessions/{s}/finish", {}))[0] == 200
            ops.go.set()
            value = await c.result(out["request_id"])
            assert "was finished while this request waited for its turn" in value["error"], value
            assert out["model_id"] not in ops.tenants and ops.unloaded == [out["model_id"]]

    _run(main())


def test_a_shutdown_answers_every_long_poll_at_once(tmp_path):
    """`retrieve_future` long-polls for `poll_s` (20 s in `tinker-serve`): a SIGTERMed server waited that long for
    each open poll before it exited (a reviewer measured 20.5 s, past a container's 10 s grace period)."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            m = await c.model(await c.session())
            # seq_id 5 of a model at seq_id 1: acknowledged, it waits for 1 to 4, which never come
            status, out = await c.post("optim_step", {"model_id": m, "seq_id": 5, "adam_params": {}})
            assert status == 200, out
            poll = asyncio.ensure_future(c.http.post("/api/v1/retrieve_future", headers=HEADERS,
                                                     data=json.dumps({"request_id": out["request_id"]})))  # fmt: skip
            await asyncio.sleep(0.2)
            assert not poll.done()
            start = asyncio.get_running_loop().time()
            await c.server._on_shutdown(None)
            r = await asyncio.wait_for(poll, 1.0)  # at once, not after poll_s (2 s here)
            assert (await r.json())["type"] == "try_again"
            assert asyncio.get_running_loop().time() - start < 1.0

    _run(main())


def test_a_finished_or_expired_session_stays_ended_after_a_restart(tmp_path):
    """Sessions ended in memory only: a restart replayed their creation and they came back to life (heartbeats
    answered 200, models created in them). The end is journaled and replayed now."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            finished, expired = await c.session(), await c.session()
            assert (await c.post(f"sessions/{finished}/finish", {}))[0] == 200
            c.server._expire(expired)
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            for sid, why in ((finished, "was finished by its client"), (expired, "expired")):
                assert (await c.post("session_heartbeat", {"session_id": sid}))[0] == 410, sid
                status, out = await c.post("create_model", {"session_id": sid, "model_seq_id": 3,
                                                             "base_model": "tiny", "lora_config": {"rank": 4}})  # fmt: skip
                assert status == 400 and why in out["detail"], (sid, out)
            assert await c.model(await c.session())  # a new session works

    _run(main())


def test_a_recording_base_sample_leaves_the_journal_once_its_records_are_gone(tmp_path):
    """A recording sample of the base stayed in the journal for ever (no snapshot compacts it) and ran again at every
    restart, long after its stability records had expired."""

    async def main():
        now = [0.0]
        ops = _Ops()
        ops.records = StabilityRecords(ttl_s=60.0, clock=lambda: now[0])
        async with _Client(ops, tmp_path / "j.sqlite") as c:
            sid = await c.base_sampler(await c.session())
            body = {"sampling_session_id": sid, "seq_id": 0, "num_samples": 2, "prompt": PROMPT,
                    "sampling_params": {"max_tokens": 2}, "record_stability_info": True}  # fmt: skip
            status, out = await c.post("asample", body)
            assert status == 200, out
            key = out["request_id"]
            assert (await c.result(key))["type"] == "sample"
            assert ops.records.stats()["records"] == 2
            await c.server._finish_recorded()
            assert [k for k, kind, *_ in c.server.journal.replay() if kind == "sample"] == [key]  # records held
            now[0] += 61.0  # the records expire unused
            await c.server._finish_recorded()
            assert not [k for k, kind, *_ in c.server.journal.replay() if kind == "sample"]
            assert (await c.result(key))["type"] == "sample"  # its result from the journal's kept results
        again = _Ops()
        async with _Client(again, tmp_path / "j.sqlite"):
            await asyncio.sleep(0.2)
            assert again.seeds == []  # not sampled again

    _run(main())


def test_a_sample_in_a_sampling_session_needs_an_int_seq_id(tmp_path):
    """A reviewer's repro: `seq_id` null (or "1" beside 1) keyed two different requests of a sampling session the
    same, so the second got the first one's samples."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            sid = await c.base_sampler(await c.session())
            body = {"sampling_session_id": sid, "num_samples": 1, "prompt": PROMPT,
                    "sampling_params": {"max_tokens": 2}}  # fmt: skip
            for seq in (None, "1", -1, 1.0):
                status, out = await c.post("asample", body | {"seq_id": seq})
                assert status == 400 and f"seq_id={seq!r} is not allowed" in out["detail"], (seq, out)
            status, out = await c.post("asample", {k: v for k, v in body.items()})  # no seq_id at all
            assert status == 400 and "seq_id=None is not allowed" in out["detail"], out
            status, out = await c.sample(sid, 1)
            assert status == 200 and len((await c.result(out["request_id"]))["sequences"]) == 1

    _run(main())


def test_after_a_restart_a_request_waiting_for_a_seq_id_never_sent_does_not_hold_up_samples(tmp_path):
    """A reviewer's repro: a model's seq_id 3 acknowledged and waiting for a 2 the client had not sent; after a
    restart, a sample naming sampler weights that do not exist got no answer (the restart's wait for replayed
    requests waited on seq 3), where before the restart it was refused at once. Once 2 comes, 3 still runs."""

    async def main():
        async with _Client(_Ops(), tmp_path / "j.sqlite") as c:
            m = await c.model(await c.session())
            status, out = await c.post("optim_step", {"model_id": m, "seq_id": 1, "adam_params": {}})
            assert status == 200 and "metrics" in await c.result(out["request_id"])
            status, out = await c.post("optim_step", {"model_id": m, "seq_id": 3, "adam_params": {}})
            assert status == 200, out
        ops = _Ops()
        async with _Client(ops, tmp_path / "j.sqlite") as c:
            body = {"model_path": f"tinker://{m}/sampler_weights/nope", "num_samples": 1, "prompt": PROMPT,
                    "sampling_params": {"max_tokens": 2}}  # fmt: skip
            status, out = await asyncio.wait_for(c.post("asample", body), 5)
            assert status == 400 and "names no sampler weights" in out["detail"], out
            status, out = await c.post("optim_step", {"model_id": m, "seq_id": 2, "adam_params": {}})
            assert status == 200 and "metrics" in await c.result(out["request_id"])
            assert "metrics" in await c.result(f"{m}.3")
            assert len(ops.optim_calls) == 3  # the replayed 1, then 2 and 3

    _run(main())


@pytest.mark.parametrize(
    ("tokens", "inputs", "why"),
    [
        ([], {"target_tokens": []}, "model_input has 0 tokens"),
        ([1, 2], {"target_tokens": [2, 3], "weight": [1.0, 1.0]},
         "loss_fn_inputs\\['weight'\\] is not an input of any loss.*allowed for loss_fn 'cross_entropy': 'target_tokens', 'weights'"),
        ([[1, 2], [3, 4]], {"target_tokens": [2, 3, 4, 5]}, "model_input is not a flat list of token ids"),
    ],
)  # fmt: skip
def test_malformed_datums_are_user_errors_naming_the_field(tokens, inputs, why):
    """Reviewers' repros: an empty model_input failed as a server error (`min() arg is an empty sequence`, with a
    traceback, re-running a mixed batch request by request); an unknown loss input (a misspelt `weights`) was
    ignored, training every token at weight 1; nested token lists were flattened."""
    from rl_multilora.tinker.ops import _datum_row

    datum = Datum(np.asarray(tokens), {k: np.asarray(v) for k, v in inputs.items()})
    with pytest.raises(UserError, match=why):
        _datum_row("t", "cross_entropy", datum, vocab_size=100, context_length=64)


def test_a_sample_prompt_must_be_a_flat_nonempty_list_of_token_ids():
    """A nested prompt was acknowledged and failed later in its turn (its length counted as 2 by the context check);
    an empty one reached the engine."""
    from rl_multilora.tinker.ops import check_tokens

    with pytest.raises(UserError, match="prompt is not a flat list of token ids"):
        check_tokens("prompt", [[5, 6], [7, 8]], 100)
    with pytest.raises(UserError, match="prompt is not a flat list of token ids"):
        check_tokens("prompt", [[5, 6], [7]], 100)
    ops = ClientOps.__new__(ClientOps)
    ops.limits = ModelLimits(100, 64)
    with pytest.raises(UserError, match="prompt has 0 tokens"):
        ops.check_sample([], {"max_tokens": 2})
    assert ops.check_sample([5], {"max_tokens": 2}) == 2
