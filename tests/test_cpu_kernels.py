"""The C kernels for the LoRA's rank-wide products on CPU (`rl_multilora/lora/cpu_kernels.c`) against a float64
oracle, their bit-for-bit independence of threads, row length and batch mates, the layer on them against the torch
path, and the build's fallbacks (no compiler, switched off, cached)."""

from __future__ import annotations

import warnings

import pytest
import torch
from tiny_models import tiny_model

from rl_multilora.lora import MultiLoRAModel, cpu_kernels
from rl_multilora.lora import layer as layer_mod

needs_kernels = pytest.mark.skipif(
    not cpu_kernels.usable(torch.zeros(1)), reason="no C compiler or no AVX2 here: the layer keeps its torch path"
)


def _problem(n, length, fan_in, fan_out, r, slots, seed=0):
    g = torch.Generator().manual_seed(seed)
    s = max(slots) + 2
    return dict(
        x=torch.randn(n, length, fan_in, generator=g, dtype=torch.float64),
        y=torch.randn(n, length, fan_out, generator=g, dtype=torch.float64),
        grad=torch.randn(n, length, fan_out, generator=g, dtype=torch.float64),
        a=torch.randn(s, r, fan_in, generator=g, dtype=torch.float64),
        b=torch.randn(s, fan_out, r, generator=g, dtype=torch.float64),
        slots=torch.tensor(slots),
        scales=torch.rand(n, generator=g, dtype=torch.float64) + 0.5,
    )


def _oracle(p):
    """The float64 math: forward delta, xa, the input gradient, and the per-slot A and B gradients."""
    a, b, s = p["a"][p["slots"]], p["b"][p["slots"]], p["scales"].view(-1, 1, 1)
    xa = torch.einsum("nlk,nrk->nlr", p["x"], a) * s
    delta = torch.einsum("nlr,nor->nlo", xa, b)
    g_xa = torch.einsum("nlo,nor->nlr", p["grad"], b) * s
    dx = torch.einsum("nlr,nrk->nlk", g_xa, a)
    ga = torch.zeros_like(p["a"]).index_add_(0, p["slots"], torch.einsum("nlr,nlk->nrk", g_xa, p["x"]))
    gb = torch.zeros_like(p["b"]).index_add_(0, p["slots"], torch.einsum("nlo,nlr->nor", p["grad"], xa))
    return delta, xa, dx, ga, gb


def _kernels(p, fresh=False):
    f = {k: v.float().contiguous() if v.is_floating_point() else v for k, v in p.items()}
    used, inverse = torch.unique(f["slots"], return_inverse=True)
    r = f["a"].shape[1]
    at, bt, a, b = cpu_kernels.slot_weights(f["a"], f["b"], used, r)
    y = f["y"].clone()
    xa = cpu_kernels.forward(y, f["x"], at, bt, inverse, f["scales"], fresh=fresh)
    dx = torch.full_like(f["x"], float("nan")) if fresh else torch.zeros_like(f["x"])
    ga, gb = cpu_kernels.backward(f["x"], f["grad"], xa, a, b, inverse, f["scales"], dx, fresh=fresh)
    return y, xa, dx, ga, gb, used


SHAPES = {  # n, length, in, out, rank, each row's slot
    "smollm2_mlp": (4, 64, 576, 1536, 8, [2, 2, 2, 2]),
    "odd_widths": (5, 13, 40, 29, 5, [0, 3, 1, 3, 0]),
    "rank_12": (3, 7, 24, 17, 12, [1, 0, 1]),
    "rank_64": (2, 9, 70, 33, 64, [0, 1]),
    "one_token": (6, 1, 16, 16, 8, [0, 1, 2, 0, 1, 2]),
}


@needs_kernels
@pytest.mark.parametrize("fresh", [False, True], ids=["accumulate", "fresh"])
@pytest.mark.parametrize("shape", list(SHAPES))
def test_kernels_match_a_float64_oracle(shape, fresh):
    """Forward (delta, xa), input gradient and per-slot weight gradients against float64 einsums, for widths and
    ranks that are not multiples of the vector width, rows of one token, several slots; the padded rank columns are
    exact zeros; `fresh` writes (y = delta, dx = g_xa @ A) without reading what was there (NaN)."""
    p = _problem(*SHAPES[shape])
    delta, xa, dx, ga, gb = _oracle(p)
    y, kxa, kdx, kga, kgb, used = _kernels(p, fresh)
    r = p["a"].shape[1]

    def close(got, want):
        torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5 * float(want.abs().max()))

    close(y, delta if fresh else p["y"] + delta)
    close(kxa[..., :r], xa)
    assert torch.count_nonzero(kxa[..., r:]) == 0
    close(kdx, dx)
    close(kga[:, :r], ga[used])
    close(kgb[:, :r].transpose(1, 2), gb[used])
    assert torch.count_nonzero(kga[:, r:]) == 0 and torch.count_nonzero(kgb[:, r:]) == 0


