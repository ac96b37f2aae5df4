"""More tenants than slots: gradients only for the slots that hold rows, the host tenant store and its paging.

The exactness tests compare tensors bit for bit (`torch.equal`): paging moves bytes, it never recomputes them. Where
a run on fewer slots puts a tenant's rows in differently shaped products, they compare to the bit where this
machine's matrix products give a row the same bits in any product (`tiny_models.gemm_rows_independent`), else to
float rounding.
"""

from __future__ import annotations

import random
from pathlib import Path

import torch

from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.lora import MultiLoRAModel
from rl_multilora.lora.routing import SlotGradSink
from rl_multilora.rows import Row
from rl_multilora.train_ops import TrainOps
from tests.tiny_models import PAD_ID, assert_same_bits, tiny_model

VOCAB = 128
REPO = Path(__file__).resolve().parents[1]


def _rows(names: list[str], n: int, seed: int) -> list[Row]:
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, VOCAB) for _ in range(rng.randint(4, 9))]
        out.append(Row(names[i % len(names)], ids, list(range(2, len(ids))), rng.uniform(-1, 1), None))
    return out


def _ops(max_loras: int, names: list[str], ranks: dict[str, int] | None = None) -> tuple[MultiLoRAModel, TrainOps]:
    model = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=max_loras, max_rank=16)
    ops = TrainOps(model, GRPOSettings(), pad_token_id=PAD_ID)
    for i, n in enumerate(names):
        r = (ranks or {}).get(n, 8)
        model.add_adapter(n, rank=r, alpha=2 * r, seed=i)
        ops.add_tenant(n, OptimSettings(), lr=1e-2)
    return model, ops


def test_backward_keeps_gradients_of_the_slots_with_rows_only_and_they_equal_the_dense_ones():
    names = [f"t{i}" for i in range(8)]
    ranks = {n: (4, 8, 16)[i % 3] for i, n in enumerate(names)}
    with_rows = ["t1", "t4", "t6"]  # 3 of 8 occupied slots, mixed ranks
    model, ops = _ops(8, names, ranks)
    assert isinstance(model._grad_sink, SlotGradSink)
    seen: list[tuple[int, ...]] = []
    add = model._grad_sink.add

    def spy(stacked, used, compact):
        seen.append((stacked.shape[0], compact.shape[0], *used.tolist()))
        add(stacked, used, compact)

    model._grad_sink.add = spy
    rows = _rows(with_rows, 9, seed=1)
    ops.forward_backward(rows)
    # every stacked LoRA tensor got a gradient for the 3 slots with rows, none for the other 5, nothing in `.grad`
    assert seen and all(s == 8 and u == 3 and tuple(ids) == (1, 4, 6) for s, u, *ids in seen)
    assert all(p.grad is None for k, p in model.named_parameters() if "lora_" in k)
    sparse = {n: [g.clone() for g in ops.tenant(n).grads] for n in with_rows}
    assert all(ops.tenant(n).grads is None for n in names if n not in with_rows)

    dense_model, dense_ops = _ops(8, names, ranks)
    dense_model._grad_sink = None  # the all-slots `.grad` path, as a sharded model keeps it
    dense_ops.forward_backward(_rows(with_rows, 9, seed=1))
    for n in with_rows:
        got, want = sparse[n], dense_ops.tenant(n).grads
        assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
        assert any(bool(g.abs().sum() > 0) for g in got)


def _backend(max_loras: int, max_tenants: int | None, names: list[str], budget: int | None = None, spill=None):
    from rl_multilora.backends.local import LocalBackend
    from rl_multilora.tenant_store import TenantStore
    from rl_multilora.trainer import MultiLoRATrainer

    model = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=max_loras, max_rank=16)
    paging = max_tenants is not None and max_tenants > max_loras
    store = TenantStore(budget, spill) if paging else None
    trainer = MultiLoRATrainer(model, GRPOSettings(), pad_token_id=PAD_ID, store=store)
    backend = LocalBackend(model, trainer, max_tenants=max_tenants)
    for i, n in enumerate(names):
        r = (4, 8, 16)[i % 3]
        backend.add_client(n, r, 2.0 * r, seed=i, target_modules=model.lora_modules if i % 4 else ["q_proj"])
    return backend


