"""`train_ops.pick_states`: the states before the loss tokens, with a backward that sums in a fixed order."""

import torch

from rl_multilora.train_ops import pick_states


def _case():
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(3, 40, 64, generator=g)
    rows = torch.arange(3).repeat_interleave(300)
    positions = torch.randint(0, 5, (900,), generator=g)  # many tokens share a state (a group's shared prompt)
    grad = torch.randn(900, 64, generator=g)
    return hidden, rows, positions, grad


def test_pick_states_are_advanced_indexing_forward_and_backward_in_float64():
    hidden, rows, positions, grad = _case()
    h = hidden.double().requires_grad_()
    want = h[rows, positions]
    want.backward(grad.double())
    x = hidden.clone().requires_grad_()
    got = pick_states(x, rows, positions)
    got.backward(grad)
    assert torch.equal(got, hidden[rows, positions])  # a gather: the same values
    torch.testing.assert_close(x.grad.double(), h.grad, rtol=1e-6, atol=1e-5)


def test_the_backward_sums_shared_states_in_one_order_with_two_threads():
    # Advanced indexing's backward (index_put_ with accumulate) adds duplicates with atomics across CPU threads, in an
    # order that varies from run to run; pick_states must not go through it, and must repeat bit for bit.
    hidden, rows, positions, grad = _case()
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        grads = []
        for _ in range(20):
            x = hidden.clone().requires_grad_()
            out = pick_states(x, rows, positions)
            assert "IndexPut" not in type(out.grad_fn).__name__ and "IndexBackward" not in type(out.grad_fn).__name__
            out.backward(grad)
            grads.append(x.grad)
        assert all(torch.equal(grads[0], g) for g in grads[1:])
        torch.use_deterministic_algorithms(True)
        try:  # torch's own deterministic mode (serial accumulation) gives the same bits
            x = hidden.clone().requires_grad_()
            x[rows, positions].backward(grad)
        finally:
            torch.use_deterministic_algorithms(False)
        assert torch.equal(grads[0], x.grad)
    finally:
        torch.set_num_threads(threads)
