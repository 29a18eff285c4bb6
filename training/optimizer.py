"""The optimizer of a run: torch's fused SGD or AdamW, which also take row-sparse gradients (PartialFC's
centres when it samples: `sparse_grad=True`) and give them the dense gradient's update exactly.

With dense semantics (torch's and arcface_torch's: a sampled-out centre has gradient 0, not "no gradient"),
weight decay and momentum move every row of the centres every step, sampled or not. The dense way to get
there zero-fills a (C, D) gradient, scatters the sampled rows into it and reads it back in the update: three
passes over C x D for the rows' zeros. Here the gradient holds only the sampled rows and the update is:

- one pass over every row with gradient 0 (on a CPU in blocks of rows that stay in cache, so that the few
  elementwise operations of a row cost about one trip to memory, as a fused kernel's would);
- then the sampled rows' gradient: for SGD, added (the update is linear in it: momentum buffer += g,
  weight -= lr * g); for AdamW, the sampled rows are taken before the pass and their update redone with their
  gradient (S x D work).

The state (momentum_buffer; step, exp_avg, exp_avg_sq) is torch's, under torch's names, dtypes and devices,
so checkpoints save, load and reshard it as they do any optimizer state.
"""
from __future__ import annotations

import torch

CPU_BLOCK_ELEMENTS = 1 << 19  # rows per block of the dense pass on a CPU: 2 MiB of float32 per tensor


class _RowSparse:
    """Mixin over a torch optimizer: dense gradients go to torch's step, sparse ones to `_sparse_update`."""

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
        # Set by a GradScaler around the step (torch's fused kernels read them too): skip on an inf/NaN
        # gradient, and unscale gradients it did not unscale yet.
        found_inf, grad_scale = getattr(self, "found_inf", None), getattr(self, "grad_scale", None)
        if not sparse or (found_inf is not None and bool(found_inf)):
            return loss
        with torch.no_grad():
            for group in self.param_groups:
                for p in group["params"]:
                    if p in sparse:
                        grad = sparse[p].coalesce() if grad_scale is None else sparse[p].coalesce() / grad_scale
                        self._sparse_update(p, grad._indices()[0], grad._values(), group, self.state[p])
        return loss


class RowSparseSGD(_RowSparse, torch.optim.SGD):
    """torch's SGD; a sparse gradient's rows get the update of a dense gradient that is zero elsewhere."""

    def _sparse_update(self, p: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, group: dict,
                       state: dict) -> None:
        if group["nesterov"] or group["dampening"] or group["maximize"]:
            raise ValueError("RowSparseSGD takes sparse gradients with plain momentum only (no nesterov, dampening "
                             "or maximize)")
        lr, momentum, decay = group["lr"], group["momentum"], group["weight_decay"]
        if momentum == 0:
            for w, in _blocks(p):
                w.add_(w, alpha=-lr * decay)
        else:
            buffer = state.get("momentum_buffer")
            if buffer is None:  # torch's first step: the buffer is the first gradient itself
                buffer = state["momentum_buffer"] = torch.zeros_like(p)
            for w, b in _blocks(p, buffer):
                b.mul_(momentum).add_(w, alpha=decay)
                w.add_(b, alpha=-lr)
            buffer.index_add_(0, rows, values)
        p.index_add_(0, rows, values, alpha=-lr)


class RowSparseAdamW(_RowSparse, torch.optim.AdamW):
    """torch's AdamW; a sparse gradient's rows get the update of a dense gradient that is zero elsewhere."""

    def _sparse_update(self, p: torch.Tensor, rows: torch.Tensor, values: torch.Tensor, group: dict,
                       state: dict) -> None:
        if group["amsgrad"] or group["maximize"]:
            raise ValueError("RowSparseAdamW takes sparse gradients without amsgrad or maximize")
        if not state:  # as torch's AdamW makes it (a fused one keeps a float32 step on the parameter's device)
            fused = group["fused"] or group["capturable"]
            state["step"] = torch.zeros((), dtype=torch.float32, device=p.device) if fused else torch.tensor(0.0)
            state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["step"] += 1
        # The bias corrections stay on the parameter's device (reading the step would make the host wait for it),
        # in float64 whatever the step's dtype; 1 / step_size is folded into the denominator.
        step = state["step"].to(torch.float64)
        lr, (beta1, beta2), eps, decay = group["lr"], group["betas"], group["eps"], group["weight_decay"]
        step_size = lr / (1 - beta1 ** step)
        scale, shift = (1 - beta2 ** step).sqrt() * step_size, eps / step_size
        avg, avg_sq = state["exp_avg"], state["exp_avg_sq"]
        sampled = [t.index_select(0, rows) for t in (p, avg, avg_sq)]  # before the pass, to be redone with g

        def update(w, m, v, g):
            w.mul_(1 - lr * decay)
            if g is None:
                m.mul_(beta1)
                v.mul_(beta2)
            else:
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            w.addcdiv_(m, v.sqrt().div_(scale).add_(shift), value=-1)

        for w, m, v in _blocks(p, avg, avg_sq):
            update(w, m, v, None)
        update(*sampled, values)
        for t, rows_now in zip((p, avg, avg_sq), sampled):
            t.index_copy_(0, rows, rows_now)


def _blocks(*tensors: torch.Tensor):
    """The tensors' rows in blocks, the same rows of each together: on a CPU blocks that fit in cache, elsewhere
    the whole tensors (a GPU's elementwise kernels stream from memory whatever the block)."""
    first = tensors[0]
    if first.device.type != "cpu" or first.dim() == 0:
        return [tensors]
    rows = max(1, CPU_BLOCK_ELEMENTS // max(1, first[0].numel()))
    return zip(*(t.split(rows) for t in tensors))
