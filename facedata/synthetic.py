"""Procedurally drawn face-like identities for demos and tests.

An identity is a set of traits (head and hair shape, skin, hair, iris and lip colours, eye, brow,
nose and mouth geometry, a mark, glasses); a sample of it draws pose (shift, scale, roll, yaw),
expression, lighting, background, occlusion and noise. Identity is therefore learnable (the
traits survive every sample) but not trivial: raw pixels of two photos of one identity differ
more than many photos of different identities do. Everything is a pure function of
(seed, identity, sample). Each shape is evaluated only inside its bounding window, so one core
draws several hundred faces a second (tools/make_synthetic.py spreads identities over processes).
"""
from __future__ import annotations

import math

import numpy as np

from facedata.packing import encode, side_by_side
from utils.image import IMAGE_SIZE

# Pixel-centre coordinates in [-1, 1] shared by every image.
_AXIS = (np.arange(IMAGE_SIZE, dtype=np.float32) + 0.5) / IMAGE_SIZE * 2 - 1
_X, _Y = np.meshgrid(_AXIS, _AXIS)
_PIXELS_PER_UNIT = IMAGE_SIZE / 2
# Sensor noise is cut from one fixed field at a per-sample offset: as random per sample as a fresh
# draw for this purpose, at a fraction of the cost.
_NOISE = np.random.default_rng(20240229).standard_normal((3, 2 * IMAGE_SIZE, 2 * IMAGE_SIZE), dtype=np.float32)


def _rng(seed: int, *keys: int) -> np.random.Generator:
    return np.random.default_rng([seed, *keys])


def _identity_traits(seed: int, identity: int) -> dict[str, np.ndarray | float]:
    r = _rng(seed, 0, identity)
    skin = np.array([r.uniform(0.35, 0.95), 0, 0])
    skin[1] = skin[0] * r.uniform(0.65, 0.85)
    skin[2] = skin[1] * r.uniform(0.65, 0.9)
    return {
        "skin": skin,
        "hair": r.uniform(0.0, 0.75, 3) * r.uniform(0.3, 1.0),
        "iris": r.uniform(0.05, 0.7, 3),
        "lips": skin * np.array([r.uniform(0.8, 1.1), r.uniform(0.4, 0.7), r.uniform(0.4, 0.7)]),
        "face_w": r.uniform(0.46, 0.62), "face_h": r.uniform(0.62, 0.78),
        "hair_volume": r.uniform(1.02, 1.25), "hairline": r.uniform(-0.62, -0.3), "hair_sides": r.uniform(0.0, 0.5),
        "eye_x": r.uniform(0.17, 0.3), "eye_y": r.uniform(-0.2, -0.05),
        "eye_w": r.uniform(0.08, 0.13), "eye_h": r.uniform(0.035, 0.07), "iris_r": r.uniform(0.035, 0.06),
        "brow_gap": r.uniform(0.09, 0.17), "brow_tilt": r.uniform(-0.35, 0.35), "brow_thick": r.uniform(0.015, 0.04),
        "nose_len": r.uniform(0.1, 0.22), "nose_w": r.uniform(0.04, 0.08),
        "mouth_y": r.uniform(0.3, 0.45), "mouth_w": r.uniform(0.12, 0.24), "mouth_h": r.uniform(0.025, 0.05),
        "smile": r.uniform(-0.04, 0.06),
        "mark": r.uniform(-0.35, 0.35, 2) * [1, 1.3] if r.random() < 0.6 else None, "mark_r": r.uniform(0.02, 0.04),
        "glasses": r.random() < 0.25,
    }


def _sample_pose(seed: int, identity: int, sample: int) -> dict[str, float | np.ndarray]:
    r = _rng(seed, 1, identity, sample)
    return {
        "shift": r.uniform(-0.04, 0.04, 2), "scale": r.uniform(1.2, 1.32), "roll": r.uniform(-0.08, 0.08),
        "yaw": r.uniform(-0.05, 0.05), "openness": r.uniform(0.65, 1.1), "mouth_open": r.uniform(0.75, 1.35),
        "background": r.uniform(0.25, 0.75, 3), "background_tilt": r.uniform(-0.25, 0.25, 2),
        "light": r.uniform(0.85, 1.1), "light_dir": r.uniform(-0.15, 0.15, 2), "tint": r.uniform(0.97, 1.03, 3),
        "occluder": (r.uniform(-0.8, 0.8, 2), r.uniform(0.1, 0.3, 2), r.uniform(0, 1, 3))
        if r.random() < 0.1 else None,
        "noise": r.uniform(0.01, 0.03), "noise_offset": r.integers(0, IMAGE_SIZE, 2),
    }