def _train_in_turns(backend, names: list[str], steps: int, per_step: int) -> None:
    """`steps` rounds: each round `per_step` tenants (rotating) do a mixed forward_backward and an optim_step."""
    from rl_multilora.losses import client_algo
    from rl_multilora.tenant_optim import AdamSettings

    for k in range(steps):
        chosen = [names[(k * per_step + j) % len(names)] for j in range(per_step)]
        rows = _rows(chosen, 2 * per_step, seed=100 + k)
        backend.forward_backward(rows, {n: client_algo("importance_sampling", None) for n in chosen})
        for n in chosen:
            backend.optim_step(n, AdamSettings(learning_rate=1e-2, weight_decay=0.01))


def _state(backend, name: str) -> tuple[dict[str, torch.Tensor], dict]:
    return backend.adapter_state_dict(name), backend.optimizer_state_dict(name)


def _assert_same_state(a, b) -> None:
    (wa, oa), (wb, ob) = a, b
    assert wa.keys() == wb.keys()
    for k in wa:
        assert_same_bits(wb[k], wa[k], ulps=1024)  # ten steps of Adam from gradients equal to float rounding
    assert oa["scheduler"] == ob["scheduler"]
    assert oa["optimizer"]["param_groups"] == ob["optimizer"]["param_groups"]
    sa, sb = oa["optimizer"]["state"], ob["optimizer"]["state"]
    assert sa.keys() == sb.keys() and sa
    for i in sa:
        assert sa[i].keys() == sb[i].keys()
        for k in sa[i]:
            assert_same_bits(sb[i][k], sa[i][k], ulps=1024)


def test_16_tenants_on_4_slots_end_bit_identical_to_16_slots(tmp_path):
    names = [f"c{i:02d}" for i in range(16)]
    full = _backend(16, None, names)
    paged = _backend(4, 16, names, budget=200_000, spill=tmp_path / "spill")  # a few tenants spill to disk
    for b in (full, paged):
        _train_in_turns(b, names, steps=10, per_step=3)
        # a client's gradient waits in its state across page-outs until its own optim_step
        _train_in_turns(b, names[:5], steps=1, per_step=5)
    stats = paged.paging_stats()
    assert stats.page_ins > 16 and stats.resident == 4 and stats.paged == 12
    assert paged.trainer.ops.store.stats.spills > 0 and paged.trainer.ops.store.stats.loads > 0
    assert full.paging_stats() is None
    for n in names:
        state = _state(full, n)
        assert any(bool(v.abs().sum() > 0) for k, v in state[0].items() if "lora_B" in k)  # it trained
        _assert_same_state(state, _state(paged, n))
    assert len(paged.model.adapters) == 4  # reading every state paged them in turn through the 4 slots


def test_a_forward_backward_of_more_tenants_than_slots_runs_in_parts_with_the_same_outputs():
    from rl_multilora.losses import client_algo

    names = [f"c{i}" for i in range(6)]
    full, paged = _backend(6, None, names), _backend(2, 8, names)
    rows = _rows(names, 12, seed=5)
    algos = {n: client_algo("importance_sampling", None) for n in names}
    a, b = full.forward_backward(rows, algos), paged.forward_backward(rows, algos)
    for x, y in zip(a.logprobs, b.logprobs, strict=True):
        assert_same_bits(y, x)
    assert_same_bits(torch.tensor(b.row_loss), torch.tensor(a.row_loss))
    assert a.backwarded == b.backwarded == set(names)
    for n in names:
        ga, gb = full.trainer.ops.tenant(n).grads, paged.trainer.ops.tenant(n).grads
        if not paged.trainer.ops.is_resident(n):
            paged.trainer.ops.ensure_resident([n])
            gb = paged.trainer.ops.tenant(n).grads
        for x, y in zip(ga, gb, strict=True):
            assert_same_bits(y, x)


