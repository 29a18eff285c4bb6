"""training/optimizer.py: a sparse gradient steps a parameter exactly as torch's own optimizer steps the same
gradient made dense (zero on the rows it does not hold), every row and every state tensor, in float64.
Through PartialFC and DDP, on 1 and 2 processes: tests/test_partial_fc.py's
test_sampled_steps_move_every_row_as_the_dense_reference."""
import pytest
import torch

from training import optimizer as row_sparse

SETTINGS = {
    "sgd momentum": (row_sparse.RowSparseSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, weight_decay=0.05)),
    "sgd nesterov": (row_sparse.RowSparseSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.9, nesterov=True)),
    "sgd dampening, no decay": (row_sparse.RowSparseSGD, torch.optim.SGD, dict(lr=0.1, momentum=0.8, dampening=0.3)),
    "sgd plain": (row_sparse.RowSparseSGD, torch.optim.SGD, dict(lr=0.1, weight_decay=0.05)),
    "adamw": (row_sparse.RowSparseAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05)),
    "adamw amsgrad": (row_sparse.RowSparseAdamW, torch.optim.AdamW, dict(lr=0.01, weight_decay=0.05, amsgrad=True)),
}


@pytest.mark.parametrize("fused", [True, False])
@pytest.mark.parametrize("name", SETTINGS)
def test_sparse_gradients_step_every_row_as_their_dense_equivalent(monkeypatch, name, fused):
    """Four steps over 50 rows in blocks of 7 (the last one shorter), each gradient a few rows given unsorted and
    repeated (summed, as torch sums a sparse tensor's repeated entries); the rows without gradient move by
    momentum and decay alone, as in the dense update."""
    monkeypatch.setattr(row_sparse, "CPU_BLOCK_ELEMENTS", 7 * 3)
    mine, theirs, settings = *SETTINGS[name][:2], SETTINGS[name][2]
    generator = torch.Generator().manual_seed(3)
    start = torch.randn(50, 3, generator=generator, dtype=torch.float64)
    sparse, dense = (torch.nn.Parameter(start.clone()) for _ in range(2))
    sparse_opt, dense_opt = mine([sparse], fused=fused, **settings), theirs([dense], foreach=False, **settings)
    for _ in range(4):
        rows = torch.randint(0, 50, (9,), generator=generator)
        values = torch.randn(9, 3, generator=generator, dtype=torch.float64)
        sparse.grad = torch.sparse_coo_tensor(rows[None], values, sparse.shape, check_invariants=True)
        dense.grad = torch.zeros_like(dense).index_add_(0, rows, values)
        sparse_opt.step()
        dense_opt.step()
    torch.testing.assert_close(sparse.detach(), dense.detach(), rtol=1e-14, atol=1e-15)
    assert sparse_opt.state[sparse].keys() == dense_opt.state[dense].keys()
    for key, value in dense_opt.state[dense].items():
        torch.testing.assert_close(sparse_opt.state[sparse][key].double(), value.double(), rtol=1e-14, atol=1e-15,
                                   msg=key)
    assert not torch.equal(sparse.detach(), start)


def test_dense_gradients_are_torchs_own_step():
    """A dense gradient goes to torch's fused step untouched: the same bits as torch's fused optimizer."""
    generator = torch.Generator().manual_seed(4)
    start, grad = (torch.randn(6, 4, generator=generator) for _ in range(2))
    results = []
    for cls in (row_sparse.RowSparseSGD, torch.optim.SGD):
        weight = torch.nn.Parameter(start.clone())
        opt = cls([weight], lr=0.1, momentum=0.9, weight_decay=0.01, fused=True)
        for _ in range(2):
            weight.grad = grad.clone()
            opt.step()
        results.append(weight.detach())
    assert torch.equal(*results)
