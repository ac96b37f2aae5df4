"""The multi-LoRA model sharded with FSDP2 over 2 ranks (gloo on CPU), against the same model unsharded.

Each rank is a process (`torch.multiprocessing.spawn`). Checked: only rank 0 opens the weight files (counted), nothing
is left on meta, each rank holds half of every sharded parameter (base and LoRA slots), adapters added or loaded on
the sharded model give the unsharded model's logits and LoRA gradients in a mixed batch (each rank its own half of
the rows: the reduce-scatter must sum them), and an adapter's export moves only its slot's bytes and equals the
unsharded export.
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tests.tiny_models import MOE_EXPERTS, save_tiny_model

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def _gloo(rank: int, world: int, port: int):
    """This process as `rank` of a gloo group of `world` on this host, one intra-op thread, torn down after."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    torch.set_num_threads(1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def _worker(rank: int, folder: str, port: int, out_dir: str, moe: bool) -> None:
    with _gloo(rank, WORLD, port):
        _check(rank, Path(folder), Path(out_dir), moe)


def _check(rank: int, folder: Path, out_dir: Path, moe: bool) -> None:
    import transformers.modeling_utils as modeling_utils
    from torch.distributed.device_mesh import init_device_mesh

    from rl_multilora.backends.fsdp import adapter_slot_bytes, gather_adapter_state_dict, load_sharded, meta_tensors
    from rl_multilora.lora import MultiLoRAModel

    opened = []
    real_open = modeling_utils.safe_open
    modeling_utils.safe_open = lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1]
    params = MOE_EXPERTS if moe else None
    mesh = init_device_mesh("cpu", (WORLD,))
    model = load_sharded(folder, mesh, max_loras=4, max_rank=8, target_parameters=params)
    modeling_utils.safe_open = real_open
    reads = [None] * WORLD
    dist.all_gather_object(reads, len(opened))

    shards = {}
    for name, p in model.named_parameters():
        local = p.to_local()
        shards[name] = [local.shape[0], p.shape[0]]
    report = {"reads": reads, "meta": meta_tensors(model), "shards": shards}

    ref = MultiLoRAModel.from_pretrained(folder, max_loras=4, max_rank=8, target_parameters=params)
    for m in (model, ref):  # the same adapters: seeded inits, and b loaded from the other's export
        m.add_adapter("a", rank=4, alpha=8, seed=1)  # slot 0, on rank 0
        m.add_adapter("x", rank=2, alpha=2, seed=4)  # slot 1, on rank 0
    ref.add_adapter("b", rank=8, alpha=16, seed=2)  # slot 2, on rank 1: its export has to move
    with torch.no_grad():
        for p in ref.adapter_parameters("b")[1::2]:  # B non-zero, so the adapter changes the output
            p.normal_(0, 0.1, generator=torch.Generator().manual_seed(3))
    model.load_adapter_state_dict("b", ref.adapter_state_dict("b"), ref.peft_config("b"))

    ids = torch.randint(3, 100, (4, 6), generator=torch.Generator().manual_seed(0))
    names = ["a", "b", None, "b"]
    mine = slice(2 * rank, 2 * rank + 2)  # each rank its half of the rows
    out = model(ids[mine], adapter_names=names[mine]).logits
    want = ref(ids, adapter_names=names).logits
    torch.testing.assert_close(out, want[mine], rtol=1e-5, atol=1e-5)
    out.float().sum().div(want.numel()).backward()  # each rank's share of the mean: the ranks' grads are summed
    want.float().mean().backward()
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters(), strict=True):
        if "lora_" in name:
            torch.testing.assert_close(p.grad.full_tensor(), q.grad, rtol=1e-5, atol=1e-6, msg=name)

    state, received = gather_adapter_state_dict(model, "b", dst=0)
    if rank == 0:
        expected = ref.adapter_state_dict("b")
        assert sorted(state) == sorted(expected)
        for key in expected:
            torch.testing.assert_close(state[key], expected[key], rtol=0, atol=0)
        report["received"] = received
        report["slot_bytes"] = adapter_slot_bytes(model, "b")
        report["slot_b"] = model.slot_of("b")
    (out_dir / f"rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize("moe", [False, True], ids=["dense", "moe_experts"])
@pytest.mark.timeout(300)
def test_two_ranks_shard_load_once_and_match_the_unsharded_model(tmp_path, moe):
    folder = save_tiny_model(tmp_path / "model", family="qwen3_moe" if moe else "qwen2")
    mp.spawn(_worker, args=(str(folder), _free_port(), str(tmp_path), moe), nprocs=WORLD, join=True)
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)]
    assert reports[0]["reads"][0] >= 1 and reports[0]["reads"][1:] == [0]  # only rank 0 opened weight files
    for report in reports:
        assert report["meta"] == []
        for name, (local, full) in report["shards"].items():
            assert local == -(-full // WORLD) or local == full - -(-full // WORLD), name  # half of dim 0 each
    assert all(sum(r["shards"][n][0] for r in reports) == reports[0]["shards"][n][1] for n in reports[0]["shards"])
    # b's slot (2 of 4, 2 per rank) lives on rank 1: its export moved exactly its slot's LoRA bytes to rank 0
    first = reports[0]
    assert first["slot_b"] == 2 and first["received"] == first["slot_bytes"] > 0


def _node_worker(rank: int, world: int, nodes: list[list[int]], folder: str, port: int, out_dir: str) -> None:
    """Load the model sharded over `world` ranks that `nodes` groups into nodes; report the weight-file reads and
    whether every gathered parameter equals the unsharded model's."""
    import transformers.modeling_utils as modeling_utils
    from torch.distributed.device_mesh import init_device_mesh

    from rl_multilora.backends.fsdp import load_sharded, meta_tensors
    from rl_multilora.lora import MultiLoRAModel

    with _gloo(rank, world, port):
        opened = []
        real_open = modeling_utils.safe_open
        modeling_utils.safe_open = lambda path, *a, **k: (opened.append(str(path)), real_open(path, *a, **k))[1]
        model = load_sharded(Path(folder), init_device_mesh("cpu", (world,)), 4, 8, node_ranks=nodes)
        modeling_utils.safe_open = real_open
        reads = [None] * world
        dist.all_gather_object(reads, len(opened))
        ref = dict(MultiLoRAModel.from_pretrained(folder, max_loras=4, max_rank=8).named_parameters())
        ref_buffers = dict(MultiLoRAModel.from_pretrained(folder, max_loras=4, max_rank=8).named_buffers())
        mismatched = [n for n, p in model.named_parameters() if not torch.equal(p.full_tensor(), ref[n].detach())]
        mismatched += [n for n, b in model.named_buffers() if not torch.equal(b, ref_buffers[n])]
        report = {"reads": reads, "meta": meta_tensors(model), "mismatched": mismatched}
        (Path(out_dir) / f"node_rank{rank}.json").write_text(json.dumps(report))


@pytest.mark.parametrize(
    ("world", "nodes", "readers"),
    [(2, [[0, 1]], [0]), (2, [[0], [1]], [0, 1]), (4, [[0, 1], [2, 3]], [0, 2]), (3, [[0, 2], [1]], [0, 1])],
    ids=["1node_x2", "2nodes_x1", "2nodes_x2", "uneven"],
)
@pytest.mark.timeout(300)
def test_weights_are_read_once_per_node_and_every_shard_is_exact(tmp_path, world, nodes, readers):
    """Only the first rank of each node opens the weight files; each rank's shard (scattered within its node) and
    every buffer equal the unsharded model's, bit for bit, and nothing stays on meta. 3 ranks: the last shard of
    every 4-slot / odd-sized dim is short or empty."""
    folder = save_tiny_model(tmp_path / "model")
    mp.spawn(_node_worker, args=(world, nodes, str(folder), _free_port(), str(tmp_path)), nprocs=world, join=True)
    reports = [json.loads((tmp_path / f"node_rank{r}.json").read_text()) for r in range(world)]
    reads = reports[0]["reads"]
    assert [r for r in range(world) if reads[r] > 0] == readers, reads
    for report in reports:
        assert report["meta"] == [] and report["mismatched"] == []


def _train_worker(rank: int, folder: str, port: int, out_dir: str) -> None:
    with _gloo(rank, WORLD, port):
        from torch.distributed.device_mesh import init_device_mesh

        from rl_multilora.backends.fsdp import gather_adapter_state_dict, load_sharded

        model = load_sharded(Path(folder), init_device_mesh("cpu", (WORLD,)), max_loras=4, max_rank=16)
        stats, state = _train(model)
        gathered = {name: gather_adapter_state_dict(model, name)[0] for name in TENANTS}
        if rank == 0:
            torch.save({"stats": stats, "state": gathered}, Path(out_dir) / "sharded.pt")


TENANTS = {"a": (4, 11), "b": (8, 22), "c": (16, 33)}  # name -> (rank, seed), as tests/test_trainer.py


def _train(model):
    """Three tenants (ranks 4/8/16), two GRPO steps of 2 PPO epochs on a mixed batch, one tenant clipped hard."""
    from rl_multilora.config import GRPOSettings, OptimSettings
    from rl_multilora.trainer import MultiLoRATrainer
    from tests.test_trainer import random_samples

    trainer = MultiLoRATrainer(model, GRPOSettings(micro_batch_size=3, ppo_epochs=2), pad_token_id=0)
    for name, (r, seed) in TENANTS.items():
        model.add_adapter(name, rank=r, alpha=2 * r, seed=seed)
        clip = {"max_grad_norm": 1e-3} if name == "b" else {}
        # eps 1e-3: an element whose grad is float noise moves by noise, not by lr (Adam divides by |grad| + eps)
        trainer.add_adapter(name, OptimSettings(weight_decay=0.01, eps=1e-3, **clip), lr=1e-2)
    samples = [s for i, name in enumerate(TENANTS) for s in random_samples(name, 2, 4, seed=i)]
    stats = []
    for _ in range(2):
        out = trainer.train_step(samples)
        stats.append({n: (s.loss, s.grad_norm, s.n_steps, s.entropy, s.n_tokens) for n, s in out.items()})
    return stats, None


@pytest.mark.timeout(300)
def test_two_ranks_train_like_one(tmp_path):
    """The same GRPO steps on 2 sharded ranks (rows split between them) and on one unsharded model: the same
    per-tenant losses, grad norms (clipping included), step counts and final adapters, within float tolerance."""
    from rl_multilora.lora import MultiLoRAModel

    folder = save_tiny_model(tmp_path / "model")
    mp.spawn(_train_worker, args=(str(folder), _free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    sharded = torch.load(tmp_path / "sharded.pt", weights_only=True)
    ref = MultiLoRAModel.from_pretrained(folder, max_loras=4, max_rank=16)
    ref_stats, _ = _train(ref)
    for got, want in zip(sharded["stats"], ref_stats, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            (loss, norm, steps, ent, ntok), (loss_r, norm_r, steps_r, ent_r, ntok_r) = got[name], want[name]
            assert (steps, ntok) == (steps_r, ntok_r) and steps == 2
            assert loss == pytest.approx(loss_r, rel=1e-4, abs=1e-6) and ent == pytest.approx(ent_r, rel=1e-5)
            assert norm == pytest.approx(norm_r, rel=1e-4)
    for name in TENANTS:
        want = ref.adapter_state_dict(name)
        for key, tensor in want.items():
            torch.testing.assert_close(sharded["state"][name][key], tensor, rtol=1e-4, atol=1e-6, msg=key)


HARD = {"n": (2, 5), "a": (4, 11), "b": (4, 22)}  # name -> (rank, seed); added in this order: slots 0, 1, 2


def _train_hard(model, max_loras: int = 3):
    """Three tenants, three PPO epochs with a KL term, micro-batches of 2: `n` has NaN weights (every step skipped),
    `a` may take one step (it leaves after the first epoch, so the rows left are re-dealt unevenly and a short rank
    runs zero-weight filler steps), `b` (rank 4 < max_rank 8) sits in slot 2, which rank 1 holds."""
    from rl_multilora.config import GRPOSettings, OptimSettings
    from rl_multilora.trainer import MultiLoRATrainer
    from tests.test_trainer import random_samples

    settings = GRPOSettings(micro_batch_size=2, ppo_epochs=3, kl_coef=0.05, kl_type="k3")
    trainer = MultiLoRATrainer(model, settings, pad_token_id=0)
    for name, (r, seed) in HARD.items():
        model.add_adapter(name, rank=r, alpha=2 * r, seed=seed)
        trainer.add_adapter(name, OptimSettings(eps=1e-3), lr=1e-2)
    with torch.no_grad():
        for p in model.adapter_parameters("n"):
            p.fill_(float("nan"))
    samples = [s for i, name in enumerate(HARD) for s in random_samples(name, 2, 3 + i, seed=10 + i)]
    stats = []
    for _ in range(2):
        out = trainer.train_step(samples, max_steps={"a": 1})
        stats.append({n: (s.loss, s.grad_norm, s.n_steps, s.skipped_nonfinite, s.n_tokens) for n, s in out.items()})
    return stats


def _hard_worker(rank: int, folder: str, port: int, out_dir: str) -> None:
    with _gloo(rank, WORLD, port):
        from torch.distributed.device_mesh import init_device_mesh

        from rl_multilora.backends.fsdp import adapter_slot_bytes, gather_adapter_state_dict, load_sharded

        model = load_sharded(Path(folder), init_device_mesh("cpu", (WORLD,)), max_loras=3, max_rank=8)
        stats = _train_hard(model)
        gathered = {name: gather_adapter_state_dict(model, name) for name in ("a", "b")}
        if rank == 0:
            torch.save(
                {
                    "stats": stats,
                    "state": {name: g[0] for name, g in gathered.items()},
                    "received": gathered["b"][1],
                    "b_bytes": adapter_slot_bytes(model, "b"),
                },
                Path(out_dir) / "hard.pt",
            )


@pytest.mark.timeout(300)
def test_two_ranks_match_one_with_kl_a_tenant_leaving_mid_batch_and_a_diverged_tenant(tmp_path):
    """The paths where ranks could fall out of step: a tenant whose budget ends after the first epoch (rows re-dealt,
    filler steps on a short rank, reference log-probs needed in later epochs), a tenant whose loss is NaN on every
    step (its backward still joins the collectives), 3 slots over 2 ranks, and an export of a rank-4 adapter from
    rank 1 that moves only its true-rank bytes. Everything equals the one-process run."""
    from rl_multilora.lora import MultiLoRAModel

    folder = save_tiny_model(tmp_path / "model")
    mp.spawn(_hard_worker, args=(str(folder), _free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    sharded = torch.load(tmp_path / "hard.pt", weights_only=True)
    ref = MultiLoRAModel.from_pretrained(folder, max_loras=3, max_rank=8)
    ref_stats = _train_hard(ref)
    for got, want in zip(sharded["stats"], ref_stats, strict=True):
        assert got.keys() == want.keys()
        assert got["n"][2:4] == (0, True) and got["a"][2] == 1 and got["b"][2] == 3
        assert got["n"][1] is want["n"][1] is None  # no backward reached it: no grad norm, as in one process
        for name in ("a", "b"):
            (loss, norm, *rest), (loss_r, norm_r, *rest_r) = got[name], want[name]
            assert rest == rest_r
            assert loss == pytest.approx(loss_r, rel=1e-4, abs=1e-6) and norm == pytest.approx(norm_r, rel=1e-4)
    for name in ("a", "b"):
        for key, tensor in ref.adapter_state_dict(name).items():
            torch.testing.assert_close(sharded["state"][name][key], tensor, rtol=1e-4, atol=1e-6, msg=key)
    b_true_rank = sum(t.numel() * t.element_size() for t in ref.adapter_state_dict("b").values())
    assert sharded["received"] == sharded["b_bytes"] == b_true_rank  # rank 4 of max_rank 8: half the slot


def _train_uneven(model):
    """Slot 0 (`a`, rank 0's) and slot 1 (`b`, rank 1's); one long `b` row outweighs the five short ones, so the token
    balance gives rank 0 that row alone and rank 1 the rest: rank 0 runs zero-weight filler micro-batches (on a `b`
    row) while rank 1 trains `a`, whose gradients the reduce-scatter hands rank 0."""
    from rl_multilora.config import GRPOSettings, OptimSettings
    from rl_multilora.trainer import MultiLoRATrainer
    from tests.test_trainer import sample

    trainer = MultiLoRATrainer(model, GRPOSettings(micro_batch_size=1, ppo_epochs=1), pad_token_id=0)
    for name, seed in (("a", 1), ("b", 2)):
        model.add_adapter(name, rank=4, alpha=8, seed=seed)
        trainer.add_adapter(name, OptimSettings(eps=1e-3), lr=1e-2)
    rows = [sample("b", 0, 1.0, prompt=[5, 6], response=list(range(10, 70))), sample("b", 0, 0.0, prompt=[5, 6])]
    rows += [sample("a", 0, float(i % 2), prompt=[7, 8], response=[20 + i, 30 + i]) for i in range(4)]
    return {n: (s.grad_norm, s.n_steps) for n, s in trainer.train_step(rows).items()}


def _uneven_worker(rank: int, folder: str, port: int, out_dir: str) -> None:
    with _gloo(rank, WORLD, port):
        from torch.distributed.device_mesh import init_device_mesh

        from rl_multilora.backends.fsdp import gather_adapter_state_dict, load_sharded

        model = load_sharded(Path(folder), init_device_mesh("cpu", (WORLD,)), max_loras=2, max_rank=4)
        stats = _train_uneven(model)
        gathered = {name: gather_adapter_state_dict(model, name)[0] for name in ("a", "b")}
        if rank == 0:
            torch.save({"stats": stats, "state": gathered}, Path(out_dir) / "uneven.pt")


@pytest.mark.timeout(300)
def test_a_rank_running_filler_micro_batches_keeps_the_other_tenants_gradients(tmp_path):
    """A reviewer's case: the filler call kept only its own row's tenant's gradient, so `a` (trained on rank 1,
    slot on rank 0) got grad norm 0 and did not move, while its step count still rose. Now it matches one process."""
    from rl_multilora.lora import MultiLoRAModel

    folder = save_tiny_model(tmp_path / "model")
    mp.spawn(_uneven_worker, args=(str(folder), _free_port(), str(tmp_path)), nprocs=WORLD, join=True)
    sharded = torch.load(tmp_path / "uneven.pt", weights_only=True)
    ref = MultiLoRAModel.from_pretrained(folder, max_loras=2, max_rank=4)
    want = _train_uneven(ref)
    assert sharded["stats"].keys() == want.keys() == {"a", "b"}
    for name, (norm, steps) in want.items():
        assert norm > 0 and steps == 1
        assert sharded["stats"][name][0] == pytest.approx(norm, rel=1e-4) and sharded["stats"][name][1] == steps
        for key, tensor in ref.adapter_state_dict(name).items():
            torch.testing.assert_close(sharded["state"][name][key], tensor, rtol=1e-4, atol=1e-6, msg=key)
