"""A declared, hashable preprocessing pipeline: decode, convert, resize, center-crop, scale, normalize, cast to CHW."""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
import zlib

import numpy as np
import PIL
from PIL import Image

from .sources import UnreadableSample

# Bump when the same parameters would produce different arrays (changed op order, rounding, layout):
# it is part of the hash, so every cache built by the old code stops matching.
FORMAT_VERSION = 1

MODES = {"L": 1, "RGB": 3}
DTYPES = ("float32", "float16", "uint8")
_PILLOW_MAJOR = int(PIL.__version__.split(".")[0])
# What Pillow raises on undecodable input varies by plugin: OSError (incl. UnidentifiedImageError and
# "image file is truncated"), SyntaxError, ValueError, EOFError, struct/zlib errors, or the bomb check.
_DECODE_ERRORS = (OSError, SyntaxError, ValueError, EOFError, struct.error, zlib.error, Image.DecompressionBombError)


def _size_pair(value, what: str, allow_int: bool):
    """None, a positive int (if allowed) or a (h, w) pair of positive ints; returns the canonical form."""
    if value is None:
        return None
    if isinstance(value, (int, np.integer)) and not isinstance(value, bool):
        if allow_int and value > 0:
            return int(value)
    elif isinstance(value, (tuple, list)) and len(value) == 2 and all(
            isinstance(v, (int, np.integer)) and not isinstance(v, bool) and v > 0 for v in value):
        return [int(value[0]), int(value[1])]
    raise ValueError(f"{what} must be None, a positive int or a (height, width) pair of positive ints, got {value!r}")


def _per_channel(value, what: str, channels: int, positive: bool):
    if value is None:
        return None
    try:
        values = [float(v) for v in value]
    except (TypeError, ValueError):
        raise ValueError(f"{what} must be a sequence of numbers, one per channel, got {value!r}") from None
    if len(values) != channels:
        raise ValueError(f"{what} has {len(values)} values but the pipeline produces {channels} channel(s)")
    if not all(math.isfinite(v) and (v > 0 or not positive) for v in values):
        raise ValueError(f"{what} values must be finite{' and > 0' if positive else ''}, got {values}")
    return values


