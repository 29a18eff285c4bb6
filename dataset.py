"""The one import path for face data: reading, loading, packing and synthetic faces.

Training, tools, benchmarks and tests import from here; the pieces live in the small modules of
``facedata/`` (one job each), which import each other but are not imported from outside.
"""
from facedata.errors import DataError
from facedata.faces import FaceDataset, ViewSource, build_dataset
from facedata.loader import Batch, FaceLoader, build_loader
from facedata.packing import InsightfaceWriter, check_output, encode, pack_identity, scan_identities, side_by_side
from facedata.recordio import IRHeader, RecordReader, RecordWriter, pack, unpack
from facedata.synthetic import identity_records, render_faces, verification_pairs

__all__ = ["Batch", "DataError", "FaceDataset", "FaceLoader", "IRHeader", "InsightfaceWriter", "RecordReader",
           "RecordWriter", "ViewSource", "build_dataset", "build_loader", "check_output", "encode",
           "identity_records", "pack", "pack_identity", "render_faces", "scan_identities", "side_by_side", "unpack",
           "verification_pairs"]