def test_places_resident_and_removal():
    names = [f"c{i}" for i in range(5)]
    b = _backend(2, 6, names)
    assert b.max_tenants == 6 and b.max_loras == 2 and sorted(b.adapters) == names
    assert b.free_slots() == [5]
    b.remove_adapter("c0")  # paged out: its stored state goes
    b.remove_adapter("c4")  # resident: its slot frees
    assert b.free_slots() == [0, 4, 5] and len(b.model.adapters) == 1
    assert b.trainer.ops.store.names == ["c1", "c2"] and b.trainer.ops.resident == ["c3"]
    b.add_client("d", 4, 8.0, seed=1, target_modules=b.model.lora_modules)
    b.add_client("e", 4, 8.0, seed=2, target_modules=b.model.lora_modules)
    b.add_client("f", 4, 8.0, seed=3, target_modules=b.model.lora_modules)
    try:
        b.add_client("g", 4, 8.0, seed=4, target_modules=b.model.lora_modules)
    except RuntimeError as e:
        assert "model.max_tenants=6" in str(e)
    else:
        raise AssertionError("a 7th tenant got a place of 6")


def test_engine_bank_pages_adapters_on_demand_with_the_outputs_of_a_bank_that_holds_them_all():
    from rollout.engines.embedded import EmbeddedEngine
    from rollout.types import GenerateRequest, SamplingParams
    from tests.tiny_models import tiny_tokenizer

    names = [f"a{i}" for i in range(6)]
    trainer_model = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=6, max_rank=16)
    for i, n in enumerate(names):
        trainer_model.add_adapter(n, rank=8, alpha=16, seed=i)
        with torch.no_grad():  # B = 0 at init: give every adapter an effect of its own
            for k, p in enumerate(trainer_model.adapter_parameters(n)):
                if k % 2:
                    p.normal_(0, 0.5, generator=torch.Generator().manual_seed(10 * i + k))
    weights = {n: (trainer_model.adapter_state_dict(n), trainer_model.peft_config(n)) for n in names}
    engines = {}
    for slots, page in ((6, False), (2, True)):
        model = MultiLoRAModel.from_model(tiny_model(seed=0, vocab=VOCAB), max_loras=slots, max_rank=16)
        eng = EmbeddedEngine(model, tiny_tokenizer(), eos_token_ids=[], page_adapters=page)
        for n in names:
            eng.load_adapter(n, *weights[n])  # 4 of them are parked in the 2-slot engine: no "slots in use" error
        engines[slots] = eng
    greedy = SamplingParams(temperature=0.0, max_new_tokens=5)
    requests = [GenerateRequest(input_ids=[5 + i, 9, 11], adapter=n, sampling=greedy) for i, n in enumerate(names)]
    requests += [GenerateRequest(input_ids=[7, 8], adapter=None, sampling=greedy)]
    try:
        outs = {k: e.generate(requests * 2) for k, e in engines.items()}
        assert all(r.error is None and r.finish_reason == "length" for r in outs[2])
        assert [r.output_ids for r in outs[2]] == [r.output_ids for r in outs[6]]
        assert len({tuple(r.output_ids) for r in outs[6][:6]}) > 1  # the adapters differ
        assert engines[2].bank_page_ins >= 4 and engines[6].bank_page_ins == 0
        engines[2].unload_adapter("a0")  # parked or resident, it goes
        assert engines[2].generate(requests[:1])[0].finish_reason == "error"
    finally:
        for e in engines.values():
            e.close()


# -- a whole run: 6 GRPO tenants on 2 slots vs the same turns on 6 slots, and a kill -9 + resume ----------------------

RUN_NAMES = tuple(f"g{i}" for i in range(6))


def _run_config(root, run_dir, max_loras: int, max_tenants: int | None) -> dict:
    from tests.tiny_models import sum_task_adapter

    ranks = (2, 4, 8)
    adapters = [
        sum_task_adapter(root / "data", n, 7 + i, rank=ranks[i % 3], alpha=2 * ranks[i % 3], max_steps=3)
        for i, n in enumerate(RUN_NAMES)
    ]
    adapters[1]["weight"] = 2.0  # turns in proportion to weight
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": max_loras, "max_rank": 8, "max_tenants": max_tenants},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6, "max_tenants_per_step": 2},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "checkpoint": {"save_every": 1, "keep_last": 2},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": adapters,
    }


