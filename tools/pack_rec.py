"""Pack an image folder (one sub-folder per identity) into ``train.rec/.idx`` in insightface's layout.

    python -m tools.pack_rec faces/ data/faces_pair --views 2 --resize

Any image size and grayscale images are fine: every photo becomes a 112x112 RGB face as in every tool
that reads photos (facedata/photos.py): stretched (``--resize``, the default; a warning names the photos
whose aspect ratio that changed), centre-cropped (``--crop``), shrunk to fit and centred on black
(``--pad``), or aligned by its five landmarks (``--landmarks FILE``, photos named relative to the input
folder) or by those a face detector finds (``--detect``, for ordinary photos). The preparation is recorded
beside the records (``train.rec.preparation.json``): training carries it into the run's model.json, and
tools.make_bin (writing beside train.rec) and tools.inference prepare their photos the same way by default.

With ``--views V`` each record holds V different images of one identity side by side (112 x 112V); an
identity's images are taken V at a time in name order, its last record topped up with its first images,
and identities with fewer than V images are left out (and listed, as are sub-folders without images).
Classes are numbered in the sorted order of the sub-folders that were kept.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from multiprocessing import Pool

from dataset import (
    InsightfaceWriter,
    add_preparation_arguments,
    add_skip_bad_argument,
    check_output,
    pack_identity,
    preparation_from_args,
    scan_identities,
    several_faces_line,
    skipped_folders_line,
    skipped_line,
    stretch_warning,
    write_preparation,
)
from utils.cli import exit_on_user_error, ignore_ctrl_c
from utils.errors import ConfigError, DataError
from utils.progress import progress


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("input", help="image folder: one sub-folder of images per identity")
    parser.add_argument("output", help="folder to write train.rec and train.idx to")
    parser.add_argument("--views", type=int, default=1, help="images of one identity side by side per record")
    parser.add_argument("--format", choices=("jpeg", "png"), default="jpeg", help="record image encoding")
    parser.add_argument("--quality", type=int, default=95, help="JPEG quality")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="encoding processes")
    parser.add_argument("--overwrite", "--force", dest="overwrite", action="store_true",
                        help="replace a train.rec/.idx already in output")
    add_preparation_arguments(parser, "the photo's path relative to the input folder, e.g. anna/001.jpg")
    add_skip_bad_argument(parser, "an identity left with fewer than --views photos is left out and listed")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.time()
    with exit_on_user_error():
        if args.views < 1:
            raise ConfigError(f"--views {args.views} is not a positive number; pass --views 1 or more")
        check_output(args.output, ["train.rec", "train.idx"], args.overwrite)
        identities = scan_identities(args.input)
        kept = [(name, paths) for name, paths in identities if len(paths) >= args.views]
        left_out = [name for name, paths in identities if len(paths) < args.views]
        if not kept:
            raise DataError(f"no identity in {args.input} has the {args.views} images --views needs; "
                            "lower --views or add images")
        preparation = preparation_from_args(args, args.input)
        encode_one = partial(pack_identity, views=args.views, preparation=preparation, image_format=args.format,
                             quality=args.quality, skip_bad=args.skip_bad)
        stretched, crowded, unreadable, packed_people, sizes = [], [], [], [], set()
        with InsightfaceWriter(args.output) as writer, Pool(max(1, args.workers), ignore_ctrl_c) as pool:
            packed = zip(kept, pool.imap(encode_one, [paths for _, paths in kept], chunksize=4))
            for (name, _), (records, identity_stretched, identity_unreadable, identity_sizes, identity_crowded) in \
                    progress(packed, len(kept), "packing identities", sys.stderr):
                unreadable += identity_unreadable
                stretched += identity_stretched
                crowded += identity_crowded
                sizes |= identity_sizes
                if records:  # --skip-bad may leave an identity too few photos: it gets no class
                    writer.write_identity(records)
                    packed_people.append(name)
                else:
                    left_out.append(name)
            if not packed_people:
                print(skipped_line(unreadable), file=sys.stderr)
                raise DataError(f"no identity in {args.input} has the {args.views} readable images --views needs; "
                                "replace the photos named above or lower --views")
        # Once the records are whole; the people, so that tools.make_bin can tell whether a set holds others.
        write_preparation(writer.rec_path, preparation, "tools.pack_rec", sizes, {"people": packed_people})
    photos = sum(len(paths) for _, paths in kept)
    if warning := stretch_warning(stretched, photos):
        print(warning, file=sys.stderr)
    if note := several_faces_line(crowded, photos):
        print(note)
    if skipped := skipped_folders_line(args.input):
        print(skipped)
    if left_out:
        readable = " readable" if args.skip_bad else ""
        print(f"left out {len(left_out)} identities with fewer than {args.views}{readable} images: "
              f"{', '.join(left_out[:10])}{' ...' if len(left_out) > 10 else ''}")
    print(f"{args.output}: {writer.num_records} records of {args.views} view(s), {len(packed_people)} identities "
          f"(classes 0..{len(packed_people) - 1}), {preparation.describe()}, {args.format} "
          f"({time.time() - start:.1f} s)")
    if said := skipped_line(unreadable):  # last: every photo left out, named once
        print(said, file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
