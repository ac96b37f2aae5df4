"""Tinker clients beyond the slots are paged, not refused: a standalone server with 2 slots serves 12 models."""

from __future__ import annotations

import copy

import tinker
import torch
from tinker import types

from tests.test_tinker_server import BASE, TOKEN, _datum, _Running, tiny_model_folder  # noqa: F401


def test_clients_beyond_the_slots_train_and_sample_and_their_states_survive_paging(tmp_path):
    s = _Running(tmp_path / "state", max_loras=2, max_tenants=16)
    try:
        sc = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
        clients, first = [], None
        for i in range(12):  # one after another, each through a whole round while the others wait paged out
            tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=i)
            tokens = [5 + i, 6, 7, 8, 9, 10]
            fb = tc.forward_backward([_datum(tokens)], "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            assert fb.result().metrics["loss:sum"] > 0
            if i == 0:  # its weights and Adam state as it leaves the slots for good
                name = s.server.ops.tenants[tc.model_id].name
                ops = s.server.ops.backend.trainer.ops
                first = (s.server.ops.backend.adapter_state_dict(name), copy.deepcopy(ops.optimizer_state_dict(name)))
            sampler = tc.save_weights_and_get_sampling_client().result()
            out = sampler.sample(
                types.ModelInput.from_ints(tokens[:3]), 1, types.SamplingParams(max_tokens=4, temperature=0.0)
            ).result()
            assert len(out.sequences[0].tokens) == 4
            clients.append((tc, tokens))
        backend = s.server.ops.backend
        stats = backend.paging_stats()
        assert stats.resident == 2 and stats.paged == 10 and stats.page_outs == 10 and stats.page_ins == 0
        # the first client, paged out 10 clients ago, comes back bit for bit and trains on
        tc, tokens = clients[0]
        assert not backend.resident(name)
        weights, optim = backend.adapter_state_dict(name), backend.trainer.ops.optimizer_state_dict(name)
        assert backend.paging_stats().page_ins == 1 and backend.resident(name)
        assert weights.keys() == first[0].keys() and all(torch.equal(weights[k], first[0][k]) for k in weights)
        got, want = optim["optimizer"]["state"], first[1]["optimizer"]["state"]
        assert got.keys() == want.keys() and all(torch.equal(got[i][k], want[i][k]) for i in got for k in got[i])
        tc.forward_backward([_datum(tokens)], "cross_entropy").result()
        tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
        assert not all(torch.equal(weights[k], v) for k, v in backend.adapter_state_dict(name).items())
    finally:
        s.close()
