"""Shared-prompt packing (`rl_multilora.packing`): a micro-batch whose rows share their tenant and prompt trains the
prompt once, and every log-prob, loss and per-tenant gradient equals the unpacked batch's (each row right-padded on
its own, the oracle) in float64 (float32 for the MoE model, whose grouped expert matmul has no float64; slot
gradients are kept in float32), over the dense families, an MoE model, a LoRA on the output head, the logits path,
a KL to the base and an entropy bonus."""

from __future__ import annotations

import pytest
import torch

from rl_multilora.batch import build_batch, micro_batches
from rl_multilora.config import GRPOSettings, OptimSettings
from rl_multilora.lora import MultiLoRAModel
from rl_multilora.packing import groups, pack, packable, worth_packing
from rl_multilora.rows import Row, TokenIndex
from rl_multilora.train_ops import TrainOps
from rollout.types import AdapterRef, Sample, SampleStatus
from tests.tiny_models import PAD_ID, tiny_config, tiny_model

VOCAB = 128


def _rows() -> list[Row]:
    """Two tenants' GRPO-like groups of different prompt and completion lengths, a row that shares nothing, a row
    with a gap in its loss tokens (a multi-turn episode's environment turn), and rows interleaved across tenants."""
    g = torch.Generator().manual_seed(0)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    pa, pb = ids(7), ids(4)
    rows = []
    for k, n in enumerate((3, 5, 1)):  # tenant a, one prompt, three completions
        rows.append(Row("a", pa + ids(n), list(range(7, 7 + n)), 0.5 - 0.4 * k, None, prompt_len=7))
    for k, n in enumerate((6, 2)):  # tenant b, another prompt
        rows.insert(1 + 2 * k, Row("b", pb + ids(n), list(range(4, 4 + n)), 1.0 - 2 * k, None, prompt_len=4))
    rows.append(Row("b", pb + ids(8), [4, 5, 9, 10, 11], -0.7, None, prompt_len=4))  # loss tokens with a gap
    rows.append(Row("a", ids(9), [5, 6, 7, 8], 0.3, None))  # no prompt_len: never shared
    rows.append(Row("b", pa + ids(3), [7, 8, 9], 0.2, None, prompt_len=7))  # a's prompt, b's row: not shared with a
    return rows


def _ops(family: str, share: bool, head_lora: bool = False, **grpo) -> TrainOps:
    base = tiny_model(family, seed=0, vocab=VOCAB)
    base = base if family == "qwen3_moe" else base.double()  # torch's grouped expert matmul has no float64
    modules = "all-linear" if not head_lora else ["q_proj", "v_proj", "down_proj", "lm_head"]
    m = MultiLoRAModel.from_model(base, max_loras=3, max_rank=8, target_modules=modules)
    ops = TrainOps(m, GRPOSettings(share_prompts=share, **grpo), pad_token_id=PAD_ID, temperature=0.8)
    for i, (name, rank) in enumerate((("a", 4), ("b", 8))):
        m.add_adapter(name, rank=rank, alpha=2 * rank, seed=i + 1)
        with torch.no_grad():  # B non-zero: the adapters change the forward, so their gradients reach A too
            for k, p in enumerate(m.adapter_parameters(name)):
                if k % 2:
                    p.normal_(0, 0.3, generator=torch.Generator().manual_seed(10 + i * 100 + k))
        ops.add_tenant(name, OptimSettings(), lr=1e-2)
    return ops


def _run(ops: TrainOps, rows: list[Row], **kw):
    out = ops.forward_backward(rows, **kw)
    grads = {n: [g.clone() for g in ops.tenant(n).grads] for n in ("a", "b")}
    return out, grads


def _assert_same(packed, plain):
    (out_p, grads_p), (out_u, grads_u) = packed, plain
    tol = dict(atol=1e-11, rtol=1e-9) if out_u.logprobs[0].dtype == torch.float64 else dict(atol=1e-5, rtol=1e-5)
    for got, want in zip(out_p.logprobs, out_u.logprobs, strict=True):
        torch.testing.assert_close(got, want, **tol)
    if out_u.ref_logprobs is not None:
        for got, want in zip(out_p.ref_logprobs, out_u.ref_logprobs, strict=True):
            torch.testing.assert_close(got, want, **tol)
    assert out_p.row_loss == pytest.approx(out_u.row_loss, rel=tol["rtol"], abs=tol["atol"])
    for name, sums in out_u.sums.items():
        assert out_p.sums[name] == pytest.approx(sums, rel=tol["rtol"], abs=tol["atol"])
    for name, want in grads_u.items():
        assert any(g.abs().sum() > 0 for g in want)
        for got, w in zip(grads_p[name], want, strict=True):
            # the slots' gradients are kept in the LoRA dtype (float32 here): float32 rounding, at the tensor's scale
            eps = torch.finfo(w.dtype).eps * (8 if out_u.logprobs[0].dtype == torch.float64 else 256)
            torch.testing.assert_close(got, w, atol=eps * float(w.abs().max()), rtol=eps)


