"""The bounded Tinker request journal: snapshots every `snapshot_every` optimizer steps (and at save_state) swap a
model's finished requests for a run checkpoint of its state, so the log and a restart's replay follow the snapshot
interval, not the client's history; a restart from a snapshot continues exactly as an uninterrupted server does,
sampler versions and not-yet-fetched results included."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import tinker
from aiohttp import web
from tinker import types

from rl_multilora.tinker.server import SHUTDOWN_S, build_server
from tests.test_tinker_server import BASE, MODEL, TOKEN, _datum, _free_port, _Running, _sft, tiny_model_folder  # noqa: F401

TOKENS = list(range(5, 25))


class _OnPort(_Running):
    """A server on a given port: a restart the same clients reach again."""

    def __init__(self, state_dir, port: int, **options) -> None:
        self.server = build_server(str(MODEL), state_dir, TOKEN, base_model=BASE, poll_s=5, **options)
        self.port = port
        self.loop = asyncio.new_event_loop()
        self.runner = web.AppRunner(self.server.app(), shutdown_timeout=SHUTDOWN_S)
        self.loop.run_until_complete(self.runner.setup())
        self.loop.run_until_complete(web.TCPSite(self.runner, "127.0.0.1", port).start())
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        self.url = f"http://127.0.0.1:{port}"


def _retrieve(server, request_id: str) -> dict:
    """A future's result as JSON (an SDK before the protos asks for it so)."""
    import httpx

    r = httpx.post(server.url + "/api/v1/retrieve_future", json={"request_id": request_id},
                   headers={"X-API-Key": TOKEN, "Accept": "application/json"}, timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()


def _weights(server, tc) -> dict:
    name = server.server.ops.tenants[tc.model_id].name
    return {k: v.clone() for k, v in server.server.ops.backend.adapter_state_dict(name).items()}


def test_the_journal_stays_bounded_and_a_restart_from_a_snapshot_continues_exactly(tmp_path):
    reference = _Running(tmp_path / "ref", snapshot_every=1000)  # never snapshots: the plain replay-free run
    sc = tinker.ServiceClient(base_url=reference.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    expected = _sft(tc, 9, TOKENS)
    expected_weights = _weights(reference, tc)
    assert reference.server.journal.size() >= 1 + 2 * 9  # without snapshots every request stays
    reference.close()

    state = tmp_path / "state"
    port = _free_port()
    first = _OnPort(state, port, snapshot_every=3)
    sc = tinker.ServiceClient(base_url=first.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    losses = _sft(tc, 7, TOKENS)
    path = tc.save_weights_for_sampler("s7").result().path
    sampler = sc.create_sampling_client(model_path=path).result()
    journal = first.server.journal
    # 1 create + 2 requests per step: without snapshots 15 model requests; with them only those after step 6
    assert journal.size() <= 1 + 2 * 3 + 2, journal.size()
    [snap] = journal.snapshots()
    assert snap.next_seq == 13  # after optim_step 6 (seq 12): the create is request 0
    compacted = f"{tc.model_id}.1"  # the first forward_backward: its result is kept in the journal, not in memory
    assert compacted not in first.server.state.results
    assert "loss_fn_outputs" in _retrieve(first, compacted)
    adapter_dir = first.server.ops.ckpt.adapter_dir(first.server.ops.tenants[tc.model_id].name)
    snapshots_on_disk = [
        d for d in adapter_dir.iterdir() if "_journal-snapshot" in (d / "checkpoint.json").read_text()
    ]
    assert len(snapshots_on_disk) == 1, "a superseded snapshot's checkpoint is removed"
    sampled = sampler.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=6, seed=1))
    tokens_before = sampled.result().sequences[0].tokens
    first.close()

    second = _OnPort(state, port, snapshot_every=3)  # the same state dir: restore the snapshot, replay the rest
    assert "loss_fn_outputs" in _retrieve(second, compacted)  # still found after the restart
    losses += _sft(tc, 2, TOKENS)
    np.testing.assert_array_equal(np.array(losses), np.array(expected))  # bit for bit: same math, same order
    for key, value in _weights(second, tc).items():
        assert np.array_equal(value.numpy(), expected_weights[key].numpy()), key
    again = sc.create_sampling_client(model_path=path).result()
    resampled = again.sample(types.ModelInput.from_ints(TOKENS[:4]), 1, types.SamplingParams(max_tokens=6, seed=1))
    assert resampled.result().sequences[0].tokens == tokens_before  # the sampler version came back from the snapshot
    second.close()


def test_a_client_that_only_runs_forward_keeps_the_journal_bounded(tmp_path):
    """A reviewer's repro: a model whose client only calls `forward` (an evaluation loop) never called for a
    snapshot, so the journal kept a row and the server a result per call without bound (300 rows after 300
    forwards), and a restart replayed them all. Now `ROWS_PER_SNAPSHOT * snapshot_every` rows snapshot it; the
    results of its two latest snapshots stay retrievable (as for a training client), across a restart too."""
    state, port = tmp_path / "state", _free_port()
    first = _OnPort(state, port, snapshot_every=2)  # a snapshot once the model holds 8 rows
    sc = tinker.ServiceClient(base_url=first.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=8, seed=3).result()
    expected = tc.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    compactions = []
    compact = first.server._compact
    first.server._compact = lambda *a, **k: (compactions.append(a), compact(*a, **k))[1]
    pipelined = [tc.forward([_datum(TOKENS)], "cross_entropy") for _ in range(24)]  # sent before any is done
    for future in pipelined:
        assert future.result().loss_fn_outputs[0]["logprobs"].tolist() == expected
    # a snapshot per 8 done rows: queued requests are not counted (they made every turn snapshot, freeing one row)
    assert 1 <= len(compactions) <= 4, len(compactions)
    journal = first.server.journal
    assert journal.size() <= 8, journal.size()
    assert len(first.server._model_keys[tc.model_id]) < 8
    assert len(journal.snapshots()) == 1
    assert "loss_fn_outputs" in _retrieve(first, f"{tc.model_id}.20")  # the last snapshots' results stay
    first.close()
    second = _OnPort(state, port, snapshot_every=2)
    assert "loss_fn_outputs" in _retrieve(second, f"{tc.model_id}.22")
    again = tc.forward([_datum(TOKENS)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    assert again == expected
    second.close()


def test_sampling_clients_of_freed_weights_leave_the_journal(tmp_path):
    """The cookbook's loop (train, `save_weights_for_sampler(name)`, `create_sampling_client(model_path=...)`,
    sample) added one sampling session a step for ever, in memory and as a journal row, even with a snapshot every
    step (a reviewer's repro: 4, 8, 12 rows at steps 4, 8, 12). One whose weights are freed is forgotten now."""
    server = _Running(tmp_path / "state", snapshot_every=1, max_sampler_versions=2)
    try:
        sc = tinker.ServiceClient(base_url=server.url, api_key=TOKEN)
        tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=3).result()
        for step in range(6):
            _sft(tc, 1, TOKENS)
            path = tc.save_weights_for_sampler(f"w{step}").result().path
            sampler = sc.create_sampling_client(model_path=path).result()
            sampler.sample(types.ModelInput.from_ints(TOKENS[:3]), 1, types.SamplingParams(max_tokens=2)).result()
        db = server.server.journal._db
        rows = db.execute("SELECT COUNT(*) FROM requests WHERE kind = 'create_sampling_session'").fetchone()[0]
        assert rows <= 3 and len(server.server.state.sampling) <= 3, (rows, server.server.state.sampling)
        assert sampler.sample(types.ModelInput.from_ints(TOKENS[:3]), 1, types.SamplingParams(max_tokens=2)).result()
    finally:
        server.close()


def _loss(tc) -> float:
    return tc.forward([_datum(TOKENS)], "cross_entropy").result().metrics["loss:sum"]


def test_a_loaded_model_survives_a_restart_after_its_checkpoint_is_deleted_and_saved_again(tmp_path):
    """A replayed load_weights read its checkpoint by name again: deleted meanwhile, the loaded model was lost;
    saved again, it silently came back with the new weights. A load is snapshotted at once now."""
    import httpx

    state, port = tmp_path / "state", _free_port()
    first = _OnPort(state, port)
    sc = tinker.ServiceClient(base_url=first.url, api_key=TOKEN)
    a = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    _sft(a, 1, TOKENS)
    x = a.save_state("x").result().path
    _sft(a, 1, TOKENS)
    a.save_state("y").result()  # A's snapshot now: x may be deleted
    b = sc.create_training_client_from_state(x).result()
    before = _loss(b)
    r = httpx.delete(f"{first.url}/api/v1/training_runs/{a.model_id}/checkpoints/weights/x",
                     headers={"X-API-Key": TOKEN})  # fmt: skip
    assert r.status_code == 200, r.text
    _sft(a, 1, TOKENS)
    a.save_state("x").result()  # the name again, other weights
    first.close()

    second = _OnPort(state, port)
    try:
        assert _loss(b) == before
    finally:
        second.close()


def test_a_save_state_between_forward_backward_and_optim_step_keeps_the_gradient_across_a_restart(tmp_path):
    """save_state compacted the journal up to itself, forward_backward included, though its checkpoint holds no
    gradient: after a restart the optim_step stepped without it. No snapshot is taken while a gradient waits now."""
    state, port = tmp_path / "state", _free_port()
    first = _OnPort(state, port)
    sc = tinker.ServiceClient(base_url=first.url, api_key=TOKEN)
    tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=1).result()
    tc.forward_backward([_datum(TOKENS)], "cross_entropy").result()
    tc.save_state("mid").result()
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    before = _loss(tc)
    first.close()

    second = _OnPort(state, port)
    try:
        assert _loss(tc) == before
    finally:
        second.close()
