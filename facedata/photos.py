"""From a photo file to the 112x112 RGB face every network sees: one preparation shared by every tool that
reads photos (tools.pack_rec, tools.make_bin, tools.inference), so that training records, ``.bin`` sets and
inference see faces the same way.

Each photo is fitted to 112x112 in one of three ways, the same options in every tool:
- ``resize`` (the default): stretched to the square; a photo that is not square changes its aspect ratio,
  and the tools say so (``stretch_warning``);
- ``crop``: the largest centred square, resized: the aspect ratio kept, the ends of the longer side cut;
- ``pad``: shrunk to fit when larger, centred on black: the whole photo kept, the face smaller;
or, where a landmarks file gives its five points, warped onto the ArcFace template by the similarity that
maps them there (facedata/alignment.py, as the IJB evaluation aligns its faces). A landmarks file is
text, one photo per line: ``PHOTO x1 y1 x2 y2 x3 y3 x4 y4 x5 y5`` (left eye, right eye, nose tip, left
and right mouth corner, in the photo's pixels; numbers after the ten, such as a detector's score, are
ignored). PHOTO is the path relative to the image folder the tool reads, or as given on the command
line; with a landmarks file, every photo must have its line.
"""
from __future__ import annotations

import argparse
import contextlib
import os
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from facedata.alignment import align_face
from utils.errors import ConfigError, DataError, FaceImageError, located
from utils.image import IMAGE_SIZE

FITS = ("resize", "crop", "pad")
LANDMARKS = "landmarks"
PREPARATIONS = (*FITS, LANDMARKS)  # the names a preparation is recorded by, each the tools' option --<name>
LANDMARK_NUMBERS = 10  # five (x, y) points


@dataclass(frozen=True)
class PreparedFace:
    """A photo as a face: uint8 RGB (112, 112, 3), the photo's (width, height) when ``resize``
    stretched it out of its aspect ratio (None otherwise), and its size."""

    pixels: np.ndarray
    stretched_from: tuple[int, int] | None = None
    photo_size: tuple[int, int] | None = None  # (width, height) of the photo a fit prepared (None: aligned)


@dataclass(frozen=True)
class Preparation:
    """How photos become faces: ``fit`` for every photo, or alignment by its landmarks when ``landmarks``
    (photo name -> (5, 2) points, read by ``read_landmarks``) is given. A photo's name is its path
    relative to ``root``, or the path as given when there is no root."""

    fit: str = "resize"
    landmarks: Mapping[str, np.ndarray] | None = None
    landmarks_file: Path | None = None
    root: Path | None = None

    def __post_init__(self) -> None:
        if self.fit not in FITS:
            raise ValueError(f"fit {self.fit!r} is not one of {FITS}")

    @property
    def name(self) -> str:
        """``resize``, ``crop``, ``pad`` or ``landmarks``: what the preparation records say (PREPARATIONS)."""
        return LANDMARKS if self.landmarks is not None else self.fit

    def describe(self) -> str:
        """``crop to 112x112`` or ``aligned by the landmarks in X``: for the tools' summary lines."""
        if self.landmarks is not None:
            return f"aligned by the landmarks in {self.landmarks_file}"
        return f"{self.fit} to {IMAGE_SIZE}x{IMAGE_SIZE}"

    def face(self, path: str | os.PathLike) -> PreparedFace:
        """The photo at ``path`` prepared; FaceImageError when it cannot be read (or has no landmarks)."""
        with _open_photo(Path(path)) as image:
            if self.landmarks is None:
                return fit_photo(image, self.fit)
            name = self._name(Path(path))
            if name not in self.landmarks:
                raise FaceImageError(f"{path} has no line in landmarks file {self.landmarks_file}; add its five "
                                     f"points ('{name} x1 y1 ... x5 y5') or leave the photo out")
            try:
                return PreparedFace(_aligned(image, self.landmarks[name]))
            except ValueError as error:
                raise FaceImageError(f"{path} cannot be aligned by its line in landmarks file {self.landmarks_file} "
                                     f"({error}); fix that line") from None

    def _name(self, path: Path) -> str:
        return os.path.normpath(path if self.root is None else os.path.relpath(path, self.root))


Box = tuple[int, int, int, int]  # left, top, right, bottom


def fit_geometry(fit: str, width: int, height: int, size: int = IMAGE_SIZE) -> tuple[Box, Box]:
    """``(the part of a width x height photo that ``fit`` uses, the part of the size x size face it fills)``:
    ``fit_photo`` resamples the one onto the other (bilinear), so two fits with the same geometry for a photo
    give it the same pixels (``resize`` and ``crop`` on a square photo, say)."""
    whole = (0, 0, width, height)
    if fit == "resize":
        return whole, (0, 0, size, size)
    if fit == "crop":
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        return (left, top, left + side, top + side), (0, 0, size, size)
    if fit != "pad":
        raise ValueError(f"fit {fit!r} is not one of {FITS}")
    ratio = min(1.0, size / max(width, height))
    fitted = (max(1, round(width * ratio)), max(1, round(height * ratio))) if ratio < 1.0 else (width, height)
    left, top = (size - fitted[0]) // 2, (size - fitted[1]) // 2
    return whole, (left, top, left + fitted[0], top + fitted[1])