@pytest.mark.parametrize("family", ["qwen2", "qwen3", "llama", "qwen3_moe"])
def test_packed_log_probs_losses_and_gradients_equal_the_unpacked_batch(family):
    rows = _rows()
    _assert_same(_run(_ops(family, True), rows), _run(_ops(family, False), rows))


def test_the_same_with_a_kl_to_the_base_an_entropy_bonus_and_a_lora_on_the_output_head():
    rows = _rows()
    settings = dict(kl_coef=0.1, entropy_coef=0.01, loss_agg="seq-mean-token-mean")
    packed = _run(_ops("qwen2", True, head_lora=True, **settings), rows, want_ref=True)
    plain = _run(_ops("qwen2", False, head_lora=True, **settings), rows, want_ref=True)
    _assert_same(packed, plain)


def test_the_same_through_the_full_logits_path(monkeypatch):
    """A model whose output head is not a plain Linear (soft-capping, a sharded head) takes the logits path."""
    rows = _rows()
    results = []
    for share in (True, False):
        ops = _ops("llama", share)
        monkeypatch.setattr(ops.model, "output_head", lambda: None)
        results.append(_run(ops, rows))
    _assert_same(*results)


def test_a_group_trains_its_prompt_once():
    rows = _rows()
    parts = groups(rows)
    assert parts == [[0, 2, 4], [1, 3, 5], [6], [7]]
    tok = TokenIndex.build(rows, {"a": 0, "b": 1}, None, "cpu")
    p = pack(rows, tok.row, tok.pos, PAD_ID, torch.float32, "cpu")
    plain_tokens = sum(len(r.input_ids) for r in rows)
    assert p.tokens == plain_tokens - 2 * 7 - 2 * 4  # each group's prompt once instead of once per row
    assert p.input_ids.shape[0] == 4
    # the first completion of group a continues its prompt's positions; the second starts over at the prompt's end
    assert p.position_ids[0, :7].tolist() == list(range(7))
    assert p.position_ids[0, 7:10].tolist() == [7, 8, 9] and p.position_ids[0, 10:15].tolist() == list(range(7, 12))
    # the second completion sees the prompt and itself, not the first completion
    allowed = p.attention_mask[0, 0] == 0
    assert allowed[10, :7].all() and not allowed[10, 7:10].any() and allowed[10, 10]
    # padding attends to itself only among the padded positions, so no softmax row is empty
    assert allowed.any(dim=-1).all()


def test_a_group_packs_only_where_the_estimate_says_it_saves():
    """A group whose continuations are long beside its prompt trains each row on its own: packed, its attention would
    be dense over prompt + every continuation. The decision is per group (a group's own rows), the layouts mix in one
    micro-batch, and the numbers still equal the unpacked batch's; alone, the refused group takes the plain batch."""
    assert worth_packing([30, 30, 30], 20, 0.01)  # long prompt, short continuations
    assert not worth_packing([200, 200, 200, 200], 20, 0.01)  # short prompt, long continuations
    assert worth_packing([200, 200, 200, 200], 20, 0.0)  # pair cost 0: every group of two or more packs
    assert not worth_packing([30], 20, 0.0)  # one row shares with nobody
    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    pa, pb = ids(3), ids(20)
    rows = [Row("a", pa + ids(60), list(range(3, 63)), 0.5 - 0.5 * k, None, prompt_len=3) for k in range(3)]
    rows += [Row("b", pb + ids(4 + k), list(range(20, 24 + k)), 1.0 - k, None, prompt_len=20) for k in range(3)]
    ops = _ops("qwen2", True)
    assert 0 < ops.pair_cost < 0.1
    assert not worth_packing([63] * 3, 3, ops.pair_cost) and worth_packing([24, 25, 26], 20, ops.pair_cost)
    tok = TokenIndex.build(rows, {"a": 0, "b": 1}, None, "cpu")
    p = pack(rows, tok.row, tok.pos, PAD_ID, torch.float32, "cpu", ops.pair_cost)
    assert p.input_ids.shape[0] == 4  # a's three rows on their own, b's group as one sequence
    assert p.tokens == 3 * 63 + 20 + 4 + 5 + 6
    forced = pack(rows, tok.row, tok.pos, PAD_ID, torch.float32, "cpu")
    assert forced.input_ids.shape[0] == 2  # pair cost 0: both groups pack
    tok_a = TokenIndex.build(rows[:3], {"a": 0}, None, "cpu")
    assert pack(rows[:3], tok_a.row, tok_a.pos, PAD_ID, torch.float32, "cpu", ops.pair_cost) is None  # plain batch
    _assert_same(_run(ops, rows), _run(_ops("qwen2", False), rows))


