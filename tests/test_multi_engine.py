"""Several rollout engines (`rollout.num_engines`): the same results as one engine, every engine used, every sync
reaching all of them.

Oracles: one engine on the same requests (seeded sampling makes each row's output independent of its batch and
engine), and a whole GRPO run with one engine against the same run with two (rewards and final adapters).
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from rl_multilora.checkpoint import CheckpointManager
from rl_multilora.config import ConfigError, parse_run_config
from rl_multilora.loop import run
from rl_multilora.lora import MultiLoRAModel
from rl_multilora.metrics import read_metrics
from rollout.engines.embedded import EmbeddedEngine
from rollout.engines.multi import MultiEngine
from rollout.types import GenerateRequest, SamplingParams
from tests.tiny_models import save_tiny_model, sum_task_adapter, tiny_model, tiny_tokenizer, write_sum_task

PROMPTS = [[5, 17, 33, 48, 9, 71], [12, 40], [3, 99, 64, 21], [88, 7, 7]]


@pytest.fixture
def model() -> MultiLoRAModel:
    m = MultiLoRAModel.from_model(tiny_model(), max_loras=3, max_rank=8)
    for i, name in enumerate(("a", "b")):
        m.add_adapter(name, rank=4, alpha=8, seed=i)
        with torch.no_grad():
            for b in m.adapter_parameters(name)[1::2]:
                b.normal_(0, 0.2, generator=torch.Generator().manual_seed(10 + i))
    return m


def _requests() -> list[GenerateRequest]:
    """Four prompt groups of 3 samples each (adapters a, b, base, a), seeded, then greedy rows."""
    out = []
    for g, (prompt, adapter) in enumerate(zip(PROMPTS, ["a", "b", None, "a"], strict=True)):
        for k in range(3):
            out.append(
                GenerateRequest(prompt, adapter, SamplingParams(temperature=1.0, max_new_tokens=8, seed=g * 10 + k))
            )
    out += [GenerateRequest(p, "b", SamplingParams(temperature=0.0, max_new_tokens=8)) for p in PROMPTS]
    return out


def _load(engine, model: MultiLoRAModel, version: int) -> None:
    engine.pause()
    for name in ("a", "b"):
        assert (
            engine.load_adapter(name, model.adapter_state_dict(name), model.peft_config(name), version=version)
            == version
        )
    engine.resume()


def test_two_engines_give_one_engines_results_and_share_the_work(model):
    one = EmbeddedEngine(model, tiny_tokenizer())
    two = MultiEngine([EmbeddedEngine(model, tiny_tokenizer()) for _ in range(2)])
    try:
        _load(one, model, 3)
        _load(two, model, 3)
        assert two.engine_adapter_versions() == [{"a": 3, "b": 3}] * 2  # the sync reached both engines
        requests = _requests()
        expected = one.generate(requests)
        got = two.generate(requests)
        assert [r.output_ids for r in got] == [r.output_ids for r in expected]
        assert [r.weight_version for r in got] == [r.weight_version for r in expected]
        assert all(n > 0 for n in two.served)  # both engines served, groups kept whole (runs of 3, then 1s)

        async def by_group():  # GenerateState's way: one agenerate call per prompt group, all at once
            groups = [requests[i : i + 3] for i in range(0, 12, 3)] + [[r] for r in requests[12:]]
            return await asyncio.gather(*(two.agenerate(g) for g in groups))

        before = two.served
        flat = [r for group in asyncio.run(by_group()) for r in group]
        assert [r.output_ids for r in flat] == [r.output_ids for r in expected]
        assert all(after > b for after, b in zip(two.served, before, strict=True))

        # a later sync reaches both: new weights and versions on each, and outputs follow them
        with torch.no_grad():
            model.adapter_parameters("b")[1].add_(0.5)
        _load(one, model, 4)
        _load(two, model, 4)
        assert two.adapter_versions() == {"a": 4, "b": 4} and two.engine_adapter_versions() == [{"a": 4, "b": 4}] * 2
        again, again_one = two.generate(requests), one.generate(requests)
        assert [r.output_ids for r in again] == [r.output_ids for r in again_one]
        assert {r.weight_version for r in again[12:]} == {4}
        two.pause()
        two.unload_adapter("a")
        two.resume()
        assert two.engine_adapter_versions() == [{"b": 4}] * 2
    finally:
        one.close()
        two.close()


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("multi_engine")
    save_tiny_model(root / "model", hidden=32, layers=2)
    write_sum_task(root / "data" / "t1.jsonl", 40, 1)
    write_sum_task(root / "data" / "t2.jsonl", 40, 3)
    return root


def _config(root: Path, run_dir: Path, num_engines: int) -> dict:
    return {
        "run_dir": str(run_dir),
        "model": {"path": str(root / "model"), "max_loras": 2, "max_rank": 8},
        "rollout": {"n_samples_per_prompt": 4, "max_new_tokens": 6, "num_engines": num_engines},
        "grpo": {"micro_batch_size": 8, "drop_uniform_groups": False},
        "checkpoint": {"save_every": 3},
        "logging": {"plot": False, "progress": False},
        "rewards": {"num_workers": 1},
        "adapters": [
            sum_task_adapter(root / "data", "t1", 7, max_steps=3),
            sum_task_adapter(root / "data", "t2", 11, rank=8, max_steps=3),
        ],
    }


def test_a_run_with_two_engines_matches_one_engine(workspace, tmp_path):
    runs = {n: tmp_path / f"engines_{n}" for n in (1, 2)}
    for n, run_dir in runs.items():
        rt = run(parse_run_config(_config(workspace, run_dir, n)))
        if n == 2:
            assert isinstance(rt.engine, MultiEngine) and all(s > 0 for s in rt.engine.served)

    def series(run_dir):
        return [
            (r["adapter"], r["adapter_step"], r["reward_mean"], r["weight_version"]) for r in read_metrics(run_dir)
        ]

    assert series(runs[2]) == series(runs[1])
    for name in ("t1", "t2"):
        got = load_file(str(CheckpointManager(runs[2]).latest(name) / "adapter_model.safetensors"))
        want = load_file(str(CheckpointManager(runs[1]).latest(name) / "adapter_model.safetensors"))
        for key in want:
            torch.testing.assert_close(got[key], want[key], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    ("rollout", "fragment"),
    [
        ({"engine": "http", "num_engines": 2, "urls": ["http://127.0.0.1:1"]}, "rollout.urls=['http://127.0.0.1:1']"),
        ({"engine": "embedded", "urls": ["http://127.0.0.1:1"]}, "null unless engine is 'http'"),
        ({"engine": "sglang", "num_engines": 2}, "rollout.num_engines=2 is not allowed"),
        ({"num_engines": 0}, "num_engines"),
        ({"trainer": {"colocate_engines": True}}, "trainer.colocate_engines=True is not allowed"),
        (
            {"engine_actors": True, "trainer": {"world_size": 2, "colocate_engines": True}, "num_engines": 3},
            "rollout.num_engines=3 is not allowed; allowed: at most trainer.world_size (2)",
        ),
        ({"trainer": {"world_size": 2, "colocate_engines": True}}, "rollout.engine_actors is true"),
    ],
)
def test_engine_count_errors_name_the_field(workspace, tmp_path, rollout, fragment):
    cfg = _config(workspace, tmp_path / "x", 1)
    rollout = dict(rollout)
    trainer = rollout.pop("trainer", None)
    if trainer:
        cfg["trainer"] = trainer
    cfg["rollout"].update(rollout)
    with pytest.raises(ConfigError) as err:
        parse_run_config(cfg)
    assert fragment in str(err.value)


@pytest.fixture
def local_ray():
    ray = pytest.importorskip("ray")
    if not ray.is_initialized():
        ray.init(address="local", include_dashboard=False, configure_logging=False, log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.mark.ray
@pytest.mark.timeout(900)
def test_engines_as_ray_actors_match_in_process_engines(workspace, tmp_path, local_ray, model):
    """Two engines in their own actor processes, each loading the base from the folder: the same outputs and
    versions as an in-process engine, every sync reaching both; then a whole run with them matches one engine."""
    from rl_multilora.components import build_embedded_engine
    from rl_multilora.config import ModelConfig
    from rollout.engines.ray_engine import RayEngine

    folder = workspace / "model"  # save_tiny_model(seed 0): the same weights as tiny_model()
    build = (build_embedded_engine, ModelConfig(path=str(folder), max_loras=3, max_rank=8))
    actors = MultiEngine([RayEngine(build) for _ in range(2)])
    local = EmbeddedEngine(model, tiny_tokenizer())
    try:
        _load(actors, model, 5)
        _load(local, model, 5)
        assert actors.engine_adapter_versions() == [{"a": 5, "b": 5}] * 2
        requests = _requests()

        async def by_group():
            groups = [requests[i : i + 3] for i in range(0, 12, 3)] + [[r] for r in requests[12:]]
            return await asyncio.gather(*(actors.agenerate(g) for g in groups))

        got = [r for group in asyncio.run(by_group()) for r in group]
        want = local.generate(requests)
        assert [r.output_ids for r in got] == [r.output_ids for r in want]
        assert [r.weight_version for r in got] == [r.weight_version for r in want]
        assert all(n > 0 for n in actors.served)
    finally:
        actors.close()
        local.close()

    cfg = _config(workspace, tmp_path / "actors", 2)
    cfg["rollout"]["engine_actors"] = True
    run(parse_run_config(cfg))
    reference = tmp_path / "one"
    run(parse_run_config(_config(workspace, reference, 1)))
    series = [
        [(r["adapter"], r["adapter_step"], r["reward_mean"], r["weight_version"]) for r in read_metrics(d)]
        for d in (tmp_path / "actors", reference)
    ]
    assert series[0] == series[1]