class Pipeline:
    """decode -> convert(mode) -> resize (bilinear) -> center crop -> /255 -> normalize -> dtype, as a CHW array."""

    def __init__(self, mode: str = "L", resize=None, crop=None, mean=None, std=None, dtype: str = "float32"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {sorted(MODES)}, got {mode!r}")
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
        if (mean is None) != (std is None):
            raise ValueError("normalize needs both mean and std (or neither)")
        self.mode, self.dtype = mode, dtype
        # An int resize scales the shorter side (aspect kept); a pair is the exact (h, w).
        self.resize = _size_pair(resize, "resize", allow_int=True)
        crop = _size_pair(crop, "crop", allow_int=True)
        self.crop = [crop, crop] if isinstance(crop, int) else crop  # a square crop is just h == w
        self.mean = _per_channel(mean, "mean", MODES[mode], positive=False)
        self.std = _per_channel(std, "std", MODES[mode], positive=True)
        if dtype == "uint8" and self.mean is not None:
            raise ValueError("dtype 'uint8' keeps raw 0..255 values and cannot be normalized; "
                             "use float32/float16 or drop mean/std")

    @classmethod
    def fashion_mnist(cls) -> "Pipeline":
        """Gray 28x28, normalized with the training set's mean and std: (1, 28, 28) float32."""
        return cls(mode="L", mean=(0.2860,), std=(0.3530,), dtype="float32")

    def config(self) -> dict:
        # The Pillow major version is in because decoders and resampling filters change across majors.
        return {"format_version": FORMAT_VERSION, "pillow": _PILLOW_MAJOR, "mode": self.mode,
                "resize": self.resize, "crop": self.crop, "mean": self.mean, "std": self.std, "dtype": self.dtype}

    @property
    def hash(self) -> str:
        text = json.dumps(self.config(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(text.encode()).hexdigest()[:16]

    @classmethod
    def from_config(cls, config: dict) -> "Pipeline":
        """Rebuild from config(); format_version/pillow describe the producer and are not parameters, so the
        rebuilt pipeline's hash differs from the stored one exactly when this code would produce other arrays."""
        params = {k: v for k, v in config.items() if k not in ("format_version", "pillow")}
        unknown = set(params) - {"mode", "resize", "crop", "mean", "std", "dtype"}
        if unknown:
            raise ValueError(f"unknown pipeline parameter(s) {sorted(unknown)} in config {config}")
        return cls(**params)

    def __eq__(self, other) -> bool:
        return isinstance(other, Pipeline) and self.config() == other.config()

    def __hash__(self) -> int:
        return hash(self.hash)

    def __repr__(self) -> str:
        params = ", ".join(f"{k}={v!r}" for k, v in self.config().items() if k not in ("format_version", "pillow"))
        return f"Pipeline({params})"

    def _to_pixels(self, raw, name: str) -> np.ndarray:
        """HxW (L) or HxWx3 (RGB) uint8 after decode, convert and resize."""
        if isinstance(raw, np.ndarray):
            if raw.dtype != np.uint8 or raw.ndim not in (2, 3) or (raw.ndim == 3 and raw.shape[2] not in (1, 3, 4)):
                raise TypeError(f"{name}: a decoded sample must be a uint8 HxW, HxWx1, HxWx3 or HxWx4 array, "
                                f"got {raw.dtype} {raw.shape}")
            if raw.ndim == 3 and raw.shape[2] == 1:
                raw = raw[:, :, 0]
            if self.resize is None and (raw.ndim == 2 if self.mode == "L" else raw.ndim == 3 and raw.shape[2] == 3):
                return raw  # already in the target mode: skip the round trip through Pillow
            image = Image.fromarray(np.ascontiguousarray(raw))
        elif isinstance(raw, (bytes, bytearray, memoryview)):
            try:
                image = Image.open(io.BytesIO(raw))
                image.load()  # open() only reads the header; truncation shows up here
            except PIL.UnidentifiedImageError as e:  # its own message names only the BytesIO object
                raise UnreadableSample(name, f"cannot decode image: not a format Pillow recognises "
                                             f"({len(raw)} bytes starting {bytes(raw[:8])!r})") from e
            except _DECODE_ERRORS as e:
                raise UnreadableSample(name, f"cannot decode image ({type(e).__name__}: {e})") from e
        else:
            raise TypeError(f"{name}: raw sample must be encoded bytes or a uint8 array, got {type(raw).__name__}")
        try:
            if image.mode != self.mode:
                image = image.convert(self.mode)
            if self.resize is not None:
                image = image.resize(self._resized(image.height, image.width)[::-1], Image.Resampling.BILINEAR)
            return np.asarray(image)
        except _DECODE_ERRORS as e:  # lazy plugins may still fail while converting
            raise UnreadableSample(name, f"cannot decode image ({type(e).__name__}: {e})") from e

    def _resized(self, h: int, w: int) -> tuple[int, int]:
        if isinstance(self.resize, list):
            return self.resize[0], self.resize[1]
        s = self.resize
        # Same rule as torchvision's Resize(int): the shorter side becomes s, the longer one is truncated.
        return (s, int(s * w / h)) if h <= w else (int(s * h / w), s)

    def apply(self, raw, name: str = "sample") -> np.ndarray:
        """One raw sample (encoded bytes or decoded uint8 array) -> C-contiguous CHW array of `dtype`.
        Undecodable bytes raise UnreadableSample naming `name` (pass the source's name(i))."""
        pixels = self._to_pixels(raw, name)
        if self.crop is not None:
            ch, cw = self.crop
            h, w = pixels.shape[:2]
            if ch > h or cw > w:
                raise ValueError(f"{name}: image is {h}x{w} after resize, smaller than the {ch}x{cw} crop; "
                                 f"add or enlarge resize")
            top, left = (h - ch) // 2, (w - cw) // 2
            pixels = pixels[top:top + ch, left:left + cw]
        chw = pixels[None] if pixels.ndim == 2 else pixels.transpose(2, 0, 1)
        if self.dtype == "uint8":
            return np.array(chw, order="C")  # always a copy: chw may be a read-only view into a whole IDX file
        x = chw.astype(np.float32) / np.float32(255)
        if self.mean is not None:
            mean = np.asarray(self.mean, dtype=np.float32).reshape(-1, 1, 1)
            std = np.asarray(self.std, dtype=np.float32).reshape(-1, 1, 1)
            x = (x - mean) / std
        return np.ascontiguousarray(x.astype(self.dtype, copy=False))

    def output_shape(self, first_raw) -> tuple[int, ...]:
        """The shape apply() gives for this sample (fixed for all samples when resize is a pair or crop is set)."""
        return tuple(self.apply(first_raw, "first sample").shape)


def check_shape(x: np.ndarray, expected, name: str) -> None:
    """A preprocessed sample must have the other samples' shape (`expected`, None while unknown): they share one
    shard and one batch array. Another shape is this image's problem, so it is an UnreadableSample naming it
    (skipped under on_error="skip"), not an error of the whole shard."""
    if expected is not None and x.shape != tuple(expected):
        raise UnreadableSample(name, f"preprocessed to shape {x.shape}, but the other samples are {tuple(expected)} "
                                     f"(an image of another size): give the pipeline one output size, a crop "
                                     f"(--crop N, with --resize N if images may be smaller) or resize=(h, w)")
