"""How often the face detector behind ``--detect`` finds a face, and how fast, on a folder of photos (e.g. LFW's
raw ``images/``): every photo read, detected and aligned as the tools prepare it, on one thread.

    python -m experiments.detection_rate /path/to/lfw/images [--limit N]

Prints the photos in which no face was found (each by name), how many held several (and in how many of those the
largest face, the one the tools take, is not the one nearest the photo's centre: on LFW, whose photos are centred
on their subject, a sign that the largest was someone else), and the CPU time per photo (of
this process, on one thread, so that work beside it does not change the figure): the detection alone (on the
decoded photo) and the whole preparation (reading the file, detection, alignment).
"""
from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Sequence
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from dataset import PACKABLE_SUFFIXES, Preparation
from facedata.detector import SCORE_THRESHOLD, check_detector, detect_faces
from utils.errors import FaceImageError


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("photos", type=Path, help="a folder of photos (searched recursively)")
    parser.add_argument("--limit", type=int, help="only the first N photos, in name order")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    detector = check_detector()
    paths = sorted(path for path in args.photos.rglob("*") if path.suffix.lower() in PACKABLE_SUFFIXES)
    paths = paths[:args.limit] if args.limit else paths
    preparation = Preparation(detector=detector)
    missed, found, off_centre, detect_seconds, prepare_seconds, sizes = [], [], [], 0.0, 0.0, set()
    for path in paths:
        with Image.open(path) as image:
            image.load()
            sizes.add(image.size)
            began = time.process_time()
            faces = detect_faces(image)
            detect_seconds += time.process_time() - began
        found.append(len(faces))
        if len(faces) > 1:
            centre = np.array(image.size) / 2
            distances = [np.linalg.norm((face.box[:2] + face.box[2:]) / 2 - centre) for face in faces]
            if int(np.argmin(distances)) != 0:  # faces come largest first
                off_centre.append(path)
        began = time.process_time()
        try:
            preparation.face(path)
        except FaceImageError:
            missed.append(path)
        prepare_seconds += time.process_time() - began
    found = np.array(found)
    shown = ", ".join(f"{w}x{h}" for w, h in sorted(sizes)[:3]) + (" ..." if len(sizes) > 3 else "")
    print(f"{detector}, score > {SCORE_THRESHOLD}, one thread, {len(paths)} photos ({shown}) in {args.photos}")
    print(f"a face found in {len(paths) - len(missed)} of {len(paths)} ({1 - len(missed) / len(paths):.2%}); "
          f"several faces in {int((found > 1).sum())} (the largest used; in {len(off_centre)} of them another face is "
          "nearer the photo's centre)")
    print(f"CPU time per photo: detection {1000 * detect_seconds / len(paths):.1f} ms; the whole preparation (reading "
          f"the file, detection, alignment) {1000 * prepare_seconds / len(paths):.1f} ms")
    for path in missed:
        print(f"no face: {path}")
    for path in off_centre:
        print(f"largest face not the most central: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