def same_pixels_as(fit: str, photo_sizes: Iterable[tuple[int, int]]) -> list[str]:
    """The fits (``fit`` among them) that give every photo of these (width, height) sizes the pixels ``fit``
    gives it: what a preparation record keeps, so that a check compares the faces a model sees, not the option's
    name (--crop and --resize on square photos are one preparation)."""
    sizes = set(photo_sizes)
    return [other for other in FITS
            if all(fit_geometry(other, *size) == fit_geometry(fit, *size) for size in sizes)]


def fit_photo(image: Image.Image, fit: str = "resize", size: int = IMAGE_SIZE) -> PreparedFace:
    """Any PIL image (grayscale, palette, alpha...) fitted to uint8 RGB (size, size, 3); see the module doc."""
    image = image.convert("RGB")
    width, height = image.size
    source, target = fit_geometry(fit, width, height, size)
    if source != (0, 0, width, height):
        image = image.crop(source)
    filled = (target[2] - target[0], target[3] - target[1])
    if image.size != filled:
        image = image.resize(filled, Image.BILINEAR)
    stretched = (width, height) if fit == "resize" and width != height else None
    if target == (0, 0, size, size):
        return PreparedFace(np.asarray(image), stretched, (width, height))
    canvas = Image.new("RGB", (size, size))
    canvas.paste(image, target[:2])
    return PreparedFace(np.asarray(canvas), stretched, (width, height))


def _aligned(image: Image.Image, points: np.ndarray) -> np.ndarray:
    rgb = torch.from_numpy(np.array(image.convert("RGB"))).permute(2, 0, 1)
    return align_face(rgb, points).permute(1, 2, 0).numpy()


@contextlib.contextmanager
def _open_photo(path: Path) -> Iterator[Image.Image]:
    """The photo opened and fully decoded (a truncated file fails here, not later); every reading failure is
    one FaceImageError naming the file."""
    if not path.is_file():
        raise FaceImageError(f"image file {located(path)} does not exist; check the path")
    try:
        image = Image.open(path)
        image.load()
    except (OSError, ValueError, Image.DecompressionBombError) as error:
        raise FaceImageError(f"cannot read image {path} ({error}); replace or remove it") from None
    with image:
        yield image


def read_landmarks(path: str | os.PathLike) -> dict[str, np.ndarray]:
    """photo name -> (5, 2) float64 points, from a landmarks file (see the module doc)."""
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as error:
        raise DataError(f"landmarks file {located(path)} cannot be read ({error}); pass a text file with lines "
                        "'PHOTO x1 y1 ... x5 y5'") from None
    landmarks = {}
    for number, line in enumerate(lines, 1):
        fields = line.split()
        if not fields:
            continue
        try:
            values = [float(value) for value in fields[1:]]
        except ValueError:
            values = []
        if len(values) < LANDMARK_NUMBERS:
            raise DataError(f"{path} line {number} is not 'PHOTO x1 y1 x2 y2 x3 y3 x4 y4 x5 y5' (a photo name and "
                            "ten numbers: eyes, nose tip, mouth corners); fix that line")
        landmarks[os.path.normpath(fields[0])] = np.asarray(values[:LANDMARK_NUMBERS]).reshape(5, 2)
    if not landmarks:
        raise DataError(f"landmarks file {path} lists no photo; give one line 'PHOTO x1 y1 ... x5 y5' per photo")
    return landmarks


def stretch_warning(stretched: Sequence[tuple[str, tuple[int, int]]], total: int) -> str | None:
    """One line for the photos ``resize`` stretched (``(name, (width, height))`` each), or None."""
    if not stretched:
        return None
    name, (width, height) = stretched[0]
    return (f"warning: {len(stretched)} of {total} photos are not square (e.g. {name}, {width}x{height}): --resize "
            f"stretched them to {IMAGE_SIZE}x{IMAGE_SIZE}, changing their aspect ratio; --crop or --pad keeps it. "
            "Prepare training, .bin and inference photos with the same option")


def prepare_or_skip(preparation: Preparation, path: str | os.PathLike, skipped: list[str] | None
                    ) -> PreparedFace | None:
    """``preparation.face(path)``; when it cannot be read or prepared, the FaceImageError raised, or, with
    ``skipped`` a list (--skip-bad), its sentence added there and None returned. Callers read each photo once,
    so that ``skipped_line`` names each once."""
    try:
        return preparation.face(path)
    except FaceImageError as error:
        if skipped is None:
            raise
        skipped.append(str(error))
        return None


