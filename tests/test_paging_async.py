"""More tenants than slots, the rest of issue 36: prefetching the next step's tenants while a step trains (async
runs), weight sync of a changed adapter evicted before its sync, and paging in the service status.

Bit-exactness is `torch.equal`: a prefetch prepares the same tensors a page-in on demand would, earlier.
"""

from __future__ import annotations

import torch

from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.train_ops import TrainOps
from tests.test_paging import (
    RUN_NAMES,
    _assert_same_run,
    _assert_same_state,
    _backend,
    _final,
    _rows,
    _run_config,
    _state,
)


def _train_groups(backend, groups: list[list[str]], steps: int, prefetch: bool) -> list[list[str]]:
    """`steps` rounds over `groups` in turn, each a mixed forward_backward and an optim_step per tenant; with
    `prefetch` the next round's group is staged first (as an async run does while a step trains). Returns, per
    round, the names the store held staged right after the prefetch call."""
    from rl_multilora.losses import client_algo
    from rl_multilora.tenant_optim import AdamSettings

    staged = []
    for k in range(steps):
        chosen = groups[k % len(groups)]
        if prefetch:
            slots_before = dict(backend.model.adapters)
            backend.prefetch(groups[(k + 1) % len(groups)])
            assert backend.model.adapters == slots_before  # staging touches no slot (the step's autograd reads them)
            staged.append(backend.trainer.ops.store.staged())
        rows = _rows(chosen, 2 * len(chosen), seed=300 + k)
        backend.forward_backward(rows, {n: client_algo("importance_sampling", None) for n in chosen})
        for n in chosen:
            backend.optim_step(n, AdamSettings(learning_rate=1e-2, weight_decay=0.01))
    return staged


def test_prefetched_page_ins_are_bit_identical_to_paging_on_demand_and_to_enough_slots(tmp_path):
    names = [f"c{i:02d}" for i in range(9)]
    groups = [names[0:3], names[3:6], names[6:9]]
    full = _backend(9, None, names)
    on_demand = _backend(3, 9, names, budget=60_000, spill=tmp_path / "a")  # some tenants spill to disk
    prefetched = _backend(3, 9, names, budget=60_000, spill=tmp_path / "b")
    _train_groups(full, groups, 7, prefetch=False)
    _train_groups(on_demand, groups, 7, prefetch=False)
    staged = _train_groups(prefetched, groups, 7, prefetch=True)
    st, store = prefetched.paging_stats(), prefetched.trainer.ops.store
    # each prefetch staged the next round's 3 tenants while this round's (staged by the round before) waited taken
    assert all(set(groups[(k + 1) % 3]) <= set(s) for k, s in enumerate(staged))
    # every page-in but the first round's (group 0 paged in on demand) found its tenant staged
    assert st.prefetched == st.page_ins - 3 == 18 and on_demand.paging_stats().prefetched == 0
    assert store.stats.loads > 0  # spilled tenants were read back by the prefetch thread
    for n in names:
        want = _state(full, n)
        _assert_same_state(want, _state(on_demand, n))
        _assert_same_state(want, _state(prefetched, n))
    prefetched.close()


def _async_cfg(root, run_dir, max_loras: int, max_tenants: int | None) -> dict:
    cfg = _run_config(root, run_dir, max_loras, max_tenants)
    cfg["rollout"]["mode"] = "async"
    cfg["rollout"]["max_staleness"] = 1
    for a in cfg["adapters"]:
        a.pop("weight", None)  # equal weights: the turns alternate {g0, g1}, {g2, g3}, {g4, g5}
    return cfg


