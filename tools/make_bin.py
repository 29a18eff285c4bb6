"""Make a verification ``.bin`` (as insightface's lfw.bin) from a folder of your own face photos.

    python -m tools.make_bin lfw_aligned/ lfw.bin --pairs pairs.txt
    python -m tools.make_bin faces/ faces_val.bin --random 3000 --seed 0

IMAGE_FOLDER holds one sub-folder of face photos per identity. Each photo becomes a 112x112 face as in
every tool that reads photos (facedata/photos.py): ``--resize`` (the default; a warning names the photos
whose aspect ratio that changed), ``--crop``, ``--pad``, ``--landmarks FILE`` or ``--detect``. Use the option the
training records were packed with (tools.pack_rec), so that evaluation sees faces as training did: when
OUT.bin goes beside a train.rec whose preparation tools.pack_rec recorded, that one is the default (an
option that differs gets a warning). The preparation is recorded beside OUT.bin too
(``OUT.bin.preparation.json``), for eval.verification to check against the model's.

--pairs FILE: LFW's pairs.txt format. A header line (``folds pairs_per_fold``: 2 x folds x
pairs_per_fold pairs follow, or a single count N: 2N follow), then ``name n1 n2`` for photos n1 and n2
of one person and ``name1 n1 name2 n2`` for photos of two people; photo n of name is
``IMAGE_FOLDER/name/name_%04d.jpg``. A ``folds pairs_per_fold`` file keeps its order (pairs.txt: 10 folds of
300 same then 300 different). A single-count file lists its N same-person pairs first (LFW's pairsDevTest.txt):
its pairs are laid out as 10 folds of N/10 same then N/10 different, as pairs.txt is, so that each of the ten
contiguous folds evaluation cuts holds both kinds.

--random N: N same-person and N different-person pairs drawn from the folder with ``--seed``, each
possible pair equally likely and none twice, same and different alternating (so every one of the
ten contiguous folds evaluation cuts holds both kinds).

Output: a pickle (protocol 4) of ``(bins, issame)``, what arcface_torch's ``load_bin`` reads: 2N
encoded images, pair i = images (2i, 2i+1). A 112x112 JPEG or PNG is stored byte for byte (unless
aligned by landmarks). Any other photo is prepared and stored as JPEG quality 95, or PNG when the file
was lossless.
"""
from __future__ import annotations

import argparse
import io
import os
import pickle
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TextIO

import numpy as np
from PIL import Image

from dataset import (
    TRAINING_RECORDS,
    Preparation,
    PreparedFace,
    add_preparation_arguments,
    add_skip_bad_argument,
    encode,
    preparation_following,
    prepare_or_skip,
    read_preparation,
    read_record,
    scan_identities,
    several_faces_line,
    skipped_folders_line,
    skipped_line,
    stretch_warning,
    write_preparation,
)
from utils.cli import exit_on_user_error
from utils.errors import ConfigError, DataError, located
from utils.image import IMAGE_SIZE
from utils.progress import progress

JPEG_QUALITY = 95

Pair = tuple[Path, Path, bool]  # first image, second image, same person


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("images", type=Path, metavar="IMAGE_FOLDER", help="one sub-folder of face crops per identity")
    parser.add_argument("output", type=Path, metavar="OUT.bin", help="the verification set to write")
    pairs = parser.add_mutually_exclusive_group(required=True)
    pairs.add_argument("--pairs", type=Path, metavar="FILE", help="pairs in LFW's pairs.txt format")
    pairs.add_argument("--random", type=int, metavar="N", help="draw N same-person and N different-person pairs")
    parser.add_argument("--seed", type=int, default=0, help="seed of --random")
    parser.add_argument("--force", "--overwrite", dest="force", action="store_true", help="replace OUT.bin")
    add_preparation_arguments(parser, "the photo's path relative to IMAGE_FOLDER, e.g. Ann_Lee/Ann_Lee_0001.jpg",
                              "the train.rec.preparation.json beside the .bin")
    add_skip_bad_argument(parser, "with the pairs it is in")
    return parser.parse_args(argv)


# --- pairs ---------------------------------------------------------------------------------------


