"""Many Tinker clients on few slots: sampler versions count against the host budget (spilled past it, read back
bit for bit), the server's memory by component, and bench/bench_tinker_clients.py at a small count (slow)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import pytest
import tinker
from tinker import types

from tests.test_tinker_server import BASE, ROOT, TOKEN, _datum, _Running, tiny_model_folder  # noqa: F401

GREEDY = types.SamplingParams(max_tokens=4, temperature=0.0)


def _memory(s: _Running) -> dict:
    req = urllib.request.Request(s.url + "/api/v1/memory", headers={"X-API-Key": TOKEN})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


def test_sampler_versions_spill_past_the_host_budget_and_come_back_bit_for_bit(tmp_path):
    s = _Running(tmp_path / "state", max_loras=2, max_tenants=16)
    ops = s.server.ops
    try:
        sc = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
        samplers = []
        for i in range(10):
            tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=i).result()
            tokens = [5 + i, 6, 7, 8, 9, 10]
            tc.forward_backward([_datum(tokens)], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=5e-2)).result()
            sampler = tc.save_weights_and_get_sampling_client().result()
            prompt = types.ModelInput.from_ints(tokens[:3])
            samplers.append((tc, sampler, prompt, sampler.sample(prompt, 1, GREEDY).result().sequences[0].tokens))
            if i == 0:
                version = ops.samplers[next(iter(ops.tenants[tc.model_id].sampler_paths))]
                first = {k: v.clone() for k, v in version.tensors.items()}
                # from now on the paged tenants and the versions share room for about three clients' versions
                ops.host_budget_bytes = 3 * version.nbytes
        m = _memory(s)
        assert m["counts"]["models"] == 10 and m["counts"]["paged"] == 8
        assert m["counts"]["sampler_versions"] == 10 and m["counts"]["sampler_versions_spilled"] >= 7
        # the versions spill first while the tenant store holds more than the budget by itself (it spills on its own
        # budget, the server's --host-budget-gb, None here): none of the versions stays beyond the newest
        assert m["samplers_host"] <= version.nbytes and m["samplers_disk"] > 0
        assert version.tensors is None and version.spilled is not None and version.spilled.exists()
        # the first client's version, spilled 9 clients ago, samples the same tokens and is its tensors bit for bit
        tc, sampler, prompt, tokens = samplers[0]
        assert sampler.sample(prompt, 1, GREEDY).result().sequences[0].tokens == tokens
        assert version.tensors is not None and version.spilled is None and ops.sampler_loads >= 1
        assert version.tensors.keys() == first.keys() and all(version.tensors[k].equal(first[k]) for k in first)
        # unloading a model frees its spilled version's file too
        tc2, *_ = samplers[1]
        spilled = ops.samplers[next(iter(ops.tenants[tc2.model_id].sampler_paths))].spilled
        assert spilled is not None and spilled.exists()
        ops.unload(tc2.model_id)
        assert not spilled.exists()
        assert _memory(s)["counts"]["sampler_versions"] == 9
    finally:
        s.close()


def test_memory_by_component_counts_what_the_server_holds(tmp_path):
    s = _Running(tmp_path / "state", max_loras=2, max_tenants=8)
    try:
        sc = tinker.ServiceClient(base_url=s.url, api_key=TOKEN)
        before = _memory(s)
        assert before["counts"]["models"] == 0 and before["paged_host"] == 0 and before["samplers_host"] == 0
        assert before["base"] > 0 and before["slots"] > 0 and before["engine"] > 0
        for i in range(3):
            tc = sc.create_lora_training_client(base_model=BASE, rank=4, seed=i).result()
            tc.forward_backward([_datum([5, 6, 7, 8, 9])], "cross_entropy").result()
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            tc.save_weights_for_sampler(f"v{i}").result()
        m = _memory(s)
        backend = s.server.ops.backend
        name = s.server.ops.tenants[tc.model_id].name
        adapter = sum(t.numel() * 4 for t in backend.adapter_state_dict(name).values())
        assert m["counts"]["paged"] == 1
        # the paged client: its adapter and two AdamW moments at true rank, and AdamW's step counters (a few bytes)
        assert 3 * adapter <= m["paged_host"] <= 3 * adapter + 256
        assert m["samplers_host"] == 3 * adapter  # three versions, one adapter each
        assert m["base"] == before["base"] and m["slots"] == before["slots"]
        assert m["optimizer"] > 0 and m["results"] > before["results"]
        assert m["rss"] == sum(m[k] for k in ("base", "slots", "gradients", "optimizer", "paged_host",
                                               "samplers_host", "engine", "results", "other"))  # fmt: skip
    finally:
        s.close()


@pytest.mark.slow
def test_bench_forty_clients_on_eight_slots_none_refused_and_memory_within_the_budget(tmp_path):
    """bench/bench_tinker_clients.py at 40 clients (5x the slots) on the tiny preset with a 16 MiB host budget."""
    preset = ROOT / "artifacts" / "tiny"
    subprocess.run(["bash", str(ROOT / "examples/multi_lora/provision.sh"), str(preset)], check=True, cwd=ROOT)
    out = tmp_path / "report.json"
    cmd = [sys.executable, str(ROOT / "bench/bench_tinker_clients.py"), "--model", str(preset / "model"),
           "--clients", "40", "--every", "8", "--host-budget-gb", str(16 / 1024), "--json", str(out)]  # fmt: skip
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r = json.loads(out.read_text())
    assert r["refused"] == 0 and r["resampled_equal"]
    last = r["rows"][-1]
    m = last["memory"]
    assert m["counts"]["models"] == 40 and m["counts"]["paged"] == 32
    # what the budget keeps in memory, within one version of it; the rest went to disk
    assert m["paged_host"] + m["samplers_host"] <= r["host_budget_bytes"] + 2**20
    assert m["paged_disk"] + m["samplers_disk"] > 0
    assert last["rss"] <= r["budget_bytes"]
