"""Face-recognition backbones whose state_dicts are interchangeable with arcface_torch's.

``get_model(name, ...)`` builds one; ``load_backbone(name, weights, ...)`` builds one and loads a
``backbone.pth`` into it with errors that say what to fix; ``read_face_image`` and ``unit_embeddings`` turn
aligned face files into unit-length embeddings; ``fuse_batchnorm`` makes a faster inference copy.
"""
from backbones.base import FaceBackbone
from backbones.fusion import fuse_batchnorm
from backbones.inference import FaceImageError, read_face_image, unit_embeddings
from backbones.registry import NETWORKS, get_model
from backbones.weights import WeightsError, load_backbone, read_state_dict, suggest_network

__all__ = [
    "NETWORKS", "FaceBackbone", "FaceImageError", "WeightsError", "unit_embeddings", "fuse_batchnorm",
    "get_model", "load_backbone", "read_face_image", "read_state_dict", "suggest_network",
]
