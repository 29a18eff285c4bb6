"""The optimizer of a run: torch's fused SGD or AdamW, which also take row-sparse gradients (PartialFC's
centres when it samples: `sparse_grad=True`) and give every row the update its dense gradient would.

With dense semantics (torch's and arcface_torch's: a sampled-out centre has gradient 0, not "no gradient"),
weight decay and momentum move every row of the centres every step, sampled or not. The dense way there
zero-fills a (C, D) gradient, scatters the sampled rows into it and reads it back in the update. Here the
gradient holds only the sampled rows and the update is torch's own optimizer kernel, run:

- over every row with a zero gradient, block by block: one small block of zeros, reused, stands for the
  gradient of every block (on a CPU it stays in cache, so the pass reads and writes the centres and their
  state once, as the dense update does, less the gradient's reading);
- then over the sampled rows, taken before that pass, with their gradient, and put back.

So every row gets exactly the arithmetic of torch's optimizer on the dense gradient, with no host wait (a
GradScaler's found_inf and grad_scale go to the kernels as torch's step passes them), and the state
(momentum_buffer; step, exp_avg, exp_avg_sq) is torch's own, so checkpoints save, load and reshard it as any.
"""
from __future__ import annotations

import torch
from torch.optim.adamw import adamw
from torch.optim.sgd import sgd

CPU_BLOCK_ELEMENTS = 1 << 19  # a CPU block: 2 MiB of float32 per tensor, which a core's cache holds
DEVICE_BLOCK_ELEMENTS = 1 << 24  # a GPU streams from memory whatever the block: few, large ones


class _RowSparse:
    """Mixin over a torch optimizer: dense gradients go to its step, sparse ones to `_sparse_update`."""

    def step(self, closure=None):
        sparse = {p: p.grad for group in self.param_groups for p in group["params"]
                  if p.grad is not None and p.grad.is_sparse}
        for p in sparse:
            p.grad = None  # torch's step skips parameters without a gradient
        try:
            loss = super().step(closure)
        finally:
            for p, grad in sparse.items():
                p.grad = grad
        scaling = dict(grad_scale=getattr(self, "grad_scale", None), found_inf=getattr(self, "found_inf", None))
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p in sparse:
                        self._sparse_update(p, *_distinct_rows(sparse[p]), group, self.state[p], scaling)
        return loss


def _distinct_rows(grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows, their gradient), each row once (a repeated row's gradients summed: an update is not linear in
    them). Autograd drops the flag that says a gradient is coalesced when it stores it, though PartialFC's rows
    come sorted and distinct (and sums of such stay so): checking them is one comparison of the S row indices,
    coalescing a sort and a copy of the S x D values."""
    rows = grad._indices()[0]
    if not (grad.is_coalesced() or bool((rows[1:] > rows[:-1]).all())):
        grad = grad.coalesce()
        rows = grad._indices()[0]
    return rows, grad._values()


class RowSparseSGD(_RowSparse, torch.optim.SGD):
    """torch's SGD; a sparse gradient's parameter gets the update of the dense gradient (zero elsewhere)."""

    def _sparse_update(self, p: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, group: dict, state: dict,
                       scaling: dict) -> None:
        momentum = group["momentum"]
        buffer = state.get("momentum_buffer")
        first = momentum != 0 and buffer is None  # torch's first step makes the buffer from the gradient

        def update(params, grads, buffers):
            buffers = list(buffers)
            sgd(params, grads, buffers, fused=group["fused"], foreach=group["foreach"], **scaling,
                weight_decay=group["weight_decay"], momentum=momentum, lr=group["lr"], dampening=group["dampening"],
                nesterov=group["nesterov"], maximize=group["maximize"])
            return buffers

        sampled = p.index_select(0, rows)
        sampled_buffer = None if buffer is None else buffer.index_select(0, rows)
        if first:
            buffer = state["momentum_buffer"] = torch.empty_like(p)
        for w, b, zeros in _blocks(p, buffer):
            made = update([w], [zeros], [None if first or b is None else b])
            if first:
                b.copy_(made[0])
        made = update([sampled], [values], [sampled_buffer])
        p.index_copy_(0, rows, sampled)
        if momentum != 0:
            buffer.index_copy_(0, rows, made[0])


class RowSparseAdamW(_RowSparse, torch.optim.AdamW):
    """torch's AdamW; a sparse gradient's parameter gets the update of the dense gradient (zero elsewhere)."""

    def _sparse_update(self, p: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, group: dict, state: dict,
                       scaling: dict) -> None:
        if not state:  # as torch's AdamW makes it (a fused one keeps a float32 step on the parameter's device)
            on_device = group["fused"] or group["capturable"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if on_device else torch.tensor(0.0)
            for name in ("exp_avg", "exp_avg_sq") + (("max_exp_avg_sq",) if group["amsgrad"] else ()):
                state[name] = torch.zeros_like(p, memory_format=torch.preserve_format)
        moments = [state[name] for name in ("exp_avg", "exp_avg_sq", "max_exp_avg_sq") if name in state]

        def update(tensors, grad, step):
            w, avg, avg_sq, *most = tensors
            adamw([w], [grad], [avg], [avg_sq], most, [step], fused=group["fused"], foreach=group["foreach"],
                  capturable=group["capturable"], **scaling, amsgrad=group["amsgrad"], beta1=group["betas"][0],
                  beta2=group["betas"][1], lr=group["lr"], weight_decay=group["weight_decay"], eps=group["eps"],
                  maximize=group["maximize"])

        sampled = [t.index_select(0, rows) for t in (p, *moments)]
        for *tensors, zeros in _blocks(p, *moments):
            update(tensors, zeros, state["step"].clone())  # each block steps a copy: the step counts once
        update(sampled, values, state["step"])
        for t, rows_now in zip((p, *moments), sampled):
            t.index_copy_(0, rows, rows_now)


def _blocks(p: torch.Tensor, *states: torch.Tensor | None):
    """(rows of p, the same rows of each state, zeros shaped like them) block by block."""
    elements = CPU_BLOCK_ELEMENTS if p.device.type == "cpu" else DEVICE_BLOCK_ELEMENTS
    rows = max(1, elements // max(1, p[0].numel())) if p.dim() else 1
    zeros = torch.zeros((min(rows, len(p)), *p.shape[1:]) if p.dim() else (), dtype=p.dtype, device=p.device)
    if not p.dim():
        yield p, *states, zeros
        return
    for start in range(0, len(p), rows):
        block = slice(start, start + rows)
        yield p[block], *(None if s is None else s[block] for s in states), zeros[:len(p[block])]