def add_skip_bad_argument(parser: argparse.ArgumentParser, left_out: str) -> None:
    """``--skip-bad``, the same in every tool that reads many photos; ``left_out`` says what goes with a bad one."""
    parser.add_argument("--skip-bad", action="store_true",
                        help=f"leave out every photo that cannot be read or prepared ({left_out}) and name each one "
                             "once at the end, instead of stopping at the first; the output is still written only "
                             "when the job ends")


def skipped_line(skipped: Sequence[str]) -> str | None:
    """One line naming every photo --skip-bad left out, with why (each FaceImageError's sentence, its advice
    left off), or None when none was."""
    if not skipped:
        return None
    reasons = "; ".join(reason.rpartition("; ")[0] or reason for reason in skipped)
    return f"warning: --skip-bad left out {len(skipped)} photo(s) that could not be prepared: {reasons}"


class _FitOption(argparse.Action):
    """``--resize``/``--crop``/``--pad``: sets ``fit``, and ``fit_given`` so that a tool can tell an option given
    from the default (a recorded preparation wins over the default, not over an option given)."""

    def __init__(self, option_strings, dest, const, **kwargs) -> None:
        super().__init__(option_strings, dest, nargs=0, const=const, **kwargs)

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        setattr(namespace, self.dest, self.const)
        namespace.fit_given = True


def add_preparation_arguments(parser: argparse.ArgumentParser, photo_names: str, recorded_in: str | None = None
                              ) -> None:
    """``--resize`` / ``--crop`` / ``--pad`` and ``--landmarks FILE``: the same in every tool that reads photos.
    ``photo_names`` says how this tool's landmarks file names a photo; ``recorded_in`` names the file whose
    recorded preparation is this tool's default (preparation_following), None when --resize is. ``args.fit``
    is ``resize`` unless an option says otherwise (``args.fit_given`` says whether one did)."""
    group = parser.add_argument_group(
        "preparing photos (the same options in tools.pack_rec, tools.make_bin, tools.inference and tools.search)")
    default = ("default" if recorded_in is None else
               f"the default when {recorded_in} records no option; when it records one, that one is the default")
    fit = group.add_mutually_exclusive_group()
    fit.add_argument("--resize", dest="fit", action=_FitOption, const="resize",
                     help=f"stretch every photo to {IMAGE_SIZE}x{IMAGE_SIZE} ({default}; warns when that changes a "
                          "photo's aspect ratio)")
    fit.add_argument("--crop", dest="fit", action=_FitOption, const="crop",
                     help="cut the largest centred square, then resize it: keeps the aspect ratio")
    fit.add_argument("--pad", dest="fit", action=_FitOption, const="pad",
                     help=f"keep the whole photo: shrink it to fit {IMAGE_SIZE}x{IMAGE_SIZE} if larger, centre it "
                          "on black")
    group.add_argument("--landmarks", type=Path, metavar="FILE",
                       help="align each photo by its five landmarks instead of fitting it, as the IJB evaluation "
                            "does: lines 'PHOTO x1 y1 ... x5 y5' (eyes, nose tip, mouth corners); PHOTO is "
                            f"{photo_names}")
    parser.set_defaults(fit="resize", fit_given=False)


def preparation_from_args(args: argparse.Namespace, root: str | os.PathLike | None = None) -> Preparation:
    """The Preparation ``add_preparation_arguments``' options ask for (the landmarks file read now)."""
    if args.landmarks is None:
        return Preparation(args.fit)
    return Preparation(args.fit, read_landmarks(args.landmarks), args.landmarks, None if root is None else Path(root))


def given_preparation(args: argparse.Namespace) -> str | None:
    """The preparation an option asked for (``--landmarks`` over a fit), or None when none was given."""
    if args.landmarks is not None:
        return LANDMARKS
    return args.fit if getattr(args, "fit_given", False) else None


def preparation_following(args: argparse.Namespace, recorded: str | None, where: str | None,
                          root: str | os.PathLike | None = None) -> tuple[Preparation, str | None]:
    """The Preparation to use when ``where`` (e.g. ``output/run/model.json``) records that its photos were
    prepared as ``recorded`` (a PREPARATIONS name; None: nothing recorded), and the one line to say about it:
    without an option, the recorded one is used and said; an option that differs is used, with a warning
    naming both; one that agrees needs no line."""
    given = given_preparation(args)
    if recorded is None or given == recorded:
        return preparation_from_args(args, root), None
    if given is not None:
        return preparation_from_args(args, root), (
            f"warning: --{given} given, but {where} records --{recorded}, the preparation of the photos the model "
            f"was trained on; faces prepared otherwise score worse: drop --{given} to use --{recorded}")
    if recorded == LANDMARKS:
        raise ConfigError(f"{where} records photos aligned by their landmarks (--landmarks); pass --landmarks FILE "
                          "with these photos' five points (or --resize, --crop or --pad to fit them anyway)")
    return Preparation(recorded), f"photos prepared with --{recorded}, as {where} records (another option overrides it)"