def test_async_run_prefetches_the_next_steps_tenants_and_ends_bit_identical(tmp_path, monkeypatch):
    from rl_multilora.backends.local import LocalBackend
    from rl_multilora.config import parse_run_config
    from rl_multilora.loop import run
    from rl_multilora.metrics import read_metrics
    from tests.tiny_models import save_tiny_model, write_sum_task

    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    for i, n in enumerate(RUN_NAMES):
        write_sum_task(tmp_path / "data" / f"{n}.jsonl", 40, 1 + i)
    calls: list[tuple[str, tuple[str, ...]]] = []
    prefetch, train_step = LocalBackend.prefetch, LocalBackend.train_step

    def spy_prefetch(self, names):
        calls.append(("prefetch", tuple(names)))
        return prefetch(self, names)

    def spy_train(self, samples, *a, **k):
        calls.append(("train", tuple(sorted({s.adapter.name for s in samples if s.adapter is not None}))))
        return train_step(self, samples, *a, **k)

    monkeypatch.setattr(LocalBackend, "prefetch", spy_prefetch)
    monkeypatch.setattr(LocalBackend, "train_step", spy_train)
    run(parse_run_config(_async_cfg(tmp_path, tmp_path / "prefetch", 2, 6)))
    # each step's prefetch names the next step's tenants and comes before this step trains
    trains = [i for i, c in enumerate(calls) if c[0] == "train"]
    assert len(trains) >= 6
    for i, j in zip(trains, trains[1:], strict=False):
        ahead = [c for c in calls[:i] if c[0] == "prefetch"][-1]
        assert calls[i - 1] == ahead and set(calls[j][1]) <= set(ahead[1]) and not set(ahead[1]) & set(calls[i][1])
    rows = read_metrics(tmp_path / "prefetch")
    assert sum(r.get("page_ins_prefetched") or 0 for r in rows) > 0
    assert all(len({r["adapter"] for r in rows if r["step"] == s}) <= 2 for s in {r["step"] for r in rows})

    monkeypatch.setattr(LocalBackend, "prefetch", lambda self, names: [])  # pages on demand
    run(parse_run_config(_async_cfg(tmp_path, tmp_path / "on_demand", 2, 6)))
    run(parse_run_config(_async_cfg(tmp_path, tmp_path / "six", 6, None)))  # enough slots, the same turns
    assert not any(r.get("page_ins_prefetched") for r in read_metrics(tmp_path / "on_demand"))
    _assert_same_run(_final(tmp_path / "six"), _final(tmp_path / "prefetch"))
    _assert_same_run(_final(tmp_path / "six"), _final(tmp_path / "on_demand"))
    key = [(r["step"], r["adapter"], r["reward_mean"]) for r in rows if "reward_mean" in r]
    assert key == [
        (r["step"], r["adapter"], r["reward_mean"]) for r in read_metrics(tmp_path / "six") if "reward_mean" in r
    ]


def test_turns_planned_ahead_are_the_next_pick_and_survive_a_restart():
    from rl_multilora.turns import TurnScheduler

    names = [f"t{i}" for i in range(5)]
    weights = dict.fromkeys(names, 1.0)
    plain, ahead = TurnScheduler(cap=2), TurnScheduler(cap=2)
    want = [plain.pick(names, weights) for _ in range(8)]
    got = [ahead.pick(names, weights)]
    for _ in range(7):
        planned = ahead.plan(names, weights)  # while the step before runs
        restored = TurnScheduler(cap=2)
        restored.load_state_dict(ahead.state_dict())  # a kill between the plan and its step
        got.append(ahead.pick(names, weights))
        assert restored.pick(names, weights) == got[-1] == planned
    assert got == want  # planning ahead picks what picking then would
    # a planned tenant that stopped running is left out; a newcomer waits for the next pick
    planned = ahead.plan(names, weights)
    left = [n for n in names if n != planned[0]]
    assert ahead.pick([*left, "new"], weights) == planned[1:]
    assert ahead.planned is None and any("new" in ahead.pick([*left, "new"], weights) for _ in range(3))


