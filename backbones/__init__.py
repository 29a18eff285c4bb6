"""Face-recognition backbones whose state_dicts are interchangeable with arcface_torch's.

``get_model(name, ...)`` builds one; ``load_backbone(name, weights, ...)`` builds one and loads a
``backbone.pth`` into it with errors that say what to fix; ``read_face_image`` and ``flip_fused_embeddings``
turn face photos into unit-length embeddings as verification scores them; ``fuse_batchnorm`` makes a faster
inference copy.
"""
from backbones.base import FaceBackbone
from backbones.fusion import fuse_batchnorm
from backbones.inference import face_tensor, flip_fused_embeddings, prepared_face, read_face_image
from backbones.registry import NETWORKS, get_model
from backbones.weights import WeightsError, load_backbone, read_state_dict, suggest_network

__all__ = [
    "NETWORKS", "FaceBackbone", "WeightsError", "face_tensor", "flip_fused_embeddings", "fuse_batchnorm",
    "get_model", "load_backbone", "prepared_face", "read_face_image", "read_state_dict", "suggest_network",
]
