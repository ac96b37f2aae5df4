"""Trainer ranks on Ray (`trainer.world_size: 2`, the base sharded by FSDP2 over gloo on CPU) against one process.

A short GRPO run of two tenants with 2 ranks gives the same rewards and, within float tolerance, the same final
adapters as with 1 rank; the ranks hold half of every parameter and nothing on meta; the weight sync gathers LoRA
slot bytes only; a run resumes with another world size (2 -> 1 and 1 -> 2) and ends where an uninterrupted run
ends. AdamW eps is 1e-3 here: with 1e-8 Adam turns float-noise grads into lr-sized moves (tests/test_fsdp.py).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import parse_run_config
from rl_multilora.loop import run
from rl_multilora.metrics import read_metrics
from tests.tiny_models import save_tiny_model, sum_task_adapter, write_sum_task

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("ray_trainer")
    save_tiny_model(root / "model", hidden=32, layers=2)
    write_sum_task(root / "data" / "t1.jsonl", 40, 1)
    write_sum_task(root / "data" / "t2.jsonl", 40, 3)
    return root


@pytest.fixture(scope="module")
def local_ray():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


def _config(root: Path, run_dir: Path, world_size: int, **over) -> dict:
    optim = {"eps": 1e-3}
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": 2, "max_rank": 8, "device": "cpu"},
        "trainer": {"world_size": world_size},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6},
        "grpo": {"micro_batch_size": 3, "drop_uniform_groups": False},
        "checkpoint": {"save_every": 2},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [
            sum_task_adapter(root / "data", "t1", 7, max_steps=4, optim=optim),
            sum_task_adapter(root / "data", "t2", 11, rank=8, max_steps=4, optim=optim),
        ],
        **over,
    }


def _series(run_dir: Path) -> list[tuple]:
    return [(r["adapter"], r["adapter_step"], r["reward_mean"], r["weight_version"]) for r in read_metrics(run_dir)]


def _assert_same_adapters(run_dir: Path, reference: Path) -> None:
    for name in ("t1", "t2"):
        got = load_file(str(CheckpointManager(run_dir).latest(name) / "adapter_model.safetensors"))
        want = load_file(str(CheckpointManager(reference).latest(name) / "adapter_model.safetensors"))
        assert sorted(got) == sorted(want)
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-6, msg=f"{name} {key}")


@pytest.fixture(scope="module")
def one_rank(workspace, tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("one") / "run"
    run(parse_run_config(_config(workspace, run_dir, 1)))
    return run_dir


def test_two_ranks_train_like_one_and_sync_moves_lora_bytes_only(workspace, one_rank, local_ray, tmp_path):
    from rl_multilora.backends.fsdp import adapter_slot_bytes
    from rl_multilora.backends.ray_fsdp import RayFSDPBackend
    from rl_multilora.lora import MultiLoRAModel

    backend = run(parse_run_config(_config(workspace, tmp_path / "two", 2))).backend
    assert isinstance(backend, RayFSDPBackend) and backend.world_size == 2
    for info in backend.rank_info:  # each rank: half of every sharded parameter, nothing on meta
        assert info["meta"] == []
    for name, shape in backend.rank_info[0]["shards"].items():
        other = backend.rank_info[1]["shards"][name]
        assert shape[1:] == other[1:] and abs(shape[0] - other[0]) <= 1, name
    gathered = backend.gathered_bytes
    assert _series(tmp_path / "two") == _series(one_rank)
    _assert_same_adapters(tmp_path / "two", one_rank)
    # t2 sits in slot 1, held by rank 1: every sync of t2 moved exactly its slot rows, never the base
    probe = MultiLoRAModel.from_pretrained(workspace / "model", max_loras=2, max_rank=8)
    probe.add_adapter("t1", rank=4, alpha=8)
    probe.add_adapter("t2", rank=8, alpha=8)
    slot_bytes = adapter_slot_bytes(probe, "t2")
    base_bytes = sum(p.numel() * p.element_size() for n, p in probe.named_parameters() if "lora_" not in n)
    versions = max(r["weight_version"] for r in read_metrics(tmp_path / "two") if r["adapter"] == "t2")
    assert gathered > 0 and gathered % slot_bytes == 0 and gathered // slot_bytes >= versions
    logged = sum(r["bytes_gathered"] for r in read_metrics(tmp_path / "two") if r["adapter"] == "t2")
    assert 0 < logged <= gathered and logged % slot_bytes == 0  # the metrics count the sync's share (not checkpoints)
    assert slot_bytes < base_bytes


@pytest.mark.parametrize(("first", "then"), [(2, 1), (1, 2)])
def test_resume_with_another_world_size_ends_like_an_uninterrupted_run(
    workspace, one_rank, local_ray, tmp_path, first, then
):
    run_dir = tmp_path / "run"
    run(parse_run_config(_config(workspace, run_dir, first, max_global_steps=2)))
    run(parse_run_config(_config(workspace, run_dir, then)))
    assert _series(run_dir) == _series(one_rank)
    _assert_same_adapters(run_dir, one_rank)


def test_colocated_engines_share_the_ranks_bundles_and_train_like_one_rank(
    workspace, one_rank, local_ray, tmp_path, monkeypatch
):
    """`trainer.colocate_engines`: the engine actors land in the trainer ranks' placement group, each bundle taken
    by one rank and one engine (half of it each, so both bundles are exactly full), and the run still gives the
    one-rank run's rewards and adapters."""
    from rl_multilora import components
    from rl_multilora.loop import Runtime

    cfg = _config(workspace, tmp_path / "colocated", 2, trainer={"world_size": 2, "colocate_engines": True})
    cfg["rollout"].update(engine_actors=True, num_engines=2)
    built = []  # models the driver builds (the engine actors build theirs in their own processes)
    real_build_model = components.build_model
    monkeypatch.setattr(components, "build_model", lambda *a, **k: built.append(a) or real_build_model(*a, **k))
    rt = Runtime.build(parse_run_config(cfg))
    try:
        ranks = rt.backend.rank_placement()
        engines = [e.placement() for e in rt.engine.engines]
        pg = ranks[0]["pg"]
        assert pg is not None and all(p["pg"] == pg for p in ranks + engines)
        assert all(p["resources"] == {"CPU": 0.5} for p in ranks + engines)
        assert len({p["node"] for p in ranks + engines}) == 1
        left = local_ray.available_resources()
        assert all(left.get(f"CPU_group_{i}_{pg}", 0) == 0 for i in range(2)), left  # one rank + one engine each
        rt.start()
        while not rt.finished():
            rt.step()
        assert built == [] and rt.backend.shared_model is None  # the driver never loaded an unsharded copy
    finally:
        rt.close()
    assert _series(tmp_path / "colocated") == _series(one_rank)
    _assert_same_adapters(tmp_path / "colocated", one_rank)