def _final(run_dir) -> dict[str, dict[str, torch.Tensor]]:
    from safetensors.torch import load_file

    from rl_multilora.checkpoint import CheckpointManager

    out = {}
    for n in RUN_NAMES:
        d = CheckpointManager(run_dir).latest(n)
        out[n] = {
            f"{f}/{k}": v
            for f in ("adapter_model", "optimizer")
            for k, v in load_file(str(d / f"{f}.safetensors")).items()
        }
        out[n]["json"] = [(d / f).read_text() for f in ("optimizer.json", "data_state.json")]
    return out


def _assert_same_run(a: dict, b: dict) -> None:
    for n in RUN_NAMES:
        assert a[n]["json"] == b[n]["json"], n
        keys = sorted(k for k in a[n] if k != "json")
        assert keys == sorted(k for k in b[n] if k != "json") and keys
        assert all(torch.equal(a[n][k], b[n][k]) for k in keys), n


def test_grpo_run_on_fewer_slots_ends_bit_identical_including_a_kill_and_resume(tmp_path):
    import json
    import os
    import signal
    import subprocess
    import sys
    from pathlib import Path

    import yaml

    from rl_multilora.config import parse_run_config
    from rl_multilora.loop import run
    from rl_multilora.metrics import read_metrics
    from tests.tiny_models import save_tiny_model, write_sum_task

    save_tiny_model(tmp_path / "model", hidden=32, layers=2)
    for i, n in enumerate(RUN_NAMES):
        write_sum_task(tmp_path / "data" / f"{n}.jsonl", 40, 1 + i)
    slots6 = run(parse_run_config(_run_config(tmp_path, tmp_path / "six", 6, None)))
    paged = run(parse_run_config(_run_config(tmp_path, tmp_path / "two", 2, 6)))
    assert paged.tenants.global_step == slots6.tenants.global_step
    _assert_same_run(_final(tmp_path / "six"), _final(tmp_path / "two"))
    rows = read_metrics(tmp_path / "two")
    assert {(r["step"], r["adapter"]) for r in rows} == {
        (r["step"], r["adapter"]) for r in read_metrics(tmp_path / "six")
    }
    assert all(len([r for r in rows if r["step"] == s]) <= 2 for s in {r["step"] for r in rows})  # 2 per step
    assert sum(r["page_ins"] for r in rows if r.get("page_ins")) > 0 and all("tenants_resident" in r for r in rows)
    assert all(r.get("engine_page_ins") is not None for r in rows)

    # the paged run again, SIGKILLed in the middle of an optimizer step, then resumed in this process
    cfg = _run_config(tmp_path, tmp_path / "killed", 2, 6)
    path = tmp_path / "killed.yaml"
    path.write_text(yaml.safe_dump(cfg))
    repo = Path(__file__).resolve().parents[1]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(repo), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run(
        [sys.executable, "-m", "tests.fault_plugins", "train:9", "run", str(path)],
        cwd=repo, env=env, capture_output=True, text=True, timeout=600,
    )  # fmt: skip
    assert proc.returncode == -signal.SIGKILL, proc.stderr
    state = json.loads((tmp_path / "killed" / "run_state.json").read_text())
    assert 0 < state["global_step"] and state["turns"]["passes"]  # the turns are run state
    run(parse_run_config(cfg))
    _assert_same_run(_final(tmp_path / "six"), _final(tmp_path / "killed"))


