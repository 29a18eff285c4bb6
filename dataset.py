"""The one import path for face data: reading, loading, packing, augmentation and synthetic faces.

Training, tools, benchmarks and tests import from here; the pieces live in the small modules of
``facedata/`` (one job each), which import each other but are not imported from outside.
"""
from facedata.augment import SampleRandom
from facedata.dali_aug import (
    ViewAugment,
    dali_augment,
    draw_augments,
    gaussian_blur,
    grey,
    hue_saturation,
    low_resolution,
)
from facedata.errors import DataError
from facedata.faces import FaceDataset, ViewSource, build_dataset
from facedata.loader import Batch, FaceLoader, build_loader
from facedata.packing import InsightfaceWriter, check_output, encode, pack_identity, scan_identities, side_by_side
from facedata.recordio import IRHeader, RecordReader, RecordWriter, pack, unpack
from facedata.staging import one_ahead
from facedata.synthetic import identity_records, render_faces, verification_pairs

__all__ = ["Batch", "DataError", "FaceDataset", "FaceLoader", "IRHeader", "InsightfaceWriter", "RecordReader",
           "RecordWriter", "SampleRandom", "ViewAugment", "ViewSource", "build_dataset", "build_loader", "check_output",
           "dali_augment", "draw_augments", "encode", "gaussian_blur", "grey", "hue_saturation", "identity_records",
           "low_resolution", "one_ahead", "pack", "pack_identity", "render_faces", "scan_identities", "side_by_side",
           "unpack", "verification_pairs"]