def test_the_grpo_batch_marks_each_rows_prompt():
    samples = [
        Sample(
            index=i,
            group_index=0,
            prompt="p",
            prompt_ids=[5, 6, 7],
            response_ids=[8 + i, 9],
            reward=float(i),
            status=SampleStatus.COMPLETED,
            adapter=AdapterRef("a", 0),
        )
        for i in range(3)
    ]
    rows = build_batch(samples).rows
    assert [r.prompt_len for r in rows] == [3, 3, 3]
    assert groups(rows) == [[0, 1, 2]]


def test_models_whose_attention_takes_no_custom_mask_are_not_packed():
    config = tiny_config("qwen2")
    config._attn_implementation = "sdpa"
    assert packable(config)
    config._attn_implementation = "flash_attention_2"
    assert not packable(config)
    windowed = tiny_config("llama")
    windowed.sliding_window = 16
    assert not packable(windowed)


def test_micro_batches_keep_a_groups_rows_together_whoever_else_is_in_the_step():
    rows = _rows()  # groups [0, 2, 4] (a), [1, 3, 5] (b), [6], [7]
    cut = micro_batches([rows], 0, 4, keep_groups=True)
    assert [[rows.index(r) for r in m] for m in cut] == [[0, 2, 4], [1, 3, 5, 6], [7]]
    cut = micro_batches([rows], 0, 2, keep_groups=True)  # a group larger than a micro-batch: pieces of it, in order
    assert [[rows.index(r) for r in m] for m in cut] == [[0, 2], [4], [1, 3], [5, 6], [7]]
    group = [rows[k] for k in (0, 2, 4)]
    for size in (2, 3, 4, 16):  # its pieces are the same alone and in the mixed step

        def pieces(share, size=size):
            cut = micro_batches([share], 0, size, keep_groups=True)
            return [[r for r in m if any(r is g for g in group)] for m in cut if any(r is g for g in group for r in m)]

        assert pieces(rows) == pieces(group)


def _tinker_rows() -> list[Row]:
    """Tinker datums as the server turns them into rows (`ClientOps._row`): tenant a's GRPO group (a shared prompt,
    advantages zero over it, `importance_sampling`), tenant b's SFT datums with the prompt weighted zero
    (`cross_entropy`), and a datum whose every target counts (no prompt: never shared)."""
    import numpy as np

    from rl_multilora.tinker.ops import _datum_row, _prompt_len
    from rl_multilora.tinker.wire import Datum

    g = torch.Generator().manual_seed(1)

    def ids(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=g).tolist()

    def row(name: str, loss_fn: str, tokens: list[int], prompt: int, value: float, key: str) -> Row:
        n = len(tokens) - 1
        per_token = np.array([0.0] * (prompt - 1) + [value] * (n - prompt + 1), dtype=np.float32)
        inputs = {"target_tokens": np.array(tokens[1:]), key: per_token}
        if loss_fn == "importance_sampling":
            inputs["logprobs"] = np.full(n, -4.0, dtype=np.float32)
        r = _datum_row(name, loss_fn, Datum(np.array(tokens[:-1]), inputs), VOCAB)
        r.prompt_len = _prompt_len(r)
        return r

    pa, pb = ids(6), ids(5)
    rows = [
        row("a", "importance_sampling", pa + ids(n), 6, 0.8 - 0.5 * k, "advantages") for k, n in enumerate((4, 2, 5))
    ]
    rows += [row("b", "cross_entropy", pb + ids(n), 5, 1.0, "weights") for n in (3, 6)]
    rows.append(row("b", "cross_entropy", ids(7), 1, 1.0, "weights"))
    return rows


def test_tinker_datums_of_a_group_train_their_prompt_once_with_the_same_numbers():
    from rl_multilora.losses import client_algo

    rows = _tinker_rows()
    assert [r.prompt_len for r in rows] == [6, 6, 6, 5, 5, None]
    assert groups(rows) == [[0, 1, 2], [3, 4], [5]]
    algos = {"a": client_algo("importance_sampling", None), "b": client_algo("cross_entropy", None)}
    _assert_same(_run(_ops("qwen2", True), rows, algos=algos), _run(_ops("qwen2", False), rows, algos=algos))
