"""From a photo file to the 112x112 RGB face every network sees: one preparation shared by every tool that
reads photos (tools.pack_rec, tools.make_bin, tools.inference), so that training records, ``.bin`` sets and
inference see faces the same way.

Each photo is fitted to 112x112 in one of three ways, the same options in every tool:
- ``resize`` (the default): stretched to the square; a photo that is not square changes its aspect ratio,
  and the tools say so (``stretch_warning``);
- ``crop``: the largest centred square, resized: the aspect ratio kept, the ends of the longer side cut;
- ``pad``: shrunk to fit when larger, centred on black: the whole photo kept, the face smaller;
or, where a landmarks file gives its five points, warped onto the ArcFace template by the similarity that
maps them there (facedata/alignment.py, as the IJB evaluation aligns its faces and insightface's ``norm_crop``
does); or, with ``--detect``, warped the same way by the five points a face detector finds in the photo
(facedata/detector.py: the largest face when it finds several; a photo with none cannot be prepared). A
landmarks file is text, one photo per line: ``PHOTO x1 y1 x2 y2 x3 y3 x4 y4 x5 y5`` (left eye, right eye, nose
tip, left and right mouth corner, in the photo's pixels; numbers after the ten, such as a detector's score, are
ignored). PHOTO is the path relative to the image folder the tool reads, or as given on the command line; with a
landmarks file, every photo must have its line.
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

from facedata.alignment import ARCFACE_TEMPLATE, align_face, umeyama_similarity
from facedata.detector import INSTALL, check_detector, detect_faces
from utils.errors import ConfigError, DataError, FaceImageError, located
from utils.image import IMAGE_SIZE

FITS = ("resize", "crop", "pad")
LANDMARKS = "landmarks"
DETECT = "detect"
PREPARATIONS = (*FITS, LANDMARKS, DETECT)  # the names a preparation is recorded by, each the tools' option --<name>
LANDMARK_NUMBERS = 10  # five (x, y) points


@dataclass(frozen=True)
class PreparedFace:
    """A photo as a face: uint8 RGB (112, 112, 3), the photo's (width, height) when ``resize``
    stretched it out of its aspect ratio (None otherwise), its size, and how many faces the detector found in it
    (``--detect``: the largest was used)."""

    pixels: np.ndarray
    stretched_from: tuple[int, int] | None = None
    photo_size: tuple[int, int] | None = None  # (width, height) of the photo a fit prepared (None: aligned)
    faces_found: int | None = None  # None: no detector ran

    @property
    def crowded(self) -> bool:
        """Whether the detector found more than this one face in the photo."""
        return (self.faces_found or 0) > 1


@dataclass(frozen=True)
class Preparation:
    """How photos become faces: ``fit`` for every photo, alignment by its landmarks when ``landmarks``
    (photo name -> (5, 2) points, read by ``read_landmarks``) is given, or by the points the face detector finds
    when ``detector`` (its name and version, from ``facedata.detector.check_detector``) is. A photo's name is its
    path relative to ``root``, or the path as given when there is no root."""

    fit: str = "resize"
    landmarks: Mapping[str, np.ndarray] | None = None
    landmarks_file: Path | None = None
    root: Path | None = None
    detector: str | None = None

    def __post_init__(self) -> None:
        if self.fit not in FITS:
            raise ValueError(f"fit {self.fit!r} is not one of {FITS}")
        if self.detector is not None and self.landmarks is not None:
            raise ValueError("a preparation aligns by a landmarks file or by a detector, not both")

    @property
    def name(self) -> str:
        """``resize``, ``crop``, ``pad``, ``landmarks`` or ``detect``: what the preparation records say
        (PREPARATIONS)."""
        if self.detector is not None:
            return DETECT
        return LANDMARKS if self.landmarks is not None else self.fit

    @property
    def aligns(self) -> bool:
        """Whether faces are warped by five points (a landmarks file or the detector's), not fitted."""
        return self.landmarks is not None or self.detector is not None

    def describe(self) -> str:
        """``crop to 112x112``, ``aligned by the landmarks in X`` or ``aligned by the five points X finds``: for
        the tools' summary lines."""
        if self.detector is not None:
            return f"aligned by the five points {self.detector} finds"
        if self.landmarks is not None:
            return f"aligned by the landmarks in {self.landmarks_file}"
        return f"{self.fit} to {IMAGE_SIZE}x{IMAGE_SIZE}"

    def face(self, path: str | os.PathLike) -> PreparedFace:
        """The photo at ``path`` prepared; FaceImageError when it cannot be read (or has no landmarks, or the
        detector finds no face in it)."""
        with _open_photo(Path(path)) as image:
            if self.detector is not None:
                return _detected(image, path)
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


def _detected(image: Image.Image, path: str | os.PathLike) -> PreparedFace:
    faces = detect_faces(image)
    if not faces:
        raise FaceImageError(f"the face detector found no face in {path}; leave the photo out (--skip-bad) or "
                             "replace it with one that shows the face larger and from the front")
    return PreparedFace(_aligned(image, faces[0].landmarks), faces_found=len(faces))


def _aligned(image: Image.Image, points: np.ndarray) -> np.ndarray:
    """The face warped onto the ArcFace template by its five points. A face more than twice the template's size
    is first averaged down by a whole factor (PIL's box reduce), so that the bilinear warp, which samples four
    pixels per output pixel, does not alias it: on photos where the face is smaller, this is norm_crop's warp."""
    points = np.asarray(points, dtype=np.float64)
    matrix = umeyama_similarity(points, ARCFACE_TEMPLATE)
    factor = int(1.0 / np.sqrt(abs(np.linalg.det(matrix[:, :2]))))
    image = image.convert("RGB")
    if factor >= 2:
        image = image.reduce(factor)
        points = (points + 0.5) / factor - 0.5  # pixel centres: block k covers photo pixels kf .. kf + f - 1
    rgb = torch.from_numpy(np.array(image)).permute(2, 0, 1)
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


def several_faces_line(crowded: Sequence[tuple[str, int]], total: int) -> str | None:
    """One line for the photos in which the detector found several faces (``(name, faces found)`` each), or
    None."""
    if not crowded:
        return None
    name, found = crowded[0]
    return (f"note: the face detector found several faces in {len(crowded)} of {total} photos (e.g. {found} in "
            f"{name}); the largest face of each was used")


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
    """``--resize`` / ``--crop`` / ``--pad``, ``--landmarks FILE`` and ``--detect``: the same in every tool that
    reads photos.
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
    points = group.add_mutually_exclusive_group()
    points.add_argument("--landmarks", type=Path, metavar="FILE",
                        help="align each photo by its five landmarks instead of fitting it, as the IJB evaluation "
                             "does: lines 'PHOTO x1 y1 ... x5 y5' (eyes, nose tip, mouth corners); PHOTO is "
                             f"{photo_names}")
    points.add_argument("--detect", action="store_true",
                        help="find the face in each photo (RetinaFace, run offline) and align it by the five points "
                             "found, as insightface aligns faces: for ordinary photos; the largest face when there "
                             f"are several; needs the detector package: {INSTALL}")
    parser.set_defaults(fit="resize", fit_given=False)


def preparation_from_args(args: argparse.Namespace, root: str | os.PathLike | None = None) -> Preparation:
    """The Preparation ``add_preparation_arguments``' options ask for (the landmarks file read now; with
    ``--detect``, ConfigError naming the install command when the detector is not installed)."""
    if args.detect:
        return Preparation(args.fit, detector=check_detector())
    if args.landmarks is None:
        return Preparation(args.fit)
    return Preparation(args.fit, read_landmarks(args.landmarks), args.landmarks, None if root is None else Path(root))


def given_preparation(args: argparse.Namespace) -> str | None:
    """The preparation an option asked for (``--detect`` or ``--landmarks`` over a fit), or None when none was
    given."""
    if args.detect:
        return DETECT
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
    if recorded == DETECT:
        return Preparation(detector=check_detector()), (
            f"photos aligned by the face detector (--detect), as {where} records (another option overrides it)")
    return Preparation(recorded), f"photos prepared with --{recorded}, as {where} records (another option overrides it)"
