"""Make a synthetic face dataset: ``train.rec/.idx`` (V views per record, insightface layout) and a
verification set ``synthetic_val.bin`` of held-out identities with equal positive and negative pairs.

    python -m tools.make_synthetic --output data/synthetic_pair --identities 1000 \\
        --images-per-identity 8 --views 2 --val-pairs 600 --seed 0

Each identity draws ``--images-per-identity`` photos, packed ``--views`` per record (leftovers are
dropped). The val identities are numbered after the training ones, so the two never overlap.
"""
from __future__ import annotations

import argparse
import os
import pickle
import sys
import time
from functools import partial
from multiprocessing import Pool

import numpy as np

from dataset import (
    TRAINING_RECORDS,
    InsightfaceWriter,
    Preparation,
    check_output,
    encode,
    identity_records,
    verification_pairs,
    write_preparation,
)
from utils.atomic import atomic_save
from utils.cli import exit_on_user_error, ignore_ctrl_c
from utils.errors import ConfigError
from utils.image import IMAGE_SIZE
from utils.progress import progress

VAL_NAME = "synthetic_val.bin"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--output", required=True, help="folder for train.rec, train.idx and synthetic_val.bin")
    parser.add_argument("--identities", type=int, default=1000, help="training identities (classes)")
    parser.add_argument("--images-per-identity", type=int, default=8, help="photos drawn per training identity")
    parser.add_argument("--views", type=int, default=2, help="photos side by side in one record (V)")
    parser.add_argument("--val-identities", type=int, default=200, help="held-out identities of the val set")
    parser.add_argument("--val-pairs", type=int, default=600, help="val pairs, half positive, half negative")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quality", type=int, default=95, help="JPEG quality")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="drawing processes")
    parser.add_argument("--overwrite", "--force", dest="overwrite", action="store_true",
                        help="replace files already in --output")
    return parser.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    if args.views < 1 or args.images_per_identity < args.views:
        raise ConfigError(f"--views {args.views} with --images-per-identity {args.images_per_identity} cannot be "
                          "packed; pass --views 1 or more and at least that many --images-per-identity")
    if args.identities < 1 or args.val_identities < 2 or args.val_pairs < 2 or args.val_pairs % 2:
        raise ConfigError(f"--identities {args.identities}, --val-identities {args.val_identities} and --val-pairs "
                          f"{args.val_pairs} make no data set; pass --identities 1 or more, --val-identities 2 or "
                          "more and an even --val-pairs of 2 or more")


def record_preparation(folder: str | os.PathLike) -> None:
    """Record beside the data in ``folder`` how its faces were prepared, as tools.pack_rec and tools.make_bin
    record theirs: drawn as 112x112 faces, which every preparation leaves as they are, and a verification set none
    of whose identities is trained on; so that a model trained on them (the demo's) says so in its model.json. The
    tool itself leaves it out: its data stands for records packed elsewhere, which record nothing."""
    drawn = [(IMAGE_SIZE, IMAGE_SIZE)]
    write_preparation(os.path.join(folder, TRAINING_RECORDS), Preparation(), "tools.make_synthetic", drawn)
    write_preparation(os.path.join(folder, VAL_NAME), Preparation(), "tools.make_synthetic", drawn,
                      {"people_in_training": 0})


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_on_user_error():
        check_args(args)
        check_output(args.output, ["train.rec", "train.idx", VAL_NAME], args.overwrite)
        start = time.time()
        jobs = [(identity, args.images_per_identity, args.views, args.seed, args.quality)
                for identity in range(args.identities)]
        with InsightfaceWriter(args.output) as writer, Pool(max(1, args.workers), ignore_ctrl_c) as pool:
            drawn = pool.imap(identity_records, jobs, chunksize=8)
            for records in progress(drawn, len(jobs), "drawing identities", sys.stderr):
                writer.write_identity(records)
        val_identities = np.arange(args.identities, args.identities + args.val_identities)
        faces, issame = verification_pairs(val_identities, args.val_pairs, args.seed)
        val_set = ([encode(face, quality=args.quality) for face in faces], issame)
        atomic_save(val_set, os.path.join(args.output, VAL_NAME), write=partial(pickle.dump, protocol=4))
    print(f"{args.output}: {writer.num_records} records of {args.views} view(s) for {args.identities} identities, "
          f"{VAL_NAME} with {args.val_pairs} pairs of {args.val_identities} held-out identities "
          f"({time.time() - start:.1f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