def _photo(folder: Path, name: str, number: str, where: str) -> Path:
    try:
        index = int(number)
    except ValueError:
        raise DataError(f"{where}: photo number {number!r} is not a whole number; write e.g. '{name} 1 4'") from None
    path = folder / name / f"{name}_{index:04d}.jpg"
    if not path.is_file():
        raise DataError(f"{where} names photo {index} of {name}, but {path} does not exist; check IMAGE_FOLDER "
                        "(one sub-folder per name, photos named name_0001.jpg, ...)")
    return path


def _expected_pairs(header: list[str], where: str) -> int:
    try:
        counts = [int(field) for field in header]
    except ValueError:
        counts = []
    if len(counts) == 2:
        return 2 * counts[0] * counts[1]
    if len(counts) == 1:
        return 2 * counts[0]
    raise DataError(f"{where} is {' '.join(header)!r}; the first line must be 'folds pairs_per_fold' (e.g. '10 300') "
                    "or one count, as in LFW's pairs.txt")


def read_pairs(pairs_file: Path, folder: Path) -> tuple[list[Pair], str | None]:
    """The pairs of an LFW-format pairs file, their photos looked up in ``folder``, and the line saying how they
    were laid out in folds (None: in the file's order)."""
    try:
        lines = [(number, line.split()) for number, line in enumerate(pairs_file.read_text().splitlines(), 1)]
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"pairs file {pairs_file} cannot be read ({error}); pass LFW's pairs.txt or a file "
                        "in its format") from None
    lines = [(number, fields) for number, fields in lines if fields]
    if not lines:
        raise DataError(f"pairs file {pairs_file} is empty; pass LFW's pairs.txt or a file in its format")
    expected = _expected_pairs(lines[0][1], f"{pairs_file} line {lines[0][0]}")
    pairs = []
    for number, fields in lines[1:]:
        where = f"{pairs_file} line {number}"
        if len(fields) == 3:
            name, first, second = fields
            pairs.append((_photo(folder, name, first, where), _photo(folder, name, second, where), True))
        elif len(fields) == 4:
            name1, first, name2, second = fields
            pairs.append((_photo(folder, name1, first, where), _photo(folder, name2, second, where), False))
        else:
            raise DataError(f"{where} has {len(fields)} fields; same-person lines are 'name n1 n2' and "
                            "different-person lines 'name1 n1 name2 n2'")
    if len(pairs) != expected:
        raise DataError(f"{pairs_file} lists {len(pairs)} pairs but its header promises {expected}; the file is "
                        "truncated or its first line is wrong")
    if len(lines[0][1]) == 2:
        return pairs, None
    pairs = in_folds(pairs)
    return pairs, (f"{pairs_file} lists one count: its pairs are laid out as LFW's pairs.txt is, in folds of "
                   "same-person then different-person pairs, so that each evaluation fold holds both kinds")


def in_folds(pairs: list[Pair], folds: int = 10) -> list[Pair]:
    """``pairs`` as ``folds`` blocks, block i the i-th contiguous run of the same-person pairs then the i-th run of
    the different-person pairs (both kept in order), as LFW's pairs.txt lays out its ten folds."""
    same = [pair for pair in pairs if pair[2]]
    different = [pair for pair in pairs if not pair[2]]
    runs = min(folds, len(same), len(different)) or 1
    blocks = zip(np.array_split(np.arange(len(same)), runs), np.array_split(np.arange(len(different)), runs))
    return [pair for same_run, different_run in blocks
            for pair in [same[i] for i in same_run] + [different[i] for i in different_run]]


def _draw_unique(rng: np.random.Generator, count: int, draw) -> list[tuple[int, int]]:
    """``count`` different unordered pairs from ``draw(rng) -> (a, b)`` (None: drawn again)."""
    seen, pairs = set(), []
    while len(pairs) < count:
        pair = draw(rng)
        if pair is not None and frozenset(pair) not in seen:
            seen.add(frozenset(pair))
            pairs.append(pair)
    return pairs


