"""See the faces a model will see: every photo under a folder prepared as the tools prepare it (--detect, --crop,
--landmarks FILE, ...) and written as a 112x112 PNG under OUT, in the same sub-folders, beside one contact sheet of
them all (OUT/contact_sheet.png, each face over its file's name).

    python -m tools.prepare_photos photos/ output/aligned --detect

Check the crops before packing: with --detect, a face cut badly (a poster behind the person, a profile) shows here;
replace that photo, or leave it out. A photo that cannot be prepared (no face found, unreadable) stops the job
naming it, or, with --skip-bad, is left out and named at the end.
"""
from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from dataset import (
    PACKABLE_SAID,
    PACKABLE_SUFFIXES,
    add_preparation_arguments,
    add_skip_bad_argument,
    preparation_from_args,
    prepare_or_skip,
    several_faces_line,
    skipped_line,
    stretch_warning,
)
from utils.cli import exit_on_user_error
from utils.errors import ConfigError, DataError, located
from utils.image import IMAGE_SIZE
from utils.progress import progress

SHEET = "contact_sheet.png"
COLUMNS = 10
LABEL = 14  # pixels of file name under each face
SHEET_LIMIT = 500  # faces on the sheet at most (the folder holds them all)


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", type=Path, help="a folder of photos (sub-folders included)")
    parser.add_argument("output", type=Path, help=f"the folder to write the faces and {SHEET} to (new or empty)")
    add_preparation_arguments(parser, "the photo's path relative to the input folder, e.g. anna/001.jpg")
    add_skip_bad_argument(parser, "it gets no face and no place on the sheet")
    return parser.parse_args(argv)


def face_name(photo: Path, root: Path) -> Path:
    """Where a photo's face goes under the output folder: its path, as a PNG."""
    return photo.relative_to(root).with_suffix(".png")


def contact_sheet(faces: Sequence[tuple[str, np.ndarray]]) -> Image.Image:
    """The faces in rows of COLUMNS, each over its name (cut to fit)."""
    rows = -(-len(faces) // COLUMNS)
    tile = (IMAGE_SIZE, IMAGE_SIZE + LABEL)
    sheet = Image.new("RGB", (min(len(faces), COLUMNS) * tile[0], rows * tile[1]), "white")
    draw = ImageDraw.Draw(sheet)
    for index, (name, pixels) in enumerate(faces):
        left, top = index % COLUMNS * tile[0], index // COLUMNS * tile[1]
        sheet.paste(Image.fromarray(pixels), (left, top))
        draw.text((left + 2, top + IMAGE_SIZE + 1), name if len(name) <= 18 else "..." + name[-15:], fill="black")
    return sheet


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_on_user_error():
        if not args.input.is_dir():
            raise DataError(f"input folder {located(args.input)} does not exist; pass a folder of photos")
        if args.output.exists() and (not args.output.is_dir() or any(args.output.iterdir())):
            raise ConfigError(f"{args.output} already exists and is not an empty folder; choose a new one, or empty "
                              "it (nothing already written is replaced)")
        photos = sorted(path for path in args.input.rglob("*") if path.is_file()
                        and path.suffix.lower() in PACKABLE_SUFFIXES)
        if not photos:
            raise DataError(f"{args.input} holds no photo ({PACKABLE_SAID}); pass the folder that holds them")
        names = [face_name(photo, args.input) for photo in photos]
        if len(set(names)) < len(names):
            twin = next(name for name in names if names.count(name) > 1)
            raise DataError(f"two photos in {args.input} would both become {twin} (the same name, another suffix); "
                            "rename one")
        preparation = preparation_from_args(args, args.input)
        skipped: list[str] | None = [] if args.skip_bad else None
        faces, stretched, crowded = [], [], []
        for photo, name in progress(list(zip(photos, names)), len(photos), "preparing photos", sys.stderr):
            face = prepare_or_skip(preparation, photo, skipped)
            if face is None:
                continue
            faces.append((name, face.pixels))
            stretched += [(str(photo), face.stretched_from)] if face.stretched_from else []
            crowded += [(str(photo), face.faces_found)] if face.crowded else []
        if not faces:
            raise DataError(f"--skip-bad left out every one of the {len(photos)} photos in {args.input} (e.g. "
                            f"{(skipped or ['?'])[0]}); replace them")
        for name, pixels in faces:
            (args.output / name).parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(pixels).save(args.output / name)
        shown = faces[:SHEET_LIMIT]
        contact_sheet([(name.as_posix(), pixels) for name, pixels in shown]).save(args.output / SHEET)
    if warning := stretch_warning(stretched, len(faces)):
        print(warning, file=sys.stderr)
    if note := several_faces_line(crowded, len(faces)):
        print(note)
    more = f" (the first {len(shown)} of them)" if len(shown) < len(faces) else ""
    print(f"{args.output}: {len(faces)} faces ({preparation.describe()}); contact sheet{more}: {args.output / SHEET}")
    if said := skipped_line(skipped or []):
        print(said, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
