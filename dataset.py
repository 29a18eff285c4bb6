"""Face data for training and the tools: reading insightface RecordIO, V views per sample, the loader,
packing datasets and the synthetic faces of the demo.

The one import path for face data outside ``facedata/``: train.py, the tools, eval, the backbones' photo
preparation, benchmarks and tests all import these names from here, and arcface_torch users find the names
they know (``RecordReader``, ``unpack``). ``facedata/`` is the implementation, small modules with one job
each; only a test or benchmark of one of those modules imports what it does not export here.
"""
from facedata.alignment import align_face
from facedata.faces import build_dataset
from facedata.loader import FaceLoader, build_loader
from facedata.packing import (
    PACKABLE_SAID,
    PACKABLE_SUFFIXES,
    InsightfaceWriter,
    check_output,
    empty_folders,
    encode,
    pack_identity,
    scan_identities,
    side_by_side,
    skipped_folders_line,
)
from facedata.photos import (
    PREPARATIONS,
    Preparation,
    PreparedFace,
    add_preparation_arguments,
    add_skip_bad_argument,
    preparation_following,
    preparation_from_args,
    prepare_or_skip,
    several_faces_line,
    skipped_line,
    stretch_warning,
)
from facedata.preparation_record import (
    TRAINING_RECORDS,
    copy_record,
    held_out,
    preparation_note,
    read_preparation,
    read_record,
    record_path,
    recorded_preparation,
    write_preparation,
)
from facedata.recordio import IRHeader, RecordReader, RecordWriter, pack, unpack
from facedata.sources import classes_in_header
from facedata.synthetic import identity_records, render_faces, verification_pairs
from facedata.view_sources import VIEW_SOURCES

__all__ = ["PACKABLE_SAID", "PACKABLE_SUFFIXES", "PREPARATIONS", "TRAINING_RECORDS", "VIEW_SOURCES", "FaceLoader",
           "IRHeader", "InsightfaceWriter", "Preparation", "PreparedFace", "RecordReader", "RecordWriter",
           "add_preparation_arguments", "add_skip_bad_argument", "align_face", "build_dataset", "build_loader",
           "check_output", "classes_in_header", "copy_record", "empty_folders", "encode", "held_out",
           "identity_records", "pack", "pack_identity", "prepare_or_skip", "preparation_following",
           "preparation_from_args", "preparation_note", "read_preparation", "read_record", "record_path",
           "recorded_preparation", "render_faces", "scan_identities", "several_faces_line", "side_by_side",
           "skipped_folders_line", "skipped_line", "stretch_warning", "unpack", "verification_pairs",
           "write_preparation"]