def random_pairs(folder: Path, count: int, seed: int) -> list[Pair]:
    """``count`` same-person and ``count`` different-person pairs, alternating, each possible pair equally likely."""
    identities = scan_identities(str(folder))
    paths = [Path(path) for _, photos in identities for path in photos]
    owner = np.repeat(np.arange(len(identities)), [len(photos) for _, photos in identities])
    first_photo = np.r_[0, np.cumsum([len(photos) for _, photos in identities])[:-1]]
    sizes = np.bincount(owner)
    same_possible = int((sizes * (sizes - 1) // 2).sum())
    different_possible = int((len(paths) ** 2 - (sizes ** 2).sum()) // 2)
    if count > min(same_possible, different_possible):
        raise DataError(f"{folder} allows {same_possible} same-person and {different_possible} different-person "
                        f"pairs, fewer than the {count} asked for; lower --random or add photos (same-person pairs "
                        "need identities with two or more)")
    rng = np.random.default_rng(seed)
    pair_weights = sizes * (sizes - 1) / (2 * same_possible)

    def same(rng: np.random.Generator) -> tuple[int, int]:
        identity = rng.choice(len(sizes), p=pair_weights)  # weighted by its pairs: every pair equally likely
        a, b = rng.choice(sizes[identity], 2, replace=False)
        return int(first_photo[identity] + a), int(first_photo[identity] + b)

    def different(rng: np.random.Generator) -> tuple[int, int] | None:
        a, b = rng.choice(len(paths), 2, replace=False)
        return None if owner[a] == owner[b] else (int(a), int(b))

    positives = _draw_unique(rng, count, same)
    negatives = _draw_unique(rng, count, different)
    pairs = []
    for (a, b), (c, d) in zip(positives, negatives):
        pairs += [(paths[a], paths[b], True), (paths[c], paths[d], False)]
    return pairs


# --- images --------------------------------------------------------------------------------------


def encode_face(path: Path, preparation: Preparation, skipped: list[str] | None = None
                ) -> tuple[bytes, PreparedFace, bool] | None:
    """``(what the .bin stores for this photo, the prepared face, whether it was re-encoded)``; see the module
    doc. A photo that cannot be prepared raises its FaceImageError, or, with ``skipped`` a list (--skip-bad),
    gives None and its sentence is added there."""
    face = prepare_or_skip(preparation, path, skipped)  # decodes it all: a truncated file fails here, not later
    if face is None:
        return None
    data = path.read_bytes()
    with Image.open(io.BytesIO(data)) as image:
        size, source_format = image.size, image.format
    if not preparation.aligns and size == (IMAGE_SIZE, IMAGE_SIZE) and source_format in ("JPEG", "PNG"):
        return data, face, False
    return encode(face.pixels, "jpeg" if source_format == "JPEG" else "png", JPEG_QUALITY), face, True


def encode_pairs(pairs: Sequence[Pair], preparation: Preparation, stream: TextIO | None = None,
                 skipped: list[str] | None = None
                 ) -> tuple[list[bytes], list[bool], dict[Path, tuple[PreparedFace, bool]]]:
    """``(2N encoded images in pair order, the N pairs' issame, each photo's prepared face and whether it was
    re-encoded)``; each file is read once. With ``skipped`` a list (--skip-bad), a pair holding a photo that
    cannot be prepared is left out, and each such photo's sentence is added there once."""
    encoded: dict[Path, tuple[bytes, PreparedFace, bool] | None] = {}
    paths = [path for first, second, _ in pairs for path in (first, second)]
    for path in progress(paths, len(paths), "encoding photos", stream):
        if path not in encoded:
            encoded[path] = encode_face(path, preparation, skipped)
    bins, issame = [], []
    for first, second, same in pairs:
        if encoded[first] is not None and encoded[second] is not None:
            bins += [encoded[first][0], encoded[second][0]]
            issame.append(same)
    return bins, issame, {path: done[1:] for path, done in encoded.items() if done is not None}


def write_bin(path: Path, bins: list[bytes], issame: list[bool]) -> None:
    """The pickle, written beside ``path`` and renamed over it: never a half-written .bin."""
    partial = path.with_name(f".{path.name}.partial")
    with open(partial, "wb") as f:
        pickle.dump((bins, issame), f, protocol=4)
    os.replace(partial, path)


def stored_line(faces: dict[Path, tuple[PreparedFace, bool]], preparation: Preparation) -> str:
    """How the .bin stores its photos: prepared and re-encoded, or byte for byte (see the module doc)."""
    reencoded = sum(again for _, again in faces.values())
    if reencoded == len(faces):
        return f"every one of the {len(faces)} photos prepared ({preparation.describe()}) and re-encoded"
    if reencoded == 0:
        return f"every one of the {len(faces)} photos already {IMAGE_SIZE}x{IMAGE_SIZE}, stored as it was"
    return (f"{reencoded} of {len(faces)} photos prepared ({preparation.describe()}) and re-encoded, the others "
            f"already {IMAGE_SIZE}x{IMAGE_SIZE}, stored as they were")


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    with exit_on_user_error():
        if not args.images.is_dir():
            raise DataError(f"image folder {located(args.images)} does not exist; pass a folder with one sub-folder "
                            "per identity")
        if not args.output.parent.is_dir():
            raise ConfigError(f"{args.output} is in a folder that does not exist; create {args.output.parent} first "
                              "or choose another path")
        if args.output.exists() and not args.force:
            raise ConfigError(f"{args.output} already exists; pass --force to replace it or choose another path")
        if args.random is not None and args.random < 1:
            raise ConfigError(f"--random {args.random} is not a positive number; pass --random 1 or more")
        if args.pairs is not None:
            pairs, laid_out = read_pairs(args.pairs, args.images)
            if laid_out:
                print(laid_out)
        else:
            pairs = random_pairs(args.images, args.random, args.seed)
        records = args.output.parent / TRAINING_RECORDS  # beside the .bin, as val_targets look sets up
        preparation, said = preparation_following(args, read_preparation(records), str(records), args.images)
        if said:
            print(said, file=sys.stderr if said.startswith("warning") else sys.stdout)
        people = sorted({path.parent.name for first, second, _ in pairs for path in (first, second)})
        training_people = read_record(records).get("people")
        in_training = sorted(set(people) & set(training_people)) if isinstance(training_people, list) else None
        if in_training:
            print(f"note: {len(in_training)} of the {len(people)} people in this set are among the people "
                  f"{records} was packed from (e.g. {in_training[0]}): it does not measure faces the model has "
                  "never seen, and tools.inference prefers a set of people kept out of training")
        if args.random is not None and (skipped := skipped_folders_line(str(args.images))):
            print(skipped)
        unreadable: list[str] | None = [] if args.skip_bad else None
        bins, issame, faces = encode_pairs(pairs, preparation, sys.stderr, unreadable)
        if unreadable and len(set(issame)) < 2:
            print(skipped_line(unreadable), file=sys.stderr)
            kind = "no pair" if not issame else f"only {'same' if issame[0] else 'different'}-person pairs"
            raise DataError(f"with the pairs holding the {len(unreadable)} photo(s) --skip-bad left out (named above), "
                            f"{args.output} would hold {kind}, which no evaluation can score; replace those photos")
        write_bin(args.output, bins, issame)
        write_preparation(args.output, preparation, "tools.make_bin",
                          {face.photo_size for face, _ in faces.values() if face.photo_size},
                          None if in_training is None else {"people_in_training": len(in_training)})
    print(f"wrote {args.output}: {len(issame)} pairs ({sum(issame)} same person, {len(issame) - sum(issame)} "
          f"different), {len(bins)} images, {stored_line(faces, preparation)}")
    stretched = [(str(path), face.stretched_from) for path, (face, _) in faces.items() if face.stretched_from]
    if warning := stretch_warning(stretched, len(faces)):
        print(warning, file=sys.stderr)
    crowded = [(str(path), face.faces_found) for path, (face, _) in faces.items() if face.crowded]
    if note := several_faces_line(crowded, len(faces)):
        print(note)
    if said := skipped_line(unreadable or []):  # last: every photo left out, named once
        print(f"{said}; the {len(pairs) - len(issame)} pair(s) holding them are not in {args.output}",
              file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