def test_turns_give_every_tenant_turns_in_proportion_to_its_weight_and_survive_a_restart():
    from rl_multilora.turns import TurnScheduler

    names = [f"t{i}" for i in range(10)]
    weights = {n: 2.0 if n == "t3" else 1.0 for n in names}
    turns = TurnScheduler(cap=3)
    counts = dict.fromkeys(names, 0)
    for _ in range(33):
        chosen = turns.pick(names, weights)
        assert len(chosen) == 3
        for n in chosen:
            counts[n] += 1
    assert counts["t3"] == 2 * min(counts.values()) and max(c for n, c in counts.items() if n != "t3") == 9
    restored = TurnScheduler(cap=3)
    restored.load_state_dict(turns.state_dict())
    assert restored.pick(names, weights) == turns.pick(names, weights)
    # a newcomer starts at the smallest pass: its turn comes within one round of the others, and it gets no backlog
    # of turns that would starve them
    rounds = [turns.pick([*names, "new"], weights) for _ in range(8)]
    assert "new" in [n for r in rounds[:4] for n in r]
    assert sum("new" in r for r in rounds) <= 3


def test_paging_config_errors_name_the_field_value_and_what_is_allowed():
    import pytest

    from rl_multilora.config import ConfigError, parse_run_config

    def problems(**over) -> str:
        cfg = {"model": {"path": "m", "max_loras": 4}, **over}
        with pytest.raises(ConfigError) as e:
            parse_run_config(cfg)
        return str(e.value)

    msg = problems(model={"path": "m", "max_loras": 4, "max_tenants": 2})
    assert "model.max_tenants=2 is not allowed; allowed: null or >= model.max_loras (4)" in msg
    msg = problems(model={"path": "m", "max_loras": 4, "max_tenants": 8}, trainer={"world_size": 2})
    assert "model.max_tenants=8 is not allowed" in msg and "trainer.world_size 1" in msg
    msg = problems(model={"path": "m", "max_loras": 4, "max_tenants": 8}, rollout={"engine": "sglang"})
    assert "model.max_tenants=8 is not allowed" in msg and "rollout.engine is 'embedded'" in msg
    msg = problems(model={"path": "m", "max_loras": 4, "host_budget_gb": 1.0})
    assert "model.host_budget_gb=1.0 is not allowed; allowed: null unless model.max_tenants > max_loras" in msg
    msg = problems(model={"path": "m", "max_loras": 4, "max_tenants": 8}, rollout={"max_tenants_per_step": 5})
    assert "rollout.max_tenants_per_step=5 is not allowed; allowed: null or <= model.max_loras (4)" in msg


def _spilling_store(spill_dir, budget: int = 1000):
    from rl_multilora.tenant_store import PagedTenant, TenantStore

    store = TenantStore(budget_bytes=budget, spill_dir=spill_dir)  # one tenant's 4 KiB is over it: all spill
    for i in range(3):
        store.put(f"t{i}", PagedTenant(8, 16.0, frozenset({"q"}), torch.full((1024,), float(i)), [], None))
    return store


def test_close_deletes_the_spill_files_and_a_folder_it_made_but_nothing_else(tmp_path):
    given = tmp_path / "paged"
    given.mkdir()
    (given / "notes.txt").write_text("the user's")
    store = _spilling_store(given)
    [own] = [p for p in given.iterdir() if p.is_dir()]  # a folder of its own inside the one given
    assert sorted(p.name for p in own.iterdir()) == [".owner.lock", "t0.pt", "t1.pt", "t2.pt"]
    assert store.disk_bytes > 0 and store.peek("t1").weights[0] == 1.0  # spilled, and read back from its file
    store.close()
    assert [p.name for p in given.iterdir()] == ["notes.txt"] and store.disk_bytes == 0

    empty = tmp_path / "empty"  # made by the store on its first spill: gone with its files
    _spilling_store(empty).close()
    assert not empty.exists()

    store = _spilling_store(None)  # a temporary folder of its own
    made = store._spill_dir
    assert made is not None and len(list(made.glob("*.pt"))) == 3
    store.close()
    assert not made.exists()