def test_async_mode_with_engine_actors_and_two_ranks(workspace, local_ray, tmp_path):
    """rollout.mode async on Ray: two engine actors generate the next step while two trainer ranks train; every
    publish goes to the actors without a pause, samples lag at most one version, and both tenants spend their
    budgets with every adapter step logged once."""
    from rl_multilora.loop import Runtime

    cfg = _config(workspace, tmp_path / "async", 2, trainer={"world_size": 2, "colocate_engines": True})
    cfg["rollout"].update(engine_actors=True, num_engines=2, mode="async")  # 2 CPUs: ranks and engines share
    rt = Runtime.build(parse_run_config(cfg))
    try:
        assert rt.engine.publishes_without_pause
        rt.start()
        while not rt.finished():
            rt.step()
        assert rt.weight_sync.pauses == 0
    finally:
        rt.close()
    rows = [r for r in read_metrics(tmp_path / "async") if r.get("kind") != "eval"]
    for name in ("t1", "t2"):
        mine = [r for r in rows if r["adapter"] == name]
        assert [r["adapter_step"] for r in mine] == [1, 2, 3, 4]
        assert all(0 <= r["version_lag_max"] <= 1 and r["stale_samples"] == 0 for r in mine)
    assert any(r["version_lag_max"] == 1 for r in rows)  # the rollout ran ahead of training