class _Canvas:
    """A float RGB image drawn in face coordinates (u, v): the sample's shift, scale and roll undone.

    Shapes are evaluated only inside their bounding window, which keeps small features cheap.
    """

    def __init__(self, pose: dict) -> None:
        self.scale, self.roll = float(pose["scale"]), float(pose["roll"])
        self.cos, self.sin = math.cos(self.roll), math.sin(self.roll)
        self.shift = [float(c) for c in pose["shift"]]
        tx, ty = pose["background_tilt"]
        gradient = _X * float(tx) + _Y * float(ty)
        # Channels first: every paint then runs over contiguous rows of one channel at a time.
        self.rgb = np.clip(gradient[None] + pose["background"].astype(np.float32)[:, None, None], 0, 1)

    def coords(self, window: tuple[slice, slice]) -> tuple[np.ndarray, np.ndarray]:
        """Face coordinates (u, v) of the pixels of ``window``."""
        x, y = _X[window] - self.shift[0], _Y[window] - self.shift[1]
        return (self.cos * x + self.sin * y) / self.scale, (self.cos * y - self.sin * x) / self.scale

    def _window(self, cx: float, cy: float, radius: float) -> tuple[slice, slice]:
        x = self.scale * (self.cos * cx - self.sin * cy) + self.shift[0]
        y = self.scale * (self.sin * cx + self.cos * cy) + self.shift[1]
        centre_x, centre_y = (x + 1) * _PIXELS_PER_UNIT, (y + 1) * _PIXELS_PER_UNIT
        reach = radius * self.scale * _PIXELS_PER_UNIT + 2

        def span(centre: float) -> slice:
            return slice(min(max(int(centre - reach), 0), IMAGE_SIZE), min(max(int(centre + reach + 1), 0), IMAGE_SIZE))
        return span(centre_y), span(centre_x)

    def ellipse(self, cx: float, cy: float, ax: float, ay: float, angle: float = 0.0, bend: float = 0.0,
                window: tuple[slice, slice] | None = None) -> tuple[tuple[slice, slice], np.ndarray]:
        """Anti-aliased coverage (0..1) of an ellipse, rotated by ``angle`` and bent into an arc by ``bend``."""
        window = window or self._window(cx, cy, max(ax, ay) + abs(bend))
        u, v = self.coords(window)
        u, v = u - cx, v - cy
        if angle:
            cos, sin = math.cos(angle), math.sin(angle)
            u, v = cos * u + sin * v, cos * v - sin * u
        if bend:
            v = v + bend * (u / ax) ** 2
        d = np.sqrt((u / ax) ** 2 + (v / ay) ** 2)
        return window, np.clip((1 - d) * (min(ax, ay) * self.scale * _PIXELS_PER_UNIT) + 0.5, 0, 1)

    def paint(self, window: tuple[slice, slice], alpha: np.ndarray, colour) -> None:
        for channel, value in zip(self.rgb[(slice(None), *window)], colour):
            channel += alpha * (np.float32(value) - channel)