def test_a_store_removes_the_spill_folders_of_killed_runs_and_no_living_ones(tmp_path):
    """A run killed without `close` (SIGKILL, the OOM killer) left 3x its idle tenants' adapter bytes in
    `run_dir/paged` for good, and each killed-then-resumed run added a folder (a reviewer's repro). A new store
    removes the folders whose owner's lock is not held; a living store's folder stays."""
    import signal
    import subprocess
    import sys

    code = (
        "import os, signal, sys; from tests.test_paging import _spilling_store; "
        "s = _spilling_store(sys.argv[1]); print(s._spill_dir, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    killed = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert killed.returncode == -signal.SIGKILL, killed.stderr
    dead = Path(killed.stdout.strip())
    assert len(list(dead.glob("*.pt"))) == 3  # what the killed run left
    living = _spilling_store(tmp_path)  # this process's store: alive, its lock held
    assert not dead.exists()  # removed when the living store was made
    (tmp_path / "rl-multilora-paged-unlocked").mkdir()  # no lock file and fresh: maybe a store being made now
    again = _spilling_store(tmp_path)
    assert living.peek("t1").weights[0] == 1.0 and (tmp_path / "rl-multilora-paged-unlocked").is_dir()
    again.close()
    living.close()
    assert [p.name for p in tmp_path.iterdir()] == ["rl-multilora-paged-unlocked"]


def test_two_stores_given_one_spill_dir_never_read_each_others_tenants(tmp_path):
    """Spill files were `<spill_dir>/<name>.pt`: two runs given one scratch folder and a tenant name in common
    overwrote each other's, and one paged in the other's adapter and moments (a reviewer's repro)."""
    first, second = _spilling_store(tmp_path), _spilling_store(tmp_path)
    second.take("t1")  # the second run pages its t1 in (and deletes its spill file)
    assert first.take("t1").weights[0] == 1.0 and first.peek("t2").weights[0] == 2.0
    first.close()
    second.close()
    assert list(tmp_path.iterdir()) == []


def test_a_failed_spill_keeps_the_tenant_in_host_memory_and_a_page_in_loses_nobody(tmp_path, monkeypatch, caplog):
    """A full disk during a page-in's eviction lost three of four tenants: taken from the store, not yet in a
    slot (a reviewer's repro). A spill is a cache: one that fails leaves the tenant in host memory past the budget,
    with one warning, and every tenant's state is still there, bit for bit."""
    import errno
    import logging

    import rl_multilora.tenant_store as ts

    names = ["a", "b", "c", "d"]
    backend = _backend(2, 4, names, budget=None, spill=tmp_path / "spill")
    _train_in_turns(backend, names, steps=2, per_step=2)
    before = {n: _state(backend, n) for n in names}
    store, ops = backend.trainer.ops.store, backend.trainer.ops

    def disk_full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ts.torch, "save", disk_full)
    store.budget_bytes = 0  # every page-out is past the budget: it tries to spill, and the disk is full
    resident = ops.resident
    paged_out = [n for n in names if n not in resident]
    with caplog.at_level(logging.WARNING, logger="rl_multilora"):
        ops.ensure_resident(paged_out)  # the two resident ones are evicted onto the full disk
    assert sorted(ops.resident) == sorted(paged_out) and sorted(store.names) == sorted(resident)
    assert store.spilled() == [] and store.host_bytes > store.budget_bytes
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert "could not spill tenant" in caplog.records[0].getMessage()
    monkeypatch.undo()
    for n in names:
        _assert_same_state(before[n], _state(backend, n))


def test_removing_a_tenant_while_its_spilled_state_is_prefetched_does_not_deadlock(tmp_path):
    """`drop` waited for the prefetch while holding the store's lock, which the prefetch thread takes to read a
    spilled tenant back: remove_adapter hung for ever (a reviewer's repro, 3 of 3 runs)."""
    import threading
    import time

    store = _spilling_store(tmp_path, budget=0)

    def slow_prepare(paged):
        time.sleep(0.3)  # a device copy
        return paged

    assert store.stage(["t0", "t1"], slow_prepare) == ["t0", "t1"]
    done = threading.Event()
    threading.Thread(target=lambda: (store.drop("t1"), done.set()), daemon=True).start()
    assert done.wait(20), "drop blocked: deadlock"
    assert store.take("t0").weights[0] == 0.0 and "t1" not in store
    store.close()
