"""An ONNX face model (e.g. one insightface released) run by onnxruntime on the CPU, behind the
nn.Module interface the evaluation loops use: (N, 3, 112, 112) RGB in [-1, 1] -> (N, D) embeddings.

Input conventions follow arcface_torch's ``onnx_helper.ArcFaceORT``: the input name comes from the
model, images are NCHW float32 RGB scaled to [-1, 1] (``(x - 127.5) / 127.5``), except for models
converted from mxnet whose graph starts by subtracting a mean and scaling (a node named ``Sub*`` or
``_minus*`` and one named ``Mul*``, ``_mul*`` or ``Div*`` among its first eight): those take raw
0..255 pixels.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime
import torch
from torch import nn

from utils.errors import WeightsError
from utils.image import IMAGE_SIZE

FACE_SHAPE = (3, IMAGE_SIZE, IMAGE_SIZE)


def takes_raw_pixels(graph: onnx.GraphProto) -> bool:
    """Upstream's test for a model that normalises its own 0..255 input (see the module doc)."""
    names = [node.name for node in graph.node[:8]]
    subtracts = any(name.startswith(("Sub", "_minus")) for name in names)
    scales = any(name.startswith(("Mul", "_mul", "Div")) for name in names)
    return subtracts and scales


def _open(path: Path) -> tuple[onnx.ModelProto, onnxruntime.InferenceSession]:
    if not path.is_file():
        raise WeightsError(f"{path} does not exist; pass the path of an ONNX face model")
    options = onnxruntime.SessionOptions()
    # As many threads as torch was given: onnxruntime would otherwise take every core of a shared machine.
    options.intra_op_num_threads = torch.get_num_threads()
    try:
        return onnx.load(str(path)), onnxruntime.InferenceSession(str(path), options,
                                                                  providers=["CPUExecutionProvider"])
    except Exception as error:  # onnx and onnxruntime raise their own types for foreign or damaged files
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise WeightsError(f"{path} is not a readable ONNX model ({reason}); pass a .onnx file such as "
                           "tools.export_onnx writes or insightface releases") from None


class OnnxBackbone(nn.Module):
    """``forward``: float (N, 3, 112, 112) in [-1, 1] -> float32 (N, D), on the CPU, any N."""

    def __init__(self, path: str | Path) -> None:
        super().__init__()
        self.path = Path(path)
        model, self.session = _open(self.path)
        face_input = self.session.get_inputs()[0]
        shape = face_input.shape
        # A dimension onnxruntime reports as a string (or None) is symbolic: any size fits it.
        fits = len(shape) == 4 and all(not isinstance(dim, int) or dim == want
                                       for dim, want in zip(shape[1:], FACE_SHAPE))
        if not fits or face_input.type != "tensor(float)":
            raise WeightsError(f"{self.path} takes input '{face_input.name}' as {face_input.type} {shape}; "
                               "evaluation feeds float (batch, 3, 112, 112) face crops: export a model with that input")
        self.input_name = face_input.name
        self.output_name = self.session.get_outputs()[0].name
        # Models exported with a fixed batch size are fed that many images at a time.
        self.fixed_batch = shape[0] if isinstance(shape[0], int) else None
        self.raw_pixels = takes_raw_pixels(model.graph)

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        pixels = images.detach().cpu().float().numpy()
        if self.raw_pixels:
            pixels = pixels * 127.5 + 127.5
        if self.fixed_batch is None:
            return torch.from_numpy(self._run(pixels))
        size = self.fixed_batch
        outputs = []
        for start in range(0, len(pixels), size):
            chunk = pixels[start:start + size]
            padded = np.concatenate([chunk, np.zeros((size - len(chunk), *chunk.shape[1:]), chunk.dtype)])
            outputs.append(self._run(padded)[:len(chunk)])
        return torch.from_numpy(np.concatenate(outputs))

    def _run(self, pixels: np.ndarray) -> np.ndarray:
        return self.session.run([self.output_name], {self.input_name: np.ascontiguousarray(pixels)})[0]
