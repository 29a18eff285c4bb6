"""Face data for training and the tools: reading insightface RecordIO, V views per sample, the loader,
packing datasets and the synthetic faces of the demo.

The pieces live in the small modules of ``facedata/`` (one job each); this module names what
train.py and the tools use, and the names arcface_torch users know (``RecordReader``, ``unpack``).
"""
from facedata.faces import build_dataset
from facedata.loader import FaceLoader, build_loader
from facedata.packing import InsightfaceWriter, check_output, encode, pack_identity, scan_identities
from facedata.photos import (
    Preparation,
    PreparedFace,
    add_preparation_arguments,
    preparation_from_args,
    stretch_warning,
)
from facedata.recordio import IRHeader, RecordReader, unpack
from facedata.synthetic import identity_records, verification_pairs

__all__ = ["FaceLoader", "IRHeader", "InsightfaceWriter", "Preparation", "PreparedFace", "RecordReader",
           "add_preparation_arguments", "build_dataset", "build_loader", "check_output", "encode", "identity_records",
           "pack_identity", "preparation_from_args", "scan_identities", "stretch_warning", "unpack",
           "verification_pairs"]
