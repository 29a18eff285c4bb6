"""The data API the training loop uses; the pieces live in the small modules of ``facedata/``."""
from facedata.errors import DataError
from facedata.faces import FaceDataset, build_dataset
from facedata.loader import FaceLoader, build_loader
from facedata.recordio import IRHeader, RecordReader, RecordWriter, pack, unpack

__all__ = ["DataError", "FaceDataset", "FaceLoader", "IRHeader", "RecordReader", "RecordWriter", "build_dataset",
           "build_loader", "pack", "unpack"]