def _draw(t: dict, p: dict) -> np.ndarray:
    """One face (3, H, W) float in [0, 1] from identity traits ``t`` and sample draw ``p``."""
    c = _Canvas(p)
    face_w, face_h, skin, hair_colour = t["face_w"], t["face_h"], t["skin"], t["hair"]
    hair_w, hair_h = face_w * t["hair_volume"], face_h * (0.45 + 0.55 * t["hair_volume"])
    hair_window, hair = c.ellipse(0, -0.05, hair_w, hair_h)
    hair_v = c.coords(hair_window)[1]
    c.paint(hair_window, hair * np.clip((t["hair_sides"] - hair_v) * 8, 0, 1), hair_colour)
    for side in (-1, 1):
        c.paint(*c.ellipse(side * face_w * 0.97, 0.02, 0.07, 0.13), skin * 0.92)
    c.paint(*c.ellipse(0, 0.05, face_w, face_h), skin)
    c.paint(hair_window, hair * np.clip((t["hairline"] - hair_v) * 10, 0, 1), hair_colour)

    # Yaw moves the inner features sideways against the outline, as a head turn does.
    yaw = float(p["yaw"])
    for side in (-1, 1):
        ex, ey = side * t["eye_x"] + yaw, t["eye_y"]
        window, eye = c.ellipse(ex, ey, t["eye_w"], t["eye_h"] * p["openness"])
        c.paint(window, eye, (0.95, 0.95, 0.93))
        c.paint(window, eye * c.ellipse(ex, ey, t["iris_r"], t["iris_r"], window=window)[1], t["iris"])
        c.paint(window, eye * c.ellipse(ex, ey, t["iris_r"] * 0.45, t["iris_r"] * 0.45, window=window)[1],
                (0.02, 0.02, 0.02))
        c.paint(*c.ellipse(ex, ey - t["brow_gap"], t["eye_w"] * 1.25, t["brow_thick"], angle=side * t["brow_tilt"]),
                hair_colour * 0.8)
        if t["glasses"]:
            window, ring = c.ellipse(ex, ey, t["eye_w"] * 1.6, t["eye_w"] * 1.2)
            inner = c.ellipse(ex, ey, t["eye_w"] * 1.42, t["eye_w"] * 1.03, window=window)[1]
            c.paint(window, ring - inner, (0.08, 0.08, 0.1))
    c.paint(*c.ellipse(yaw, 0.08 + t["nose_len"] / 2, t["nose_w"], t["nose_len"] / 2), skin * 0.8)
    c.paint(*c.ellipse(yaw, t["mouth_y"], t["mouth_w"], t["mouth_h"] * p["mouth_open"], bend=t["smile"]), t["lips"])
    if t["mark"] is not None:
        c.paint(*c.ellipse(t["mark"][0] + yaw, t["mark"][1], t["mark_r"], t["mark_r"]), skin * 0.45)

    light = p["light"] + _X * float(p["light_dir"][0]) + _Y * float(p["light_dir"][1])
    rgb = c.rgb * light[None] * p["tint"].astype(np.float32)[:, None, None]
    if p["occluder"] is not None:
        (ox, oy), (ow, oh), colour = p["occluder"]
        rgb[:, (np.abs(_X - ox) < ow / 2) & (np.abs(_Y - oy) < oh / 2)] = colour[:, None]
    oy, ox = p["noise_offset"]
    rgb += _NOISE[:, oy:oy + IMAGE_SIZE, ox:ox + IMAGE_SIZE] * np.float32(p["noise"])
    return rgb


def render_faces(identities, samples, seed: int = 0) -> np.ndarray:
    """uint8 RGB faces (N, 112, 112, 3): image n is sample ``samples[n]`` of identity ``identities[n]``.

    A pure function of (seed, identity, sample): the same triple always gives the same image.
    """
    identities, samples = np.broadcast_arrays(np.asarray(identities), np.asarray(samples))
    out = np.empty((len(identities), IMAGE_SIZE, IMAGE_SIZE, 3), dtype=np.uint8)
    traits: dict[int, dict] = {}
    for n, (identity, sample) in enumerate(zip(identities.tolist(), samples.tolist())):
        if identity not in traits:
            traits[identity] = _identity_traits(seed, identity)
        face = _draw(traits[identity], _sample_pose(seed, identity, sample))
        out[n] = np.clip(face * 255 + 0.5, 0, 255).transpose(1, 2, 0)
    return out


def verification_pairs(identities, num_pairs: int, seed: int = 0) -> tuple[np.ndarray, list[bool]]:
    """A verification set over ``identities``: (images (2N, 112, 112, 3), issame) with pairs (2i, 2i+1),
    alternately the same identity (two different samples) and two different identities."""
    identities = np.asarray(identities)
    if len(identities) < 2:
        raise ValueError("a verification set needs at least 2 identities")
    r = _rng(seed, 2, len(identities), num_pairs)
    next_sample = dict.fromkeys(identities.tolist(), 0)
    pair_identities, issame = [], []
    for i in range(num_pairs):
        same = i % 2 == 0
        first, second = (r.choice(identities, 2, replace=False)).tolist()
        pair_identities += [first, first if same else second]
        issame.append(same)
    samples = []
    for identity in pair_identities:
        samples.append(next_sample[identity])
        next_sample[identity] += 1
    return render_faces(pair_identities, samples, seed), issame


def identity_records(job: tuple[int, int, int, int, int]) -> list[bytes]:
    """(identity, images, views, seed, jpeg quality) -> that identity's encoded records: ``images``
    photos drawn, ``views`` side by side per record (leftovers dropped)."""
    identity, images, views, seed, quality = job
    faces = render_faces(identity, np.arange(images - images % views), seed)
    return [encode(side_by_side(faces[i:i + views]), quality=quality) for i in range(0, len(faces), views)]
