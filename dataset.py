"""Face data for training and the tools: reading insightface RecordIO, V views per sample, the loader,
packing datasets and the synthetic faces of the demo.

The pieces live in the small modules of ``facedata/`` (one job each); this module names what
train.py and the tools use, and the names arcface_torch users know (``RecordReader``, ``unpack``).
"""
from facedata.faces import build_dataset
from facedata.loader import FaceLoader, build_loader
from facedata.packing import (
    InsightfaceWriter,
    check_output,
    empty_folders,
    encode,
    pack_identity,
    scan_identities,
    skipped_folders_line,
)
from facedata.photos import (
    Preparation,
    PreparedFace,
    add_preparation_arguments,
    add_skip_bad_argument,
    preparation_following,
    preparation_from_args,
    prepare_or_skip,
    skipped_line,
    stretch_warning,
)
from facedata.preparation_record import (
    TRAINING_RECORDS,
    held_out,
    preparation_note,
    read_preparation,
    read_record,
    recorded_preparation,
    write_preparation,
)
from facedata.recordio import IRHeader, RecordReader, unpack
from facedata.sources import classes_in_header
from facedata.synthetic import identity_records, verification_pairs

__all__ = ["TRAINING_RECORDS", "FaceLoader", "IRHeader", "InsightfaceWriter", "Preparation", "PreparedFace",
           "RecordReader", "add_preparation_arguments", "add_skip_bad_argument", "build_dataset", "build_loader",
           "check_output", "classes_in_header", "empty_folders", "encode", "held_out", "identity_records",
           "pack_identity", "prepare_or_skip", "preparation_following", "preparation_from_args", "preparation_note",
           "read_preparation", "read_record", "recorded_preparation", "scan_identities", "skipped_folders_line",
           "skipped_line", "stretch_warning", "unpack", "verification_pairs", "write_preparation"]