@needs_kernels
def test_kernel_results_do_not_follow_threads_row_length_or_batch_mates(monkeypatch):
    """Every value is one fixed sequence of fused multiply-adds: the same bits on 1, 2 or 3 threads (the work split
    by tokens or columns, forced here at any size), for a row alone or among other tenants' rows, and for a row
    padded longer with zero gradient (a packed micro-batch's padding)."""
    monkeypatch.setattr(cpu_kernels, "FLOPS_PER_THREAD", 1)
    p = _problem(5, 19, 72, 40, 8, [0, 1, 0, 2, 1])
    threads = torch.get_num_threads()
    try:
        runs = []
        for t in (1, 2, 3):
            torch.set_num_threads(t)
            runs.append(_kernels(p))
    finally:
        torch.set_num_threads(threads)
    for other in runs[1:]:
        for got, want in zip(other, runs[0], strict=True):
            assert torch.equal(got, want)
    # slot 0's rows (0 and 2) alone, then padded with 6 tokens of zero gradient
    alone = {k: (v[[0, 2]] if k in ("x", "y", "grad", "scales", "slots") else v) for k, v in p.items()}
    y, xa, dx, ga, gb, used = _kernels(alone)
    assert torch.equal(y, runs[0][0][[0, 2]]) and torch.equal(dx, runs[0][2][[0, 2]])
    assert torch.equal(ga[0], runs[0][3][0]) and torch.equal(gb[0], runs[0][4][0])
    padded = dict(alone)
    padded["x"] = torch.cat([alone["x"], torch.randn(2, 6, 72, dtype=torch.float64)], 1)
    padded["y"] = torch.cat([alone["y"], torch.randn(2, 6, 40, dtype=torch.float64)], 1)
    padded["grad"] = torch.cat([alone["grad"], torch.zeros(2, 6, 40, dtype=torch.float64)], 1)
    py, _, pdx, pga, pgb, _ = _kernels(padded)
    assert torch.equal(py[:, :19], y) and torch.equal(pdx[:, :19], dx)
    assert torch.equal(pga, ga) and torch.equal(pgb, gb)


def _train_step(m, names, ids):
    m.zero_lora_grads()
    logits = m(ids, adapter_names=names).logits
    logits.float().logsumexp(-1).mean().backward()
    used = sorted(set(names) - {None})
    return logits.detach(), {n: [None if g is None else g.clone() for g in m.adapter_grads(n)] for n in used}


@needs_kernels
@pytest.mark.parametrize("names", [["a"] * 4, ["a", "b", "a", "b"], ["a", None, "b", "a"]],
                         ids=["one_slot", "mixed", "base_rows"])  # fmt: skip
def test_the_layer_on_the_kernels_tracks_its_torch_path(names, monkeypatch):
    """A training forward+backward through `_LinearLoRA` (every row on an adapter) and `_GroupedLoRA` (base rows
    in the batch) on the kernels gives the torch path's logits and per-adapter gradients to float32 rounding."""
    torch.manual_seed(0)
    m = MultiLoRAModel.from_model(tiny_model("llama", hidden=64), 4, 8)
    for i, (name, rank) in enumerate((("a", 8), ("b", 5))):
        m.add_adapter(name, rank=rank, alpha=2 * rank, seed=i)
        with torch.no_grad():
            for p in m.adapter_parameters(name)[1::2]:
                p.normal_(0, 0.05)
    m.train()
    ids = torch.randint(0, 128, (len(names), 11), generator=torch.Generator().manual_seed(1))
    calls = []
    real = cpu_kernels.backward
    monkeypatch.setattr(cpu_kernels, "backward", lambda *a, **k: calls.append(1) or real(*a, **k))
    kernel = _train_step(m, names, ids)
    assert calls  # the kernels ran
    monkeypatch.setattr(layer_mod, "_kernels", lambda *tensors: False)
    torch_path = _train_step(m, names, ids)
    torch.testing.assert_close(kernel[0], torch_path[0], atol=1e-5, rtol=1e-5)
    for name, grads in torch_path[1].items():
        assert any(g is not None and torch.count_nonzero(g) for g in grads)
        for got, want in zip(kernel[1][name], grads, strict=True):
            if want is None:
                assert got is None
            else:
                torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-4)


@pytest.fixture
def fresh_build_state(monkeypatch, tmp_path):
    """The module's build state reset for one test, its cache in tmp_path; restored after."""
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels, "_why_not", None)
    monkeypatch.setenv("RL_MULTILORA_CACHE", str(tmp_path))
    return tmp_path


def test_without_a_compiler_training_keeps_the_torch_path_and_says_why_once(fresh_build_state, monkeypatch):
    def no_compiler():
        raise RuntimeError("no C compiler found (set $CC, or install gcc or clang)")

    monkeypatch.setattr(cpu_kernels, "compiler", no_compiler)
    monkeypatch.setattr(cpu_kernels, "enabled", lambda: True)
    with pytest.warns(RuntimeWarning, match="no C compiler found"):
        assert not cpu_kernels.usable(torch.zeros(1))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once
        assert not cpu_kernels.usable(torch.zeros(1))
    m = MultiLoRAModel.from_model(tiny_model("llama"), 2, 4)
    m.add_adapter("a", rank=4, alpha=8, seed=0)
    m.train()
    _, grads = _train_step(m, ["a", "a"], torch.randint(0, 128, (2, 5)))
    assert any(g is not None and torch.count_nonzero(g) for g in grads["a"])


def test_the_switch_turns_the_kernels_off(monkeypatch):
    for value in ("0", "off", "false"):
        monkeypatch.setenv(cpu_kernels.ENV_SWITCH, value)
        assert not cpu_kernels.enabled() and not cpu_kernels.usable(torch.zeros(1))


@needs_kernels
def test_a_build_is_cached_by_source_and_reused(fresh_build_state, monkeypatch):
    lib = cpu_kernels.library()
    assert lib is not None
    built = list((fresh_build_state / "kernels").glob("cpu_kernels-*.so"))
    assert len(built) == 1 and not list((fresh_build_state / "kernels").glob(".build-*"))
    monkeypatch.setattr(cpu_kernels, "_lib", None)
    monkeypatch.setattr(cpu_kernels.subprocess, "run", _only_version(cpu_kernels.subprocess.run))
    assert cpu_kernels.library() is not None  # loaded from the cache: no compile ran


def _only_version(run):
    def guarded(cmd, *args, **kwargs):
        assert cmd[1:] == ["--version"], f"compiled again: {cmd}"
        return run(cmd, *args, **kwargs)

    return guarded