def test_a_changed_adapter_evicted_before_its_sync_is_pushed_from_the_store_not_paged_in(tmp_path):
    from rl_multilora.config import parse_run_config
    from rl_multilora.loop import Runtime
    from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    for i, n in enumerate([*RUN_NAMES[:2], "late"]):
        write_sum_task(tmp_path / "data" / f"{n}.jsonl", 40, 1 + i)
    cfg = _run_config(tmp_path, tmp_path / "run", 2, 4)
    cfg["adapters"] = cfg["adapters"][:2]
    cfg["checkpoint"]["save_every"] = 100  # a checkpoint reads the optimizer state, which pages a tenant back in
    rt = Runtime.build(parse_run_config(cfg))
    pushed: dict[str, tuple[dict[str, torch.Tensor], int]] = {}
    load = rt.engine.load_adapter

    def spy(name, tensors, config, version=None):
        pushed[name] = ({k: v.clone() for k, v in tensors.items()}, version)
        return load(name, tensors, config, version=version)

    rt.engine.load_adapter = spy
    sync_page_ins = []
    sync_now = rt.sync_now

    def sync_spy():
        before = rt.backend.paging_stats().page_ins
        out = sync_now()
        sync_page_ins.append(rt.backend.paging_stats().page_ins - before)
        return out

    rt.sync_now = sync_spy
    try:
        rt.start()
        first = {n: rt.tenants.get(n).weight_version for n in RUN_NAMES[:2]}
        # a tenant submitted now is admitted after this step trains: its slot evicts a tenant that just changed
        rt.register(
            parse_run_config(
                {**cfg, "adapters": [sum_task_adapter(tmp_path / "data", "late", 9, max_steps=3)]}
            ).adapters[0]
        )
        pushed.clear()
        res = rt.step()
        ops = rt.backend.trainer.ops
        evicted = [n for n in RUN_NAMES[:2] if not ops.is_resident(n)]
        assert len(evicted) == 1 and ops.is_resident("late")
        assert {r.adapter for r in res.records} == set(RUN_NAMES[:2])  # both trained, then one lost its slot
        assert sync_page_ins[-1] == 0 and set(pushed) == {*RUN_NAMES[:2], "late"}
        for n in RUN_NAMES[:2]:
            assert pushed[n][1] == first[n] + 1 == rt.tenants.get(n).weight_version  # the engine got the new version
        # what was pushed is the trained adapter, bit for bit: page it in and read its slot
        ops.ensure_resident([evicted[0]])
        slot = rt.backend.model.adapter_state_dict(evicted[0])
        assert slot.keys() == pushed[evicted[0]][0].keys()
        assert all(torch.equal(slot[k], pushed[evicted[0]][0][k]) for k in slot)
        assert not rt.tenants.get(evicted[0]).dirty
    finally:
        rt.close()


def test_service_status_shows_resident_and_paged_tenants_and_page_ins():
    from rl_multilora.service import AdapterStatus, ServiceStatus, _paging_status

    names = [f"c{i}" for i in range(5)]
    b = _backend(2, 6, names)
    b.trainer.ops.ensure_resident(["c0"])  # a page-in (c0 was paged out by the later registrations)
    paging = _paging_status(b)
    assert paging["resident"] == 2 and paging["paged"] == 3 and paging["page_ins"] == 1 and paging["max_tenants"] == 6
    adapters = [
        AdapterStatus.from_record(
            {"name": n, "state": "running", "slot": i, "adapter_step": 0, "resident": b.resident(n)}
        )
        for i, n in enumerate(names)
    ]
    table = ServiceStatus(3, True, "run", 2, adapters, paging=paging).table()
    assert "paging: 2 resident in 2 slots, 3 paged (0 on disk" in table and "of 6 places | page-ins 1 (" in table
    assert sum("(paged)" in line for line in table.splitlines()) == 3


def test_a_paged_out_adapters_peft_tensors_read_from_the_store_equal_its_slots(tmp_path):
    """Linear and expert LoRA (PEFT's target_parameters layout), both tenants spilled to disk (budget 0)."""
    from rl_multilora.tenant_store import TenantStore
    from tests.test_expert_lora import EXPERTS, make_model, randomize

    model = make_model(max_loras=2)
    ops = TrainOps(model, GRPOSettings(), pad_token_id=0, store=TenantStore(0, tmp_path / "spill"))  # all spill
    spec = {"e": (4, EXPERTS), "l": (8, None), "x": (2, EXPERTS[:1])}
    want = {}
    for i, (n, (rank, params)) in enumerate(spec.items()):
        ops.make_room()
        model.add_adapter(n, rank=rank, alpha=2 * rank, seed=i, target_parameters=params)
        randomize(model, n, seed=10 + i)
        ops.add_tenant(n, OptimSettings(), lr=1e-2)
        want[n] = (model.adapter_state_dict(n), model.peft_config(n))
    ops.page_out("l")  # "e" paged out when "x" came: both wait spilled on disk now
    assert sorted(ops.store.spilled()) == ["e", "l"] and ops.resident == ["x"]
    page_ins = ops.store.stats.page_ins
    for n in ("e", "l"):
        tensors, config = ops.paged_state_dict(n)
        assert config == want[n][1] and tensors.keys() == want[n][0].keys()
        assert all(torch.equal(tensors[k], want[n][0][k]) for k in tensors)
    assert ops.store.stats.page_ins == page_ins and sorted(ops.store.spilled()) == ["e", "l"]  # read, not taken
