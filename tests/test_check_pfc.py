"""tools/check_pfc.py, the command users run on their own cluster: PASS on this PartialFC, FAIL (exit
status 1) when PartialFC's loss or a gradient is off, even slightly."""
from __future__ import annotations

import sys

import pytest

import partial_fc
from tools import check_pfc

SMALL = ["--classes", "11", "--batch", "4", "--embedding-size", "8"]


def run_main(monkeypatch, capsys, *args: str) -> tuple[int, list[str]]:
    monkeypatch.delenv("WORLD_SIZE", raising=False)  # one process, no process group
    monkeypatch.setattr(sys, "argv", ["check_pfc", *SMALL, *args])
    status = check_pfc.main()
    return status, capsys.readouterr().out.splitlines()


@pytest.mark.parametrize("args", [[], ["--views", "3", "--sample-rate", "0.5"], ["--dtype", "float32"]])
def test_main_passes_on_this_partial_fc(monkeypatch, capsys, args):
    status, lines = run_main(monkeypatch, capsys, *args)
    assert status == 0, lines
    assert lines[0].startswith("PartialFC check: world 1, cpu")
    assert {"loss", "centres.grad", "backbone.0.weight.grad"} <= {line.split()[0] for line in lines[1:-1]}
    assert lines[-1].startswith("PASS: worst ")


def _scaled_centre_gradient(original, factor):
    def backward(ctx, grad_loss, grad_rows):
        grads = list(original(ctx, grad_loss, grad_rows))
        grads[1] = grads[1] * factor
        return tuple(grads)
    return staticmethod(backward)


def _scaled_loss(original, factor):
    def forward(ctx, *args):
        loss, rows = original(ctx, *args)
        return loss * factor, rows
    return staticmethod(forward)


@pytest.mark.parametrize("broken, name", [("centre gradient", "centres.grad"), ("loss", "loss")])
def test_main_fails_on_a_partial_fc_that_is_slightly_wrong(monkeypatch, capsys, broken, name):
    softmax = partial_fc._ShardedMarginSoftmax
    if broken == "loss":
        monkeypatch.setattr(softmax, "forward", _scaled_loss(softmax.forward, 1 + 1e-4))
    else:
        monkeypatch.setattr(softmax, "backward", _scaled_centre_gradient(softmax.backward, 1 + 1e-4))
    status, lines = run_main(monkeypatch, capsys)
    assert status == 1, lines
    assert lines[-1].startswith("FAIL: worst ")
    errors = {line.split()[0]: float(line.split()[-1]) for line in lines[1:-1]}
    assert errors[name] == pytest.approx(1e-4, rel=1e-3)
